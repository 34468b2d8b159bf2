// The int4 dequantizer: op torch.ops.edgeinfer_cpu.int4_dequantize, the fp32 (N, K) weight of a
// cpu_ops.prepare_int4 weight (quantized_gemm.cpp's layout), for the dequantize + fp32 GEMM path
// of batches wider than the int4 kernel wins at (kernels.dispatch.CPU_KERNEL_MAX_M).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

namespace {

using edgeinfer_cpu::to_float;

constexpr int64_t kBlock = 32;

// The block's 32 codes as bytes, in order (the dequantizer's form).
inline __m256i unpack_block(const uint8_t* w) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

template <typename S>
void dequantize_rows(const uint8_t* w, const S* scales, const S* mins, int64_t group_size, int64_t n, int64_t k,
                     float* out) {
  const int64_t groups = k / group_size;
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const int64_t g = r * groups + b * kBlock / group_size;
        const __m256 s = _mm256_set1_ps(to_float(scales[g]));
        const __m256 mi = _mm256_set1_ps(to_float(mins[g]));
        const __m256i codes = unpack_block(w + r * (k / 2) + b * (kBlock / 2));
        float* o = out + r * k + b * kBlock;
        for (int j = 0; j < 4; ++j) {
          const __m128i eight = j < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
          const __m128i part = (j % 2) ? _mm_srli_si128(eight, 8) : eight;
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
          _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(v, s, mi));
        }
      }
    }
  });
}

// The (N, K) fp32 weight, written into the first N * K floats of `out` (a reused buffer).
void int4_dequantize(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins, int64_t group_size,
                     at::Tensor out) {
  edgeinfer_cpu::check_int4_weight(w, scales, mins, group_size);
  const int64_t n = w.size(0);
  const int64_t k = w.size(1) * 2;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= n * k,
              "out must be a contiguous fp32 buffer of at least ", n * k, " elements");
  if (scales.scalar_type() == at::kHalf) {
    dequantize_rows(w.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>(), group_size, n,
                    k, out.data_ptr<float>());
  } else {
    dequantize_rows(w.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), group_size, n, k,
                    out.data_ptr<float>());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("int4_dequantize(Tensor w, Tensor scales, Tensor mins, int group_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("int4_dequantize", &int4_dequantize); }
