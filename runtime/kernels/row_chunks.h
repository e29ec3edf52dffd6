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
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

constexpr int64_t kMinChunkBytes = 64 << 10;   // the smallest chunk of weights a thread takes

// Threads one product may take: the pool's and the caller's, or PYHLO_MATVEC_THREADS (read
// once) where set, for measurements.
inline int64_t product_threads(xla::ffi::ThreadPool& pool) {
  static const int64_t cap = getenv("PYHLO_MATVEC_THREADS") ? atoi(getenv("PYHLO_MATVEC_THREADS")) : 0;
  if (cap != 0) return cap > 0 ? cap : 1;
  return pool.num_threads() > 1 ? pool.num_threads() : 1;
}

// A product's rows as a helper sees them: whatever the row function, a helper claims chunks
// and computes them until none are left. `key` names the call (its weights: the same from
// step to step); `linger_after` says whether a helper should wait for another product after it.
struct ChunkJob {
  virtual ~ChunkJob() = default;
  virtual void drain() = 0;
  const void* key = nullptr;
  bool linger_after = true;
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
// the caller had claimed every row. A helper that has finished a product's chunks therefore
// keeps asking for the next product for linger_us() before it goes back to the pool
// (llama.cpp's threads poll the same way between a graph's nodes). Measured there,
// alternating in one process: SmolLM2-135M decode steps 11.9 -> 9.6 ms (Q4_1 exact),
// 12.2 -> 10.7 (bf16), 21.5 -> 20.0 (f32); 1.7 B bf16 and Q4_0 with int8 activations within
// noise (+-4 %); prefill unchanged.
//
// A lingering helper is a pool thread XLA cannot use: where XLA's own parallel work follows a
// kernel (its dot for the products of a type the kernel does not take, then the next layer's
// attention kernel), lingering starved it (SmolLM2-135M in f32 with XLA's dots: 33 ms a step
// in a run where the attention kernel's helpers lingered, 24 without lingering). So only a
// product's helper starts to linger, never the attention kernel's, and a call after which a
// helper waited in vain is marked: helpers go straight back to the pool after it for its next
// kSkipAfterMiss calls, then try again. Lingering changes who computes which rows, never the
// result: the caller claims rows itself until none are left.
class Board {
 public:
  static constexpr int kSkipAfterMiss = 64;

  static Board& get() {
    static Board board;
    return board;
  }
  // Posts the caller's job and decides whether a helper should linger after it.
  void post(std::shared_ptr<ChunkJob> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto miss = skip_.find(job->key);
      job->linger_after = miss == skip_.end() || miss->second <= 0;
      if (!job->linger_after) --miss->second;
      job_ = std::move(job);
    }
    seq_.fetch_add(1);
  }
  // The caller's job is done: drop it, unless another caller has posted since.
  void clear(const ChunkJob* job) {
    std::lock_guard<std::mutex> lock(mu_);
    if (job_.get() == job) job_.reset();
  }
  std::shared_ptr<ChunkJob> take() {
    std::lock_guard<std::mutex> lock(mu_);
    return job_;
  }
  // No product came within linger_us() of this call's end.
  void missed_after(const void* key) {
    std::lock_guard<std::mutex> lock(mu_);
    if (skip_.size() > 4096) skip_.clear();   // calls of programs long gone
    skip_[key] = kSkipAfterMiss;
  }
  uint64_t seq() const { return seq_.load(); }
  std::atomic<int64_t> lingering{0};

 private:
  std::mutex mu_;
  std::shared_ptr<ChunkJob> job_;
  std::unordered_map<const void*, int> skip_;
  std::atomic<uint64_t> seq_{0};
};

// How long a helper waits for the next product, in microseconds (PYHLO_LINGER_US, read
// once, for measurements; 0 sends helpers straight back to the pool).
inline int64_t linger_us() {
  static const int64_t us = getenv("PYHLO_LINGER_US") ? atoi(getenv("PYHLO_LINGER_US")) : 1000;
  return us;
}

// After `last`, a helper watches the board for linger_us() from the last job it saw, at most
// `max_lingering` helpers at a time; it leaves after a job that is not worth lingering after.
inline void linger(std::shared_ptr<ChunkJob> last, int64_t max_lingering) {
  Board& board = Board::get();
  if (linger_us() <= 0 || !last->linger_after) return;
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
      if (auto job = board.take()) {
        job->drain();
        last = std::move(job);
        if (!last->linger_after) break;
      }
      deadline = clock::now() + budget;
      continue;
    }
    if ((spin & 63) == 0 && clock::now() > deadline) {
      board.missed_after(last->key);
      break;
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
  board.lingering.fetch_sub(1);
  // A caller that counted this helper before it left scheduled none: take its product.
  if (board.seq() != seen)
    if (auto job = board.take()) job->drain();
}

// rows(begin, end) over rows 0 .. n - 1 of row_bytes each, in chunks of a multiple of
// `align` rows, on the calling thread and as many of the pool's as the chunks keep busy.
// `key` names the call from step to step (a product's weights); `product` says whether its
// helpers may start to linger (products may; attention, followed by XLA's work where the
// products are XLA's dots, may not).
template <class Rows>
xla::ffi::Error run_row_chunks(xla::ffi::ThreadPool& pool, int64_t n, int64_t row_bytes, int64_t align,
                               Rows rows, const void* key = nullptr, bool product = true) {
  const int64_t threads = product_threads(pool);
  auto work = std::make_shared<RowChunks<Rows>>(std::move(rows), n);
  work->parts = threads;
  work->align = align;
  const int64_t min_rows = (kMinChunkBytes / std::max<int64_t>(1, row_bytes) + align - 1) / align;
  work->min_rows = std::max<int64_t>(1, min_rows) * align;
  work->key = key;
  const int64_t helpers = std::min(threads - 1, (n - 1) / work->min_rows);
  Board& board = Board::get();
  if (helpers > 0) board.post(work);
  for (int64_t i = board.lingering.load(); i < helpers; ++i)
    pool.Schedule([work, threads, product] {
      work->drain();
      if (product) linger(work, threads - 1);
    });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < n) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
  if (helpers > 0) board.clear(work.get());
  return xla::ffi::Error::Success();
}

}  // namespace pyhlo_kernels
