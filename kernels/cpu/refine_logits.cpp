// The head's exact refinement of its best logits: op torch.ops.edgeinfer_cpu.refine_logits.
//
// An int4 head's coarse logits are recomputed exactly for each row's best candidates
// (edgeinfer.models.llama.LlamaModel._head, HEAD_REFINE_ROWS of them): logits[l, ids[l, r]] =
// h[l] . rows[l * R + r]. Its reference is torch: einsum("lh,lrh->lr") then scatter_. Why by hand:
// after a decode step's layers those two took ~85 and ~15 us for one row of 64 x 576 on the test
// machine (the einsum woke the intra-op pool for 37K multiply-adds; 11 us when called alone); one
// thread here does it in a few microseconds. Sums are fp32 in 8 lanes, so they differ from torch's
// in the last bits.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "simd.h"

namespace {

void refine_logits(at::Tensor logits, const at::Tensor& h, const at::Tensor& ids, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be contiguous fp32 (L, V)");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous() && h.size(0) == num_rows,
              "h must be contiguous fp32 (L, hidden), a row per logits row");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.is_contiguous() && ids.size(0) == num_rows,
              "ids must be contiguous int64 (L, R)");
  const int64_t hidden = h.size(1), per_row = ids.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.is_contiguous() &&
                  rows.size(0) == num_rows * per_row && rows.size(1) == hidden,
              "rows must be contiguous fp32 (L * R, hidden), got ", rows.sizes());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows * per_row; ++i) {
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < vocab, "id ", id[i], " is outside [0, ", vocab, ")");
  }
  float* out = logits.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  for (int64_t l = 0; l < num_rows; ++l) {
    for (int64_t r = 0; r < per_row; ++r) {
      const int64_t i = l * per_row + r;
      out[l * vocab + id[i]] = edgeinfer_cpu::dot(hp + l * hidden, rp + i * hidden, hidden);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("refine_logits(Tensor(a!) logits, Tensor h, Tensor ids, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("refine_logits", &refine_logits);
}
