// AVX-512 inner loops of CPU decode attention: a KV head's query heads scored against its keys,
// and the softmax weights' sums of its values (attention.cpp's key_scores, weighted_values and
// attend_int4 stay the AVX2 path).
//
// Why a second path: on AVX2 each (key, query head) score ends in its own horizontal sum, and a
// value row is reloaded and each weight broadcast once per 8 of its channels. Here a block of 16
// keys is converted to fp32 once for all the group's heads, each head's 16 dot products are
// reduced together (lane_sums16, ~3 instructions a key instead of ~8), and a value row is read
// once, each weight broadcast once, into up to 16 zmm accumulators (4 heads x 64 channels).
// Scores sum in another order than the AVX2 loops: the paths agree to fp32 rounding, not bit
// for bit; a process uses one path for every batch size.
//
// Compiled with AVX-512 switched on for this file only (see attention_avx512.h).
#pragma GCC target("avx2,fma,f16c,avx512f")

#include <immintrin.h>

#include <cstdint>

#include "attention_avx512.h"

namespace {

using edgeinfer_cpu::KvType;

template <KvType T>
inline __m512 load16(const void* base, int64_t at);
template <>
inline __m512 load16<KvType::kF32>(const void* base, int64_t at) {
  return _mm512_loadu_ps(static_cast<const float*>(base) + at);
}
template <>
inline __m512 load16<KvType::kF16>(const void* base, int64_t at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at)));
}
template <>
inline __m512 load16<KvType::kBF16>(const void* base, int64_t at) {  // bf16 is the top half of an fp32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
inline __m512 load16<KvType::kI8>(const void* base, int64_t at) {  // codes; the caller applies the scales
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + at));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}

template <KvType T>
constexpr int64_t kElementBytes = T == KvType::kF32 ? 4 : T == KvType::kI8 ? 1 : 2;

// Channels [16c, 16c + 16) of token t's row as fp32: plain caches and int8 codes (whose scales
// attention.cpp applies to the scores and the softmax weights) at base + rows[t] elements.
template <KvType T>
struct PlainRows {
  const void* base;
  const int64_t* rows;
  __m512 operator()(int64_t t, int64_t c) const { return load16<T>(base, rows[t] + 16 * c); }
  void prefetch(int64_t t, int64_t head_dim) const {  // token t's row (head_dim values) on its way into L1
    edgeinfer_cpu::prefetch_row(static_cast<const char*>(base) + rows[t] * kElementBytes<T>,
                                head_dim * kElementBytes<T>);
  }
};

// int4 rows (attention_avx512.h): 8 bytes hold 16 channels, each byte's low nibble the even one;
// x = code * scale + zero with the fp16 scale and zero of the channels' group of 32.
struct Int4Rows {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* zeros;
  const int64_t* srows;
  int64_t row_bytes, groups;
  __m512 operator()(int64_t t, int64_t c) const {
    const int64_t r = srows[t];
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + r * row_bytes + 8 * c));
    const __m512i doubled = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  // b0 b0 b1 b1 ...
    const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi32(doubled, shifts), _mm512_set1_epi32(0x0F));
    const int64_t at = r * groups + c / 2;
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(nibbles), _mm512_set1_ps(_cvtsh_ss(scales[at])),
                           _mm512_set1_ps(_cvtsh_ss(zeros[at])));
  }
  void prefetch(int64_t, int64_t) const {}
};

// Lane i of the result: the sum of a[i]'s 16 lanes. Pairs of vectors are folded into one at
// each level (per 128-bit lane: 4 values -> 2 -> 1 per vector, then across the 4 lanes), so every
// instruction works for several keys.
inline __m512 lane_sums16(const __m512* a) {
  __m512 b[8];  // 128-bit lane l of b[i]: a[2i] and a[2i+1], two partial sums each
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  __m512 c[4];  // 128-bit lane l of c[i]: a[4i .. 4i + 3], the sum of their lane l's 4 values
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], kEven), _mm512_shuffle_f32x4(c[0], c[1], kOdd));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], kEven), _mm512_shuffle_f32x4(c[2], c[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, kEven), _mm512_shuffle_f32x4(u0, u1, kOdd));
}

template <typename Rows>
void key_scores(const float* q, int64_t g, const Rows& key, int64_t len, int64_t head_dim, float scale, float* scores,
                int64_t stride) {
  alignas(64) float keys[16 * 256];  // a block of 16 keys as fp32 (head_dim <= 256)
  const int64_t chunks = head_dim / 16;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = len - t0 < 16 ? len - t0 : 16;
    for (int64_t i = 0; i < 16; ++i) {  // a short last block's missing keys score 0 and are not stored
      if (t0 + edgeinfer_cpu::kKvAhead + i < len) key.prefetch(t0 + edgeinfer_cpu::kKvAhead + i, head_dim);
      for (int64_t c = 0; c < chunks; ++c) {
        _mm512_store_ps(keys + i * head_dim + 16 * c, i < n ? key(t0 + i, c) : _mm512_setzero_ps());
      }
    }
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * head_dim;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 qv = _mm512_loadu_ps(qj + 16 * c);
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(keys + i * head_dim + 16 * c), qv, acc[i]);
      }
      _mm512_mask_storeu_ps(scores + j * stride + t0, mask, _mm512_mul_ps(lane_sums16(acc), vscale));
    }
  }
}

// G heads (p and o at their first), channels [d0, d0 + 16 C) of the values: each value's C
// vectors loaded once, each head's weight broadcast once, G x C accumulators.
template <typename Rows, int G, int C>
void values_pass(const float* p, int64_t stride, const Rows& value, int64_t len, int64_t d0, int64_t head_dim,
                 float* o) {
  __m512 acc[G][C];
  for (int j = 0; j < G; ++j) {
    for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < len; ++t) {
    if (d0 == 0 && t + edgeinfer_cpu::kKvAhead < len) value.prefetch(t + edgeinfer_cpu::kKvAhead, head_dim);
    __m512 x[C];
    for (int c = 0; c < C; ++c) x[c] = value(t, d0 / 16 + c);
    for (int j = 0; j < G; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * stride + t]);
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(w, x[c], acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + j * head_dim + d0 + 16 * c, acc[j][c]);
  }
}

template <typename Rows>
void weighted_values(const float* p, int64_t stride, int64_t g, const Rows& value, int64_t len, int64_t head_dim,
                     float* o) {
  using Pass = void (*)(const float*, int64_t, const Rows&, int64_t, int64_t, int64_t, float*);
  static constexpr Pass kPasses[4][4] = {
      {values_pass<Rows, 1, 1>, values_pass<Rows, 1, 2>, values_pass<Rows, 1, 3>, values_pass<Rows, 1, 4>},
      {values_pass<Rows, 2, 1>, values_pass<Rows, 2, 2>, values_pass<Rows, 2, 3>, values_pass<Rows, 2, 4>},
      {values_pass<Rows, 3, 1>, values_pass<Rows, 3, 2>, values_pass<Rows, 3, 3>, values_pass<Rows, 3, 4>},
      {values_pass<Rows, 4, 1>, values_pass<Rows, 4, 2>, values_pass<Rows, 4, 3>, values_pass<Rows, 4, 4>}};
  for (int64_t j0 = 0; j0 < g; j0 += 4) {
    const int64_t heads = g - j0 < 4 ? g - j0 : 4;
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
      const int64_t chunks = (head_dim - d0) / 16 < 4 ? (head_dim - d0) / 16 : 4;
      kPasses[heads - 1][chunks - 1](p + j0 * stride, stride, value, len, d0, head_dim, o + j0 * head_dim);
    }
  }
}

}  // namespace

void edgeinfer_cpu::key_scores_avx512(const float* q, int64_t g, const void* k_cache, KvType type, const int64_t* rows,
                                      int64_t len, int64_t head_dim, float scale, float* scores, int64_t stride) {
  switch (type) {
    case KvType::kF32: key_scores(q, g, PlainRows<KvType::kF32>{k_cache, rows}, len, head_dim, scale, scores, stride); break;
    case KvType::kF16: key_scores(q, g, PlainRows<KvType::kF16>{k_cache, rows}, len, head_dim, scale, scores, stride); break;
    case KvType::kBF16: key_scores(q, g, PlainRows<KvType::kBF16>{k_cache, rows}, len, head_dim, scale, scores, stride); break;
    case KvType::kI8: key_scores(q, g, PlainRows<KvType::kI8>{k_cache, rows}, len, head_dim, scale, scores, stride); break;
  }
}

void edgeinfer_cpu::weighted_values_avx512(const float* p, int64_t stride, int64_t g, const void* v_cache, KvType type,
                                           const int64_t* rows, int64_t len, int64_t head_dim, float* o) {
  switch (type) {
    case KvType::kF32: weighted_values(p, stride, g, PlainRows<KvType::kF32>{v_cache, rows}, len, head_dim, o); break;
    case KvType::kF16: weighted_values(p, stride, g, PlainRows<KvType::kF16>{v_cache, rows}, len, head_dim, o); break;
    case KvType::kBF16: weighted_values(p, stride, g, PlainRows<KvType::kBF16>{v_cache, rows}, len, head_dim, o); break;
    case KvType::kI8: weighted_values(p, stride, g, PlainRows<KvType::kI8>{v_cache, rows}, len, head_dim, o); break;
  }
}

void edgeinfer_cpu::key_scores_int4_avx512(const float* q, int64_t g, const Int4Cache& k, const int64_t* srows,
                                           int64_t len, int64_t head_dim, float scale, float* scores, int64_t stride) {
  key_scores(q, g, Int4Rows{k.codes, k.scales, k.zeros, srows, head_dim / 2, head_dim / 32}, len, head_dim, scale,
             scores, stride);
}

void edgeinfer_cpu::weighted_values_int4_avx512(const float* p, int64_t stride, int64_t g, const Int4Cache& v,
                                                const int64_t* srows, int64_t len, int64_t head_dim, float* o) {
  weighted_values(p, stride, g, Int4Rows{v.codes, v.scales, v.zeros, srows, head_dim / 2, head_dim / 32}, len,
                  head_dim, o);
}
