// Work split over the compute threads by chunks that each thread claims as it finishes the last.
//
// at::parallel_for gives each thread one contiguous share, decided up front: on a machine whose
// cores are shared (a desktop beside other programs, a virtual machine whose host steals time)
// one core falls behind and every other thread waits for it at the end of the loop; a 16-stream
// decode step spent ~20% of its samples in OpenMP's wait. Claimed chunks let the faster thread
// take the slower one's remaining work. Measured (default model, tools/bench_engine_step.py, a
// busy loop on one of the 2 cores): the forward 126-133 ms against 150-152 at 16 streams, 15-17
// against 19-20 at one; on a quiet machine no difference beyond the spread.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace edgeinfer_cpu {

// f(i0, i1) over [begin, end) in chunks of `chunk` (the last shorter), claimed one at a time by
// the threads of one parallel region.
template <typename F>
void balanced_for(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  if (end <= begin) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (end - begin + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      f(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
    }
  });
}

}  // namespace edgeinfer_cpu
