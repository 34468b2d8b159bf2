// int4 and int8 weight x int16 activation GEMMs for AVX2 CPUs (the int4 dequantizer for wider
// batches is int4_dequantize.cpp).
//
// Ops torch.ops.edgeinfer_cpu.int4_gemm / int8_gemm; kernels/cpu_ops.py builds
// them, prepares weights and names the torch reference
// (kernels.reference.int16_activation_gemm_reference).
//
// Weight layout (made once by cpu_ops.prepare_int4): per output row n, K / 32 blocks of 16
// bytes; byte j of block b holds element 32b + j in its low nibble and 32b + 16 + j in its high
// nibble (GGUF's Q4_0/Q4_1 order), so one 16-byte load unpacks to the block's 32 codes in order.
// w = q * scale + min with one fp16 or fp32 scale and min per group of K (a multiple of 32).
// int8 weights (GGUF's Q8_0, quant.formats int8) are (N, K) int8 codes in order, w = q * scale
// (+ min where given: GGUF Q5_1/Q5_K): the same loop with a sign-extending load instead of the
// nibble unpack. int8 may also have groups of 16 (GGUF Q6_K): a block's two halves then get
// their own scale, applied before the halves' dots are added (two cvt and a mul more per block).
//
// Activations become int16 with a scale per 4 values (see quantize_row), so a block's dot
// product is two madd on integers and one fp32 multiply of lanes:
//     sum_i x_i * (q_i * s + mn) ~= s * sum_l d_l * sum_{i in l} q_i * xq_i + mn * sum_i x_i
// with the exact float group sum in the min term (added per output after the block loop).
// Decode (M = 1) reads each weight byte once with ~9 instructions per 32 weights and runs near
// memory speed on 2 threads (the 49152 x 576 head at ~19 GB/s, measured). A weight block is
// unpacked once for up to kTile activation rows, but per block and row the integer dot still
// needs cvt + scale + FMA (AVX2 has no int dot product instruction), so 16 rows cost ~7-8x one;
// from ~64 rows on, dequantize + fp32 GEMM wins (kernels.dispatch.CPU_KERNEL_M).
//
// The scales are converted to fp32 once per weight row, not per block: a per-block fp16
// conversion, and a division to find a block's group, each cost more than the block's madds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using edgeinfer_cpu::balanced_for;
using edgeinfer_cpu::dot;
using edgeinfer_cpu::hsum;
using edgeinfer_cpu::to_float;

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;  // activation rows per pass over a weight row: 4 accumulators + operands fit 16 ymm

// One row of K floats -> int16 codes (K, in order), one scale per lane group (K / 4) and exact
// per-block sums (K / 32). Lane group l of a 32-block is the values {2l, 2l + 1, 16 + 2l, 17 + 2l}
// (l < 8): the int16 dot of the block's two halves leaves exactly those in int32 lane l, so each
// lane gets its own scale for free. x ~= scale * code, code = round(x / scale), scale = max|x| / 32767
// over the group. int8 codes (llama.cpp's Q8_1, one scale per 32) moved a near-tied logit gap by
// 0.4 on the default model and broke greedy parity with the fp32 reference; 16 bits do not.
// `sum` (K / 32) or, for groups of 16, `half_sum` (K / 16) gets the exact sums; the other is null.
void quantize_row(const float* x, int64_t k, int16_t* q, float* scale, float* sum, float* half_sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 q_max = _mm256_set1_ps(32767.0f);
  alignas(32) float first_max[8], second_max[8];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    if (sum != nullptr) sum[b] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    if (half_sum != nullptr) {
      half_sum[2 * b] = hsum(_mm256_add_ps(v[0], v[1]));
      half_sum[2 * b + 1] = hsum(_mm256_add_ps(v[2], v[3]));
    }
    // Value i pairs with value 16 + i, then neighbours 2j and 2j + 1 pair: group max per value.
    __m256 m[2];
    for (int h = 0; h < 2; ++h) {
      __m256 e = _mm256_max_ps(_mm256_andnot_ps(sign, v[h]), _mm256_andnot_ps(sign, v[h + 2]));
      m[h] = _mm256_max_ps(e, _mm256_permute_ps(e, _MM_SHUFFLE(2, 3, 0, 1)));
    }
    __m256i codes[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 mi = m[i % 2];
      const __m256 inv = _mm256_and_ps(_mm256_cmp_ps(mi, zero, _CMP_GT_OQ), _mm256_div_ps(q_max, mi));
      codes[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT));
    }
    for (int h = 0; h < 2; ++h) {  // packs works within 128-bit lanes; permute4x64 restores order
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(codes[2 * h], codes[2 * h + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock + 16 * h), packed);
    }
    _mm256_store_ps(first_max, m[0]);   // values 0..7 (and 16..23): lane groups 0..3
    _mm256_store_ps(second_max, m[1]);  // values 8..15 (and 24..31): lane groups 4..7
    for (int l = 0; l < 4; ++l) {
      scale[b * 8 + l] = first_max[2 * l] / 32767.0f;
      scale[b * 8 + 4 + l] = second_max[2 * l] / 32767.0f;
    }
  }
}

// Block b's codes 0..15 and 16..31 of a weight row as two vectors of 16 int16. int4: one
// widening of the 16 bytes, then each 16-bit lane holds a whole byte, so its low nibble is code
// j and the rest code 16 + j. int8: two sign-extending loads.
template <bool kInt8>
inline void block_codes(const uint8_t* row, int64_t b, __m256i* low, __m256i* high) {
  if constexpr (kInt8) {
    const auto* q = reinterpret_cast<const __m128i*>(row + b * kBlock);
    *low = _mm256_cvtepi8_epi16(_mm_loadu_si128(q));
    *high = _mm256_cvtepi8_epi16(_mm_loadu_si128(q + 1));
  } else {
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kBlock / 2)));
    *low = _mm256_and_si256(wide, _mm256_set1_epi16(0x0F));
    *high = _mm256_srli_epi16(wide, 4);
  }
}

// count values of src as fp32 into dst (a weight row's scales or mins, converted once per row
// instead of once per block and activation row).
inline void to_float_row(const float* src, int64_t count, float* dst) { std::copy(src, src + count, dst); }
inline void to_float_row(const c10::Half* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, edgeinfer_cpu::load8(src + i));
  for (; i < count; ++i) dst[i] = to_float(src[i]);
}

struct Activations {
  const int16_t* q;
  const float* scale;      // 8 per block: lane l scales codes 4l .. 4l + 3
  const float* group_sum;  // 1 per weight group: the exact sum of its activations (groups of 16 too)
  // The same sums per tile of kTile rows side by side, (M / kTile rounded up, groups, kTile),
  // zero-padded: a tile's min terms are then one 4-wide FMA per group (weights with mins only).
  const float* tile_group_sum;
  int64_t k;
  int64_t groups;
};

// y[m0, m0 + T) x [n0, n1) for T activation rows, R weight rows at a time: R * T independent
// accumulators, because one accumulator per output serialises on the FMA's latency (K = 576 is
// only 18 blocks per row). Per block and pair of rows the inner loop is 2 madd, add, cvt, mul,
// FMA; a weight block is unpacked once for its T activation rows. The min term (int4: min * the
// group's activation sum) comes after the block loop, for all T rows at once.
// kMin: the weight has mins (int4 always); kG16: int8 groups of 16, two scales per block.
template <int R, int T, typename S, bool kInt8, bool kMin, bool kG16>
void gemm_tile(const uint8_t* w, const S* scales, const S* mins, int64_t group_blocks, const Activations& x,
               int64_t m0, int64_t n0, int64_t n1, float* y, int64_t ld_y, float* block_scales, float* row_mins) {
  const int64_t k = x.k;
  const int64_t blocks = k / kBlock;
  const int64_t groups = x.groups;
  const int64_t row_bytes = kInt8 ? k : k / 2;
  const int64_t slots = kG16 ? groups : blocks;  // fp32 scales per weight row in block_scales
  const int16_t* xq = x.q + m0 * k;
  const float* xs = x.scale + m0 * blocks * 8;
  for (int64_t n = n0; n < n1; n += R) {
    __m256 acc[R][T];
    for (int i = 0; i < R; ++i) {
      // The row's scales as fp32 once per block (no division by group_blocks in the loop);
      // groups of 16: two per block, in order.
      float* bs = block_scales + i * slots;
      if (group_blocks == 1) {
        to_float_row(scales + (n + i) * groups, groups, bs);
      } else {
        to_float_row(scales + (n + i) * groups, groups, row_mins + i * groups);  // staging; mins overwrite it below
        for (int64_t g = 0; g < groups; ++g) std::fill_n(bs + g * group_blocks, group_blocks, row_mins[i * groups + g]);
      }
      if constexpr (kMin) to_float_row(mins + (n + i) * groups, groups, row_mins + i * groups);
      for (int r = 0; r < T; ++r) acc[i][r] = _mm256_setzero_ps();
    }
    // The next R rows, a cache line per 64 bytes of this block step: rows of R * K / 2 bytes are
    // R short interleaved streams the hardware prefetcher barely trains on (down, 768-byte rows,
    // ran at 9.8 GB/s from DRAM against gate/up's 16.6 with 288-byte rows).
    const uint8_t* next = w + (n + R < n1 ? n + R : n) * row_bytes;  // the last group: itself
    constexpr int64_t kStep = R * (kInt8 ? kBlock : kBlock / 2);  // bytes of the next rows per block
    for (int64_t b = 0; b < blocks; ++b) {
      const char* ahead = reinterpret_cast<const char*>(next + b * kStep);
      if constexpr (kStep >= 64) {
        for (int64_t line = 0; line < kStep; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      } else if ((b * kStep) % 64 == 0) {
        _mm_prefetch(ahead, _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        __m256i w_low, w_high;
        block_codes<kInt8>(w + (n + i) * row_bytes, b, &w_low, &w_high);
        const float* bs = block_scales + i * slots + (kG16 ? 2 * b : b);
        const __m256 s = _mm256_broadcast_ss(bs);
#pragma GCC unroll 8
        for (int r = 0; r < T; ++r) {
          const int16_t* xb = xq + r * k + b * kBlock;
          // A lane sums 4 products of int16 codes with int4 codes (< 4 * 15 * 32767 < 2^21) or
          // int8 codes (<= 4 * 128 * 32767 < 2^24): exact in int32 and after cvt to fp32.
          const __m256i low = _mm256_madd_epi16(w_low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
          const __m256i high = _mm256_madd_epi16(w_high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
          const __m256 xd = _mm256_loadu_ps(xs + (r * blocks + b) * 8);
          if constexpr (kG16) {  // lane l holds values 2l, 2l + 1 of each half: scale the halves apart
            const __m256 halves = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), s,
                                                  _mm256_mul_ps(_mm256_cvtepi32_ps(high), _mm256_broadcast_ss(bs + 1)));
            acc[i][r] = _mm256_fmadd_ps(halves, xd, acc[i][r]);
          } else {
            const __m256i dots = _mm256_add_epi32(low, high);
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(s, xd), acc[i][r]);
          }
        }
      }
    }
    // Fully unrolled, touching only constant indices of acc: a loop here that GCC leaves rolled
    // (the min term's dot product was one) makes it keep acc in memory, and the block loop above
    // then spilled and reloaded every accumulator each block (int4 at M = 16 ran 1.6x slower
    // than int8 until this).
    float sums[R][T];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
      for (int r = 0; r < T; ++r) sums[i][r] = hsum(acc[i][r]);
    }
    if constexpr (kMin) {  // + min * the group's activation sum, over the groups
      if constexpr (T == 1) {
        for (int i = 0; i < R; ++i) sums[i][0] += dot(row_mins + i * groups, x.group_sum + m0 * groups, groups);
      } else {  // all T rows at once: a dot product per output was 20% of the time at M = 16
        const float* ts = x.tile_group_sum + (m0 / kTile) * groups * kTile;
        for (int i = 0; i < R; ++i) {
          __m128 even = _mm_setzero_ps(), odd = _mm_setzero_ps();  // two chains: FMA latency
          int64_t g = 0;
          for (; g + 2 <= groups; g += 2) {
            even = _mm_fmadd_ps(_mm_set1_ps(row_mins[i * groups + g]), _mm_loadu_ps(ts + g * kTile), even);
            odd = _mm_fmadd_ps(_mm_set1_ps(row_mins[i * groups + g + 1]), _mm_loadu_ps(ts + (g + 1) * kTile), odd);
          }
          if (g < groups) even = _mm_fmadd_ps(_mm_set1_ps(row_mins[i * groups + g]), _mm_loadu_ps(ts + g * kTile), even);
          alignas(16) float terms[4];
          _mm_store_ps(terms, _mm_add_ps(even, odd));
          for (int r = 0; r < T; ++r) sums[i][r] += terms[r];
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int r = 0; r < T; ++r) y[(m0 + r) * ld_y + n + i] = sums[i][r];
    }
  }
}

template <int R, typename S, bool kInt8, bool kMin, bool kG16>
void gemm_columns(const uint8_t* w, const S* scales, const S* mins, int64_t group_blocks, const Activations& x,
                  int64_t m, int64_t n0, int64_t n1, float* y, int64_t ld_y) {
  const int64_t slots = kG16 ? x.groups : x.k / kBlock;
  std::vector<float> row_params(R * (slots + x.groups));
  float* rs = row_params.data();
  float* rm = rs + R * slots;
  int64_t m0 = 0;
  for (; m0 + kTile <= m; m0 += kTile) {
    gemm_tile<R, kTile, S, kInt8, kMin, kG16>(w, scales, mins, group_blocks, x, m0, n0, n1, y, ld_y, rs, rm);
  }
  switch (m - m0) {
    case 3: gemm_tile<R, 3, S, kInt8, kMin, kG16>(w, scales, mins, group_blocks, x, m0, n0, n1, y, ld_y, rs, rm); break;
    case 2: gemm_tile<R, 2, S, kInt8, kMin, kG16>(w, scales, mins, group_blocks, x, m0, n0, n1, y, ld_y, rs, rm); break;
    case 1: gemm_tile<R, 1, S, kInt8, kMin, kG16>(w, scales, mins, group_blocks, x, m0, n0, n1, y, ld_y, rs, rm); break;
    default: break;
  }
}

template <typename S, bool kInt8, bool kMin, bool kG16>
void gemm(const uint8_t* w, const S* scales, const S* mins, int64_t group_blocks, const Activations& x, int64_t m,
          int64_t n, float* y) {
  // Columns split across threads in multiples of kRows, claimed in shrinking chunks down to a
  // quarter of a thread's share (at least 16 columns); a remainder of rows runs one at a time.
  constexpr int64_t kRows = 4;
  const int64_t grain = std::max<int64_t>(16, n / (4 * at::get_num_threads())) / kRows * kRows;
  const int64_t n_tiled = n / kRows * kRows;
  balanced_for(0, n_tiled / kRows, grain / kRows, [&](int64_t t0, int64_t t1) {
    if (m == 1) {
      gemm_columns<kRows, S, kInt8, kMin, kG16>(w, scales, mins, group_blocks, x, m, t0 * kRows, t1 * kRows, y, n);
    } else {
      gemm_columns<1, S, kInt8, kMin, kG16>(w, scales, mins, group_blocks, x, m, t0 * kRows, t1 * kRows, y, n);
    }
  });
  gemm_columns<1, S, kInt8, kMin, kG16>(w, scales, mins, group_blocks, x, m, n_tiled, n, y, n);
}

template <typename S, bool kInt8>
void gemm_kind(const uint8_t* codes, const S* s, const S* mn, bool g16, int64_t group_blocks, const Activations& act,
               int64_t m, int64_t n, float* y) {
  if constexpr (!kInt8) {
    gemm<S, false, true, false>(codes, s, mn, group_blocks, act, m, n, y);
  } else if (g16) {
    if (mn != nullptr) gemm<S, true, true, true>(codes, s, mn, group_blocks, act, m, n, y);
    else gemm<S, true, false, true>(codes, s, mn, group_blocks, act, m, n, y);
  } else {
    if (mn != nullptr) gemm<S, true, true, false>(codes, s, mn, group_blocks, act, m, n, y);
    else gemm<S, true, false, false>(codes, s, mn, group_blocks, act, m, n, y);
  }
}

// y (M, N) = x (M, K) @ W.T for an int4 weight (uint8, mins required) or an int8 one (int8; mins
// optional: undefined or empty means none; group 16 or a multiple of 32).
void quantized_gemm(const float* xp, int64_t m, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                    int64_t group_size, float* y) {
  const bool int8 = w.scalar_type() == at::kChar;
  const bool has_mins = mins.defined() && mins.numel() > 0;
  const bool g16 = group_size == 16;
  const int64_t n = w.size(0);
  const int64_t k = int8 ? w.size(1) : w.size(1) * 2;
  const int64_t blocks = k / kBlock;
  std::vector<int16_t> q(m * k);
  std::vector<float> scale(m * blocks * 8);
  std::vector<float> sum(m * blocks * (g16 ? 2 : 1));  // per group of 16: the halves' sums
  for (int64_t r = 0; r < m; ++r) {
    float* row_sum = sum.data() + r * blocks * (g16 ? 2 : 1);
    quantize_row(xp + r * k, k, q.data() + r * k, scale.data() + r * blocks * 8, g16 ? nullptr : row_sum,
                 g16 ? row_sum : nullptr);
  }
  const int64_t group_blocks = g16 ? 1 : group_size / kBlock;
  const int64_t groups = g16 ? 2 * blocks : blocks / group_blocks;
  if (group_blocks > 1) {  // block sums -> group sums, in place (group g's sum lands in slot g)
    for (int64_t g = 0; g < m * groups; ++g) {
      float total = 0.0f;
      for (int64_t j = 0; j < group_blocks; ++j) total += sum[g * group_blocks + j];
      sum[g] = total;
    }
  }
  std::vector<float> tile_sum((m + kTile - 1) / kTile * groups * kTile, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) tile_sum[((r / kTile) * groups + g) * kTile + r % kTile] = sum[r * groups + g];
  }
  const Activations act{q.data(), scale.data(), sum.data(), tile_sum.data(), k, groups};
  const auto* codes = static_cast<const uint8_t*>(w.data_ptr());
  if (scales.scalar_type() == at::kHalf) {
    const auto* s = scales.data_ptr<c10::Half>();
    const c10::Half* mn = has_mins ? mins.data_ptr<c10::Half>() : nullptr;
    if (int8) gemm_kind<c10::Half, true>(codes, s, mn, g16, group_blocks, act, m, n, y);
    else gemm_kind<c10::Half, false>(codes, s, mn, g16, group_blocks, act, m, n, y);
  } else {
    const auto* s = scales.data_ptr<float>();
    const float* mn = has_mins ? mins.data_ptr<float>() : nullptr;
    if (int8) gemm_kind<float, true>(codes, s, mn, g16, group_blocks, act, m, n, y);
    else gemm_kind<float, false>(codes, s, mn, g16, group_blocks, act, m, n, y);
  }
}

at::Tensor int4_gemm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t group_size) {
  edgeinfer_cpu::check_int4_weight(w, scales, mins, group_size);
  const int64_t k = w.size(1) * 2;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be (M, ", k, "), got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  quantized_gemm(x.data_ptr<float>(), x.size(0), w, scales, mins, group_size, y.data_ptr<float>());
  return y;
}

at::Tensor int8_gemm(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins_in, int64_t group_size) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "int8 weight must be contiguous int8 (N, K)");
  const int64_t k = w.size(1);
  TORCH_CHECK(k % kBlock == 0, "int8 weight K must be a multiple of 32, got ", k);
  TORCH_CHECK((group_size == 16 || (group_size > 0 && group_size % kBlock == 0)) && k % group_size == 0,
              "group_size must be 16 or a positive multiple of 32 dividing K=", k, ", got ", group_size);
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat, "scales must be fp16 or fp32");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == w.size(0) * (k / group_size),
              "scales must be contiguous and hold N * K / group_size values");
  const at::Tensor mins = mins_in.has_value() ? *mins_in : at::Tensor();
  TORCH_CHECK(!mins.defined() || (mins.scalar_type() == scales.scalar_type() && mins.is_contiguous() &&
                                  mins.numel() == scales.numel()),
              "mins must be contiguous, of the scales' dtype and count");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be (M, ", k, "), got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  quantized_gemm(x.data_ptr<float>(), x.size(0), w, scales, mins, group_size, y.data_ptr<float>());
  return y;
}

}  // namespace

void edgeinfer_cpu::check_int4_weight(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins,
                                      int64_t group_size) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "int4 weight must be contiguous uint8 (N, K/2)");
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0, "group_size must be a positive multiple of 32, got ", group_size);
  const int64_t k = w.size(1) * 2;
  TORCH_CHECK(k % group_size == 0, "group_size ", group_size, " does not divide K=", k);
  TORCH_CHECK(scales.scalar_type() == mins.scalar_type(), "scales and mins must have one dtype");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat, "scales must be fp16 or fp32");
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous(), "scales and mins must be contiguous");
  TORCH_CHECK(scales.numel() == w.size(0) * (k / group_size) && mins.numel() == scales.numel(),
              "scales and mins must hold N * K / group_size values");
}

void edgeinfer_cpu::quantized_gemm_rows(const float* x, int64_t m, const at::Tensor& w, const at::Tensor& scales,
                                   const at::Tensor& mins, int64_t group_size, float* y) {
  quantized_gemm(x, m, w, scales, mins, group_size, y);
}

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor w, Tensor scales, Tensor mins, int group_size) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor w, Tensor scales, Tensor? mins, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_gemm", &int8_gemm);
}
