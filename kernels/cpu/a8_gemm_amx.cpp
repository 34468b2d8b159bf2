// The int8-activation GEMM kernel for AMX (Sapphire Rapids and later Xeons): the same problem and
// rounding as the VNNI kernels (a8_gemm.h), its integer dot products on the tile unit. One
// tdpbsud / tdpbssd multiplies a 16-row block of activation codes by a unit (32 values of K, 16
// for int8 groups of 16) of a 16-column weight tile: 16 x 16 x 32 multiply-adds, 1,024 a cycle
// against AVX512-VNNI's 128 at best. What is left on the vector units is a unit's rescale (int32
// -> fp32, times the column scales and the row's unit scale, plus the mins' term once per group),
// 3-4 instructions per row and unit, and the int4 unpack, once per weight tile for all row blocks.
//
// Operands: AMX multiplies signed by signed or by unsigned bytes, so x is read as int8 as it is
// (no + 128, no code sums): int4 codes 0..15 are tdpbsud's unsigned B, int8 codes tdpbssd's signed
// B. A B tile's row i holds k = 4i..4i+3 of the 16 columns, which is the a8 tiles' own byte order
// (int8: as stored, read in place; int4: the low and high nibbles of a block's 4 vectors are its
// rows 0-3 and 4-7). The caller pads x's codes, scales and group sums to a multiple of 16 rows;
// the padding rows' products are computed and never stored.
//
// Two terms (a8_gemm.h): with int4 weights a unit's A row is both terms' 64 bytes and its B
// rows are 16 x the codes (still unsigned bytes, <= 240) over the codes, so one tdpbsud gives
// 16 x dot(codes) + dot(residual codes) and a unit costs one multiply, one tile store and one
// rescale of 16 rows for both terms; stored and rescaled per term, those bounded the kernel
// (a tile store plus 16 rows' rescale ~42 ns, the multiply alone ~17). int8 weights cannot take
// the 16 (it leaves int8): one multiply per term, the pair summed as the block is rescaled.
//
// Tile state is per thread and other libraries (oneDNN) configure it too: the entry point loads
// its configuration on every call and releases it on return. The OS must have granted the process
// the tile data state (a8_gemm.cpp asks once, before the kernel is ever chosen).
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

#include <immintrin.h>

#include <cstdint>

#include "a8_gemm.h"

namespace {

using edgeinfer_cpu::A8Problem;
using edgeinfer_cpu::kA8Cols;
using edgeinfer_cpu::kA8Unit;

constexpr int kBlock = edgeinfer_cpu::kA8AmxBlock;  // activation rows per A / C tile

// Tiles: 0 and 1 hold C of two units in flight (int8 weights with two terms: one unit's two
// terms), 2 and 3 their A, 4 and 5 their B. A unit's A rows are `a_bytes` of K bytes: the unit's
// codes, or int4 with two terms both terms' (the weights' B rows then 16 x codes over codes).
void configure(int64_t a_bytes) {
  edgeinfer_cpu::AmxTileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = kBlock;
    c.colsb[t] = kA8Cols * 4;  // 16 int32
    c.rows[t + 2] = kBlock;
    c.colsb[t + 2] = static_cast<uint16_t>(a_bytes);
    c.rows[t + 4] = static_cast<uint8_t>(a_bytes / 4);
    c.colsb[t + 4] = kA8Cols * 4;  // 16 columns x 4 values of K
  }
  _tile_loadconfig(&c);
}

#include "a8_zmm_param.inc"

// A unit's int32 block (16 rows x 16 columns at c; with kPair 16 x c + c2, int8 weights' two
// terms) into the rows' fp32 sums: where the unit opens a group acc[r] += min * x_gsum[r, g],
// then acc[r] += dot[r] * scale * x_scale[r, u].
template <bool kMin, bool kPair>
inline void rescale(const A8Problem& p, const int32_t* c, const int32_t* c2, int64_t m0, int64_t u, int64_t units,
                    int64_t g, int64_t groups, bool opens_group, int64_t t, __m512* acc) {
  // The mins' term first, as the VNNI kernels add it: the same fp32 sums in the same order, so
  // the ISAs agree bit for bit (one-term int8 activations turn a last-bit difference into
  // whole codes downstream: eval-ppl moved 46.83 -> 47.01 with the order swapped).
  if constexpr (kMin) {
    if (opens_group) {
      const __m512 mn = load_param(p, p.mins, t, g);
      const float* gs = p.x_gsum + m0 * groups + g;
#pragma GCC unroll 16
      for (int r = 0; r < kBlock; ++r) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(gs[r * groups]), acc[r]);
    }
  }
  const __m512 s = load_param(p, p.scales, t, g);
  const float* xs = p.x_scale + m0 * units + u;
#pragma GCC unroll 16
  for (int r = 0; r < kBlock; ++r) {
    __m512i dot = _mm512_load_si512(c + r * kA8Cols);
    if constexpr (kPair) dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 4), _mm512_load_si512(c2 + r * kA8Cols));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(xs[r * units])), acc[r]);
  }
}

// y's rows of block m0 (those below p.m), columns [col, col + 16) clipped to N.
inline void store_block(const A8Problem& p, int64_t m0, int64_t col, const __m512* acc) {
  const int64_t valid = p.n - col;
  const __mmask16 mask = valid >= kA8Cols ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  for (int r = 0; r < kBlock && m0 + r < p.m; ++r) _mm512_mask_storeu_ps(p.y + (m0 + r) * p.n + col, mask, acc[r]);
}

// A weight tile's int4 codes as B rows (once for all row blocks: in L1 or L2 while they read
// it): per 32-block its 8 rows of codes (the low nibbles of its 4 vectors, k = 4v.., then the
// high ones, k = 16 + 4v..); with two terms first the same 8 rows x 16 (the codes' term), then
// the codes (the residual's).
template <int kTerms>
void unpack_int4(const uint8_t* b, int64_t k, uint8_t* unpacked) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  constexpr int64_t kRowsPerBlock = 8 * kTerms;
  for (int64_t blk = 0; blk < k / 32; ++blk) {
    uint8_t* out = unpacked + blk * kRowsPerBlock * 64;
    for (int v = 0; v < 4; ++v) {
      const __m512i raw = _mm512_loadu_si512(b + (blk * 4 + v) * 64);
      if constexpr (kTerms == 2) {
        _mm512_store_si512(out + v * 64, _mm512_and_si512(_mm512_slli_epi16(raw, 4), high));
        _mm512_store_si512(out + (4 + v) * 64, _mm512_and_si512(raw, high));
      }
      _mm512_store_si512(out + (kRowsPerBlock - 8 + v) * 64, _mm512_and_si512(raw, low));
      _mm512_store_si512(out + (kRowsPerBlock - 4 + v) * 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
  }
}

template <bool kInt4, bool kMin, int kTerms>
void columns(const A8Problem& p, int64_t tile0, int64_t tile1, uint8_t* unpacked) {
  const int64_t k = p.k;
  const int64_t group = p.group;
  const int64_t groups = k / group;
  const int64_t unit = group < kA8Unit ? group : kA8Unit;
  const int64_t units = k / unit;
  const int64_t units_per_group = group / unit;
  const int64_t blocks = (p.m + kBlock - 1) / kBlock;
  // int4 with two terms: one multiply per unit over both terms' bytes. int8 weights with two
  // terms: one per term (16 x an int8 code leaves int8), summed on the vector units.
  constexpr bool kFolded = kInt4 && kTerms == 2;
  constexpr bool kPair = !kInt4 && kTerms == 2;
  const int64_t a_bytes = kFolded ? 2 * unit : unit;
  const int64_t row_bytes = kTerms * k;  // a row of x's codes (a8_gemm.h)
  alignas(64) int32_t c[4][kBlock * kA8Cols];  // a ring of unit blocks
  alignas(64) int32_t c2[kPair ? 4 : 1][kBlock * kA8Cols];  // and their residuals' (kPair)
  configure(a_bytes);
  for (int64_t t = tile0; t < tile1; ++t) {
    const uint8_t* b = p.codes + t * k * kA8Cols / (kInt4 ? 2 : 1);
    if constexpr (kInt4) {
      unpack_int4<kTerms>(b, k, unpacked);
      b = unpacked;
    }
    const int64_t col = t * kA8Cols;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t m0 = blk * kBlock;
      const uint8_t* a = p.x + m0 * row_bytes;
      __m512 acc[kBlock];
#pragma GCC unroll 16
      for (int r = 0; r < kBlock; ++r) acc[r] = _mm512_setzero_ps();
      // Software-pipelined: unit u's block is multiplied and stored while unit u - 2's, stored
      // two steps earlier, is rescaled. Read right after its tile store, a block stalled the
      // loads behind that store and the tile and vector work ran one after the other.
      for (int64_t u = 0; u < units + 2; ++u) {
        if (u < units) {
          const uint8_t* au = a + u * kTerms * unit;
          const uint8_t* bu = b + u * a_bytes * kA8Cols;
          if constexpr (kPair) {
            _tile_loadd(4, bu, 64);
            _tile_loadd(2, au, row_bytes);
            _tile_loadd(3, au + unit, row_bytes);
            _tile_zero(0);
            _tile_zero(1);
            _tile_dpbssd(0, 2, 4);
            _tile_dpbssd(1, 3, 4);
            _tile_stored(0, c[u % 4], kA8Cols * 4);
            _tile_stored(1, c2[u % 4], kA8Cols * 4);
          } else if (u % 2 == 0) {
            _tile_loadd(2, au, row_bytes);
            _tile_loadd(4, bu, 64);
            _tile_zero(0);
            if constexpr (kInt4) _tile_dpbsud(0, 2, 4); else _tile_dpbssd(0, 2, 4);
            _tile_stored(0, c[u % 4], kA8Cols * 4);
          } else {
            _tile_loadd(3, au, row_bytes);
            _tile_loadd(5, bu, 64);
            _tile_zero(1);
            if constexpr (kInt4) _tile_dpbsud(1, 3, 5); else _tile_dpbssd(1, 3, 5);
            _tile_stored(1, c[u % 4], kA8Cols * 4);
          }
        }
        if (u >= 2) {
          const int64_t v = u - 2;
          rescale<kMin, kPair>(p, c[v % 4], c2[kPair ? v % 4 : 0], m0, v, units, v / units_per_group, groups,
                               v % units_per_group == 0, t, acc);
        }
      }
      store_block(p, m0, col, acc);
    }
  }
  _tile_release();
}

template <int kTerms>
void columns_of(const A8Problem& p, int64_t tile0, int64_t tile1, uint8_t* scratch) {
  if (p.int4) {
    columns<true, true, kTerms>(p, tile0, tile1, scratch);
  } else if (p.mins != nullptr) {
    columns<false, true, kTerms>(p, tile0, tile1, scratch);
  } else {
    columns<false, false, kTerms>(p, tile0, tile1, scratch);
  }
}

}  // namespace

void edgeinfer_cpu::a8_columns_amx(const A8Problem& p, int64_t tile0, int64_t tile1, uint8_t* scratch) {
  if (p.terms == 2) {
    columns_of<2>(p, tile0, tile1, scratch);
  } else {
    columns_of<1>(p, tile0, tile1, scratch);
  }
}
