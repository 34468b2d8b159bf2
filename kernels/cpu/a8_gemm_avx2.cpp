// The int8-activation GEMM kernel for plain AVX2 (no VNNI): vpmaddubsw (u8 x s8 pairs to
// int16) then vpmaddwd with ones (pairs of int16 to int32) and an add, per 32 bytes.
// int4: codes 0..15 x int8 pairs stay far below int16's limit. int8 x int8: |w| is the unsigned
// operand and x takes w's sign (vpsignb), llama.cpp's trick: a pair is at most 2 * 128 * 127,
// which fits int16 where x + 128 against signed w would saturate.
#pragma GCC target("avx2,fma")

#include <immintrin.h>

#include <cstdint>

#include "a8_gemm.h"

namespace {

using Vi = __m256i;
using Vf = __m256;
constexpr int64_t kLanes = 8;
constexpr int kRows = 4;
constexpr bool kOffsetX = false;

inline Vi load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vi add_i(Vi a, Vi b) { return _mm256_add_epi32(a, b); }
inline Vi zero_i() { return _mm256_setzero_si256(); }
inline Vi set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline Vi low_nibbles(Vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline Vi high_nibbles(Vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline Vi pairs_to_int32(Vi pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
inline Vi dot_u4(Vi acc, Vi w, Vi x) { return _mm256_add_epi32(acc, pairs_to_int32(_mm256_maddubs_epi16(w, x))); }
inline Vi s8_magnitude(Vi w) { return _mm256_abs_epi8(w); }
inline Vi dot_s8(Vi acc, Vi magnitude, Vi w, Vi x) {
  return _mm256_add_epi32(acc, pairs_to_int32(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w))));
}
inline Vf zero_f() { return _mm256_setzero_ps(); }
inline Vf set1_f(float v) { return _mm256_set1_ps(v); }
inline Vf load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline Vf to_f(Vi v) { return _mm256_cvtepi32_ps(v); }
inline Vf fmadd_f(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf mul_f(Vf a, Vf b) { return _mm256_mul_ps(a, b); }

}  // namespace

#define A8_ENTRY a8_columns_avx2
#include "a8_gemm_kernel.inc"
