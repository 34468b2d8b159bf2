// The int8-activation GEMM kernel for AVX512-VNNI: vpdpbusd on 64 bytes, 16 columns per vector,
// 8 activation rows per pass over a weight tile (16 int32 + 8 fp32 accumulators of 32 zmm);
// two-term rows against int4 weights: 8 x rows a pass, both terms in one sum (rows_fold).
// int4 x int8: codes 0..15 are dpbusd's unsigned operand as they are. int8 x int8: x + 128 is
// the unsigned operand and each group's sum starts at -128 * sum(w), prepared with the weight.
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")

#include <immintrin.h>

#include <cstdint>

#include "a8_gemm.h"

namespace {

using Vi = __m512i;
using Vf = __m512;
constexpr int64_t kLanes = 16;
constexpr int kRows = 8;
constexpr bool kOffsetX = true;
constexpr bool kFoldTerms = true;  // rows_fold (a8_gemm_kernel.inc)
constexpr int kFoldRows = 8;

inline Vi load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Vi add_i(Vi a, Vi b) { return _mm512_add_epi32(a, b); }
inline Vi times16_i(Vi a) { return _mm512_slli_epi32(a, 4); }
inline Vi zero_i() { return _mm512_setzero_si512(); }
inline Vi set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline Vi low_nibbles(Vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline Vi high_nibbles(Vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline Vi low_nibbles_x16(Vi v) { return _mm512_and_si512(_mm512_slli_epi16(v, 4), _mm512_set1_epi8(char(0xF0))); }
inline Vi high_nibbles_x16(Vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(char(0xF0))); }
// x's 4 bytes at p as vpdpbusd's embedded broadcast: GCC does not fold set1(load) into it, and a
// separate vpbroadcastd per dot product was a third of the int4 inner loop's instructions.
inline Vi dot_u4_at(Vi acc, Vi w, const uint8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}
inline Vi s8_magnitude(Vi w) { return w; }
inline Vi dot_s8(Vi acc, Vi, Vi w, Vi x_offset) { return _mm512_dpbusd_epi32(acc, x_offset, w); }
inline Vf zero_f() { return _mm512_setzero_ps(); }
inline Vf set1_f(float v) { return _mm512_set1_ps(v); }
inline Vf load_f(const float* p) { return _mm512_loadu_ps(p); }
inline Vf load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vf load_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// -128 x the unit's int16 code sums: where the int8 kernel's dot products start (x is read + 128).
inline Vi wsum_start(const int16_t* p) {
  const Vi sums = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
}
inline void store_f(float* p, Vf v) { _mm512_storeu_ps(p, v); }
inline Vf to_f(Vi v) { return _mm512_cvtepi32_ps(v); }
inline Vf fmadd_f(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }
inline Vf mul_f(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf add_f(Vf a, Vf b) { return _mm512_add_ps(a, b); }

}  // namespace

#define A8_ENTRY a8_columns_avx512vnni
#include "a8_gemm_kernel.inc"
