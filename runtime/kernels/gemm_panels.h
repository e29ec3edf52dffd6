// What the GEMM kernels (gemm_blocks.cc, gemm_kquants.cc) share: the split of a product into
// panels of weight rows between the caller and XLA's intra-op thread pool, and the transposes
// that pack weight rows side by side (16 for vpdpbusd, 8 for AVX2's vpmaddubsw).
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

#include "row_chunks.h"   // product_threads
#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

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

#if defined(__AVX2__)
// Eight rows of 8 32-bit values transposed in place: afterwards v[q] holds value q of every
// row (row r in lane r).
inline void transpose_8x8_epi32(__m256i v[8]) {
  __m256i pairs[8], quads[8];
  for (int i = 0; i < 4; ++i) {
    pairs[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);       // values 0 1 | 4 5 of rows 2i, 2i+1
    pairs[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);   // values 2 3 | 6 7
  }
  for (int half = 0; half < 2; ++half) {   // rows 0-3, then rows 4-7
    const __m256i* t = pairs + 4 * half;
    quads[4 * half + 0] = _mm256_unpacklo_epi64(t[0], t[2]);   // value 0 | 4 of four rows
    quads[4 * half + 1] = _mm256_unpackhi_epi64(t[0], t[2]);   // value 1 | 5
    quads[4 * half + 2] = _mm256_unpacklo_epi64(t[1], t[3]);   // value 2 | 6
    quads[4 * half + 3] = _mm256_unpackhi_epi64(t[1], t[3]);   // value 3 | 7
  }
  for (int q = 0; q < 4; ++q) {
    v[q] = _mm256_permute2x128_si256(quads[q], quads[4 + q], 0x20);
    v[q + 4] = _mm256_permute2x128_si256(quads[q], quads[4 + q], 0x31);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The 16 bytes at `at` of 16 rows as 4 vectors, vector q holding bytes 4q..4q+3 of every row
// (row r in lane r): four rows to a vector by 128-bit lanes, then a 4 x 4 transpose of 32-bit
// values within each lane. (Gathering them measured several times slower.)
inline void transpose_16x4(const char* const rows[16], int64_t at, __m512i out[4]) {
  __m512i a[4];
  for (int i = 0; i < 4; ++i) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + at)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 + i] + at)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[8 + i] + at)), 2);
    a[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[12 + i] + at)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// A tile's sums for weight rows n0 .. n0 + 31 (acc[h][r]: rows n0 + 16 h .. of activation row
// m0 + r) stored into y [M, n], the rows past n left out.
template <int R>
inline void store_tile(float* y, int64_t n, int64_t n0, int64_t m0, const __m512 acc[2][R]) {
  for (int h = 0; h < 2; ++h) {
    const int64_t first = n0 + h * 16;
    const int64_t real = std::clamp<int64_t>(n - first, 0, 16);
    if (real == 0) continue;
    const __mmask16 mask = real >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << real) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * n + first, mask, acc[h][r]);
  }
}
#endif

}  // namespace pyhlo_kernels
