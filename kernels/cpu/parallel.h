// Work split over the compute threads by chunks that each thread claims as it finishes the last.
//
// at::parallel_for gives each thread one contiguous share, decided up front: on a machine whose
// cores are shared (a desktop beside other programs, a virtual machine whose host steals time)
// one core falls behind and every other thread waits for it at the end of the loop; a 16-stream
// decode step spent ~20% of its samples in OpenMP's wait. Claimed chunks let the faster thread
// take the slower one's remaining work. Measured (default model, tools/bench_engine_step.py, a
// busy loop on one of the 2 cores): the forward 126-133 ms against 150-152 at 16 streams, 15-17
// against 19-20 at one; on a quiet machine no difference beyond the spread.
//
// Chunks shrink as the work runs out (OpenMP's "guided" schedule): each claim takes the rest
// divided by twice the thread count, down to `min_chunk`. Fixed chunks of a quarter of a thread's
// share left a thread waiting, at every loop's end, for the other's last chunk: in a 16-stream
// decode step the second thread spun ~30% of the time, mostly while the first finished a GEMM.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace edgeinfer_cpu {

// f(i0, i1) over [begin, end) in chunks of at least `min_chunk` (the last may be shorter), each
// claimed by whichever thread of one parallel region is free.
template <typename F>
void balanced_for(int64_t begin, int64_t end, int64_t min_chunk, const F& f) {
  if (end <= begin) return;
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int64_t threads = at::get_num_threads();
  const int64_t most = (end - begin + min_chunk - 1) / min_chunk;  // chunks at the smallest size
  std::atomic<int64_t> next{begin};
  at::parallel_for(0, std::min(threads, most), 1, [&](int64_t, int64_t) {
    int64_t start = next.load(std::memory_order_relaxed);
    while (start < end) {
      const int64_t stop = std::min(end, start + std::max(min_chunk, (end - start) / (2 * threads)));
      // On failure `start` becomes the other thread's claim's end: try again from there.
      if (next.compare_exchange_weak(start, stop, std::memory_order_relaxed)) {
        f(start, stop);
        start = next.load(std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace edgeinfer_cpu
