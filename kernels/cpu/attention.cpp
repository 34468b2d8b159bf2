// Decode attention over the paged KV pool, plain caches (fp32 / bf16 / fp16) or, for
// decode_layers, quantized ones (int8 with a scale per token and head, int4 with a scale and
// zero per 32 channels), for AVX2 CPUs; every cache's inner loops on AVX-512 where the CPU has it
// (attention_avx512.cpp; tools/bench_cpu_attention.py, fp16, 2 threads, fastest tenth: 16
// sequences of 300 tokens 163-165 us a layer against 188-189, one of 2048 60-61 against 76-79;
// the cache is then read at 21-26 GB/s, near this machine's memory rate).
//
// Op torch.ops.edgeinfer_cpu.paged_decode_attention; kernels.paged_attention calls it on the
// CPU and its torch path is the reference. One query token per sequence, q head h reads KV head
// h / (Hq / Hkv), the context of sequence s is its first context_lens[s] slots through its block
// table. Work splits over sequences, and over parts of the context where there are fewer
// sequences than two per thread; a unit runs each KV head in turn, scoring its g query heads
// together against its keys (each key and value vector loaded once for the g heads), takes an
// exact softmax (max subtracted, fp32) and sums the values; parts merge by their maxima. A
// prompt chunk's rows (one sequence's table, each row a token longer) go up to 16 to a unit, all
// their query heads scored against each key together, each row keeping its own first tokens: a
// 2,000-token prompt prefilled 743 -> 850-870 tok/s (edgeinfer bench, docs/BENCHMARKS.md).
// At one token per head this is ~15 us per layer instead of ~90 for two bmm's and a softmax.
// Against a unit per (sequence, KV head) and a pass per query head, per layer of the default
// model (fp16 cache, 2 threads): one sequence at 4096 tokens 220-257 us against 317-361, 4 at
// 1024 238-244 against 309-371, 16 at 300 207-302 against 265-350.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_avx512.h"
#include "ops.h"
#include "parallel.h"
#include "simd.h"

namespace {

using edgeinfer_cpu::exp_nonpositive;
using edgeinfer_cpu::hmax;
using edgeinfer_cpu::hsum;
using edgeinfer_cpu::load8;

// The query heads of one KV head go through its keys and values together (GQA: 3 query heads per
// KV head on the default model, 4-8 on larger ones): each K or V vector is loaded, and converted
// from fp16 / bf16 / int8, once for all of them instead of once per head. Per head the arithmetic
// is that of a loop over one head (the same FMAs in the same order): grouping moves no result.
constexpr int kMaxGroup = 4;  // heads per pass: 2 x 4 accumulators + 2 keys + 1 query stay in registers

// scores[j * stride + t] = scale * q_j . K[t] for the G heads at q (head_dim apart), two keys at
// a time (independent FMA chains), one accumulator per head and key summed over head_dim in order.
template <int G, typename T>
void key_scores(const float* q, const T* k_cache, const int64_t* rows, int64_t len, int64_t head_dim, float scale,
                float* scores, int64_t stride) {
  int64_t t = 0;
  for (; t + 2 <= len; t += 2) {
    if (t + edgeinfer_cpu::kKvAhead + 1 < len) {
      edgeinfer_cpu::prefetch_row(k_cache + rows[t + edgeinfer_cpu::kKvAhead], head_dim * sizeof(T));
      edgeinfer_cpu::prefetch_row(k_cache + rows[t + edgeinfer_cpu::kKvAhead + 1], head_dim * sizeof(T));
    }
    __m256 a0[G], a1[G];
    for (int j = 0; j < G; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
    const T* k0 = k_cache + rows[t];
    const T* k1 = k_cache + rows[t + 1];
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 x0 = load8(k0 + d), x1 = load8(k1 + d);
      for (int j = 0; j < G; ++j) {
        const __m256 qv = _mm256_loadu_ps(q + j * head_dim + d);
        a0[j] = _mm256_fmadd_ps(x0, qv, a0[j]);
        a1[j] = _mm256_fmadd_ps(x1, qv, a1[j]);
      }
    }
    for (int j = 0; j < G; ++j) {
      scores[j * stride + t] = hsum(a0[j]) * scale;
      scores[j * stride + t + 1] = hsum(a1[j]) * scale;
    }
  }
  if (t < len) {
    __m256 a[G];
    for (int j = 0; j < G; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 x = load8(k_cache + rows[t] + d);
      for (int j = 0; j < G; ++j) a[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + j * head_dim + d), a[j]);
    }
    for (int j = 0; j < G; ++j) scores[j * stride + t] = hsum(a[j]) * scale;
  }
}

// o_j[d0, d0 + 8) = sum_t p_j[t] * V[t][d0, d0 + 8) for the G heads (p_j at p + j * stride, o_j
// at o + j * head_dim): even and odd tokens in separate accumulators so consecutive FMAs do not
// wait on each other.
template <int G, typename T>
void weighted_values(const float* p, int64_t stride, const T* v_cache, const int64_t* rows, int64_t len, int64_t d0,
                     int64_t head_dim, float* o) {
  __m256 even[G], odd[G];
  for (int j = 0; j < G; ++j) even[j] = odd[j] = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 2 <= len; t += 2) {
    if (d0 == 0 && t + edgeinfer_cpu::kKvAhead + 1 < len) {  // the later channel passes find the rows cached
      edgeinfer_cpu::prefetch_row(v_cache + rows[t + edgeinfer_cpu::kKvAhead], head_dim * sizeof(T));
      edgeinfer_cpu::prefetch_row(v_cache + rows[t + edgeinfer_cpu::kKvAhead + 1], head_dim * sizeof(T));
    }
    const __m256 v0 = load8(v_cache + rows[t] + d0), v1 = load8(v_cache + rows[t + 1] + d0);
    for (int j = 0; j < G; ++j) {
      even[j] = _mm256_fmadd_ps(_mm256_set1_ps(p[j * stride + t]), v0, even[j]);
      odd[j] = _mm256_fmadd_ps(_mm256_set1_ps(p[j * stride + t + 1]), v1, odd[j]);
    }
  }
  if (t < len) {
    const __m256 v0 = load8(v_cache + rows[t] + d0);
    for (int j = 0; j < G; ++j) even[j] = _mm256_fmadd_ps(_mm256_set1_ps(p[j * stride + t]), v0, even[j]);
  }
  for (int j = 0; j < G; ++j) _mm256_storeu_ps(o + j * head_dim + d0, _mm256_add_ps(even[j], odd[j]));
}

// run(j0, heads) over the g query heads in passes of up to kMaxGroup (heads: an integral_constant).
template <typename F>
void head_passes(int64_t g, const F& run) {
  for (int64_t j0 = 0; j0 < g; j0 += kMaxGroup) {
    switch (std::min<int64_t>(kMaxGroup, g - j0)) {
      case 4: run(j0, std::integral_constant<int, 4>()); break;
      case 3: run(j0, std::integral_constant<int, 3>()); break;
      case 2: run(j0, std::integral_constant<int, 2>()); break;
      default: run(j0, std::integral_constant<int, 1>()); break;
    }
  }
}

// The caches attend_group hands to the AVX-512 loops (attention_avx512.cpp) where the CPU has
// them: plain ones and int8 codes (int4 caches take decode's own branch).
template <typename T>
constexpr bool kWide = std::is_same_v<T, float> || std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16> ||
                       std::is_same_v<T, int8_t>;
template <typename T>
constexpr edgeinfer_cpu::KvType kv_type() {
  if constexpr (std::is_same_v<T, float>) return edgeinfer_cpu::KvType::kF32;
  else if constexpr (std::is_same_v<T, c10::Half>) return edgeinfer_cpu::KvType::kF16;
  else if constexpr (std::is_same_v<T, c10::BFloat16>) return edgeinfer_cpu::KvType::kBF16;
  else return edgeinfer_cpu::KvType::kI8;
}

// The fp16 scales (and int4 zeros) of quantized caches, null for plain ones. int8: one scale per
// (token, head), at srow = slot * Hkv + h; int4: a scale and a zero per 32 channels of each
// (token, head), at srow * head_dim / 32.
struct KvScales {
  const c10::Half* k_scale = nullptr;
  const c10::Half* v_scale = nullptr;
  const c10::Half* k_zero = nullptr;
  const c10::Half* v_zero = nullptr;
};

// scores[0, len) -> exp(score - max) in place; returns the sum, the max in *m_out. `scores` must
// hold len + 8 floats. A `softcap` > 0 first takes each score to softcap * tanh(score / softcap)
// (Gemma 2), tanh(a) as 2 sigmoid(2a) - 1.
float softmax_numerators(float* scores, int64_t len, float* m_out, float softcap = 0.0f) {
  if (softcap > 0.0f) {
    const __m256 one = _mm256_set1_ps(1.0f), cap = _mm256_set1_ps(softcap);
    const __m256 twice_inv = _mm256_set1_ps(2.0f / softcap);
    for (int64_t t = 0; t < len; t += 8) {  // the padding past len is computed and never read
      const __m256 sig = edgeinfer_cpu::sigmoid8(_mm256_mul_ps(_mm256_loadu_ps(scores + t), twice_inv));
      _mm256_storeu_ps(scores + t, _mm256_mul_ps(cap, _mm256_fmsub_ps(_mm256_set1_ps(2.0f), sig, one)));
    }
  }
  int64_t t = 0;
  __m256 mv = _mm256_set1_ps(scores[0]);
  for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(scores + t));
  float m = hmax(mv);
  for (; t < len; ++t) m = std::max(m, scores[t]);
  mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (t = 0; t + 8 <= len; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
    _mm256_storeu_ps(scores + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  if (t < len) {  // the tail through one padded vector (scores has 8 spare floats)
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
    alignas(32) float tail[8];
    _mm256_store_ps(tail, e);
    for (int64_t i = 0; t + i < len; ++i) {
      scores[t + i] = tail[i];
      sum += tail[i];
    }
  }
  *m_out = m;
  return sum;
}

// The g query heads at q (head_dim apart) of one KV head against `len` cached tokens (their K/V
// row offsets in `rows`, scale indices in `srows`): per head j the largest score m[j], the sum of
// exp(score - max) l[j] and the unnormalised value sum o + j * head_dim. `scores` must hold
// g * (len + 8) floats. int8 caches: a key's scale multiplies its score, a value's its softmax
// weight (after the sum l). `wide`: the AVX-512 loops. With `query_lens`, query j attends to its
// first query_lens[j] (1..len) tokens only: its later scores are computed and left out, its later
// values weighted by zero (which adds exactly nothing).
template <typename T>
void attend_group(const float* q, int64_t g, const T* k_cache, const T* v_cache, const int64_t* rows,
                  const int64_t* srows, int64_t len, int64_t head_dim, float scale, float* scores, float* m, float* l,
                  float* o, const KvScales& sc, float softcap, bool wide, const int64_t* query_lens = nullptr) {
  const int64_t stride = len + 8;
  wide = wide && kWide<T>;  // a cache the AVX-512 loops cannot read takes the AVX2 ones
  // The loops prefetch kKvAhead rows ahead of the one they read, so each pass would begin with
  // that many rows missed one after another: ask for them together first, the values' during the
  // softmax (16 sequences of 100 tokens from memory: 80 -> 60 us a layer; docs/BENCHMARKS.md).
  const int64_t burst = std::min<int64_t>(len, edgeinfer_cpu::kKvAhead);
  for (int64_t t = 0; t < burst; ++t) edgeinfer_cpu::prefetch_row(k_cache + rows[t], head_dim * sizeof(T));
  if constexpr (kWide<T>) {
    if (wide) edgeinfer_cpu::key_scores_avx512(q, g, k_cache, kv_type<T>(), rows, len, head_dim, scale, scores, stride);
  }
  if (!wide) {
    head_passes(g, [&](int64_t j0, auto heads) {
      key_scores<decltype(heads)::value>(q + j0 * head_dim, k_cache, rows, len, head_dim, scale, scores + j0 * stride,
                                         stride);
    });
  }
  for (int64_t t = 0; t < burst; ++t) edgeinfer_cpu::prefetch_row(v_cache + rows[t], head_dim * sizeof(T));
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * stride;
    const int64_t own = query_lens != nullptr ? query_lens[j] : len;
    if (sc.k_scale != nullptr) {
      for (int64_t t = 0; t < own; ++t) sj[t] *= static_cast<float>(sc.k_scale[srows[t]]);
    }
    l[j] = softmax_numerators(sj, own, m + j, softcap);
    if (sc.v_scale != nullptr) {
      for (int64_t t = 0; t < own; ++t) sj[t] *= static_cast<float>(sc.v_scale[srows[t]]);
    }
    std::fill(sj + own, sj + len, 0.0f);
  }
  if constexpr (kWide<T>) {
    if (wide) edgeinfer_cpu::weighted_values_avx512(scores, stride, g, v_cache, kv_type<T>(), rows, len, head_dim, o);
  }
  if (!wide) {
    head_passes(g, [&](int64_t j0, auto heads) {
      for (int64_t d0 = 0; d0 < head_dim; d0 += 8) {
        weighted_values<decltype(heads)::value>(scores + j0 * stride, stride, v_cache, rows, len, d0, head_dim,
                                                o + j0 * head_dim);
      }
    });
  }
}

// 8 int4 codes (4 bytes: channel 2i in the low nibble of byte i, 2i + 1 in the high) as floats.
inline __m256 unpack8_int4(const uint8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i bytes = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(word));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi32(0x0F)), high = _mm_srli_epi32(bytes, 4);
  return _mm256_cvtepi32_ps(_mm256_set_m128i(_mm_unpackhi_epi32(low, high), _mm_unpacklo_epi32(low, high)));
}

// attend_group for int4 caches, G query heads at q (head_dim apart): x = code * scale + zero per
// 32 channels, so a key's score is sum_g (scale_g q_g . codes_g + zero_g sum(q_g)), and a value
// adds p * scale_g * codes_g to o and p * zero_g to the group's channels (summed over tokens
// first). Each key's and value's codes are unpacked once for the G heads (one pass per head
// before: at 2048 tokens the default model decoded 43-47 tok/s with an int4 cache, now 51-55).
template <int G>
void attend_int4(const float* q, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* srows, int64_t len,
                 int64_t head_dim, float scale, float* scores, int64_t stride, float* m, float* l, float* o,
                 const KvScales& sc, float softcap) {
  const int64_t groups = head_dim / 32, row_bytes = head_dim / 2;
  float q_sum[G][16], zero_sum[G][16] = {};  // head_dim <= 512
  for (int j = 0; j < G; ++j) {
    const float* qj = q + j * head_dim;
    for (int64_t g = 0; g < groups; ++g) q_sum[j][g] = hsum(_mm256_add_ps(
        _mm256_add_ps(_mm256_loadu_ps(qj + 32 * g), _mm256_loadu_ps(qj + 32 * g + 8)),
        _mm256_add_ps(_mm256_loadu_ps(qj + 32 * g + 16), _mm256_loadu_ps(qj + 32 * g + 24))));
  }
  for (int64_t t = 0; t < len; ++t) {
    const uint8_t* key = k_cache + srows[t] * row_bytes;
    const c10::Half* ks = sc.k_scale + srows[t] * groups;
    const c10::Half* kz = sc.k_zero + srows[t] * groups;
    float total[G] = {};
    for (int64_t g = 0; g < groups; ++g) {
      __m256 codes[4];
      for (int i = 0; i < 4; ++i) codes[i] = unpack8_int4(key + 16 * g + 4 * i);
      for (int j = 0; j < G; ++j) {
        const float* qg = q + j * head_dim + 32 * g;
        __m256 acc = _mm256_mul_ps(codes[0], _mm256_loadu_ps(qg));
        for (int i = 1; i < 4; ++i) acc = _mm256_fmadd_ps(codes[i], _mm256_loadu_ps(qg + 8 * i), acc);
        total[j] += static_cast<float>(ks[g]) * hsum(acc) + static_cast<float>(kz[g]) * q_sum[j][g];
      }
    }
    for (int j = 0; j < G; ++j) scores[j * stride + t] = total[j] * scale;
  }
  for (int j = 0; j < G; ++j) l[j] = softmax_numerators(scores + j * stride, len, m + j, softcap);
  std::fill_n(o, G * head_dim, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const uint8_t* value = v_cache + srows[t] * row_bytes;
    const c10::Half* vs = sc.v_scale + srows[t] * groups;
    const c10::Half* vz = sc.v_zero + srows[t] * groups;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 codes[4];
      for (int i = 0; i < 4; ++i) codes[i] = unpack8_int4(value + 16 * g + 4 * i);
      for (int j = 0; j < G; ++j) {
        const float p = scores[j * stride + t];
        const __m256 w = _mm256_set1_ps(p * static_cast<float>(vs[g]));
        zero_sum[j][g] += p * static_cast<float>(vz[g]);
        for (int i = 0; i < 4; ++i) {
          float* dst = o + j * head_dim + 32 * g + 8 * i;
          _mm256_storeu_ps(dst, _mm256_fmadd_ps(w, codes[i], _mm256_loadu_ps(dst)));
        }
      }
    }
  }
  for (int j = 0; j < G; ++j) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t d = 32 * g; d < 32 * (g + 1); ++d) o[j * head_dim + d] += zero_sum[j][g];
    }
  }
}

constexpr int64_t kMinPart = 64;  // tokens: below this a context part is not worth its merge
// A prompt's rows attended together (decode's row groups): at most this many rows, and query
// heads, a unit (its scores are queries x context floats).
constexpr int64_t kMaxGroupRows = 16;
constexpr int64_t kMaxGroupQueries = 64;

template <typename T>
void decode(const float* q, const T* k_cache, const T* v_cache, const int32_t* tables, int64_t table_stride,
            const int32_t* lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, float scale, float* out, const KvScales& sc, int64_t window, float softcap, bool wide,
            const edgeinfer_cpu::Team* team) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * slot_stride;
  const int64_t pairs = num_seqs * num_kv_heads;
  // Work units are (sequence, context part), each running all KV heads of its tokens: a slot
  // holds every KV head's row side by side, so a unit streams its blocks' bytes once, in order,
  // where a unit per KV head read a third of each cache line run and left the rest to be fetched
  // again by another unit. With fewer sequences than two per thread, contexts are cut into parts
  // whose partial softmaxes are merged after (flash decoding).
  const int64_t want = 2 * (team != nullptr ? team->n : at::get_num_threads());  // a team's threads agree on it
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) max_len = std::max<int64_t>(max_len, lens[s]);
  const int64_t parts =
      num_seqs >= want ? 1 : std::max<int64_t>(1, std::min((want + num_seqs - 1) / num_seqs, max_len / kMinPart));
  const int64_t units = num_seqs * parts;
  const int64_t items = pairs * parts;  // (sequence, KV head, part): one partial softmax each
  // The partial softmaxes: maxima, sums and value sums per item and query head (a team's are shared).
  std::vector<float> own;
  std::vector<float>& partials = team != nullptr ? team->scratch : own;
  const size_t partial_floats = items * group * (2 + head_dim);
  if (team == nullptr || team->tid == 0) partials.resize(std::max(partials.size(), partial_floats));
  if (team != nullptr) team->sync();
  float* const part_m = partials.data();
  float* const part_l = part_m + items * group;
  float* const part_o = part_l + items * group;
  // A prompt chunk arrives as rows of one sequence: the same block table, each row one token
  // longer than the one before. Up to max_rows of them make one unit whose query heads are scored
  // against each key together (each block of keys and each value converted once for all of them
  // instead of once per row), each row then keeping only its own first tokens. Only without
  // context parts (parts == 1), a team or a window that cuts, and not for int4 caches (their own
  // loops). starts: unit i covers rows [starts[i], starts[i + 1]).
  std::vector<int64_t> starts;
  if constexpr (!std::is_same_v<T, uint8_t>) {
    const int64_t max_rows = std::clamp<int64_t>(std::min(num_seqs / want, kMaxGroupQueries / group), 1, kMaxGroupRows);
    bool grouped = false;
    if (parts == 1 && team == nullptr && max_rows > 1 && (window == 0 || max_len <= window)) {
      for (int64_t s = 0; s < num_seqs; ++s) {
        const bool joins = !starts.empty() && s - starts.back() < max_rows && lens[s - 1] > 0 && lens[s] == lens[s - 1] + 1 &&
                           std::equal(tables + s * table_stride, tables + (s + 1) * table_stride,
                                      tables + (s - 1) * table_stride);
        if (!joins) starts.push_back(s);
        grouped = grouped || joins;
      }
      starts.push_back(num_seqs);
    }
    if (!grouped) starts.clear();
  }
  // rows: the element offset of each of tokens [t_begin, t_end)'s (K or V) row of KV head 0
  // through the block table `table`; srows (quantized caches): the index of its scale for KV
  // head 0 (slot * Hkv). Block by block: no division per token.
  const auto token_rows = [&](const int32_t* table, int64_t t_begin, int64_t t_end, std::vector<int64_t>& rows,
                              std::vector<int64_t>& srows) {
    rows.resize(t_end - t_begin);
    for (int64_t t = t_begin; t < t_end;) {
      const int64_t block = t / block_size, stop = std::min(t_end, (block + 1) * block_size);
      int64_t row = table[block] * block_stride + (t - block * block_size) * slot_stride;
      for (; t < stop; ++t, row += slot_stride) rows[t - t_begin] = row;
    }
    if (sc.k_scale != nullptr) {
      srows.resize(rows.size());
      for (size_t i = 0; i < rows.size(); ++i) srows[i] = rows[i] / head_dim;
    }
  };
  // KV head h's scales (and int4 zeros): its rows sit h * head_dim into each slot, its scales h
  // into each slot's (int4: h * head_dim / 32).
  const auto head_scales = [&](int64_t h) -> KvScales {
    if (sc.k_scale == nullptr) return sc;
    const int64_t at = h * (std::is_same_v<T, uint8_t> ? head_dim / 32 : 1);
    return {sc.k_scale + at, sc.v_scale + at, sc.k_zero ? sc.k_zero + at : nullptr, sc.v_zero ? sc.v_zero + at : nullptr};
  };
  const auto run_units = [&](int64_t u0, int64_t u1) {
    std::vector<float> scores;
    std::vector<int64_t> rows, srows;  // token_rows'
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t s = unit / parts, part = unit % parts;
      // A sliding window (Mistral, Phi-3) keeps the last `window` tokens: the query and window - 1 before it.
      const int64_t len = lens[s], first = window > 0 && len > window ? len - window : 0;
      const int64_t span = len - first;
      const int64_t t_begin = first + span * part / parts, t_end = first + span * (part + 1) / parts;
      if (t_end > t_begin) token_rows(tables + s * table_stride, t_begin, t_end, rows, srows);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t item = (s * num_kv_heads + h) * parts + part;
        float* m = part_m + item * group;
        float* l = part_l + item * group;
        float* o = part_o + item * group * head_dim;
        if (t_end <= t_begin) {  // an empty part weighs nothing in the merge
          std::fill_n(m, group, -INFINITY);
          std::fill_n(l, group, 0.0f);
          std::fill_n(o, group * head_dim, 0.0f);
          continue;
        }
        const KvScales hs = head_scales(h);
        const float* qh = q + (s * num_heads + h * group) * head_dim;  // the KV head's query heads
        if constexpr (std::is_same_v<T, uint8_t>) {  // int4 codes, two per byte
          const int64_t len = t_end - t_begin, stride = len + 8;
          scores.resize(group * stride);
          const uint8_t* kh = k_cache + h * head_dim / 2;
          const uint8_t* vh = v_cache + h * head_dim / 2;
          if (wide) {
            const auto half = [](const c10::Half* p) { return reinterpret_cast<const uint16_t*>(p); };
            edgeinfer_cpu::key_scores_int4_avx512(qh, group, {kh, half(hs.k_scale), half(hs.k_zero)}, srows.data(),
                                                  len, head_dim, scale, scores.data(), stride);
            for (int64_t j = 0; j < group; ++j) l[j] = softmax_numerators(scores.data() + j * stride, len, m + j, softcap);
            edgeinfer_cpu::weighted_values_int4_avx512(scores.data(), stride, group, {vh, half(hs.v_scale), half(hs.v_zero)},
                                                       srows.data(), len, head_dim, o);
          } else {
            head_passes(group, [&](int64_t j0, auto heads) {
              attend_int4<decltype(heads)::value>(qh + j0 * head_dim, kh, vh, srows.data(), len, head_dim, scale,
                                                  scores.data() + j0 * stride, stride, m + j0, l + j0,
                                                  o + j0 * head_dim, hs, softcap);
            });
          }
        } else {
          scores.resize(group * (t_end - t_begin + 8));
          attend_group(qh, group, k_cache + h * head_dim, v_cache + h * head_dim, rows.data(), srows.data(),
                       t_end - t_begin, head_dim, scale, scores.data(), m, l, o, hs, softcap, wide);
        }
      }
    }
  };
  // Rows [r0, r1) of one sequence (the last the longest) as one unit: per KV head their query
  // heads gathered side by side, attended together, each output put back in its row's item.
  const auto run_row_groups = [&](int64_t u0, int64_t u1) {
    std::vector<float> scores, qs, ms, ls, os;
    std::vector<int64_t> rows, srows, query_lens;
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t r0 = starts[unit], r1 = starts[unit + 1], n = (r1 - r0) * group, len = lens[r1 - 1];
      if (len <= 0) {  // an empty context (a row alone: it joins no group) weighs nothing in the merge
        const int64_t item = r0 * num_kv_heads;
        std::fill_n(part_m + item * group, num_kv_heads * group, -INFINITY);
        std::fill_n(part_l + item * group, num_kv_heads * group, 0.0f);
        std::fill_n(part_o + item * group * head_dim, num_kv_heads * group * head_dim, 0.0f);
        continue;
      }
      token_rows(tables + r0 * table_stride, 0, len, rows, srows);
      query_lens.resize(n);
      for (int64_t j = 0; j < n; ++j) query_lens[j] = lens[r0 + j / group];
      qs.resize(n * head_dim), ms.resize(n), ls.resize(n), os.resize(n * head_dim);
      scores.resize(n * (len + 8));
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t r = r0; r < r1; ++r) {
          std::copy_n(q + (r * num_heads + h * group) * head_dim, group * head_dim, qs.data() + (r - r0) * group * head_dim);
        }
        const KvScales hs = head_scales(h);
        if constexpr (!std::is_same_v<T, uint8_t>) {  // int4 caches form no groups (above)
          attend_group(qs.data(), n, k_cache + h * head_dim, v_cache + h * head_dim, rows.data(), srows.data(), len,
                       head_dim, scale, scores.data(), ms.data(), ls.data(), os.data(), hs, softcap, wide,
                       query_lens.data());
        }
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t item = r * num_kv_heads + h, at = (r - r0) * group;
          std::copy_n(ms.data() + at, group, part_m + item * group);
          std::copy_n(ls.data() + at, group, part_l + item * group);
          std::copy_n(os.data() + at * head_dim, group * head_dim, part_o + item * group * head_dim);
        }
      }
    }
  };
  if (!starts.empty()) {
    edgeinfer_cpu::balanced_for(0, static_cast<int64_t>(starts.size()) - 1, 1, run_row_groups);
  } else if (team == nullptr) {
    // Claimed in chunks: sequences' contexts differ in length, so equal counts of units are not equal work.
    edgeinfer_cpu::balanced_for(0, units, 1, run_units);
  } else {  // a few rows: every unit about as long; each thread takes every n-th
    for (int64_t unit = team->tid; unit < units; unit += team->n) run_units(unit, unit + 1);
    team->sync();
  }
  // Merge: out = sum_c o_c exp(m_c - M) / sum_c l_c exp(m_c - M), M the largest part max.
  for (int64_t pair = team ? team->tid : 0; pair < pairs; pair += team ? team->n : 1) {
    const int64_t s = pair / num_kv_heads, h = pair % num_kv_heads;
    for (int64_t j = 0; j < group; ++j) {
      float* dst = out + (s * num_heads + h * group + j) * head_dim;
      float top = -INFINITY;
      for (int64_t c = 0; c < parts; ++c) top = std::max(top, part_m[(pair * parts + c) * group + j]);
      if (top == -INFINITY) continue;  // an empty context: the output stays zero
      float total = 0.0f;
      std::fill_n(dst, head_dim, 0.0f);
      for (int64_t c = 0; c < parts; ++c) {
        const int64_t at = (pair * parts + c) * group + j;
        const float w = std::exp(part_m[at] - top);
        total += part_l[at] * w;
        const float* o = part_o + at * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] += w * o[d];
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] *= inv;
    }
  }
}

// AVX512F, with the OS saving zmm state (GCC's check reads XCR0 too).
bool avx512_supported() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has;
}

// Which loops run: "avx2", "avx512" (an error where the CPU lacks it), or "" for the widest this
// CPU has. Every cache type takes the AVX-512 loops, for head_dim a multiple of 16 up to 256.
bool wide_loops(const std::string& isa, int64_t head_dim) {
  TORCH_CHECK(isa.empty() || isa == "avx2" || isa == "avx512", "unknown attention isa '", isa,
              "' (expected avx2, avx512 or empty for this CPU's widest)");
  TORCH_CHECK(isa != "avx512" || avx512_supported(), "this CPU cannot run the avx512 attention loops");
  return isa != "avx2" && avx512_supported() && head_dim % 16 == 0 && head_dim <= 256;
}

// decode() for the caches' dtype; the caches' shape gives Hkv, D and the block size. int8 caches
// come with their fp16 scales (blocks, block_size, Hkv), int4 ones (two codes per byte) with
// scales and zeros (blocks, block_size, Hkv, D / 32); plain ones with undefined tensors.
void decode_any(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scale,
                const at::Tensor& v_scale, const at::Tensor& k_zero, const at::Tensor& v_zero, const int32_t* tables,
                int64_t table_stride, const int32_t* lens, int64_t num_seqs, int64_t num_heads, float scale,
                float* out, int64_t window = 0, float softcap = 0.0f, const std::string& isa = "",
                const edgeinfer_cpu::Team* team = nullptr) {
  const bool int4 = k_cache.scalar_type() == at::kByte;
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t head_dim = int4 ? 2 * k_cache.size(3) : k_cache.size(3);
  const bool wide = wide_loops(isa, head_dim);
  const auto run = [&](auto* k, auto* v, const KvScales& sc = {}) {
    decode(q, k, v, tables, table_stride, lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out, sc,
           window, softcap, wide, team);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>()); break;
    case at::kBFloat16: run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>()); break;
    case at::kChar:  // quantized caches: decode_layers checked their scales (and zeros) before writing them
      run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
          {k_scale.data_ptr<c10::Half>(), v_scale.data_ptr<c10::Half>()});
      break;
    case at::kByte:
      run(k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(),
          {k_scale.data_ptr<c10::Half>(), v_scale.data_ptr<c10::Half>(), k_zero.data_ptr<c10::Half>(),
           v_zero.data_ptr<c10::Half>()});
      break;
    default: TORCH_CHECK(false, "caches must be fp32, bf16, fp16, int8 or int4 (uint8), got ", k_cache.scalar_type());
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  const std::string& isa, const c10::optional<at::Tensor>& k_scale_in,
                                  const c10::optional<at::Tensor>& v_scale_in,
                                  const c10::optional<at::Tensor>& k_zero_in,
                                  const c10::optional<at::Tensor>& v_zero_in) {
  TORCH_CHECK(q_in.dim() == 3, "q must be (S, Hq, D)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v caches must be (blocks, block_size, Hkv, D) of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_seqs = q_in.size(0), num_heads = q_in.size(1), head_dim = q_in.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const bool int8 = k_cache.scalar_type() == at::kChar, int4 = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(k_cache.size(3) == (int4 ? head_dim / 2 : head_dim) && head_dim % (int4 ? 32 : 8) == 0,
              int4 ? "int4 caches hold head_dim / 2 bytes per row, head_dim a multiple of 32"
                   : "head_dim must match the cache and be a multiple of 8");
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
  TORCH_CHECK(k_cache.is_floating_point() || int8 || int4,
              "this op reads plain caches (fp32, bf16, fp16), int8 ones or int4 ones (uint8)");
  at::Tensor k_scale, v_scale, k_zero, v_zero;
  if (int8 || int4) {
    TORCH_CHECK(k_scale_in.has_value() && v_scale_in.has_value() && (!int4 || (k_zero_in.has_value() && v_zero_in.has_value())),
                int4 ? "int4 caches need k_scale, v_scale, k_zero and v_zero" : "int8 caches need k_scale and v_scale");
    TORCH_CHECK(int4 || (!k_zero_in.has_value() && !v_zero_in.has_value()), "int8 caches take no zeros");
    k_scale = k_scale_in->contiguous();
    v_scale = v_scale_in->contiguous();
    if (int4) {
      k_zero = k_zero_in->contiguous();
      v_zero = v_zero_in->contiguous();
    }
    for (const at::Tensor* t : {&k_scale, &v_scale, &k_zero, &v_zero}) {
      if (!t->defined()) continue;
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == (int4 ? 4 : 3) && t->size(0) == k_cache.size(0) &&
                      t->size(1) == block_size && t->size(2) == num_kv_heads && (!int4 || t->size(3) == head_dim / 32),
                  int4 ? "int4 caches' scales and zeros must be fp16 (blocks, block_size, Hkv, D / 32)"
                       : "int8 caches' scales must be fp16 (blocks, block_size, Hkv)");
    }
  } else {
    TORCH_CHECK(!k_scale_in.has_value() && !v_scale_in.has_value() && !k_zero_in.has_value() && !v_zero_in.has_value(),
                "plain caches take no scales or zeros");
  }
  at::Tensor out = at::zeros_like(q);
  decode_any(q.data_ptr<float>(), k_cache, v_cache, k_scale, v_scale, k_zero, v_zero,
             tables.data_ptr<int32_t>(), tables.size(1), len_ptr, num_seqs, num_heads, static_cast<float>(scale),
             out.data_ptr<float>(), 0, 0.0f, isa);
  return out;
}

}  // namespace

void edgeinfer_cpu::decode_attention(const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& k_zero,
                                     const at::Tensor& v_zero, const int32_t* tables, int64_t table_stride,
                                     const int32_t* lens, int64_t num_seqs, int64_t num_heads, float scale, float* out,
                                     int64_t window, float softcap, const Team* team) {
  decode_any(q, k_cache, v_cache, k_scale, v_scale, k_zero, v_zero, tables, table_stride, lens, num_seqs, num_heads,
             scale, out, window, softcap, "", team);
}

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, str isa=\"\", Tensor? k_scale=None, Tensor? v_scale=None, Tensor? k_zero=None, "
        "Tensor? v_zero=None) -> Tensor");
  m.def("attention_isa_supported(str isa) -> bool", [](const std::string& isa) {
    TORCH_CHECK(isa == "avx2" || isa == "avx512", "unknown attention isa '", isa, "' (expected avx2 or avx512)");
    return isa == "avx2" || avx512_supported();
  });
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
