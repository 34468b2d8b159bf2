// The int8-activation GEMM kernel for AVX-VNNI (256-bit vpdpbusd, without AVX-512): 8 columns
// per vector, two vectors per 16-column tile, 4 activation rows per pass (16 ymm). Same operands
// as the AVX512-VNNI kernel: int4 codes unsigned as they are, int8 weights against x + 128.
#pragma GCC target("avx2,fma,avxvnni")

#include <immintrin.h>

#include <cstdint>

#include "a8_gemm.h"

namespace {

using Vi = __m256i;
using Vf = __m256;
constexpr int64_t kLanes = 8;
constexpr int kRows = 4;
constexpr bool kOffsetX = true;

inline Vi load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vi add_i(Vi a, Vi b) { return _mm256_add_epi32(a, b); }
inline Vi zero_i() { return _mm256_setzero_si256(); }
inline Vi set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline Vi low_nibbles(Vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline Vi high_nibbles(Vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline Vi dot_u4(Vi acc, Vi w, Vi x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
inline Vi s8_magnitude(Vi w) { return w; }
inline Vi dot_s8(Vi acc, Vi, Vi w, Vi x_offset) { return _mm256_dpbusd_avx_epi32(acc, x_offset, w); }
inline Vf zero_f() { return _mm256_setzero_ps(); }
inline Vf set1_f(float v) { return _mm256_set1_ps(v); }
inline Vf load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline Vf to_f(Vi v) { return _mm256_cvtepi32_ps(v); }
inline Vf fmadd_f(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf mul_f(Vf a, Vf b) { return _mm256_mul_ps(a, b); }

}  // namespace

#define A8_ENTRY a8_columns_avxvnni
#include "a8_gemm_kernel.inc"
