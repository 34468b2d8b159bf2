// Work split over the compute threads: by chunks that each thread claims as it finishes the last
// (balanced_for, below), or, for a step of a few rows, by fixed shares of a team whose threads
// meet at spin barriers (Team, run_team, at the end).
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
#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

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

// The threads of one parallel region that run a whole fused step together (decode_layers' team
// for a few rows): each op takes its share by `tid` and the threads meet at `sync`, a spin
// barrier, instead of a fork and join per op. At one row an op is ~5-30 us, and libgomp's fork
// and join around it (two futex calls, and a worker that is sometimes late into the region)
// left the second thread idle through much of the small GEMMs (docs/BENCHMARKS.md, "Where a
// decode step's time goes"). Nothing run by a team may throw: a thread that left would leave
// the others waiting at the barrier.
class Team {
 public:
  Team(int64_t tid, int64_t n, std::atomic<int64_t>& arrived, std::atomic<int64_t>& phase, std::vector<float>& scratch)
      : tid(tid), n(n), scratch(scratch), arrived_(arrived), phase_(phase) {}

  // Every thread waits here until all n have arrived: spinning, then (a thread that long in
  // coming is off its core: more threads than cores, or another program on them) yielding the
  // core, so that it can come.
  void sync() const {
    const int64_t phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < kSpins) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

  // This thread's share [begin, end) of `count` items, in order.
  std::pair<int64_t, int64_t> share(int64_t count) const { return {count * tid / n, count * (tid + 1) / n}; }

  const int64_t tid, n;
  std::vector<float>& scratch;  // shared by the team; resized by thread 0 between syncs

 private:
  static constexpr int64_t kSpins = 1 << 16;  // of pause, ~1 ms or more: past a team step's ops
  std::atomic<int64_t>& arrived_;
  std::atomic<int64_t>& phase_;
};

// The cores this process may run on (its affinity mask; read once). A team of more threads than
// this spins at every barrier for a thread that is off its core: a one-row step took ~590 ms on 4
// threads over 2 cores against ~4.4 on 2.
inline int64_t available_cpus() {
  static const int64_t count = [] {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
#endif
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return count;
}

// f(team) on every thread of one OpenMP parallel region (at most at::get_num_threads() threads;
// the team is the threads the runtime gave it).
template <typename F>
void run_team(const F& f) {
  std::atomic<int64_t> arrived{0}, phase{0};
  std::vector<float> scratch;
#pragma omp parallel num_threads(at::get_num_threads())
  f(Team(omp_get_thread_num(), omp_get_num_threads(), arrived, phase, scratch));
}

}  // namespace edgeinfer_cpu
