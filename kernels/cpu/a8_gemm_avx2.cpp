// The int8-activation GEMM kernel for plain AVX2 (no VNNI): vpmaddubsw (u8 x s8 pairs to
// int16) then vpmaddwd with ones (pairs of int16 to int32) and an add, per 32 bytes.
// int4: codes 0..15 x int8 pairs stay far below int16's limit. int8 x int8: |w| is the unsigned
// operand and x takes w's sign (vpsignb), llama.cpp's trick: a pair is at most 2 * 128 * 127,
// which fits int16 where x + 128 against signed w would saturate.
#pragma GCC target("avx2,fma,f16c")

#include <immintrin.h>

#include <cstdint>

#include "a8_gemm.h"

namespace {

#include "a8_ymm.inc"

constexpr int kRows = 4;
constexpr bool kOffsetX = false;
constexpr bool kFoldTerms = false;  // rows_fold (a8_gemm_kernel.inc)
constexpr int kFoldRows = 2;

inline Vi pairs_to_int32(Vi pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
inline Vi dot_u4(Vi acc, Vi w, Vi x) { return _mm256_add_epi32(acc, pairs_to_int32(_mm256_maddubs_epi16(w, x))); }
inline Vi dot_u4_at(Vi acc, Vi w, const uint8_t* p) {
  int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return dot_u4(acc, w, set1_i(x));
}
inline Vi s8_magnitude(Vi w) { return _mm256_abs_epi8(w); }
inline Vi dot_s8(Vi acc, Vi magnitude, Vi w, Vi x) {
  return _mm256_add_epi32(acc, pairs_to_int32(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w))));
}

}  // namespace

#define A8_ENTRY a8_columns_avx2
#include "a8_gemm_kernel.inc"
