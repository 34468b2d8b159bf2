// The entry points the C++ ops share: decode_layers.cpp composes them into one call per decode
// step. Each is defined in its own op's file and checks nothing; the ops that wrap them check.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace edgeinfer_cpu {

class Team;  // parallel.h

// quantized_gemm.cpp: y (M, N) = x (M, K) @ W.T, x rounded to int16 with a scale per 4 values;
// W int4 (uint8 codes, mins) or int8 (int8 codes; mins undefined or empty: none; group 16 too).
void quantized_gemm_rows(const float* x, int64_t m, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                    int64_t group_size, float* y);

// a8_gemm.cpp: y (M, N) = x (M, K) @ W.T for a kernels.cpu_a8 prepared weight (codes, fp16 or fp32 scales,
// mins or an empty tensor, int16 wsum or an empty tensor for int4), x rounded to int8 per row
// (`terms` 2: x and its rounding residual, each to int8), on the `isa` kernel
// (amx, avx512vnni, avxvnni, avx2); checks the weight.
void a8_gemm_rows(const float* x, int64_t m, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  const at::Tensor& wsum, int64_t n, int64_t k, const std::string& isa, float* y, int64_t terms = 1);

// a8_gemm.cpp: TORCH_CHECKs what a8_gemm_rows checks for an m-row GEMM on this weight (the CPU
// runs `isa`, the tiles, mins and wsum fit N x K; messages name the weight `name`); its group.
int64_t a8_check(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& wsum,
                 int64_t m, int64_t n, int64_t k, const std::string& isa, int64_t terms, const char* name);

// The fewest rows of x (by terms - 1: one or two int8 terms) the a8 GEMMs run on AMX, where the
// CPU has it; fewer run its AVX512-VNNI kernel. AMX from 16 rows of x with one term (a full 16-row
// block), 12 with two: its blocks then hold 16 rows of x, both terms each (a8_gemm_amx.cpp), so at
// 8 rows half of every multiply would be padding; at 12 AMX took 133-138 us against AVX512-VNNI's
// 151-165 on the default model's MLP shapes, at 16 136-141 against 199-214
// (tools/bench_int8_gemm.py --terms 2, docs/BENCHMARKS.md).
inline constexpr int64_t kA8AmxMinRows[] = {16, 12};

// a8_gemm.cpp: a8_gemm_rows run by a team (parallel.h) inside its region, for fewer rows than
// kA8AmxMinRows (the AMX kernel needs a scratch the team does not give it): each thread
// quantizes x into its own buffers and writes its share of the column tiles; returns once every
// share is written. Checks nothing (the caller checked the weight with a8_check, which gave
// `group`).
void a8_gemm_team(const float* x, int64_t m, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  const at::Tensor& wsum, int64_t n, int64_t k, int64_t group, const std::string& isa, float* y,
                  int64_t terms, const Team& team);

// a8_gemm.cpp: the group size of a prepared a8 weight of N x K, TORCH_CHECKed.
int64_t a8_group(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t k, const char* name);

// quantized_gemm.cpp: TORCH_CHECKs an int4 weight (uint8 (N, K / 2), fp16/fp32 scales and mins,
// a group a multiple of 32 dividing K).
void check_int4_weight(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins, int64_t group_size);

// rms_norm.cpp: out = x / sqrt(mean(x^2) + eps) * weight, row by row.
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t hidden, float eps, float* out);

// attention.cpp (with `team`: run by every thread of a team inside its region, each its share of
// the units and of the merge; returns before the last thread's share is written, so the caller
// syncs before reading `out`): out (S, Hq, D) for q (S, Hq, D) over caches (blocks, block_size, Hkv, D): plain
// (scales and zeros undefined), int8 with fp16 scales (blocks, block_size, Hkv), or int4 (two
// codes a byte) with fp16 scales and zeros (blocks, block_size, Hkv, D / 32).
void decode_attention(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scale,
                      const at::Tensor& v_scale, const at::Tensor& k_zero, const at::Tensor& v_zero,
                      const int32_t* tables, int64_t table_stride, const int32_t* lens, int64_t num_seqs,
                      int64_t num_heads, float scale, float* out, int64_t window = 0, float softcap = 0.0f,
                      const Team* team = nullptr);

}  // namespace edgeinfer_cpu
