// The AVX-512 inner loops of CPU decode attention (attention_avx512.cpp), for attention.cpp.
//
// Plain data only, like a8_gemm.h: the kernel file switches on AVX-512 with `#pragma GCC target`
// and includes nothing from ATen or the standard library, so no out-of-line copy of a shared
// inline function compiled with AVX-512 can end up serving a caller on a CPU without it.
#pragma once

#include <cstdint>

namespace edgeinfer_cpu {

// Cached tokens the decode attention loops over plain and int8 caches prefetch ahead of the one
// they read (both paths; int4 caches' loops do not): a step's caches come from memory (each
// layer's after the weights of the layers between), and with the hardware prefetchers alone the
// op read them at 9-10 GB/s against 26-30 from cache (tools/bench_cpu_attention.py --layers 30;
// 16 and 64 ahead measured alike, docs/BENCHMARKS.md).
constexpr int64_t kKvAhead = 32;

// A row of `bytes` at p on its way into L2 (prefetcht2), not L1: into L1 the op read 12-17 GB/s
// from memory, into L2 17-22 (16 x 1000 tokens: 13 -> 20 GB/s; a 16-row step's attention 28%
// shorter; AMD EPYC, docs/BENCHMARKS.md), most likely because a prefetch into L1 holds one of
// the core's few L1 miss buffers until its line arrives, which bounds the lines in flight;
// into NTA as slow as into L1. static: each file keeps its own copy (see above).
static inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 1);
}

// The cache element types the AVX-512 loops read (int8: the codes; attention.cpp applies their
// scales to the scores and the softmax weights; int4 caches have loops of their own, below).
// attention.cpp checks the CPU (AVX512F) before calling them.
enum class KvType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };

// One KV head of an int4 cache: token row r (a slot's index x Hkv) holds head_dim / 2 bytes at
// codes + r * head_dim / 2, channel 2i in byte i's low nibble and 2i + 1 in its high one, and a
// value is code * scale + zero with the fp16 scale and zero (IEEE half bits) of its group of 32
// channels at r * head_dim / 32.
struct Int4Cache {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* zeros;
};

// scores[j * stride + t] = scale * q_j . K[t] for the g query heads at q (head_dim apart), K[t] the
// head_dim values at k_cache + rows[t] (elements of `type`). head_dim: a multiple of 16, <= 256.
void key_scores_avx512(const float* q, int64_t g, const void* k_cache, KvType type, const int64_t* rows, int64_t len,
                       int64_t head_dim, float scale, float* scores, int64_t stride);

// o[j * head_dim + d] = sum_t p[j * stride + t] * V[t][d] for the g heads, V[t] at v_cache + rows[t].
void weighted_values_avx512(const float* p, int64_t stride, int64_t g, const void* v_cache, KvType type,
                            const int64_t* rows, int64_t len, int64_t head_dim, float* o);

// key_scores_avx512 and weighted_values_avx512 over int4 rows `srows` (dequantized 16 channels at
// a time into the same loops). head_dim: a multiple of 32, <= 256.
void key_scores_int4_avx512(const float* q, int64_t g, const Int4Cache& k, const int64_t* srows, int64_t len,
                            int64_t head_dim, float scale, float* scores, int64_t stride);
void weighted_values_int4_avx512(const float* p, int64_t stride, int64_t g, const Int4Cache& v, const int64_t* srows,
                                 int64_t len, int64_t head_dim, float* o);

}  // namespace edgeinfer_cpu
