// The int8-activation GEMM's problem description and its per-ISA column kernels.
//
// Shared by a8_gemm.cpp (the op: activation quantization, the ISA choice, threading; compiled
// with the folder's AVX2 flags) and the kernel translation units a8_gemm_avx512vnni.cpp,
// a8_gemm_avxvnni.cpp, a8_gemm_avx2.cpp, a8_gemm_amx.cpp and a8_gemm_amx_bf16.cpp, each of which
// switches on its own instruction set with `#pragma GCC target` at its top (the per-file equivalent of -m flags, which
// torch.utils.cpp_extension cannot set per source). Those files include only this header,
// <cstdint> and <immintrin.h> (always-inline intrinsics): an out-of-line inline function from
// ATen or the standard library compiled there with AVX-512 could be the copy the linker keeps
// for every caller and fault on a CPU without it. So this header is plain data, no templates.
#pragma once

#include <cstdint>

namespace edgeinfer_cpu {

constexpr int64_t kA8Cols = 16;  // output columns per prepared weight tile (one zmm of int32)
// Activation values per scale: min(group, kA8Unit). On SmolLM2-135M (perplexity 46.58 with
// int16 activations) one scale per row (per token) gave 56.98 (+22%; likely a few large
// channels, whose row-wide scale flattens every other value), one per 32 46.83 (+0.52%), one
// per 16 47.00 (+0.90%: finer, yet no better; at this level rounding noise decides).
constexpr int64_t kA8Unit = 32;
constexpr int64_t kA8SuperBlock = 256;  // two-level parameters: values of K per super-scale
constexpr int64_t kA8SuperGroups = kA8SuperBlock / 32;
constexpr int64_t kA8SuperBytes = kA8Cols * 2 + kA8SuperGroups * kA8Cols;

// y (M, N) fp32 = x (M, K) @ W.T, x quantized to int8 per unit u of U = min(group, kA8Unit)
// values (x ~= x_scale[r, u] * code; with two terms x ~= x_scale[r, u] * (16 * code + residual code)):
//   y[r, n] = sum_u scale[n, g(u)] * x_scale[r, u] * dot_u(r, q_n) + sum_g min[n, g] * x_gsum[r, g]
// with dot_u the unit's exact integer dot (two terms: 16 x the codes' dot + the residual's) and
// x_gsum the exact fp32 group sums of x.
// Weight tiles of kA8Cols columns (N padded to a multiple), per tile in K order:
//   int4: per 32-block, 4 vectors of 64 bytes; byte 4c + j of vector v holds column c's code
//         for k = 4v + j in its low nibble and k = 16 + 4v + j in its high nibble (unsigned 0..15).
//   int8: per 4 values of K, 64 bytes; byte 4c + j holds column c's signed code for k = 4q + j.
// scales / mins: (tiles, groups, kA8Cols), fp16 or fp32 (`half`) as the checkpoint has them: a
// GGUF's fp16 kept as fp16 is 20 rather than 24 bytes per 32 int4 weights, and a decode step of a
// model larger than the caches reads every byte. Or (`two_level`, int4 in groups of 32: GGUF
// Q4_K as its file holds it) per tile and super-block of kA8SuperBlock values of K, kA8SuperBytes
// bytes: the 16 columns' fp16 super-scale, then per group of the block the 16 columns' uint8
// codes; a group's scale (or min) is super-scale x code, exact in fp32: 18.5 bytes per 32 weights
// against the file's 18. wsum: (tiles, K / U, kA8Cols) int16, the unit's
// code sum (int8 weights; |sum| <= 32 * 128).
struct A8Problem {
  const uint8_t* codes;
  const void* scales;
  const void* mins;      // null: no min term
  const int16_t* wsum;   // int8 weights; the VNNI kernels start each unit's sum from -128 x it
  // (M, terms * K) codes: int8, or for the VNNI int8 kernels int8 + 128 as uint8. With two terms
  // a row holds, per unit, the unit's U codes of x, then the U codes of its rounding residual at
  // a sixteenth of x's scale (in -8..8), so that 16 x dot(x codes) + dot(residual codes) is the
  // row's unit dot at that scale, summed exactly in int32 before the one rescale (two-term rows
  // below: x_scale holds the residual's scale, and a unit's 2U bytes are one AMX tile row).
  const uint8_t* x;
  const float* x_scale;  // (M, K / U): the scale of the unit's last term
  const float* x_gsum;   // (M, groups); null without mins
  float* y;              // (M, N)
  int64_t m, n, k, group;
  int64_t terms;
  bool int4;
  bool half;       // scales and mins are fp16
  bool two_level;  // scales and mins are super-scales and codes (see above)
};

// Where group g of tile t's 16 columns are in `base` (p.scales or p.mins). Two-level: the
// super-block's 16 fp16 super-scales (a8_super_block) and the group's 16 codes after them
// (a8_group_codes); else the element offset in (tiles, groups, 16) (a8_param_at). static: each
// kernel file keeps its own copy (see above); they compile to integer arithmetic.
static inline const uint8_t* a8_super_block(const A8Problem& p, const void* base, int64_t t, int64_t g) {
  return static_cast<const uint8_t*>(base) + (t * (p.k / kA8SuperBlock) + g / kA8SuperGroups) * kA8SuperBytes;
}
static inline const uint8_t* a8_group_codes(const uint8_t* super_block, int64_t g) {
  return super_block + kA8Cols * 2 + (g % kA8SuperGroups) * kA8Cols;
}
static inline int64_t a8_param_at(const A8Problem& p, int64_t t, int64_t g) {
  return (t * (p.k / p.group) + g) * kA8Cols;
}

// Columns tiles [tile0, tile1) of y for all M rows.
void a8_columns_avx512vnni(const A8Problem& p, int64_t tile0, int64_t tile1);
void a8_columns_avxvnni(const A8Problem& p, int64_t tile0, int64_t tile1);
void a8_columns_avx2(const A8Problem& p, int64_t tile0, int64_t tile1);
// AMX: x as int8 (no + 128), padded to a multiple of 16 rows; scratch: 64-byte aligned, K x 16
// bytes (an int4 tile unpacked), the calling thread's own.
void a8_columns_amx(const A8Problem& p, int64_t tile0, int64_t tile1, uint8_t* scratch);
constexpr int64_t kA8AmxBlock = 16;
// The tile configuration LDTILECFG reads (palette 1): bytes per row and rows of each tile.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// AMX-BF16 (a8_gemm_amx_bf16.cpp): x is bf16 (uint16), rows padded to a multiple of 16, one term;
// x_scale, x_gsum and wsum unused. scratch: 64-byte aligned, K x 32 bytes (a tile dequantized).
void a8_columns_amx_bf16(const A8Problem& p, int64_t tile0, int64_t tile1, uint8_t* scratch);
// count fp32 values -> bf16, round to nearest even (AVX512-BF16).
void a8_rows_to_bf16(const float* x, int64_t count, uint16_t* out);

}  // namespace edgeinfer_cpu
