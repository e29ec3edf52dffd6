// The weight rows of a matrix-vector product shared out over XLA's intra-op threads.
//
// Chunks of rows are handed out by an atomic counter: whoever is free takes the next one, so
// the result never waits on a helper that has not started. A chunk is a share of the rows
// left (1 / threads), down to kMinChunkBytes of weights, so the threads finish together:
// chunks of a fixed quarter of each thread's rows left one core idle at the end of every
// product while the other finished its chunk. PYHLO_MATVEC_THREADS (read once) caps the
// threads a product takes, for measurements.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

constexpr int64_t kMinChunkBytes = 64 << 10;   // the smallest chunk of weights a thread takes

template <class Rows>
struct RowChunks {
  Rows rows;                      // rows(begin, end) computes those weight rows
  int64_t n = 0, parts = 1, align = 1, min_rows = 1;
  std::atomic<int64_t> next{0};   // the first row not yet handed out
  std::atomic<int64_t> done{0};   // rows finished

  RowChunks(Rows r, int64_t n_rows) : rows(std::move(r)), n(n_rows) {}

  bool claim(int64_t* begin, int64_t* end) {
    int64_t start = next.load(std::memory_order_relaxed), size;
    do {
      const int64_t left = n - start;
      if (left <= 0) return false;
      size = std::min(left, std::max(min_rows, (left / parts + align - 1) / align * align));
    } while (!next.compare_exchange_weak(start, start + size, std::memory_order_relaxed));
    *begin = start;
    *end = start + size;
    return true;
  }

  void drain() {
    int64_t begin, end;
    while (claim(&begin, &end)) {
      rows(begin, end);
      done.fetch_add(end - begin, std::memory_order_release);
    }
  }
};

// rows(begin, end) over rows 0 .. n - 1 of row_bytes each, in chunks of a multiple of
// `align` rows, on the calling thread and as many of the pool's as the chunks keep busy.
template <class Rows>
xla::ffi::Error run_row_chunks(xla::ffi::ThreadPool& pool, int64_t n, int64_t row_bytes, int64_t align,
                               Rows rows) {
  static const int64_t cap = getenv("PYHLO_MATVEC_THREADS") ? atoi(getenv("PYHLO_MATVEC_THREADS")) : 0;
  int64_t threads = pool.num_threads() > 1 ? pool.num_threads() : 1;
  if (cap != 0) threads = cap > 0 ? cap : 1;
  auto work = std::make_shared<RowChunks<Rows>>(std::move(rows), n);
  work->parts = threads;
  work->align = align;
  const int64_t min_rows = (kMinChunkBytes / std::max<int64_t>(1, row_bytes) + align - 1) / align;
  work->min_rows = std::max<int64_t>(1, min_rows) * align;
  const int64_t helpers = std::min(threads - 1, (n - 1) / work->min_rows);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < n) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
  return xla::ffi::Error::Success();
}

}  // namespace pyhlo_kernels
