// Decode attention over the paged KV pool, plain caches (fp32 / bf16 / fp16), for AVX2 CPUs.
//
// Op torch.ops.edgeinfer_cpu.paged_decode_attention; kernels.paged_attention calls it on the
// CPU and its torch path is the reference. One query token per sequence, q head h reads KV head
// h / (Hq / Hkv), the context of sequence s is its first context_lens[s] slots through its block
// table. Work splits over (sequence, KV head) pairs; a pair scores its g query heads against
// every cached key, takes an exact softmax (max subtracted, fp32) and sums the values. At one
// token per head this is ~15 us per layer instead of ~90 for two bmm's and a softmax (L = 340).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using edgeinfer_cpu::exp_nonpositive;
using edgeinfer_cpu::hmax;
using edgeinfer_cpu::hsum;
using edgeinfer_cpu::load8;

// out[0, 8W) = inv * sum_t p[t] * V[t][d0, d0 + 8W): channels held in registers, even and odd
// tokens in separate accumulators so consecutive FMAs do not wait on each other.
template <int W, typename T>
void weighted_values(const float* p, const T* v_cache, const int64_t* rows, int64_t len, int64_t d0, float inv,
                     float* out) {
  __m256 even[W], odd[W];
  for (int i = 0; i < W; ++i) even[i] = odd[i] = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 2 <= len; t += 2) {
    const __m256 w0 = _mm256_set1_ps(p[t]), w1 = _mm256_set1_ps(p[t + 1]);
    const T* v0 = v_cache + rows[t] + d0;
    const T* v1 = v_cache + rows[t + 1] + d0;
    for (int i = 0; i < W; ++i) {
      even[i] = _mm256_fmadd_ps(w0, load8(v0 + 8 * i), even[i]);
      odd[i] = _mm256_fmadd_ps(w1, load8(v1 + 8 * i), odd[i]);
    }
  }
  if (t < len) {
    const __m256 w0 = _mm256_set1_ps(p[t]);
    for (int i = 0; i < W; ++i) even[i] = _mm256_fmadd_ps(w0, load8(v_cache + rows[t] + d0 + 8 * i), even[i]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
  for (int i = 0; i < W; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_add_ps(even[i], odd[i]), iv));
}

template <typename T>
void decode(const float* q, const T* k_cache, const T* v_cache, const int32_t* tables, int64_t table_stride,
            const int32_t* lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, float scale, float* out) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * slot_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores;
    std::vector<int64_t> rows;  // element offset of each context token's (K or V) row
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t s = p / num_kv_heads;
      const int64_t h = p % num_kv_heads;
      const int64_t len = lens[s];
      if (len <= 0) continue;
      rows.resize(len);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {  // block by block: no division per token
        const int64_t base = tables[s * table_stride + t0 / block_size] * block_stride + h * head_dim;
        for (int64_t i = 0; i < block_size && t0 + i < len; ++i) rows[t0 + i] = base + i * slot_stride;
      }
      scores.resize(len + 8);
      for (int64_t j = 0; j < group; ++j) {
        const int64_t head = h * group + j;
        const float* qj = q + (s * num_heads + head) * head_dim;
        // Four keys at a time: four independent FMA chains instead of one serial chain per key.
        int64_t t = 0;
        for (; t + 4 <= len; t += 4) {
          __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
          for (int64_t d = 0; d < head_dim; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qj + d);
            for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(load8(k_cache + rows[t + i] + d), qv, acc[i]);
          }
          for (int i = 0; i < 4; ++i) scores[t + i] = hsum(acc[i]) * scale;
        }
        for (; t < len; ++t) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < head_dim; d += 8) acc = _mm256_fmadd_ps(load8(k_cache + rows[t] + d), _mm256_loadu_ps(qj + d), acc);
          scores[t] = hsum(acc) * scale;
        }
        __m256 mv = _mm256_set1_ps(scores[0]);
        for (t = 0; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(&scores[t]));
        float m = hmax(mv);
        for (; t < len; ++t) m = std::max(m, scores[t]);
        mv = _mm256_set1_ps(m);
        __m256 total = _mm256_setzero_ps();
        for (t = 0; t + 8 <= len; t += 8) {
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&scores[t]), mv));
          _mm256_storeu_ps(&scores[t], e);
          total = _mm256_add_ps(total, e);
        }
        float sum = hsum(total);
        if (t < len) {  // the tail through one padded vector (scores has 8 spare floats)
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(&scores[t]), mv));
          alignas(32) float tail[8];
          _mm256_store_ps(tail, e);
          for (int64_t i = 0; t + i < len; ++i) {
            scores[t + i] = tail[i];
            sum += tail[i];
          }
        }
        const float inv = 1.0f / sum;
        float* o = out + (s * num_heads + head) * head_dim;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
          switch (std::min<int64_t>(32, head_dim - d0) / 8) {
            case 4: weighted_values<4>(scores.data(), v_cache, rows.data(), len, d0, inv, o + d0); break;
            case 3: weighted_values<3>(scores.data(), v_cache, rows.data(), len, d0, inv, o + d0); break;
            case 2: weighted_values<2>(scores.data(), v_cache, rows.data(), len, d0, inv, o + d0); break;
            default: weighted_values<1>(scores.data(), v_cache, rows.data(), len, d0, inv, o + d0); break;
          }
        }
      }
    }
  });
}

// decode() for the caches' dtype; the caches' shape gives Hkv, D and the block size.
void decode_any(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* tables,
                int64_t table_stride, const int32_t* lens, int64_t num_seqs, int64_t num_heads, float scale, float* out) {
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const auto run = [&](auto* k, auto* v) {
    decode(q, k, v, tables, table_stride, lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>()); break;
    case at::kBFloat16: run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "plain caches only (fp32, bf16, fp16), got ", k_cache.scalar_type());
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q_in.dim() == 3, "q must be (S, Hq, D)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v caches must be (blocks, block_size, Hkv, D) of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_seqs = q_in.size(0), num_heads = q_in.size(1), head_dim = q_in.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && head_dim % 8 == 0, "head_dim must match the cache and be a multiple of 8");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && context_lens.numel() == num_seqs,
              "block_tables (S, max_blocks) and context_lens (S,) must match q");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(len_ptr[s] <= tables.size(1) * block_size, "context_lens[", s, "] exceeds its block table");
  }
  at::Tensor out = at::zeros_like(q);
  decode_any(q.data_ptr<float>(), k_cache, v_cache, tables.data_ptr<int32_t>(), tables.size(1), len_ptr, num_seqs,
             num_heads, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

}  // namespace

void edgeinfer_cpu::decode_attention(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const int32_t* tables, int64_t table_stride, const int32_t* lens, int64_t num_seqs,
                                     int64_t num_heads, float scale, float* out) {
  decode_any(q, k_cache, v_cache, tables, table_stride, lens, num_seqs, num_heads, scale, out);
}

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
