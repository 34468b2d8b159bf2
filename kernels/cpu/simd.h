// AVX2 helpers shared by the CPU ops in this folder: horizontal reductions, an fp32 dot product,
// loads of 8 values of each cache dtype as fp32, and a vector exp for softmax and sigmoid.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

namespace edgeinfer_cpu {

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return _cvtsh_ss(v.x); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The fp32 dot product of a and b (count values), 8 lanes then the rest.
inline float dot(const float* a, const float* b, int64_t count) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = hsum(acc);
  for (; i < count; ++i) total += a[i] * b[i];
  return total;
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {  // int8 KV codes (their scale applied by the caller)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2 and a degree-6 polynomial; relative error ~2e-7. Inputs below -87 give 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lower = _mm256_set1_ps(-87.0f);
  const __m256 too_small = _mm256_cmp_ps(x, lower, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lower);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2 in two steps (Cody-Waite) to keep r exact to fp32 precision.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// sigmoid(a) from exp(-|a|) only, so nothing overflows: 1 / (1 + e) for a >= 0, e / (1 + e) below;
// relative error ~2e-7 like exp_nonpositive's. SiLU / GELU-tanh (decode_layers.cpp) and the
// soft-cap's tanh(a) = 2 sigmoid(2a) - 1 (attention.cpp) use it.
inline __m256 sigmoid8(__m256 a) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(a, _mm256_set1_ps(-0.0f)));
  return _mm256_div_ps(_mm256_blendv_ps(one, e, a), _mm256_add_ps(one, e));
}

}  // namespace edgeinfer_cpu
