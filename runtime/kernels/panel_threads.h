// The GEMM kernels' (gemm_blocks.cc, gemm_kquants.cc) split of a product into panels of weight
// rows, shared between the caller and XLA's intra-op thread pool: one place for the thread
// count and the hand-out.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

// Threads one product may take: the pool's and the caller's, or PYHLO_MATVEC_THREADS (read
// once) where set, as for the matvec kernels.
inline int64_t product_threads(xla::ffi::ThreadPool& pool) {
  static const int64_t cap = getenv("PYHLO_MATVEC_THREADS") ? atoi(getenv("PYHLO_MATVEC_THREADS")) : 0;
  const int64_t threads = pool.num_threads() > 1 ? pool.num_threads() : 1;
  if (cap != 0) return cap > 0 ? cap : 1;
  return threads;
}

// run(panel, scratch) for every panel in [0, panels), `scratch` made by make() once per
// thread that takes a panel. Panels are handed out by an atomic counter: whoever is free takes
// the next one, so the result never waits on a helper that has not started. Returns once all
// are done; a helper that starts later finds none left and touches nothing of the caller's.
template <typename Make, typename Run>
void share_panels(xla::ffi::ThreadPool& pool, int64_t panels, Make make, Run run) {
  struct Shared {
    Make make;
    Run run;
    int64_t panels;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    Shared(Make m, Run r, int64_t count) : make(std::move(m)), run(std::move(r)), panels(count) {}

    void drain() {
      int64_t c = next.fetch_add(1);
      if (c >= panels) return;
      auto scratch = make();
      int64_t finished = 0;
      for (; c < panels; c = next.fetch_add(1), ++finished) run(c, scratch);
      done.fetch_add(finished, std::memory_order_release);
    }
  };
  auto shared = std::make_shared<Shared>(std::move(make), std::move(run), panels);
  const int64_t helpers = std::min(product_threads(pool) - 1, panels - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  while (shared->done.load(std::memory_order_acquire) < panels) {
#if defined(__SSE2__)
    _mm_pause();
#endif
  }
}

}  // namespace pyhlo_kernels
