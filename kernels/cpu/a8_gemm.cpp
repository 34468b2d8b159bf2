// int4 / int8 weight x int8 activation GEMMs: the op around the per-ISA kernels.
//
// Op torch.ops.edgeinfer_cpu.a8_gemm; kernels/cpu_ops.py prepares the weight tiles (a8_gemm.h)
// and picks the instruction set once (a8_isa_supported: AMX, then AVX512-VNNI, AVX-VNNI, AVX2;
// "amx_bf16" is not an int8 choice: x in bf16 on AMX-BF16, bf16_rows, a8_gemm_amx_bf16.cpp);
// kernels.reference.int8_activation_gemm_reference computes the same rounding in torch.
// Here: each activation row is quantized symmetrically to int8 with a scale per 32 values (16
// for int8 groups of 16; absmax / 127, round half to even) and its exact fp32 group sums (the
// weight mins' term), then the weight's
// column tiles are split over the threads and each tile runs through all M rows at once.
// With two terms each unit of a row also gets the codes of its rounding residual x - d * codes on
// a grid of d / 16 (in -8..8: |residual| <= d / 2), so x ~= d / 16 * (16 * codes + residual
// codes) to within d / 32, 2^-12 of the unit's absmax: the default model's eval-ppl 46.57 against
// the int16 kernel's 46.58, for twice the dot products (at small M the kernel's cost is the
// weight unpack, shared by the rows). The kernels sum 16 x the codes' dot and the residual's
// exactly in int32 and rescale that once: the AMX kernel reads a unit's two terms as one tile
// row of 64 bytes against the weights' 16 x codes stacked on their codes, one multiply, tile
// store and rescale per unit for both terms. A residual at its own absmax scale (2^-15, as
// before) needs a rescale of its own per unit, which bounded the AMX kernel.
// Unlike the int16 kernel (quantized_gemm.cpp), a block's dot product for 4 rows costs one
// vpdpbusd per 4 weights and row instead of cvt + scale + FMA per row, so wide batches become
// compute-cheap; the int16 kernel stays the accuracy reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "a8_gemm.h"
#include "ops.h"
#include "parallel.h"
#include "simd.h"

namespace {

using edgeinfer_cpu::A8Problem;
using edgeinfer_cpu::kA8Cols;
using edgeinfer_cpu::kA8Unit;
using edgeinfer_cpu::kA8AmxBlock;
using edgeinfer_cpu::kA8AmxMinRows;
using edgeinfer_cpu::a8_columns_amx_bf16;
using edgeinfer_cpu::a8_rows_to_bf16;

using Kernel = void (*)(const A8Problem&, int64_t, int64_t);

// Not every compiler's __builtin_cpu_supports knows "f16c": CPUID leaf 1 says.
bool f16c() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  }();
  return has;
}

// AMX-TILE and AMX-INT8 (CPUID leaf 7), enabled by the OS (XCR0 bits 17-18), and the tile data
// state granted to this process (Linux asks a process to request it: arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx() {
  static const bool usable = [] {  // once: in a virtual machine every CPUID traps to the host
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return false;
    unsigned xcr0 = 0, xcr0_high = 0;
    __asm__("xgetbv" : "=a"(xcr0), "=d"(xcr0_high) : "c"(0));
    if ((xcr0 & (3u << 17)) != (3u << 17)) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return usable;
}

// AMX-BF16 (CPUID leaf 7 EDX bit 22) and AVX512-BF16 (leaf 7 subleaf 1 EAX bit 5, the fp32 ->
// bf16 conversions), beside what amx() checks.
bool amx_bf16() {
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22))) return false;
    if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !(eax & (1u << 5))) return false;
    return amx();
  }();
  return usable;
}

bool isa_supported(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "amx") return isa_supported("avx512vnni") && amx();  // small batches run the AVX512-VNNI kernel
  if (isa == "amx_bf16") return isa_supported("avx512vnni") && __builtin_cpu_supports("avx512vbmi") && amx_bf16();
  if (isa == "avx512vnni") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
  // The 256-bit kernels read fp16 scales with F16C (every AVX2 CPU has it; checked all the same).
  if (isa == "avxvnni") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni") && f16c();
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c();
  TORCH_CHECK(false, "unknown instruction set '", isa, "' (expected amx_bf16, amx, avx512vnni, avxvnni or avx2)");
}

// round(v / d) per lane, half to even (the IEEE division and rounding of the torch reference);
// 0 where d is 0 (a unit of zeros).
inline __m256 rounded_quotient(const __m256& v, float d, const __m256& vd) {
  return d > 0.0f ? _mm256_round_ps(_mm256_div_ps(v, vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                  : _mm256_setzero_ps();
}

// 8 rounded fp32 codes -> 8 int8 at `out`.
inline void store_codes(const __m256& q, int8_t* out) {
  const __m256i qi = _mm256_cvtps_epi32(q);
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w16, w16));
}

// One row of x (K values) -> int8 codes with a scale per unit of `unit` values (absmax / 127,
// round half to even), unit u's codes at codes + u * stride, and, where wanted, the exact group
// sums; with `residual`, x - scale * codes per value (the second term's input). AVX2, 8 values
// at a time (a unit is 16 or 32 values): the same IEEE division, rounding and products as the
// scalar form and the torch reference, so the codes are theirs bit for bit; scalar, this loop
// cost about a tenth of a 16-row decode step.
void quantize_row(const float* x, int64_t k, int64_t unit, int64_t stride, int64_t group, int8_t* codes, float* scale,
                  float* group_sums, float* residual) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t u = 0; u < k / unit; ++u) {
    const float* xu = x + u * unit;
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < unit; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xu + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float d = _mm_cvtss_f32(h) / 127.0f;
    scale[u] = d;
    const __m256 vd = _mm256_set1_ps(d);
    for (int64_t i = 0; i < unit; i += 8) {
      const __m256 xv = _mm256_loadu_ps(xu + i);
      const __m256 q = rounded_quotient(xv, d, vd);
      store_codes(q, codes + u * stride + i);
      if (residual != nullptr) _mm256_storeu_ps(residual + u * unit + i, _mm256_sub_ps(xv, _mm256_mul_ps(vd, q)));
    }
  }
  if (group_sums == nullptr) return;
  // Eight running sums over the group's vectors, then across them, instead of one chain of
  // dependent scalar adds per group.
  for (int64_t g = 0; g < k / group; ++g) {
    __m256 total = _mm256_loadu_ps(x + g * group);
    for (int64_t i = 8; i < group; i += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(x + g * group + i));
    group_sums[g] = edgeinfer_cpu::hsum(total);
  }
}

// The second term of a row quantized by quantize_row: each unit's residual (from `residual`) on a
// grid of d / 16, d = scale[u] (x's own scale), its codes at codes + u * stride, clamped to -8..8
// (|residual| <= d / 2 but for rounding in the residual's own subtraction); scale[u] becomes d / 16.
void quantize_residual(const float* residual, int64_t k, int64_t unit, int64_t stride, int8_t* codes, float* scale) {
  const __m256 low = _mm256_set1_ps(-8.0f), high = _mm256_set1_ps(8.0f);
  for (int64_t u = 0; u < k / unit; ++u) {
    const float d = scale[u] / 16.0f;
    scale[u] = d;
    const __m256 vd = _mm256_set1_ps(d);
    for (int64_t i = 0; i < unit; i += 8) {
      const __m256 q = rounded_quotient(_mm256_loadu_ps(residual + u * unit + i), d, vd);
      store_codes(_mm256_min_ps(_mm256_max_ps(q, low), high), codes + u * stride + i);
    }
  }
}

// rows rounded up to whole 16-row AMX blocks.
int64_t amx_rows(int64_t rows) { return (rows + kA8AmxBlock - 1) / kA8AmxBlock * kA8AmxBlock; }

// Tiles of 16 columns over the threads, claimed in shrinking chunks down to about 32 x 576
// products per column (rows x K): ~1.5 us of AMX work, a tile at 16 two-term rows of the
// default model; a single row's tiles take ~0.4 us, and claimed one at a time their claims
// cost more than the wait they save. The AMX kernels get the worker's own scratch
// (`scratch_bytes`, kept between calls, aligned to 64).
template <typename Kernel>
void over_tiles(int64_t tiles, int64_t rows, int64_t k, size_t scratch_bytes, const Kernel& kernel) {
  const int64_t min_chunk = (32 * 576 + rows * k - 1) / (rows * k);
  edgeinfer_cpu::balanced_for(0, tiles, min_chunk, [&](int64_t t0, int64_t t1) {
    if (scratch_bytes == 0) return kernel(t0, t1, static_cast<uint8_t*>(nullptr));
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(std::max(scratch.size(), scratch_bytes + 64));
    const auto at = reinterpret_cast<uintptr_t>(scratch.data());
    kernel(t0, t1, reinterpret_cast<uint8_t*>((at + 63) & ~uintptr_t(63)));
  });
}

// a8_gemm_rows for isa "amx_bf16": x rounded to bf16 into the calling thread's buffer (rows padded
// to 16 with zeros), then the column tiles over the threads as for the int8 kernels.
void bf16_rows(const float* x, int64_t m, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
               int64_t n, int64_t k, int64_t group, bool int4, float* y) {
  const int64_t padded = amx_rows(m);
  thread_local std::vector<uint16_t> xb_buffer;
  xb_buffer.resize(std::max<size_t>(xb_buffer.size(), padded * k));
  uint16_t* xb = xb_buffer.data();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) { a8_rows_to_bf16(x + r0 * k, (r1 - r0) * k, xb + r0 * k); });
  std::fill(xb + m * k, xb + padded * k, uint16_t{0});
  const A8Problem p{static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(),
                    mins.defined() ? mins.data_ptr() : nullptr, nullptr, reinterpret_cast<const uint8_t*>(xb),
                    nullptr, nullptr, y, m, n, k, group, 1, int4, scales.scalar_type() == at::kHalf,
                    scales.scalar_type() == at::kByte};
  // The scratch holds a tile dequantized: K x 16 bf16 (that, not the rows, is most of a small
  // batch's work: the chunks are sized as for 16 rows at least).
  over_tiles((n + kA8Cols - 1) / kA8Cols, padded, k, k * 2 * kA8Cols,
             [&](int64_t t0, int64_t t1, uint8_t* scratch) { a8_columns_amx_bf16(p, t0, t1, scratch); });
}

// The calling thread's buffers for `rows` rows of quantized x, kept from call to call. Allocated
// per call, with the two terms' outputs kept apart and summed after, a 256-token chunk of a 1.7B
// model's gate/up took ~35 MB, zeroed and page-faulted every call.
struct XBuffers {
  int8_t* codes;
  float* scale;
  float* gsum;  // null without mins
};
XBuffers thread_buffers(int64_t rows, int64_t terms, int64_t k, int64_t units, int64_t groups, bool has_mins) {
  thread_local std::vector<int8_t> xq_buffer;
  thread_local std::vector<float> scale_buffer, gsum_buffer;
  xq_buffer.resize(std::max<size_t>(xq_buffer.size(), rows * terms * k));
  scale_buffer.resize(std::max<size_t>(scale_buffer.size(), rows * units));
  gsum_buffer.resize(std::max<size_t>(gsum_buffer.size(), has_mins ? rows * groups : 0));
  return {xq_buffer.data(), scale_buffer.data(), has_mins ? gsum_buffer.data() : nullptr};
}

// Rows [r0, r1) of x (K values each) quantized into `b`: per unit of `unit` values its codes (and
// with two terms its rounding residual's), the unit scales and, where b.gsum, the group sums;
// `offset_x`: the codes as uint8 x + 128 (the VNNI int8 kernels).
void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t k, int64_t unit, int64_t group, int64_t terms,
                   bool offset_x, const XBuffers& b) {
  const int64_t units = k / unit, groups = k / group;
  std::vector<float> residual(terms == 2 ? k : 0);  // one row's, consumed at once by its second term
  for (int64_t r = r0; r < r1; ++r) {
    int8_t* row = b.codes + r * terms * k;
    const int64_t stride = terms * unit;  // two terms: a unit's codes, then its residual's
    quantize_row(x + r * k, k, unit, stride, group, row, b.scale + r * units, b.gsum ? b.gsum + r * groups : nullptr,
                 terms == 2 ? residual.data() : nullptr);
    if (terms == 2) quantize_residual(residual.data(), k, unit, stride, row + unit, b.scale + r * units);
    if (offset_x) {
      for (int64_t i = 0; i < terms * k; ++i) row[i] = static_cast<int8_t>(row[i] ^ 0x80);  // + 128
    }
  }
}

// The kernels' problem: the prepared weight (mins and wsum undefined where unused) and x quantized
// into `b`, for y (m, n).
A8Problem problem(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& wsum,
                  const XBuffers& b, float* y, int64_t m, int64_t n, int64_t k, int64_t group, int64_t terms) {
  return {static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(),
          mins.defined() ? mins.data_ptr() : nullptr, wsum.defined() ? wsum.data_ptr<int16_t>() : nullptr,
          reinterpret_cast<const uint8_t*>(b.codes), b.scale, b.gsum, y, m, n, k, group, terms,
          codes.scalar_type() == at::kByte, scales.scalar_type() == at::kHalf, scales.scalar_type() == at::kByte};
}

// The VNNI kernels read int8 x as uint8 x + 128 (and start from -128 x the weight's code sums).
bool reads_offset_x(bool int4, const std::string& kernel_isa) {
  return !int4 && (kernel_isa == "avx512vnni" || kernel_isa == "avxvnni");
}

// The kernel that runs `isa`'s GEMM of m rows: fewer rows than kA8AmxMinRows leave much of a 16-row
// tile idle, and the weight read, not the arithmetic, bounds them: the AVX512-VNNI kernel runs
// those.
std::string run_isa(const std::string& isa, int64_t m, int64_t terms) {
  return isa == "amx" && m < kA8AmxMinRows[terms - 1] ? "avx512vnni" : isa;
}

Kernel column_kernel(const std::string& isa) {
  return isa == "avx512vnni" ? edgeinfer_cpu::a8_columns_avx512vnni
         : isa == "avxvnni"  ? edgeinfer_cpu::a8_columns_avxvnni
                               : edgeinfer_cpu::a8_columns_avx2;
}

// The op: checks, then a8_gemm_rows.
at::Tensor a8_gemm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& mins_in, const c10::optional<at::Tensor>& wsum_in, int64_t n,
                   int64_t k, int64_t group, bool int4, const std::string& isa, int64_t terms) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "x must be (M, ", k, "), got ", x_in.sizes());
  const at::Tensor mins = mins_in.has_value() ? *mins_in : at::Tensor();
  const at::Tensor wsum = wsum_in.has_value() ? *wsum_in : at::Tensor();
  TORCH_CHECK(edgeinfer_cpu::a8_group(codes, scales, n, k, "w") == group && (codes.scalar_type() == at::kByte) == int4,
              "the weight's tiles do not match group ", group, int4 ? " int4" : " int8");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  edgeinfer_cpu::a8_gemm_rows(x.data_ptr<float>(), x.size(0), codes, scales, mins, wsum, n, k, isa, y.data_ptr<float>(),
                              terms);
  return y;
}

bool a8_isa_supported(const std::string& isa) { return isa_supported(isa); }

std::string a8_run_isa(const std::string& isa, int64_t rows, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "terms must be 1 or 2, got ", terms);
  return run_isa(isa, rows, terms);
}

}  // namespace

int64_t edgeinfer_cpu::a8_group(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t k,
                                const char* name) {
  const bool int4 = codes.scalar_type() == at::kByte;
  const int64_t tiles = (n + kA8Cols - 1) / kA8Cols;
  TORCH_CHECK((int4 || codes.scalar_type() == at::kChar) && codes.is_contiguous() && k % 32 == 0 &&
                  codes.numel() == tiles * kA8Cols * (int4 ? k / 2 : k),
              name, " must be prepared int4 (uint8) or int8 tiles of N=", n, " K=", k, " (K a multiple of 32)");
  if (scales.scalar_type() == at::kByte) {  // two-level: int4 in groups of 32
    TORCH_CHECK(int4 && k % kA8SuperBlock == 0 && scales.is_contiguous() &&
                    scales.numel() == tiles * (k / kA8SuperBlock) * kA8SuperBytes,
                name, " two-level scales need int4 tiles, K a multiple of ", kA8SuperBlock, " and (tiles, K / ",
                kA8SuperBlock, ", ", kA8SuperBytes, ") bytes");
    return 32;
  }
  const int64_t groups = scales.numel() / (tiles * kA8Cols);
  const int64_t group = groups > 0 ? k / groups : 0;
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  group > 0 && groups * group == k && scales.numel() == tiles * groups * kA8Cols &&
                  (int4 ? group % 32 == 0 : group % 16 == 0),
              name, " scales must be fp16 or fp32 (tiles, K / group, 16), group a multiple of 32 (int4) or 16 (int8), "
              "or two-level uint8");
  return group;
}

int64_t edgeinfer_cpu::a8_check(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                                const at::Tensor& wsum, int64_t m, int64_t n, int64_t k, const std::string& isa,
                                int64_t terms, const char* name) {
  TORCH_CHECK(isa_supported(isa), "this CPU cannot run the ", isa, " kernel");
  TORCH_CHECK(terms == 1 || terms == 2, "terms must be 1 or 2, got ", terms);
  const int64_t group = a8_group(codes, scales, n, k, name);
  const bool int4 = codes.scalar_type() == at::kByte;
  const bool has_mins = mins.defined() && mins.numel() > 0;
  TORCH_CHECK(!int4 || has_mins, "int4 weights need mins");
  TORCH_CHECK(!has_mins || (mins.scalar_type() == scales.scalar_type() && mins.is_contiguous() &&
                             mins.numel() == scales.numel()),
              "mins must be shaped like the scales, in their dtype");
  if (isa == "amx_bf16") {
    TORCH_CHECK(terms == 1, "bf16 activations are one term, got ", terms);
    return group;
  }
  const int64_t tiles = (n + kA8Cols - 1) / kA8Cols;
  TORCH_CHECK(!reads_offset_x(int4, run_isa(isa, m, terms)) ||
                  (wsum.defined() && wsum.scalar_type() == at::kShort && wsum.is_contiguous() &&
                   wsum.numel() == tiles * (k / std::min(group, kA8Unit)) * kA8Cols),
              "int8 weights need wsum, int16 (tiles, K / min(group, 32), 16)");
  return group;
}

void edgeinfer_cpu::a8_gemm_rows(const float* x, int64_t m, const at::Tensor& codes, const at::Tensor& scales,
                                 const at::Tensor& mins, const at::Tensor& wsum, int64_t n, int64_t k,
                                 const std::string& isa, float* y, int64_t terms) {
  const int64_t group = a8_check(codes, scales, mins, wsum, m, n, k, isa, terms, "w");
  const bool int4 = codes.scalar_type() == at::kByte;
  const bool has_mins = mins.defined() && mins.numel() > 0;
  if (isa == "amx_bf16") {
    if (m > 0 && n > 0) bf16_rows(x, m, codes, scales, has_mins ? mins : at::Tensor(), n, k, group, int4, y);
    return;
  }
  const int64_t rows = m * terms;  // the kernels' rows of codes: with two terms each row's work is doubled
  const std::string run = run_isa(isa, m, terms);
  const bool on_amx = run == "amx";
  const bool offset_x = reads_offset_x(int4, run);
  const int64_t unit = std::min(group, kA8Unit);
  const int64_t units = k / unit;
  const int64_t tiles = (n + kA8Cols - 1) / kA8Cols;
  if (m == 0 || n == 0) return;
  const int64_t groups = k / group;
  // The AMX kernel reads whole 16-row blocks: the padding rows' codes and scales are left as the
  // buffers hold them (their products are never stored).
  const int64_t padded = on_amx ? amx_rows(m) : m;
  // Plain pointers: inside the parallel region a thread_local's name would be the worker's own.
  const XBuffers b = thread_buffers(padded, terms, k, units, groups, has_mins);
  // Rows over the threads from 8 rows up: serial, a 16-stream decode step's quantization took
  // ~7% of the compute thread's time while the other thread waited.
  at::parallel_for(0, m, 4, [&](int64_t r0, int64_t r1) {
    quantize_rows(x, r0, r1, k, unit, group, terms, offset_x, b);
  });
  const A8Problem p = problem(codes, scales, has_mins ? mins : at::Tensor(), offset_x ? wsum : at::Tensor(), b, y, m,
                              n, k, group, terms);
  if (on_amx) {  // the scratch holds an int4 tile unpacked: K x 16 bytes per term
    over_tiles(tiles, rows, k, terms * k * kA8Cols,
               [&](int64_t t0, int64_t t1, uint8_t* scratch) { a8_columns_amx(p, t0, t1, scratch); });
    return;
  }
  const Kernel kernel = column_kernel(run);
  over_tiles(tiles, rows, k, 0, [&](int64_t t0, int64_t t1, uint8_t*) { kernel(p, t0, t1); });
}

void edgeinfer_cpu::a8_gemm_team(const float* x, int64_t m, const at::Tensor& codes, const at::Tensor& scales,
                                 const at::Tensor& mins, const at::Tensor& wsum, int64_t n, int64_t k, int64_t group,
                                 const std::string& isa, float* y, int64_t terms, const Team& team) {
  // A team's few rows are below kA8AmxMinRows: "amx" runs its AVX512-VNNI kernel.
  const std::string run = run_isa(isa, m, terms);
  const bool int4 = codes.scalar_type() == at::kByte;
  const bool has_mins = mins.defined() && mins.numel() > 0;
  const bool offset_x = reads_offset_x(int4, run);
  const int64_t unit = std::min(group, kA8Unit);
  const XBuffers b = thread_buffers(m, terms, k, k / unit, k / group, has_mins);  // this thread's own
  quantize_rows(x, 0, m, k, unit, group, terms, offset_x, b);
  const A8Problem p = problem(codes, scales, has_mins ? mins : at::Tensor(), offset_x ? wsum : at::Tensor(), b, y, m,
                              n, k, group, terms);
  const auto [t0, t1] = team.share((n + kA8Cols - 1) / kA8Cols);
  if (t1 > t0) column_kernel(run)(p, t0, t1);
  team.sync();
}

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("a8_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? wsum, int n, int k, int group_size, "
        "bool int4, str isa, int terms=1) -> Tensor");
  m.def("a8_isa_supported(str isa) -> bool", &a8_isa_supported);  // no tensors: one kernel for all keys
  m.def("a8_run_isa(str isa, int rows, int terms) -> str", &a8_run_isa);
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("a8_gemm", &a8_gemm); }
