// The bf16 GEMM for AMX-BF16 CPUs (Sapphire Rapids and later Xeons) over the a8 weight tiles:
// y = bf16(x) @ bf16(W).T with fp32 sums, W = scale * code (+ min) dequantized per 16-column tile.
//
// Why a second arithmetic beside the int8 kernels: those rescale every unit of 32 values of K
// (int32 -> fp32, times the column scales and the row's unit scale), so a 16 x 16 x 32 tile
// product costs a tile store and ~5 vector instructions per row; on the default model's shapes
// the AMX int8 kernel ran no faster than AVX512-VNNI (16-64 rows: 5% of the tile unit's peak).
// Here the scales go into the weights once per tile, shared by every row block, and a block's
// products accumulate over all of K inside the C tile: one tile store per 16 x 16 outputs.
// The cost moves to the dequantization (~2 instructions per weight per column tile, paid once
// for all rows), so this kernel is for steps of many rows (prefill chunks, 16+ streams).
//
// Numbers: x rounded to bf16 (8 significant bits, per value: no shared scale) and each weight
// s * q + m rounded to bf16 after an fp32 FMA (round to nearest even); products and sums in fp32
// in the tile unit. kernels.reference.bf16_gemm_reference computes the same in torch.
//
// A B tile's row i holds k = 2i, 2i + 1 of the 16 columns as [column][pair] bf16: 64 bytes. The
// int4 tiles' byte 4c + j (a8_gemm.h) gives, with its nibbles, column c at k = 4v + j and
// 16 + 4v + j, so j = 0, 1 of each column form one B row and j = 2, 3 the next: one byte
// permutation (AVX512-VBMI) per 64 codes. int8 tiles have the same byte order.
//
// Tile state as in a8_gemm_amx.cpp: configured on entry, released on return; the OS grant is
// asked once by a8_gemm.cpp.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,amx-tile,amx-bf16")

#include <immintrin.h>

#include <cstdint>

#include "a8_gemm.h"

namespace {

using edgeinfer_cpu::A8Problem;
using edgeinfer_cpu::kA8Cols;

constexpr int kBlock = edgeinfer_cpu::kA8AmxBlock;  // rows per A / C tile
constexpr int64_t kRowBytes = 64;                    // one B row: 16 columns x 2 values of K, bf16

// Tiles: 0 and 3 hold C of two row blocks, 1 and 4 their A, 2 the shared B.
void configure() {
  edgeinfer_cpu::AmxTileConfig c;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = kBlock;
    c.colsb[t] = 64;  // C: 16 fp32; A: 32 bf16 of K; B: 16 columns x 2 bf16
  }
  _tile_loadconfig(&c);
}

#include "a8_zmm_param.inc"

// Per-column parameters for one group, each column's value twice: [c0, c0, c1, c1, ...] for
// columns 0-7 (lo) and 8-15 (hi), matching a B row's [column][pair] order.
struct Pairs {
  __m512 lo, hi;
};

inline Pairs pairs(__m512 v) {
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  return {_mm512_permutexvar_ps(lo, v), _mm512_permutexvar_ps(hi, v)};
}

// 64 codes in a8 byte order (4c + j: column c, value j of four consecutive k) -> two B rows
// (j = 0, 1 and j = 2, 3), each scale * code (+ min) in bf16.
template <bool kSigned, bool kMin>
inline void dequantize64(__m512i codes, const Pairs& s, const Pairs& mn, uint8_t* row) {
  // Byte 2c + j' of each half: column c's j = j' (first half) or 2 + j' (second half).
  const __m512i order = _mm512_set_epi8(63, 62, 59, 58, 55, 54, 51, 50, 47, 46, 43, 42, 39, 38, 35, 34,
                                        31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2,
                                        61, 60, 57, 56, 53, 52, 49, 48, 45, 44, 41, 40, 37, 36, 33, 32,
                                        29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i q = _mm512_permutexvar_epi8(order, codes);
  for (int half = 0; half < 2; ++half) {
    __m512 w[2];
    for (int part = 0; part < 2; ++part) {  // columns 0-7, then 8-15
      const __m128i b = half == 0 ? (part == 0 ? _mm512_extracti32x4_epi32(q, 0) : _mm512_extracti32x4_epi32(q, 1))
                                  : (part == 0 ? _mm512_extracti32x4_epi32(q, 2) : _mm512_extracti32x4_epi32(q, 3));
      const __m512 v = _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
      const __m512 sc = part == 0 ? s.lo : s.hi;
      if constexpr (kMin) {
        w[part] = _mm512_fmadd_ps(v, sc, part == 0 ? mn.lo : mn.hi);
      } else {
        w[part] = _mm512_mul_ps(v, sc);
      }
    }
    _mm512_store_si512(row + half * kRowBytes, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
  }
}

// The column tile t's weights, K x 16, as B rows into `b` (K / 2 rows of 64 bytes).
template <bool kInt4, bool kMin>
void dequantize_tile(const A8Problem& p, int64_t t, uint8_t* b) {
  const int64_t k = p.k, group = p.group;
  const uint8_t* codes = p.codes + t * k * kA8Cols / (kInt4 ? 2 : 1);
  Pairs s{}, mn{};
  int64_t loaded = -1;
  const auto params = [&](int64_t g) {
    if (g == loaded) return;
    loaded = g;
    s = pairs(load_param(p, p.scales, t, g));
    if constexpr (kMin) mn = pairs(load_param(p, p.mins, t, g));
  };
  if constexpr (kInt4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t blk = 0; blk < k / 32; ++blk) {
      params(blk * 32 / group);
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(codes + (blk * 4 + v) * 64);
        // k = 32 blk + 4v + j in the low nibbles, + 16 in the high: B rows 16 blk + 2v (+ 8).
        dequantize64<false, kMin>(_mm512_and_si512(raw, nibble), s, mn, b + (16 * blk + 2 * v) * kRowBytes);
        dequantize64<false, kMin>(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble), s, mn,
                                  b + (16 * blk + 8 + 2 * v) * kRowBytes);
      }
    }
  } else {
    for (int64_t q = 0; q < k / 4; ++q) {  // k = 4q + j: B rows 2q, 2q + 1
      params(4 * q / group);
      dequantize64<true, kMin>(_mm512_loadu_si512(codes + q * 64), s, mn, b + 2 * q * kRowBytes);
    }
  }
}

// y's rows [m0, m0 + 16) below p.m, columns [col, col + 16) clipped to N, from a C tile's copy.
inline void store_block(const A8Problem& p, int64_t m0, int64_t col, const float* c) {
  const int64_t valid = p.n - col;
  const __mmask16 mask = valid >= kA8Cols ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int r = 0; r < kBlock && m0 + r < p.m; ++r) {
    _mm512_mask_storeu_ps(p.y + (m0 + r) * p.n + col, mask, _mm512_load_ps(c + r * kA8Cols));
  }
}

template <bool kInt4, bool kMin>
void columns(const A8Problem& p, int64_t tile0, int64_t tile1, uint8_t* b) {
  const int64_t k = p.k;
  const int64_t steps = k / 32;  // 32 values of K per tile product
  const int64_t blocks = (p.m + kBlock - 1) / kBlock;
  const auto* x = reinterpret_cast<const uint16_t*>(p.x);  // bf16, rows padded to 16
  alignas(64) float c[2][kBlock * kA8Cols];
  configure();
  for (int64_t t = tile0; t < tile1; ++t) {
    dequantize_tile<kInt4, kMin>(p, t, b);
    const int64_t col = t * kA8Cols;
    for (int64_t blk = 0; blk < blocks; blk += 2) {  // two row blocks share each B tile load
      const int64_t m0 = blk * kBlock;
      const bool pair = blk + 1 < blocks;
      _tile_zero(0);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(2, b + s * kBlock * kRowBytes, kRowBytes);
        _tile_loadd(1, x + m0 * k + s * 32, k * 2);
        _tile_dpbf16ps(0, 1, 2);
        if (pair) {
          _tile_loadd(4, x + (m0 + kBlock) * k + s * 32, k * 2);
          _tile_dpbf16ps(3, 4, 2);
        }
      }
      _tile_stored(0, c[0], kA8Cols * 4);
      store_block(p, m0, col, c[0]);
      if (pair) {
        _tile_stored(3, c[1], kA8Cols * 4);
        store_block(p, m0 + kBlock, col, c[1]);
      }
    }
  }
  _tile_release();
}

}  // namespace

void edgeinfer_cpu::a8_columns_amx_bf16(const A8Problem& p, int64_t tile0, int64_t tile1, uint8_t* scratch) {
  if (p.int4) {
    columns<true, true>(p, tile0, tile1, scratch);
  } else if (p.mins != nullptr) {
    columns<false, true>(p, tile0, tile1, scratch);
  } else {
    columns<false, false>(p, tile0, tile1, scratch);
  }
}

void edgeinfer_cpu::a8_rows_to_bf16(const float* x, int64_t count, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, (__m512i)v);
  }
  for (; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)v);
  }
}
