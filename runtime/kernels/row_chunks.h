// The weight rows of a matrix-vector product shared out over XLA's intra-op threads.
//
// Chunks of rows are handed out by an atomic counter: whoever is free takes the next one, so
// the result never waits on a helper that has not started. A chunk is a share of the rows
// left (1 / threads), down to kMinChunkBytes of weights, so the threads finish together:
// chunks of a fixed quarter of each thread's rows left one core idle at the end of every
// product while the other finished its chunk. PYHLO_MATVEC_THREADS (read once) caps the
// threads a product takes, for measurements. A helper that has finished stays a moment for
// the next product (Board and linger below) instead of going back to sleep.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <chrono>
#include <memory>
#include <mutex>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

constexpr int64_t kMinChunkBytes = 64 << 10;   // the smallest chunk of weights a thread takes

// A product's rows as a helper sees them: whatever the row function, a helper claims chunks
// and computes them until none are left.
struct ChunkJob {
  virtual ~ChunkJob() = default;
  virtual void drain() = 0;
};

template <class Rows>
struct RowChunks : ChunkJob {
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

  void drain() override {
    int64_t begin, end;
    while (claim(&begin, &end)) {
      rows(begin, end);
      done.fetch_add(end - begin, std::memory_order_release);
    }
  }
};

// The product being computed, where helpers that linger between products find it.
//
// Waking a pool thread that went to sleep costs far more than the gap between two products:
// on a 2-core VM, instrumented through 1.7 B bf16 decode steps, 14 % of helpers started over a
// millisecond after their product was posted (half within 10 us), and a third arrived after
// the caller had claimed every row. A helper that has finished its chunks therefore keeps
// asking for the next product for linger_us() before it goes back to the pool (llama.cpp's
// threads poll the same way between a graph's nodes). Measured there, alternating in one
// process: SmolLM2-135M decode steps 11.9 -> 9.6 ms (Q4_1 exact), 12.2 -> 10.7 (bf16),
// 21.5 -> 20.0 (f32); 1.7 B bf16 and Q4_0 with int8 activations within noise (+-4 %);
// prefill unchanged. Lingering changes who computes which rows, never the result: the caller
// claims rows itself until none are left.
class Board {
 public:
  static Board& get() {
    static Board board;
    return board;
  }
  void post(std::shared_ptr<ChunkJob> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
    }
    seq_.fetch_add(1);
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    job_.reset();
  }
  std::shared_ptr<ChunkJob> take() {
    std::lock_guard<std::mutex> lock(mu_);
    return job_;
  }
  uint64_t seq() const { return seq_.load(); }
  std::atomic<int64_t> lingering{0};

 private:
  std::mutex mu_;
  std::shared_ptr<ChunkJob> job_;
  std::atomic<uint64_t> seq_{0};
};

// How long a helper waits for the next product, in microseconds (PYHLO_LINGER_US, read
// once, for measurements; 0 sends helpers straight back to the pool).
inline int64_t linger_us() {
  static const int64_t us = getenv("PYHLO_LINGER_US") ? atoi(getenv("PYHLO_LINGER_US")) : 1000;
  return us;
}

// After its chunks, a helper watches the board for linger_us() (from the last product it
// saw), at most `max_lingering` helpers at a time.
inline void linger(int64_t max_lingering) {
  Board& board = Board::get();
  if (linger_us() <= 0) return;
  if (board.lingering.fetch_add(1) >= max_lingering) {
    board.lingering.fetch_sub(1);
    return;
  }
  using clock = std::chrono::steady_clock;
  const auto budget = std::chrono::microseconds(linger_us());
  uint64_t seen = board.seq();
  auto deadline = clock::now() + budget;
  for (int spin = 0;; ++spin) {
    const uint64_t now_seq = board.seq();
    if (now_seq != seen) {
      seen = now_seq;
      if (auto job = board.take()) job->drain();
      deadline = clock::now() + budget;
      continue;
    }
    if ((spin & 63) == 0 && clock::now() > deadline) {
      board.lingering.fetch_sub(1);
      // A caller that counted this helper before it left scheduled none: take its product.
      if (board.seq() != seen)
        if (auto job = board.take()) job->drain();
      return;
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
}

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
  Board& board = Board::get();
  if (helpers > 0) board.post(work);
  for (int64_t i = board.lingering.load(); i < helpers; ++i)
    pool.Schedule([work, threads] {
      work->drain();
      linger(threads - 1);
    });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < n) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
  if (helpers > 0) board.clear();
  return xla::ffi::Error::Success();
}

}  // namespace pyhlo_kernels
