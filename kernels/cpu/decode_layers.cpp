// Every transformer layer of one step in a single call, for AVX2 CPUs, with decode-style
// attention: each row is one query against the cached context up to its own position.
//
// Op torch.ops.edgeinfer_cpu.decode_layers; edgeinfer.models.llama calls it for steps of up to
// FUSED_STEP_MAX_TOKENS tokens (decode, prompt chunks, mixed and verify steps) on the CPU fast
// path (int4 or int8 linears, each with its own group size: a GGUF Q4_K_M mixes int4 g32 from
// Q4_K with int8 g16 from Q6_K; plain KV caches, or int8 / int4 ones: K/V rotated, keys
// centred, then quantized) and its own per-op forward is the reference.
// Per layer: RMSNorm, QKV (int4/int8 GEMM; + Qwen 2's biases; per-head q/k RMSNorms), RoPE (a
// local layer's own tables where given), the K/V write into the paged pool, attention (within
// the sliding window on local layers: every layer of Mistral and Phi-3, Gemma's between its
// global ones; scores soft-capped for Gemma 2), the output projection (Gemma: normed) and
// residual, RMSNorm, gate/up, SiLU or GELU-tanh * up, down (Gemma: normed) and residual: the same
// arithmetic as the per-op path through the same kernels (ops.h), without ~25 Python calls and
// torch dispatches per layer (~3-5 us each, 30 layers, every token).
//
// With phase_ns ((kPhases,) int64) each phase's wall time on the calling thread is added into it,
// summed over the layers (DECODE_PHASES in kernels/cpu_ops.py names them): where a step's time goes
// (tools/bench_engine_step.py forward --phases); a clock read per phase and layer, none without it.
//
// h (M, hidden) fp32 is updated in place: M tokens at `positions`, written to pool slots
// `slot_mapping`; token t attends over the first context_lens[t] slots of its sequence through
// row t of block_tables. Every row's K/V is written before any row attends, so the tokens of one
// prompt chunk (rows with their sequence's table, context_lens = position + 1) attend causally. RoPE tables are (max_position, head_dim) fp32: cos, and sin with its first
// half negated, so rope(x)[d] = x[d] * cos[d] + x[(d + D/2) % D] * signed_sin[d].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "simd.h"

namespace {

// phase_ns' phases: input norm, qkv, RoPE + K/V write, attention, o, residual + norm, gate/up, act,
// down + residual.
constexpr int64_t kPhases = 9;

// Adds the time since the last lap to phase i of `ns` (none when null).
class PhaseClock {
 public:
  explicit PhaseClock(int64_t* ns) : ns_(ns), last_(ns ? now() : 0) {}
  void lap(int i) {
    if (ns_ == nullptr) return;
    const int64_t t = now();
    ns_[i] += t - last_;
    last_ = t;
  }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int64_t* ns_;
  int64_t last_;
};

constexpr int64_t kTeamMaxRows = 4;  // steps of up to this many rows run as a team (see use_team)
static_assert(kTeamMaxRows < edgeinfer_cpu::kA8AmxMinRows[0] && kTeamMaxRows < edgeinfer_cpu::kA8AmxMinRows[1],
              "a team's GEMMs (a8_gemm_team) run below the AMX kernel's rows");
constexpr int64_t kPerLayer = 14;  // input_norm, qkv (w, scales, mins), o (3), post_norm, gate_up (3), down (3)

// RoPE in place on `heads` vectors of head_dim at x for one token.
void rope(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* signed_sin) {
  const int64_t half = head_dim / 2;
  float rotated[512];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    // Two halves instead of an index modulo head_dim, so the compiler vectorizes both loops.
    for (int64_t d = 0; d < half; ++d) rotated[d] = v[d] * cos[d] + v[d + half] * signed_sin[d];
    for (int64_t d = half; d < head_dim; ++d) rotated[d] = v[d] * cos[d] + v[d - half] * signed_sin[d];
    std::copy(rotated, rotated + head_dim, v);
  }
}

template <typename T>
void store_row(const float* src, int64_t count, T* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<T>(src[i]);
}

void write_kv(const float* src, int64_t count, at::Tensor& cache, int64_t slot) {
  const int64_t offset = slot * count;
  switch (cache.scalar_type()) {
    case at::kFloat: store_row(src, count, cache.data_ptr<float>() + offset); break;
    case at::kBFloat16: store_row(src, count, cache.data_ptr<c10::BFloat16>() + offset); break;
    case at::kHalf: store_row(src, count, cache.data_ptr<c10::Half>() + offset); break;
    default: TORCH_CHECK(false, "plain caches only (fp32, bf16, fp16), got ", cache.scalar_type());
  }
}

// out = act(gate) * up over rows of [gate | up]: SiLU, g * sigmoid(g), or with kGelu GELU's tanh
// form (Gemma), 0.5 g (1 + tanh(z)) = g * sigmoid(2 z) with z = sqrt(2 / pi) (g + 0.044715 g^3);
// the sigmoid from the exp of -|a| only (simd.h sigmoid8), relative error ~2e-7 like the softmax's.
template <bool kGelu>
void act_mul(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  constexpr float kC = 0.7978845608028654f, kCube = 0.044715f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      __m256 a = gv;  // sigmoid's argument
      if constexpr (kGelu) {
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv);
        a = _mm256_mul_ps(_mm256_set1_ps(2.0f * kC), _mm256_fmadd_ps(_mm256_set1_ps(kCube), cube, gv));
      }
      const __m256 sig = edgeinfer_cpu::sigmoid8(a);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
    }
    for (; i < inter; ++i) {
      const float a = kGelu ? 2.0f * kC * (g[i] + kCube * g[i] * g[i] * g[i]) : g[i];
      o[i] = g[i] / (1.0f + std::exp(-a)) * u[i];
    }
  }
}

// x (heads vectors of head_dim) = x @ r for an orthonormal (head_dim, head_dim) r, in place: the
// rotation quantized caches hold K and V in (kernels.kv_quant.kv_rotation).
void rotate(float* x, int64_t heads, int64_t head_dim, const float* r) {
  float out[512];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    std::fill_n(out, head_dim, 0.0f);
    for (int64_t i = 0; i < head_dim; ++i) {
      const float vi = v[i];
      const float* ri = r + i * head_dim;
      for (int64_t j = 0; j < head_dim; ++j) out[j] += vi * ri[j];
    }
    std::copy(out, out + head_dim, v);
  }
}

// One token's heads as int8 codes with an fp16 scale each, as kernels.kv_quant.quantize_kv:
// scale = max|x| / 127 (at least 1e-6) rounded to fp16, code = x / scale rounded half away from
// zero, clamped to +-127.
void quantize_int8(const float* x, int64_t heads, int64_t head_dim, int8_t* codes, c10::Half* scales) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* v = x + h * head_dim;
    float top = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) top = std::max(top, std::abs(v[d]));
    const c10::Half s16(std::max(top / 127.0f, 1e-6f));
    const float s = static_cast<float>(s16);
    scales[h] = s16;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float a = std::floor(std::abs(v[d] / s) + 0.5f);
      codes[h * head_dim + d] = static_cast<int8_t>(std::copysign(std::min(a, 127.0f), v[d]));
    }
  }
}

// One token's heads as int4 codes (two a byte, even channel in the low nibble) with an fp16 scale
// and zero per 32 channels, as kernels.kv_quant.quantize_kv: zero = the group's min rounded to
// fp16, scale = (max - zero) / 15 (at least 1e-6) rounded to fp16, code = (x - zero) / scale
// rounded half away from zero, clamped to [0, 15].
void quantize_int4(const float* x, int64_t heads, int64_t head_dim, uint8_t* codes, c10::Half* scales,
                   c10::Half* zeros) {
  for (int64_t g = 0; g < heads * head_dim / 32; ++g) {
    const float* v = x + 32 * g;
    float lo = v[0], hi = v[0];
    for (int d = 1; d < 32; ++d) lo = std::min(lo, v[d]), hi = std::max(hi, v[d]);
    const c10::Half z16(lo);
    const float zero = static_cast<float>(z16);
    const c10::Half s16(std::max((hi - zero) / 15.0f, 1e-6f));
    const float s = static_cast<float>(s16);
    zeros[g] = z16;
    scales[g] = s16;
    for (int d = 0; d < 32; d += 2) {
      const auto code = [&](float value) {  // (value - zero) / s >= 0 up to zero's rounding
        const float a = (value - zero) / s;
        return static_cast<uint8_t>(std::clamp(std::copysign(std::floor(std::abs(a) + 0.5f), a), 0.0f, 15.0f));
      };
      codes[16 * g + d / 2] = static_cast<uint8_t>(code(v[d]) | (code(v[d + 1]) << 4));
    }
  }
}

void add_into(float* h, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) h[i] += y[i];
}

// The group size of the linear at w[at], w[at + 1], w[at + 2] (codes, scales, mins), checked:
// int4 uint8 (N, K / 2) with mins, or int8 (N, K) with mins or an empty tensor for none; the
// group is what the scales' count says (int8: 16 or a multiple of 32; int4: a multiple of 32).
int64_t linear_group(const at::TensorList& w, int64_t at, int64_t n, int64_t k, const char* name) {
  const at::Tensor& codes = w[at];
  const bool int8 = codes.scalar_type() == at::kChar;
  TORCH_CHECK((int8 || codes.scalar_type() == at::kByte) && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(0) == n && codes.size(1) * (int8 ? 1 : 2) == k,
              name, " must be a contiguous int8 (", n, ", ", k, ") or uint8 (", n, ", ", k / 2, ") weight, got ",
              codes.sizes());
  const at::Tensor& scales = w[at + 1];
  const at::Tensor& mins = w[at + 2];
  const int64_t groups = n > 0 ? scales.numel() / n : 0;
  const int64_t group = groups > 0 ? k / groups : 0;
  TORCH_CHECK(group > 0 && groups * group == k && scales.numel() == n * groups &&
                  (group % 32 == 0 || (int8 && group == 16)),
              name, " scales must hold N * K / group values, group 16 (int8) or a multiple of 32");
  TORCH_CHECK((scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  mins.is_contiguous() && (mins.numel() == scales.numel() || (int8 && mins.numel() == 0)) &&
                  (mins.numel() == 0 || mins.scalar_type() == scales.scalar_type()),
              name, " scales and mins must be contiguous fp16 or fp32 of one dtype (int8: mins may be empty)");
  return group;
}

// What a model's fused steps over one KV pool keep from step to step, checked once when made
// (kernels.cpu_ops.decode_setup): the layers' weights, the pool's caches and the architecture's
// constants (see decode_layers). Why a holder rather than the op's arguments: they are ~700
// tensors, whose Python objects a step has pushed out of the CPU caches by the time the next step
// converts them, ~220 us a call on the test machine (~65 us when they are cached), a twentieth of
// a one-row step.
struct DecodeSetup : torch::CustomClassHolder {
  DecodeSetup(std::vector<at::Tensor> weights, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
              int64_t num_heads, double scale, double eps, std::vector<at::Tensor> k_scales,
              std::vector<at::Tensor> v_scales, std::vector<at::Tensor> k_zeros, std::vector<at::Tensor> v_zeros,
              c10::optional<at::Tensor> rotation, c10::optional<at::Tensor> key_centres,
              std::vector<at::Tensor> a8_wsums, std::string a8_isa, std::vector<int64_t> a8_terms,
              std::vector<at::Tensor> qkv_biases, std::vector<at::Tensor> qk_norms, std::vector<at::Tensor> out_norms,
              int64_t window, int64_t global_every, std::string activation, double attn_softcap,
              std::vector<at::Tensor> v_weights)
      : weights(std::move(weights)), k_caches(std::move(k_caches)), v_caches(std::move(v_caches)),
        k_scales(std::move(k_scales)), v_scales(std::move(v_scales)), k_zeros(std::move(k_zeros)),
        v_zeros(std::move(v_zeros)), a8_wsums(std::move(a8_wsums)), qkv_biases(std::move(qkv_biases)),
        qk_norms(std::move(qk_norms)), out_norms(std::move(out_norms)), v_weights(std::move(v_weights)),
        rotation(std::move(rotation)), key_centres(std::move(key_centres)), a8_terms(std::move(a8_terms)),
        a8_isa(std::move(a8_isa)), activation(std::move(activation)), num_heads(num_heads), window(window),
        global_every(global_every), scale(scale), eps(eps), attn_softcap(attn_softcap) {
    check();
  }

  // Whether layer l's V has its own weight (v_weights) beside QKV's Q and K.
  bool split_v(int64_t l) const { return !v_weights.empty() && v_weights[4 * l].numel() > 0; }

  const std::vector<at::Tensor> weights, k_caches, v_caches, k_scales, v_scales, k_zeros, v_zeros, a8_wsums,
      qkv_biases, qk_norms, out_norms, v_weights;
  const c10::optional<at::Tensor> rotation, key_centres;
  const std::vector<int64_t> a8_terms;
  const std::string a8_isa, activation;
  const int64_t num_heads, window, global_every;
  const double scale, eps, attn_softcap;
  // Derived by check().
  int64_t layers = 0, hidden = 0, num_kv_heads = 0, head_dim = 0, q_size = 0, kv_size = 0, qkv_size = 0, inter = 0;
  int64_t params_per_head = 1;  // a quantized cache's scales (and int4 zeros) per token and head
  bool int8 = false, int4 = false, quantized = false, a8 = false;
  std::vector<float> rot_t;  // the KV rotation transposed: turns a quantized cache's attention output back
  std::vector<int64_t> group, v_group;  // per layer: qkv's, o's, gate_up's and down's group size; V's apart

 private:
  void check();
};

// Row counts a setup's a8 weights are checked for: one (the VNNI kernels) and many (AMX, where
// the CPU has it, which reads no code sums).
constexpr int64_t kManyRows = int64_t{1} << 20;

void DecodeSetup::check() {
  layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == kPerLayer * layers,
              "need ", kPerLayer, " weights and one K and V cache per layer");
  TORCH_CHECK(weights[0].dim() == 1, "the first weight must be layer 0's input norm (hidden,)");
  hidden = weights[0].numel();
  const at::Tensor& k0 = k_caches[0];
  TORCH_CHECK(k0.dim() == 4, "caches must be (blocks, block_size, Hkv, D)");
  int8 = k0.scalar_type() == at::kChar, int4 = k0.scalar_type() == at::kByte;  // int4: two codes a byte
  TORCH_CHECK(int8 || int4 || k0.scalar_type() == at::kFloat || k0.scalar_type() == at::kBFloat16 ||
                  k0.scalar_type() == at::kHalf,  // checked here: the writes run in a parallel region
              "caches must be fp32, bf16, fp16, int8 or int4 (uint8), got ", k0.scalar_type());
  num_kv_heads = k0.size(2), head_dim = int4 ? 2 * k0.size(3) : k0.size(3);
  TORCH_CHECK(head_dim % 8 == 0 && head_dim <= 512 && num_heads % num_kv_heads == 0,
              "head_dim must be a multiple of 8 (<= 512) and Hq a multiple of Hkv");
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& kc = k_caches[l];
    const at::Tensor& vc = v_caches[l];
    TORCH_CHECK(kc.sizes() == k0.sizes() && vc.sizes() == k0.sizes() && kc.scalar_type() == vc.scalar_type() &&
                    kc.is_contiguous() && vc.is_contiguous(),
                "every layer's K and V caches must be contiguous, of one shape and dtype");
  }
  // Quantized caches: K and V rotated (and keys centred, where measured) before they are
  // quantized, q rotated alike and the attention output turned back, as the per-op forward does.
  quantized = int8 || int4;
  params_per_head = int4 ? head_dim / 32 : 1;
  if (quantized) {
    TORCH_CHECK(!int4 || head_dim % 32 == 0, "int4 caches need head_dim a multiple of 32");
    const size_t n = static_cast<size_t>(layers);
    TORCH_CHECK(k_scales.size() == n && v_scales.size() == n && (int4 ? k_zeros.size() == n && v_zeros.size() == n
                                                                      : k_zeros.empty() && v_zeros.empty()),
                "quantized caches need one K and one V scale tensor per layer (int4: and zeros)");
    const int64_t want = k0.size(0) * k0.size(1) * num_kv_heads * params_per_head;
    for (int64_t l = 0; l < layers; ++l) {
      for (const at::TensorList list : {at::TensorList(k_scales), at::TensorList(v_scales), at::TensorList(k_zeros),
                                         at::TensorList(v_zeros)}) {
        if (list.empty()) continue;
        TORCH_CHECK(list[l].scalar_type() == at::kHalf && list[l].is_contiguous() && list[l].numel() == want,
                    "cache scales (and zeros) must be contiguous fp16, ", params_per_head, " per token and head");
      }
    }
    TORCH_CHECK(rotation.has_value() && rotation->scalar_type() == at::kFloat && rotation->is_contiguous() &&
                    rotation->dim() == 2 && rotation->size(0) == head_dim && rotation->size(1) == head_dim,
                "quantized caches need the contiguous fp32 (head_dim, head_dim) KV rotation");
    TORCH_CHECK(!key_centres.has_value() ||
                    (key_centres->scalar_type() == at::kFloat && key_centres->is_contiguous() &&
                     key_centres->numel() == layers * num_kv_heads * head_dim),
                "key centres must be contiguous fp32 (layers, Hkv, head_dim)");
    const float* r = rotation->data_ptr<float>();
    rot_t.resize(head_dim * head_dim);
    for (int64_t i = 0; i < head_dim; ++i) {
      for (int64_t j = 0; j < head_dim; ++j) rot_t[j * head_dim + i] = r[i * head_dim + j];
    }
  } else {
    TORCH_CHECK(k_scales.empty() && v_scales.empty() && k_zeros.empty() && v_zeros.empty(),
                "plain caches take no scales");
  }
  q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  qkv_size = q_size + 2 * kv_size;
  // Qwen 2's q/k/v biases (added to the projection), q/k norms (RMSNorm over each head's q and
  // k, before RoPE), Gemma's output norms, windows and activation, as the per-op forward applies them.
  TORCH_CHECK(window >= 0 && global_every >= 0 && attn_softcap >= 0,
              "window, global_every and attn_softcap must be >= 0 (0: none)");
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation must be silu or gelu_tanh, got ",
              activation);
  TORCH_CHECK(out_norms.empty() || static_cast<int64_t>(out_norms.size()) == 2 * layers,
              "out_norms: none or two per layer (the attention's and the MLP's output norms)");
  for (const at::Tensor& w : out_norms) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == hidden,
                "output norm weights must be contiguous fp32 (hidden,)");
  }
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == layers,
              "qkv_biases: none or one per layer");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "qk_norms: none or two per layer (q's, k's)");
  for (const at::Tensor& b : qkv_biases) {
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == qkv_size,
                "qkv biases must be contiguous fp32 ((Hq + 2 Hkv) * D,)");
  }
  for (const at::Tensor& w : qk_norms) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == head_dim,
                "q/k norm weights must be contiguous fp32 (head_dim,)");
  }
  // a8: the linears are kernels.cpu_a8 tiles (codes, scales, mins or empty; wsum in a8_wsums)
  // run with int8 activations on the a8_isa kernel; the intermediate size is then down's K.
  a8 = !a8_isa.empty();
  const at::Tensor& down_codes = weights[11];
  inter = !a8 ? weights[8].size(0) / 2 : down_codes.size(1) * (down_codes.scalar_type() == at::kByte ? 32 : 4);
  TORCH_CHECK(!a8 || static_cast<int64_t>(a8_wsums.size()) == 4 * layers,
              "a8 linears need one wsum tensor (empty for int4) per linear");
  TORCH_CHECK(!a8 || static_cast<int64_t>(a8_terms.size()) == 4 * layers,
              "a8 linears need their activation terms, one per linear");
  for (const int64_t terms : a8_terms) TORCH_CHECK(terms == 1 || terms == 2, "a8_terms must be 1 or 2, got ", terms);
  // v_weights: V's rows apart, where they come in another format than Q's and K's (a GGUF
  // Q4_K_M's Q6_K V beside Q4_K Q and K: fused as int8 they took 1.375 bytes per Q and K weight
  // instead of 0.58): per layer codes, scales, mins and the a8 wsum, each possibly empty; empty
  // codes: that layer's QKV weight holds V.
  TORCH_CHECK(v_weights.empty() || static_cast<int64_t>(v_weights.size()) == 4 * layers,
              "v_weights: none or four per layer (codes, scales, mins, wsum)");
  group.resize(4 * layers);
  v_group.resize(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const at::TensorList w = at::TensorList(weights).slice(l * kPerLayer, kPerLayer);
    TORCH_CHECK(w[0].numel() == hidden && w[7].numel() == hidden && w[0].scalar_type() == at::kFloat &&
                    w[7].scalar_type() == at::kFloat && w[0].is_contiguous() && w[7].is_contiguous(),
                "norm weights must be contiguous fp32 (hidden,)");
    // a8: everything its GEMMs check, here before any of them runs (a team's may not throw), for
    // one row and for many (the kernel, hence what it reads, follows the row count).
    const auto check = [&](const at::TensorList& v, int64_t at, int64_t j, const at::Tensor& wsum, int64_t n, int64_t k,
                           const char* name) {
      if (!a8) return linear_group(v, at, n, k, name);
      edgeinfer_cpu::a8_check(v[at], v[at + 1], v[at + 2], wsum, 1, n, k, a8_isa, a8_terms[4 * l + j], name);
      return edgeinfer_cpu::a8_check(v[at], v[at + 1], v[at + 2], wsum, kManyRows, n, k, a8_isa, a8_terms[4 * l + j],
                                     name);
    };
    const auto wsum = [&](int64_t j) { return a8 ? a8_wsums[4 * l + j] : at::Tensor(); };
    group[4 * l] = check(w, 1, 0, wsum(0), split_v(l) ? q_size + kv_size : qkv_size, hidden, "qkv");
    if (split_v(l)) v_group[l] = check(v_weights, 4 * l, 0, v_weights[4 * l + 3], kv_size, hidden, "v");
    group[4 * l + 1] = check(w, 4, 1, wsum(1), hidden, q_size, "o");
    group[4 * l + 2] = check(w, 8, 2, wsum(2), 2 * inter, hidden, "gate_up");
    group[4 * l + 3] = check(w, 11, 3, wsum(3), hidden, inter, "down");
  }
}

void decode_layers(at::Tensor h, const c10::intrusive_ptr<DecodeSetup>& setup, const at::Tensor& cos_table,
                   const at::Tensor& sin_table, const at::Tensor& positions_in, const at::Tensor& slot_mapping_in,
                   const at::Tensor& block_tables_in, const at::Tensor& context_lens_in,
                   const c10::optional<at::Tensor>& a8_bf16_rows, const c10::optional<at::Tensor>& local_cos,
                   const c10::optional<at::Tensor>& local_sin, const c10::optional<at::Tensor>& phase_ns) {
  const DecodeSetup& s = *setup;
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous() && h.size(1) == s.hidden,
              "h must be contiguous fp32 (M, ", s.hidden, ")");
  TORCH_CHECK(local_cos.has_value() == local_sin.has_value() &&
                  (!local_cos.has_value() || (local_cos->sizes() == cos_table.sizes() &&
                                              local_sin->sizes() == cos_table.sizes() &&
                                              local_cos->scalar_type() == at::kFloat &&
                                              local_sin->scalar_type() == at::kFloat &&
                                              local_cos->is_contiguous() && local_sin->is_contiguous())),
              "local RoPE tables: both or neither, contiguous fp32 shaped as the global ones");
  // The setup's fields under the names the step reads them by.
  const at::TensorList weights = s.weights, k_caches = s.k_caches, v_caches = s.v_caches, k_scales = s.k_scales,
                       v_scales = s.v_scales, k_zeros = s.k_zeros, a8_wsums = s.a8_wsums, qkv_biases = s.qkv_biases,
                       v_zeros = s.v_zeros, qk_norms = s.qk_norms, out_norms = s.out_norms,
                       v_weights = s.v_weights;
  const c10::optional<at::Tensor>& rotation = s.rotation;
  const c10::optional<at::Tensor>& key_centres = s.key_centres;
  const std::vector<int64_t>& a8_terms = s.a8_terms;
  const std::vector<int64_t>& group = s.group;
  const std::vector<int64_t>& v_group = s.v_group;
  const std::vector<float>& rot_t = s.rot_t;
  const std::string& a8_isa = s.a8_isa;
  const std::string& activation = s.activation;
  const int64_t m = h.size(0), layers = s.layers, hidden = s.hidden, num_heads = s.num_heads,
                num_kv_heads = s.num_kv_heads, head_dim = s.head_dim, params_per_head = s.params_per_head,
                q_size = s.q_size, kv_size = s.kv_size, qkv_size = s.qkv_size, inter = s.inter, window = s.window,
                global_every = s.global_every;
  const double scale = s.scale, eps = s.eps, attn_softcap = s.attn_softcap;
  const bool int8 = s.int8, int4 = s.int4, quantized = s.quantized, a8 = s.a8;
  const auto split_v = [&](int64_t l) { return s.split_v(l); };
  const at::Tensor& k0 = k_caches[0];
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens_in.to(at::kInt).contiguous();
  TORCH_CHECK(positions.numel() == m && slots.numel() == m && lens.numel() == m && tables.dim() == 2 &&
                  tables.size(0) == m,
              "positions, slot_mapping, context_lens and block_tables must have one row per token (M)");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.dim() == 2 &&
                  cos_table.size(1) == head_dim && sin_table.sizes() == cos_table.sizes(),
              "RoPE tables must be contiguous fp32 (max_position, head_dim)");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int64_t num_slots = k0.size(0) * k0.size(1);
  for (int64_t t = 0; t < m; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_table.size(0), "position ", pos[t], " is outside the RoPE table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the KV pool");
    TORCH_CHECK(len[t] > 0 && len[t] <= tables.size(1) * k0.size(1), "context_lens[", t, "] exceeds its block table");
  }

  // a8: rows marked in a8_bf16_rows (a step's prompt tokens) run in bf16 on AMX-BF16, each run
  // of consecutive marked or unmarked rows one GEMM.
  std::vector<uint8_t> bf16_row(m, 0);
  if (a8_bf16_rows.has_value() && a8_bf16_rows->defined()) {
    const at::Tensor marks = a8_bf16_rows->to(at::kBool).contiguous();
    TORCH_CHECK(a8 && marks.numel() == m, "a8_bf16_rows needs a8 linears and one mark per row (M)");
    std::copy_n(marks.data_ptr<bool>(), m, bf16_row.begin());
  }
  // A few a8 rows (no bf16 ones) run as a team: every layer in one parallel region, each op split
  // across its threads, which meet at spin barriers (parallel.h Team): a one-row step 0.5-16%
  // shorter, four rows 6-11% (docs/BENCHMARKS.md, "A step of up to four rows as one team"). More
  // rows: each op runs its own parallel region, its work claimed in chunks (robust to a core that
  // another program slows). Only where the threads fit the cores: a team spins for a thread that
  // is off its core.
  const int64_t threads = at::get_num_threads();
  const bool use_team = a8 && m <= kTeamMaxRows && threads > 1 && threads <= edgeinfer_cpu::available_cpus() &&
                        std::none_of(bf16_row.begin(), bf16_row.end(), [](uint8_t b) { return b != 0; });
  // y (m, n) = x @ W.T for the weight at w[at] (codes, scales, mins; a8: its wsum, its group).
  const auto gemm = [&](const edgeinfer_cpu::Team* team, const at::TensorList& w, int64_t at, const at::Tensor& wsum,
                        int64_t terms, int64_t group_size, const float* in, int64_t n, int64_t k, float* out) {
    if (team != nullptr) {
      edgeinfer_cpu::a8_gemm_team(in, m, w[at], w[at + 1], w[at + 2], wsum, n, k, group_size, a8_isa, out, terms,
                                  *team);
    } else if (a8) {
      for (int64_t r0 = 0, r1 = 0; r0 < m; r0 = r1) {
        for (r1 = r0 + 1; r1 < m && bf16_row[r1] == bf16_row[r0];) ++r1;
        edgeinfer_cpu::a8_gemm_rows(in + r0 * k, r1 - r0, w[at], w[at + 1], w[at + 2], wsum, n, k,
                                    bf16_row[r0] ? "amx_bf16" : a8_isa, out + r0 * n, bf16_row[r0] ? 1 : terms);
      }
    } else {
      edgeinfer_cpu::quantized_gemm_rows(in, m, w[at], w[at + 1], w[at + 2], group_size, out);
    }
  };
  const at::Tensor no_wsum;
  // Linear j of layer l (qkv, o, gate_up, down) at w[at].
  const auto linear = [&](const edgeinfer_cpu::Team* team, const at::TensorList& w, int64_t l, int64_t j, int64_t at,
                          const float* in, int64_t n, int64_t k, float* out) {
    gemm(team, w, at, a8 ? a8_wsums[4 * l + j] : no_wsum, a8 ? a8_terms[4 * l + j] : 1, group[4 * l + j], in, n, k,
         out);
  };
  const bool gelu = activation == "gelu_tanh";
  std::vector<float> x(m * hidden), qkv(m * qkv_size), q(m * q_size), attn(m * q_size), y(m * hidden),
      gate_up(m * 2 * inter), act(m * inter), qk(v_weights.empty() ? 0 : m * (q_size + kv_size)),
      v(v_weights.empty() ? 0 : m * kv_size);
  TORCH_CHECK(!phase_ns.has_value() || (phase_ns->scalar_type() == at::kLong && phase_ns->is_contiguous() &&
                                         phase_ns->numel() == kPhases),
              "phase_ns must be a contiguous int64 tensor of ", kPhases, " values");
  PhaseClock clock(phase_ns.has_value() ? phase_ns->data_ptr<int64_t>() : nullptr);
  float* hp = h.data_ptr<float>();
  // Every layer, run by the calling thread (team null: each op parallel on its own) or by every
  // thread of a team (each op its share, then a sync).
  const auto run_layers = [&](const edgeinfer_cpu::Team* team) {
    const bool lead = team == nullptr || team->tid == 0;
    const auto lap = [&](int phase) {
      if (lead) clock.lap(phase);
    };
    const auto sync = [&] {
      if (team != nullptr) team->sync();
    };
    const auto serial = [&](const auto& f) {  // f by one thread
      if (lead) f();
      sync();
    };
    const auto rows = [&](int64_t count, const auto& f) {  // f(r0, r1) over [0, count)
      if (team == nullptr) return at::parallel_for(0, count, 4, f);
      const auto [r0, r1] = team->share(count);
      if (r1 > r0) f(r0, r1);
      sync();
    };
    for (int64_t l = 0; l < layers; ++l) {
      const at::TensorList w = weights.slice(l * kPerLayer, kPerLayer);
      at::Tensor k_cache = k_caches[l];
      at::Tensor v_cache = v_caches[l];
      // Local layers (all of them without global_every; Gemma's global ones every global_every-th)
      // attend within the window, with their own RoPE tables where given (Gemma 3).
      const bool local = window > 0 && (global_every == 0 || (l + 1) % global_every != 0);
      const float* cos_l = (local && local_cos.has_value() ? *local_cos : cos_table).data_ptr<float>();
      const float* sin_l = (local && local_sin.has_value() ? *local_sin : sin_table).data_ptr<float>();
      serial([&] {
        edgeinfer_cpu::rms_norm_rows(hp, w[0].data_ptr<float>(), m, hidden, static_cast<float>(eps), x.data());
      });
      lap(0);
      if (split_v(l)) {  // Q and K, then V, each on its own weight, into QKV's rows
        linear(team, w, l, 0, 1, x.data(), q_size + kv_size, hidden, qk.data());
        gemm(team, v_weights, 4 * l, a8 ? v_weights[4 * l + 3] : no_wsum, a8 ? a8_terms[4 * l] : 1, v_group[l],
             x.data(), kv_size, hidden, v.data());
        serial([&] {
          for (int64_t t = 0; t < m; ++t) {
            std::copy_n(qk.data() + t * (q_size + kv_size), q_size + kv_size, qkv.data() + t * qkv_size);
            std::copy_n(v.data() + t * kv_size, kv_size, qkv.data() + t * qkv_size + q_size + kv_size);
          }
        });
      } else {
        linear(team, w, l, 0, 1, x.data(), qkv_size, hidden, qkv.data());
      }
      lap(1);
      // Tokens (and below, activation rows) in parallel; with RoPE vectorized, a 16-sequence step spends
      // 0.42 ms here and 0.27 in SiLU instead of 1.25 and 0.40.
      rows(m, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          float* row = qkv.data() + t * qkv_size;
          if (!qkv_biases.empty()) add_into(row, qkv_biases[l].data_ptr<float>(), qkv_size);
          if (!qk_norms.empty()) {  // in place: a row is read whole before it is written
            edgeinfer_cpu::rms_norm_rows(row, qk_norms[2 * l].data_ptr<float>(), num_heads, head_dim,
                                         static_cast<float>(eps), row);
            edgeinfer_cpu::rms_norm_rows(row + q_size, qk_norms[2 * l + 1].data_ptr<float>(), num_kv_heads, head_dim,
                                         static_cast<float>(eps), row + q_size);
          }
          rope(row, num_heads + num_kv_heads, head_dim, cos_l + pos[t] * head_dim, sin_l + pos[t] * head_dim);
          if (quantized) {
            float* keys = row + q_size;
            if (key_centres.has_value()) {
              const float* centre = key_centres->data_ptr<float>() + l * kv_size;
              for (int64_t i = 0; i < kv_size; ++i) keys[i] -= centre[i];
            }
            rotate(row, num_heads + 2 * num_kv_heads, head_dim, rotation->data_ptr<float>());  // q, k and v
            const int64_t at = slot[t] * num_kv_heads * params_per_head;  // the token's first scale
            if (int8) {
              quantize_int8(keys, num_kv_heads, head_dim, k_cache.data_ptr<int8_t>() + slot[t] * kv_size,
                            k_scales[l].data_ptr<c10::Half>() + at);
              quantize_int8(keys + kv_size, num_kv_heads, head_dim, v_cache.data_ptr<int8_t>() + slot[t] * kv_size,
                            v_scales[l].data_ptr<c10::Half>() + at);
            } else {
              quantize_int4(keys, num_kv_heads, head_dim, k_cache.data_ptr<uint8_t>() + slot[t] * kv_size / 2,
                            k_scales[l].data_ptr<c10::Half>() + at, k_zeros[l].data_ptr<c10::Half>() + at);
              quantize_int4(keys + kv_size, num_kv_heads, head_dim, v_cache.data_ptr<uint8_t>() + slot[t] * kv_size / 2,
                            v_scales[l].data_ptr<c10::Half>() + at, v_zeros[l].data_ptr<c10::Half>() + at);
            }
          } else {
            write_kv(row + q_size, kv_size, k_cache, slot[t]);
            write_kv(row + q_size + kv_size, kv_size, v_cache, slot[t]);
          }
          std::copy(row, row + q_size, q.data() + t * q_size);
        }
      });
      lap(2);
      const at::Tensor none;
      edgeinfer_cpu::decode_attention(q.data(), k_cache, v_cache, quantized ? k_scales[l] : none,
                                      quantized ? v_scales[l] : none, int4 ? k_zeros[l] : none,
                                      int4 ? v_zeros[l] : none, tables.data_ptr<int32_t>(), tables.size(1), len, m,
                                      num_heads, static_cast<float>(scale), attn.data(), local ? window : 0,
                                      static_cast<float>(attn_softcap), team);
      sync();
      if (quantized) {
        rows(m, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) rotate(attn.data() + t * q_size, num_heads, head_dim, rot_t.data());
        });
      }
      lap(3);
      linear(team, w, l, 1, 4, attn.data(), hidden, q_size, y.data());
      lap(4);
      serial([&] {
        if (!out_norms.empty()) {  // Gemma's sandwich norms: each block's output normed before the residual
          edgeinfer_cpu::rms_norm_rows(y.data(), out_norms[2 * l].data_ptr<float>(), m, hidden, static_cast<float>(eps),
                                       y.data());
        }
        add_into(hp, y.data(), m * hidden);
        edgeinfer_cpu::rms_norm_rows(hp, w[7].data_ptr<float>(), m, hidden, static_cast<float>(eps), x.data());
      });
      lap(5);
      linear(team, w, l, 2, 8, x.data(), 2 * inter, hidden, gate_up.data());
      lap(6);
      rows(m, [&](int64_t r0, int64_t r1) {
        (gelu ? act_mul<true> : act_mul<false>)(gate_up.data() + r0 * 2 * inter, r1 - r0, inter,
                                                 act.data() + r0 * inter);
      });
      lap(7);
      linear(team, w, l, 3, 11, act.data(), hidden, inter, y.data());
      serial([&] {
        if (!out_norms.empty()) {
          edgeinfer_cpu::rms_norm_rows(y.data(), out_norms[2 * l + 1].data_ptr<float>(), m, hidden,
                                       static_cast<float>(eps), y.data());
        }
        add_into(hp, y.data(), m * hidden);
      });
      lap(8);
    }
  };
  if (use_team) {
    edgeinfer_cpu::run_team([&](const edgeinfer_cpu::Team& team) { run_layers(&team); });
  } else {
    run_layers(nullptr);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.class_<DecodeSetup>("DecodeSetup")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, double, double,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                       std::vector<at::Tensor>, std::string, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, std::string, double,
                       std::vector<at::Tensor>>());
  // The caches the setup holds are written (not declared here: they are not arguments).
  m.def("decode_layers(Tensor(a!) h, __torch__.torch.classes.edgeinfer_cpu.DecodeSetup setup, Tensor cos, "
        "Tensor signed_sin, Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
        "Tensor? a8_bf16_rows=None, Tensor? local_cos=None, Tensor? local_sin=None, Tensor(d!)? phase_ns=None) -> ()");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
