// A step's token choice over (B, V) logits on the CPU: ops torch.ops.edgeinfer_cpu.row_topk and
// sample_rows. Their references: torch.topk (ties aside: here the lower index wins) and
// edgeinfer.worker.sampler's torch path (temperature, min-p, top-k, top-p over the top-k
// renormalised distribution, one uniform drawn by inverse CDF in vocabulary order).
//
// Why by hand: torch has no top-k of a few out of 49152 that does not sort or partially sort the
// row, nor a nucleus without one. On the 2-core test machine torch.topk(64) of a 49152-token row
// took 130-200 us, max's index 65-100 us, and the torch sampler at 16 rows ~9 ms with top-p 0.95
// or top-k 40 (tools/bench_sampler.py): more than a quarter of a decode step.
//
// Top-k: a heap of the k best seen so far, its worst at the root; the rest of the row is
// compared 8 values at a time against the root's value, and only values strictly above it enter
// (an equal one comes later in the row, so it loses the tie). In a row of no particular order
// about k ln(V / k) values enter, so the row costs about one compare per 8 values plus those
// entries (~29 us a 49152-token row at k = 64). From k = 16 a long row first tries a bound from
// its blocks' maxima (top_k_by_bound: ~15 us there). A k above kHeapMaxK takes torch's selection
// instead (top_k_wide).
//
// The draw: the largest value m first (its quotient by the temperature is the largest quotient:
// division by a positive number keeps the order), then
// - no top-k or top-p: one pass writes exp(x / T - m) of the tokens min-p keeps and their sums
//   per block of 64; u times the total is found by block, then by token;
// - otherwise: the candidates are the top-k, or with top-p alone every token above a weight
//   bound whose tokens hold top_p of the row's mass (nucleus_candidates); top-p keeps those with
//   less than top_p of the mass before them (normalised over the top-k where top-k is on, else
//   over the whole row), min-p cuts that prefix, and u picks among the kept ones taken in
//   vocabulary order.
// Sums are float64 as the reference's CDF; exp is exp_nonpositive's (relative error ~2e-7), so a
// token differs from the reference's only where u falls within that error of a CDF step.
// sample_rows refuses a row with a NaN, or with every token at -inf (the reference would draw
// from NaN probabilities; the model actor then fails that row's request alone); row_topk ranks
// NaN above every number, as torch.topk does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using edgeinfer_cpu::exp_nonpositive;
using edgeinfer_cpu::hmax;

constexpr int64_t kDrawBlock = 64;

struct Entry {
  float value;
  int64_t index;
};

// Ranks entries: the larger value first, the lower index among equal values.
inline bool better(const Entry& a, const Entry& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// top_k for a wide k, where each value entering a heap of k costs ~log k: torch.topk's own
// selection (~0.2 ms a 49152-token row at k = 512 either way, and the heap's cost keeps growing).
// Equal values come in torch's order; NaN ranks above every number.
bool top_k_wide(const float* x, int64_t n, int64_t k, std::vector<Entry>& best) {
  const auto [values, indices] = at::from_blob(const_cast<float*>(x), {n}, at::kFloat).topk(k);
  const float* vp = values.data_ptr<float>();
  const int64_t* ip = indices.data_ptr<int64_t>();
  best.resize(k);
  for (int64_t j = 0; j < k; ++j) best[j] = {vp[j], ip[j]};
  return !std::isnan(vp[0]);
}

// top_k by a bound, for k from kBoundMinK where the row has at least 2k blocks of kBoundBlock:
// the k-th largest of the blocks' maxima is at most the row's k-th largest value (k blocks each
// hold a value at least as large), so every value of the k best, ties included, is at or above
// it; the values there (a few hundred in a row of logits) are then ranked. Two passes of a
// compare per 8 values instead of the heap's ~k ln(n / k) entries at ~100 cycles each (a
// 49152-token row: ~29 us by the heap). Returns false where it cannot answer: a NaN, or more
// than kBoundMaxCandidates values at or above the bound (a row mostly masked to -inf ties there);
// the heap then runs.
constexpr int64_t kBoundBlock = 256;
constexpr int64_t kBoundMinK = 16;
constexpr int64_t kBoundMaxCandidates = 4096;
bool top_k_by_bound(const float* x, int64_t n, int64_t k, std::vector<Entry>& best) {
  const int64_t blocks = n / kBoundBlock;
  std::vector<float> maxima(blocks);
  __m256 nan = _mm256_setzero_ps();  // maxps can drop a NaN, and nth_element must not see one;
  // the NaN checks are all here, so the gathering pass below has none
  for (int64_t b = 0; b < blocks; ++b) {
    const float* p = x + b * kBoundBlock;
    const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 acc[4] = {lowest, lowest, lowest, lowest};
    for (int64_t i = 0; i < kBoundBlock; i += 32) {
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(p + i + 8 * j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        acc[j] = _mm256_max_ps(acc[j], v);
      }
    }
    maxima[b] = hmax(_mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3])));
  }
  if (_mm256_movemask_ps(nan) != 0) return false;
  for (int64_t i = blocks * kBoundBlock; i < n; ++i) {  // past the last whole block
    if (std::isnan(x[i])) return false;
  }
  std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
  const float bound = maxima[k - 1];
  best.clear();
  const __m256 vbound = _mm256_set1_ps(bound);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    int at_least = _mm256_movemask_ps(_mm256_cmp_ps(v, vbound, _CMP_GE_OQ));
    while (at_least) {
      const int64_t j = i + __builtin_ctz(at_least);
      best.push_back({x[j], j});
      at_least &= at_least - 1;
    }
    if (static_cast<int64_t>(best.size()) > kBoundMaxCandidates) return false;
  }
  for (; i < n; ++i) {
    if (x[i] >= bound) best.push_back({x[i], i});
  }
  if (static_cast<int64_t>(best.size()) < k) return false;  // cannot happen: k blocks reach the bound
  std::partial_sort(best.begin(), best.begin() + k, best.end(), better);
  best.resize(k);
  return true;
}

// The k best of x[0, n) (1 <= k <= n), best first, into `best`; false if x holds a NaN.
constexpr int64_t kHeapMaxK = 128;  // above it, top_k_wide
bool top_k(const float* x, int64_t n, int64_t k, std::vector<Entry>& best) {
  if (k > kHeapMaxK) return top_k_wide(x, n, k, best);
  if (k >= kBoundMinK && n / kBoundBlock >= 2 * k && top_k_by_bound(x, n, k, best)) return true;
  best.clear();
  bool nan = false;
  for (int64_t i = 0; i < k; ++i) {
    nan |= std::isnan(x[i]);
    best.push_back({x[i], i});
  }
  std::make_heap(best.begin(), best.end(), better);  // the root is the worst: nothing ranks below it
  float floor = best.front().value;
  const auto offer = [&](int64_t i) {
    if (x[i] > floor) {
      std::pop_heap(best.begin(), best.end(), better);
      best.back() = {x[i], i};
      std::push_heap(best.begin(), best.end(), better);
      floor = best.front().value;
    }
  };
  int64_t i = k;
  __m256i any_nan = _mm256_setzero_si256();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    any_nan = _mm256_or_si256(any_nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor), _CMP_GT_OQ));
    while (above) {
      offer(i + __builtin_ctz(above));  // floor may have risen since the compare: offer checks again
      above &= above - 1;
    }
  }
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    offer(i);
  }
  std::sort_heap(best.begin(), best.end(), better);  // ascending by the heap's order: best first
  return !nan && _mm256_testz_si256(any_nan, any_nan);
}

// top_k for a row that holds NaNs, ranked as torch.topk ranks them: above every number.
void nan_first(const float* x, int64_t n, int64_t k, std::vector<Entry>& best) {
  best.resize(n);
  for (int64_t i = 0; i < n; ++i) best[i] = {x[i], i};
  std::partial_sort(best.begin(), best.begin() + k, best.end(), [](const Entry& a, const Entry& b) {
    const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
    if (a_nan || b_nan) return a_nan && (!b_nan || a.index < b.index);
    return better(a, b);
  });
  best.resize(k);
}

// The largest value of x[0, n), or NaN if x holds one.
float row_max(const float* x, int64_t n) {
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 acc[2] = {lowest, lowest};  // two chains: max's latency, not its throughput, bounds one
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 2; ++j) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      acc[j] = _mm256_max_ps(acc[j], v);
    }
  }
  float m = hmax(_mm256_max_ps(acc[0], acc[1]));
  bool found_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    found_nan |= std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  return found_nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

struct RowParams {
  float temperature, top_p, log_min_p;
  int64_t top_k;  // >= n: off
  double u;
};

// exp(x[i] / t - m) for every token at or above `floor` (x[i] / t >= floor), else 0, into e,
// with each block's sum (fp32 within the block of 64, float64 across blocks); returns the total.
double exp_terms(const float* x, int64_t n, float t, float m, float floor, float* e, std::vector<double>& blocks) {
  blocks.assign((n + kDrawBlock - 1) / kDrawBlock, 0.0);
  const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m), fv = _mm256_set1_ps(floor);
  double total = 0.0;
  for (int64_t b = 0; b * kDrawBlock < n; ++b) {
    const int64_t lo = b * kDrawBlock, hi = std::min(n, lo + kDrawBlock);
    int64_t i = lo;
    __m256 sum = _mm256_setzero_ps();  // 8 terms a lane at most, each <= 1: fp32 is exact enough
    for (; i + 8 <= hi; i += 8) {
      const __m256 s = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
      const __m256 v = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(s, mv)), _mm256_cmp_ps(s, fv, _CMP_GE_OQ));
      _mm256_storeu_ps(e + i, v);
      sum = _mm256_add_ps(sum, v);
    }
    double block = edgeinfer_cpu::hsum(sum);
    for (; i < hi; ++i) {
      const float s = x[i] / t;
      e[i] = s >= floor ? std::exp(s - m) : 0.0f;
      block += e[i];
    }
    blocks[b] = block;
    total += block;
  }
  return total;
}

// The first token whose cumulative weight (in vocabulary order) exceeds u x the total; the last
// token of non-zero weight if rounding leaves none.
int64_t draw_all(const float* e, int64_t n, const std::vector<double>& blocks, double total, double u) {
  const double target = u * total;
  double cum = 0.0;
  int64_t b = 0;
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  while (b < num_blocks - 1 && cum + blocks[b] <= target) cum += blocks[b++];
  for (int64_t i = b * kDrawBlock; i < n; ++i) {
    cum += e[i];
    if (cum > target) return i;
  }
  for (int64_t i = n - 1; i > 0; --i) {
    if (e[i] > 0) return i;
  }
  return 0;
}

struct Scratch {
  std::vector<Entry> best;
  std::vector<float> e;
  std::vector<double> blocks, w;
};

// Top-p alone: the best tokens, best first, down to the widest weight threshold exp(-c) (c in
// nats below the largest weight, tried tightest first) above which the weights e[0, n) reach
// `mass`, with a margin for the float sums: the nucleus lies inside. Only a flat row, whose
// nucleus is wide anyway, takes more than a few thousand.
void nucleus_candidates(const float* x, const float* e, int64_t n, double mass, std::vector<Entry>& best) {
  static constexpr float kNats[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 87, 87, 87, 87};
  float bound = 0.0f;  // 0: every token of positive weight
  // Four bounds a pass, each its own sum (independent chains): usually one pass decides.
  for (int g = 0; g < 16 && bound == 0.0f; g += 4) {
    __m256 cut[4], acc[4];
    for (int j = 0; j < 4; ++j) {
      cut[j] = _mm256_set1_ps(std::exp(-kNats[g + j]));
      acc[j] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(e + i);
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_add_ps(acc[j], _mm256_and_ps(v, _mm256_cmp_ps(v, cut[j], _CMP_GE_OQ)));
    }
    for (int j = 0; j < 4; ++j) {
      const float c = std::exp(-kNats[g + j]);
      double sum = edgeinfer_cpu::hsum(acc[j]);
      for (int64_t t = i; t < n; ++t) sum += e[t] >= c ? e[t] : 0.0f;
      // The margin covers the fp32 sums (lanes of up to ~6,000 terms); sample_row checks the
      // candidates' float64 mass anyway.
      if (sum >= mass * (1 + 1e-3)) {
        bound = c;
        break;
      }
    }
  }
  // The tokens at or above the bound and of positive weight, 8 weights a compare.
  const float least = std::max(bound, std::numeric_limits<float>::denorm_min());
  const __m256 lv = _mm256_set1_ps(least);
  best.clear();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int in = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), lv, _CMP_GE_OQ));
    for (; in; in &= in - 1) {
      const int64_t j = i + __builtin_ctz(in);
      best.push_back({x[j], j});
    }
  }
  for (; i < n; ++i) {
    if (e[i] >= least) best.push_back({x[i], i});
  }
  std::sort(best.begin(), best.end(), better);
}

int64_t sample_row(const float* x, int64_t n, const RowParams& p, Scratch& scratch, int64_t row) {
  const float mx = row_max(x, n);
  TORCH_CHECK(!std::isnan(mx), "row ", row, " of the logits holds a NaN");
  TORCH_CHECK(mx > -std::numeric_limits<float>::infinity(), "row ", row, " has every token at -inf");
  const float t = p.temperature, m = mx / t;
  const float floor = m + p.log_min_p;  // min-p's bound on x / t (-inf: off)
  const int64_t k = std::min(p.top_k, n);
  if (k == n && p.top_p >= 1.0f) {
    scratch.e.resize(n);
    const double total = exp_terms(x, n, t, m, floor, scratch.e.data(), scratch.blocks);
    return draw_all(scratch.e.data(), n, scratch.blocks, total, p.u);
  }
  std::vector<Entry>& best = scratch.best;
  std::vector<double>& w = scratch.w;
  const auto weigh = [&] {  // w: each candidate's weight exp(x / t - m); returns their sum
    w.resize(best.size());
    double sum = 0.0;
    for (size_t j = 0; j < best.size(); ++j) sum += w[j] = std::exp(static_cast<double>(best[j].value / t - m));
    return sum;
  };
  double norm;  // top-p's normaliser: the top-k's weight, or with top-k off every token's
  if (k < n) {
    TORCH_CHECK(top_k(x, n, k, best), "row ", row, " of the logits holds a NaN");
    norm = weigh();
  } else {
    scratch.e.resize(n);
    norm = exp_terms(x, n, t, m, -std::numeric_limits<float>::infinity(), scratch.e.data(), scratch.blocks);
    nucleus_candidates(x, scratch.e.data(), n, p.top_p * norm, best);
    if (weigh() < p.top_p * norm) {  // rounding beyond the margin: every token of positive weight
      nucleus_candidates(x, scratch.e.data(), n, std::numeric_limits<double>::infinity(), best);
      weigh();
    }
  }
  const int64_t width = static_cast<int64_t>(best.size());
  // Top-p: the prefix whose tokens have less than top_p of the mass before them.
  int64_t kept = width;
  if (p.top_p < 1.0f) {
    double before = 0.0;
    for (int64_t j = 0; j < width; ++j) {
      if (before / norm >= p.top_p) {
        kept = j;
        break;
      }
      before += w[j];
    }
  }
  // Min-p cuts the same prefix: the candidates are in descending order.
  while (kept > 1 && best[kept - 1].value / t < floor) --kept;
  std::sort(best.begin(), best.begin() + kept, [](const Entry& a, const Entry& b) { return a.index < b.index; });
  double total = 0.0;
  for (int64_t j = 0; j < kept; ++j) {
    w[j] = std::exp(static_cast<double>(best[j].value / t - m));
    total += w[j];
  }
  const double target = p.u * total;
  double cum = 0.0;
  for (int64_t j = 0; j < kept; ++j) {
    cum += w[j];
    if (cum > target) return best[j].index;
  }
  return best[kept - 1].index;
}

at::Tensor rows_of(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, name, " must be (rows, vocabulary), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
  return x.contiguous();
}

std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& x_in, int64_t k) {
  const at::Tensor x = rows_of(x_in, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "k must be in [0, ", n, "], got ", k);
  if (k == 0 || k > kHeapMaxK) return x.topk(k);  // k = 0: empty, as torch.topk (logprobs=0 asks none)
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<Entry> best;
    for (int64_t r = r0; r < r1; ++r) {
      if (!top_k(xp + r * n, n, k, best)) nan_first(xp + r * n, n, k, best);
      for (int64_t j = 0; j < k; ++j) {
        vp[r * k + j] = best[j].value;
        ip[r * k + j] = best[j].index;
      }
    }
  });
  return {values, indices};
}

at::Tensor sample_rows(const at::Tensor& logits_in, const at::Tensor& temperature_in, const at::Tensor& greedy_in,
                       const at::Tensor& top_k_in, const at::Tensor& top_p_in, const at::Tensor& log_min_p_in,
                       const at::Tensor& uniforms_in) {
  const at::Tensor x = rows_of(logits_in, "logits");
  const int64_t rows = x.size(0), n = x.size(1);
  const auto per_row = [&](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows, name, " must be (", rows, ",), got ", t.sizes());
    return t.to(type).contiguous();
  };
  const at::Tensor temperature = per_row(temperature_in, at::kFloat, "temperature");
  const at::Tensor greedy = per_row(greedy_in, at::kBool, "greedy");
  const at::Tensor top_k_t = per_row(top_k_in, at::kLong, "top_k");
  const at::Tensor top_p = per_row(top_p_in, at::kFloat, "top_p");
  const at::Tensor log_min_p = per_row(log_min_p_in, at::kFloat, "log_min_p");
  const at::Tensor uniforms = per_row(uniforms_in, at::kDouble, "uniforms");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * n;
      if (greedy.data_ptr<bool>()[r]) {
        TORCH_CHECK(top_k(row, n, 1, scratch.best), "row ", r, " of the logits holds a NaN");
        op[r] = scratch.best[0].index;
        continue;
      }
      const RowParams p{temperature.data_ptr<float>()[r], top_p.data_ptr<float>()[r],
                        log_min_p.data_ptr<float>()[r], top_k_t.data_ptr<int64_t>()[r],
                        uniforms.data_ptr<double>()[r]};
      TORCH_CHECK(p.temperature > 0, "row ", r, ": temperature must be positive, got ", p.temperature);
      op[r] = sample_row(row, n, p, scratch, r);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("row_topk(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor greedy, Tensor top_k, Tensor top_p, "
        "Tensor log_min_p, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("row_topk", &row_topk);
  m.impl("sample_rows", &sample_rows);
}
