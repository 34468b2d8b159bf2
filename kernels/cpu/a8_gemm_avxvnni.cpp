// The int8-activation GEMM kernel for AVX-VNNI (256-bit vpdpbusd, without AVX-512): 8 columns
// per vector, two vectors per 16-column tile, 4 activation rows per pass (16 ymm). Same operands
// as the AVX512-VNNI kernel: int4 codes unsigned as they are, int8 weights against x + 128.
#pragma GCC target("avx2,fma,f16c,avxvnni")

#include <immintrin.h>

#include <cstdint>

#include "a8_gemm.h"

namespace {

#include "a8_ymm.inc"

constexpr int kRows = 4;
constexpr bool kOffsetX = true;
constexpr bool kFoldTerms = false;  // rows_fold (a8_gemm_kernel.inc)
constexpr int kFoldRows = 2;

inline Vi dot_u4(Vi acc, Vi w, Vi x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
inline Vi dot_u4_at(Vi acc, Vi w, const uint8_t* p) {
  int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return dot_u4(acc, w, set1_i(x));
}
inline Vi s8_magnitude(Vi w) { return w; }
inline Vi dot_s8(Vi acc, Vi, Vi w, Vi x_offset) { return _mm256_dpbusd_avx_epi32(acc, x_offset, w); }

}  // namespace

#define A8_ENTRY a8_columns_avxvnni
#include "a8_gemm_kernel.inc"
