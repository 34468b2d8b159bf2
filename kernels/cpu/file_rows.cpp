// Rows of a GGUF matrix read from its file as fp32: op torch.ops.edgeinfer_cpu.read_rows.
//
// quant.gguf_import.FileRows keeps a GGUF's embedding in its file and reads the rows a step
// needs (its tokens, the head's refined candidates: ~65 per decoded token). Nothing is mapped,
// so only the rows read occupy memory (a mapping's page faults bring in 64 KB around each row
// and the table creeps back to fully resident). One pread per row, ~1-2 us from the page cache
// on this VM, and the row decoded here: the Python path (quant.gguf_reader.read_rows_reference,
// then quant.gguf_import.convert_tensor and the QuantizedTensor's dequantize, the reference)
// spends ~80 us per call converting. Values equal the reference's bit for bit: the same fp32
// operations in the same order, never contracted into FMAs; K-quant scale products are rounded
// to fp16 as quant.gguf_blocks stores them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>
#include <unistd.h>

namespace {

// GGML type ids.
enum GgmlType : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kBF16 = 30
};

int64_t row_bytes_of(int64_t type, int64_t k) {
  const bool super = type == kQ4_K || type == kQ5_K || type == kQ6_K;  // 256-value super-blocks
  TORCH_CHECK(!super || k % 256 == 0, "a K-quant row needs k a multiple of 256, got ", k);
  switch (type) {
    case kF32: return 4 * k;
    case kF16: case kBF16: return 2 * k;
    case kQ4_0: return k / 32 * 18;
    case kQ4_1: return k / 32 * 20;
    case kQ5_0: return k / 32 * 22;
    case kQ5_1: return k / 32 * 24;
    case kQ8_0: return k / 32 * 34;
    case kQ4_K: return k / 256 * 144;
    case kQ5_K: return k / 256 * 176;
    case kQ6_K: return k / 256 * 210;
    default: TORCH_CHECK(false, "GGUF type ", type, " has no row reader");
  }
}

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// A K-quant scale product as the importer stores it: exact in fp32, then rounded to fp16.
inline float as_half(float x) { return static_cast<float>(c10::Half(x)); }

// Sub-block j's 6-bit scale and min of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One Q5_x / K-quant block's codes times scale plus min, as QuantizedTensor.dequantize does.
__attribute__((optimize("fp-contract=off")))
void decode_quant_row(int64_t type, const uint8_t* src, int64_t k, float* dst) {
  if (type == kQ5_0 || type == kQ5_1) {
    const bool has_min = type == kQ5_1;
    for (int64_t b = 0; b < k / 32; ++b, src += has_min ? 24 : 22) {
      const float d = half_at(src);
      const uint8_t* qh = src + (has_min ? 4 : 2);
      const uint32_t high = qh[0] | (qh[1] << 8) | (qh[2] << 16) | (static_cast<uint32_t>(qh[3]) << 24);
      const uint8_t* qs = qh + 4;
      for (int j = 0; j < 32; ++j) {
        const int code = ((j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4) | (((high >> j) & 1) << 4)) - (has_min ? 0 : 16);
        dst[32 * b + j] = has_min ? static_cast<float>(code) * d + half_at(src + 2) : static_cast<float>(code) * d;
      }
    }
    return;
  }
  if (type == kQ4_K || type == kQ5_K) {
    const bool five = type == kQ5_K;
    for (int64_t b = 0; b < k / 256; ++b, src += five ? 176 : 144) {
      const float d = half_at(src), dmin = half_at(src + 2);
      const uint8_t* qh = src + 16;  // Q5_K: bit j of byte l is sub-block j's fifth bit of element l
      const uint8_t* qs = src + (five ? 48 : 16);  // bytes 32c..: sub-block 2c low nibbles, 2c + 1 high
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min_k4(j, src + 4, &sc, &m);
        const float scale = as_half(d * static_cast<float>(sc)), mn = as_half(-dmin * static_cast<float>(m));
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = qs[32 * (j / 2) + l];
          int code = j % 2 ? byte >> 4 : byte & 0x0F;
          if (five) code |= ((qh[l] >> j) & 1) << 4;
          dst[256 * b + 32 * j + l] = static_cast<float>(code) * scale + mn;
        }
      }
    }
    return;
  }
  TORCH_CHECK(type == kQ6_K, "GGUF type ", type, " has no row reader");
  for (int64_t b = 0; b < k / 256; ++b, src += 210) {
    const float d = half_at(src + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(src + 192);
    for (int e = 0; e < 256; ++e) {  // element 128h + 32c + l: ql[64h + l + 32 (c % 2)], nibble c / 2
      const int h = e / 128, c = e % 128 / 32, l = e % 32;
      const uint8_t low = src[64 * h + l + 32 * (c % 2)];
      const int code = ((c / 2 ? low >> 4 : low & 0x0F) | (((src[128 + 32 * h + l] >> (2 * c)) & 3) << 4)) - 32;
      dst[256 * b + e] = static_cast<float>(code) * as_half(d * static_cast<float>(sc[e / 16]));
    }
  }
}

__attribute__((optimize("fp-contract=off")))
void decode_row(int64_t type, const uint8_t* src, int64_t k, float* dst) {
  switch (type) {
    case kF32: std::memcpy(dst, src, 4 * k); return;
    case kF16: for (int64_t i = 0; i < k; ++i) dst[i] = half_at(src + 2 * i); return;
    case kBF16:
      for (int64_t i = 0; i < k; ++i) {
        c10::BFloat16 b;
        std::memcpy(&b, src + 2 * i, 2);
        dst[i] = static_cast<float>(b);
      }
      return;
    case kQ8_0:
      for (int64_t b = 0; b < k / 32; ++b, src += 34) {
        const float d = half_at(src);
        for (int j = 0; j < 32; ++j) dst[32 * b + j] = static_cast<float>(static_cast<int8_t>(src[2 + j])) * d;
      }
      return;
    case kQ4_0: case kQ4_1: {
      const int64_t block = type == kQ4_1 ? 20 : 18;
      for (int64_t b = 0; b < k / 32; ++b, src += block) {
        const float d = half_at(src);
        const float m = type == kQ4_1 ? half_at(src + 2) : -8.0f * d;  // the importer's fp32 min for Q4_0
        const uint8_t* q = src + block - 16;  // byte j: element j (low nibble), j + 16 (high)
        for (int j = 0; j < 16; ++j) {
          dst[32 * b + j] = static_cast<float>(q[j] & 0x0F) * d + m;
          dst[32 * b + 16 + j] = static_cast<float>(q[j] >> 4) * d + m;
        }
      }
      return;
    }
    default: decode_quant_row(type, src, k, dst);
  }
}

// fp32 (len(ids), k): rows ids[i] of the (num_rows, k) matrix of GGUF type `type` that starts at
// byte `offset` of the open file `fd`. With `cache` (C, row bytes) uint8 and `cache_ids` (C,)
// int64 (-1: empty), a direct-mapped cache of the file's bytes: row r lives in slot r % C, a row
// found there is decoded without its pread, and the rows read are stored there after the
// parallel part (so no thread reads a slot another writes). A step's refined head rows repeat
// from step to step (the same likely tokens), and a pread costs ~1.2-1.8 us on this VM.
at::Tensor read_rows(int64_t fd, int64_t offset, int64_t num_rows, int64_t k, int64_t type, const at::Tensor& ids_in,
                     const std::optional<at::Tensor>& cache, const std::optional<at::Tensor>& cache_ids) {
  TORCH_CHECK(ids_in.dim() == 1, "row ids must be one-dimensional, got ", ids_in.sizes());
  TORCH_CHECK(k > 0 && k % 32 == 0 && offset >= 0, "bad matrix layout: offset ", offset, ", k ", k);
  const int64_t row_bytes = row_bytes_of(type, k);  // also rejects types decode_row cannot read
  TORCH_CHECK(cache.has_value() == cache_ids.has_value(), "a row cache needs both its bytes and its ids");
  int64_t slots = 0;
  uint8_t* cached = nullptr;
  int64_t* cached_id = nullptr;
  if (cache.has_value()) {
    TORCH_CHECK(cache->dim() == 2 && cache->size(1) == row_bytes && cache->size(0) > 0 &&
                    cache->scalar_type() == at::kByte && cache->is_contiguous(),
                "the row cache must be (slots, ", row_bytes, ") contiguous uint8, got ", cache->sizes(), " ",
                cache->scalar_type());
    TORCH_CHECK(cache_ids->dim() == 1 && cache_ids->size(0) == cache->size(0) &&
                    cache_ids->scalar_type() == at::kLong && cache_ids->is_contiguous(),
                "the row cache's ids must be (", cache->size(0), ",) contiguous int64, got ", cache_ids->sizes(), " ",
                cache_ids->scalar_type());
    slots = cache->size(0);
    cached = cache->data_ptr<uint8_t>();
    cached_id = cache_ids->data_ptr<int64_t>();
  }
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < num_rows, "row id ", id[i], " is outside [0, ", num_rows, ")");
  }
  // With a cache the rows read wait in `staged` (row i at i x row bytes) until they are stored.
  std::unique_ptr<uint8_t[]> staged(cached != nullptr ? new uint8_t[n * row_bytes] : nullptr);
  std::vector<uint8_t> missed(cached != nullptr ? n : 0);
  // Rows split over threads from 32 (one sequence's 64 refined head rows: two halves): a pread
  // costs ~1.2 us a row here, ~1.8 after a decode step; 64 rows after a step took 108-136 us on
  // one thread, 66-109 on two (docs/BENCHMARKS.md, "A one-row step's host work").
  std::string error;
  std::mutex error_lock;
  at::parallel_for(0, n, 32, [&](int64_t i0, int64_t i1) {
    std::vector<uint8_t> own(cached != nullptr ? 0 : row_bytes);
    for (int64_t i = i0; i < i1; ++i) {
      if (cached != nullptr && cached_id[id[i] % slots] == id[i]) {
        decode_row(type, cached + id[i] % slots * row_bytes, k, out.data_ptr<float>() + i * k);
        continue;
      }
      uint8_t* raw = cached != nullptr ? staged.get() + i * row_bytes : own.data();
      int64_t done = 0;
      while (done < row_bytes) {  // pread may return fewer bytes (signals, some filesystems)
        const ssize_t got = pread(static_cast<int>(fd), raw + done, row_bytes - done, offset + id[i] * row_bytes + done);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {  // no exceptions inside the parallel region: report after it
          std::lock_guard<std::mutex> guard(error_lock);
          error = "reading row " + std::to_string(id[i]) + " at byte " + std::to_string(offset + id[i] * row_bytes + done) +
                  ": " + (got < 0 ? std::strerror(errno) : "the file ends there (changed while in use?)");
          return;
        }
        done += got;
      }
      decode_row(type, raw, k, out.data_ptr<float>() + i * k);
      if (cached != nullptr) missed[i] = 1;
    }
  });
  TORCH_CHECK(error.empty(), error);
  for (int64_t i = 0; i < static_cast<int64_t>(missed.size()); ++i) {
    if (!missed[i]) continue;
    const int64_t slot = id[i] % slots;
    std::memcpy(cached + slot * row_bytes, staged.get() + i * row_bytes, row_bytes);
    cached_id[slot] = id[i];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def(
      "read_rows(int fd, int offset, int num_rows, int k, int ggml_type, Tensor ids, Tensor(a!)? cache=None, "
      "Tensor(b!)? cache_ids=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("read_rows", &read_rows); }
