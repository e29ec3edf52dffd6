// The exact GEMM over weights widened to f32 a panel at a time (gemm_blocks.cc's block forms and
// int8 rows, matvec_gguf.cc's forms kept as the file's bytes): y[m, n] = sum_k x[m, k] * w[n, k]
// for many rows of f32 activations (a prefill), where widen(n, k0, kc, out) writes values
// k0 .. k0 + kc - 1 of weight row n as f32.
//
// Widening a weight inside the program writes the whole f32 weight out and reads it back for
// XLA's dot. Here each thread widens a panel of 32 weight rows, kWidenedChunk values of k at a
// time, into a buffer that stays in its cache (value j of the 32 rows side by side: 128 KB),
// once for all activation rows, and multiplies it by tiles of 12 activation rows: per value of
// k, two vector loads of the panel and 12 broadcast activations meet in 24 multiply-adds, the
// 24 sums (32 weight rows by 12 activation rows) in registers across the chunk. Panels are
// split between the caller and XLA's intra-op thread pool (gemm_panels.h). AVX-512 where the
// CPU has it; AVX2 with FMA (16 registers of 8) takes the panel's 32 rows as two halves of 16
// rows by tiles of 6 activation rows, the 12 sums in registers; elsewhere a portable form on
// the same panels, correct but not fast (the lowering takes these kernels only where
// widened_gemm_is_fast()).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm_panels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PYHLO_WIDENED_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_WIDENED_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

constexpr int kWidenedLanes = 16;
constexpr int kWidenedPanelRows = 2 * kWidenedLanes;   // weight rows of a panel
#ifdef PYHLO_WIDENED_AVX2
constexpr int kWidenedTileRows = 6;                    // activation rows of a tile
#else
constexpr int kWidenedTileRows = 12;                   // activation rows of a tile
#endif
constexpr int64_t kWidenedChunk = 1024;                // values of k a panel holds at a time (a
                                                       // multiple of every form's block)

constexpr bool widened_gemm_is_fast() {
#if defined(PYHLO_WIDENED_AVX512) || defined(PYHLO_WIDENED_AVX2)
  return true;
#else
  return false;
#endif
}

struct WidenedProduct {
  int64_t m, n, k;
  const float* x;   // [M, K]
  float* y;         // [M, N]
};

// y[m0 .. m0 + R - 1][n0 .. n0 + 31] (those below N) plus (or, for the first chunk, set to) the
// sums of the panel's kc values, from k0.
template <int R>
void widened_tile(const WidenedProduct& p, const float* panel, int64_t n0, int64_t m0, int64_t k0, int64_t kc,
                  bool first) {
  const float* x = p.x + m0 * p.k + k0;
#ifdef PYHLO_WIDENED_AVX512
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h) {
    const int64_t real = std::clamp<int64_t>(p.n - (n0 + h * kWidenedLanes), 0, kWidenedLanes);
    const __mmask16 mask = real >= kWidenedLanes ? __mmask16(0xFFFF) : __mmask16((1u << real) - 1);
    for (int r = 0; r < R; ++r)
      acc[h][r] = first ? _mm512_setzero_ps()
                        : _mm512_maskz_loadu_ps(mask, p.y + (m0 + r) * p.n + n0 + h * kWidenedLanes);
  }
  for (int64_t j = 0; j < kc; ++j) {
    const __m512 w0 = _mm512_loadu_ps(panel + j * kWidenedPanelRows);
    const __m512 w1 = _mm512_loadu_ps(panel + j * kWidenedPanelRows + kWidenedLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * p.k + j]);
      acc[0][r] = _mm512_fmadd_ps(w0, xv, acc[0][r]);
      acc[1][r] = _mm512_fmadd_ps(w1, xv, acc[1][r]);
    }
  }
  store_tile<R>(p.y, p.n, n0, m0, acc);
#elif defined(PYHLO_WIDENED_AVX2)
  for (int h = 0; h < kWidenedPanelRows / 16; ++h) {   // 16 of the panel's rows at a time
    const int64_t row0 = n0 + 16 * h;
    if (row0 >= p.n) break;
    const int64_t real = std::min<int64_t>(p.n - row0, 16);
    // Every loop over the registers unrolled, or GCC keeps the sums in memory (measured 3x slower).
    __m256 acc[2][R];
    #pragma GCC unroll 16
    for (int v = 0; v < 2; ++v)
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[v][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kc; ++j) {
      const __m256 w0 = _mm256_loadu_ps(panel + j * kWidenedPanelRows + 16 * h);
      const __m256 w1 = _mm256_loadu_ps(panel + j * kWidenedPanelRows + 16 * h + 8);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * p.k + j);
        acc[0][r] = _mm256_fmadd_ps(w0, xv, acc[0][r]);
        acc[1][r] = _mm256_fmadd_ps(w1, xv, acc[1][r]);
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {   // the chunk's sums, added to the earlier chunks'
      float* out = p.y + (m0 + r) * p.n + row0;
      if (real == 16) {
        _mm256_storeu_ps(out, first ? acc[0][r] : _mm256_add_ps(acc[0][r], _mm256_loadu_ps(out)));
        _mm256_storeu_ps(out + 8, first ? acc[1][r] : _mm256_add_ps(acc[1][r], _mm256_loadu_ps(out + 8)));
        continue;
      }
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, acc[0][r]);
      _mm256_store_ps(lanes + 8, acc[1][r]);
      for (int64_t c = 0; c < real; ++c) out[c] = first ? lanes[c] : out[c] + lanes[c];
    }
  }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kWidenedPanelRows && n0 + c < p.n; ++c) {
      float sum = first ? 0.0f : p.y[(m0 + r) * p.n + n0 + c];
      for (int64_t j = 0; j < kc; ++j) sum += panel[j * kWidenedPanelRows + c] * x[r * p.k + j];
      p.y[(m0 + r) * p.n + n0 + c] = sum;
    }
#endif
}

template <int R>
void widened_tail(const WidenedProduct& p, const float* panel, int64_t n0, int64_t m0, int64_t k0, int64_t kc,
                  bool first, int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return widened_tile<R>(p, panel, n0, m0, k0, kc, first);
    widened_tail<R - 1>(p, panel, n0, m0, k0, kc, first, rows);
  }
}

// A thread's buffers: the panel [chunk][32] and 16 widened rows' chunks [16][chunk].
struct WidenedPanel {
  std::vector<float> values, rows;
  explicit WidenedPanel(int64_t k)
      : values(std::min(kWidenedChunk, k) * kWidenedPanelRows), rows(std::min(kWidenedChunk, k) * kWidenedLanes) {}
};

#ifdef PYHLO_WIDENED_AVX512
// r[i] (16 values of row i) becomes r[j] (value j of the 16 rows): pairs of rows, then fours by
// 64-bit halves, then 128-bit lanes.
inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  const auto low = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto high = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int g = 0; g < 4; ++g) {   // r[4g + c], lane l: rows 4g .. 4g + 3 at value c + 4l
    r[4 * g] = low(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = high(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = low(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = high(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[4 * c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 * c + 1] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    t[4 * c + 2] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[4 * c + 3] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[4 * c], t[4 * c + 2], 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(t[4 * c], t[4 * c + 2], 0xdd);
    r[c + 4] = _mm512_shuffle_f32x4(t[4 * c + 1], t[4 * c + 3], 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(t[4 * c + 1], t[4 * c + 3], 0xdd);
  }
}
#endif

// Values k0 .. k0 + kc - 1 of weight rows n0 .. n0 + 31 widened into the panel [kc][32], rows
// past N zeros: 16 rows widened side by side, then turned in registers 16 values at a time.
template <typename Widen>
void widen_panel(const WidenedProduct& p, const Widen& widen, WidenedPanel& panel, int64_t n0, int64_t k0,
                 int64_t kc) {
  float* values = panel.values.data();
  for (int h = 0; h < 2; ++h) {
    float* rows = panel.rows.data();
    for (int r = 0; r < kWidenedLanes; ++r) {
      const int64_t n = n0 + h * kWidenedLanes + r;
      if (n < p.n) {
        widen(n, k0, kc, rows + r * kc);
      } else {
        std::fill(rows + r * kc, rows + (r + 1) * kc, 0.0f);
      }
    }
    int64_t j = 0;
#ifdef PYHLO_WIDENED_AVX512
    for (; j + kWidenedLanes <= kc; j += kWidenedLanes) {
      __m512 v[16];
      for (int r = 0; r < kWidenedLanes; ++r) v[r] = _mm512_loadu_ps(rows + r * kc + j);
      transpose_16x16(v);
      for (int c = 0; c < kWidenedLanes; ++c)
        _mm512_storeu_ps(values + (j + c) * kWidenedPanelRows + h * kWidenedLanes, v[c]);
    }
#elif defined(PYHLO_WIDENED_AVX2)
    for (; j + 8 <= kc; j += 8)
      for (int g = 0; g < 2; ++g) {   // 8 rows by 8 values turned at a time
        __m256i v[8];
        for (int r = 0; r < 8; ++r)
          v[r] = _mm256_castps_si256(_mm256_loadu_ps(rows + (8 * g + r) * kc + j));
        transpose_8x8_epi32(v);
        for (int c = 0; c < 8; ++c)
          _mm256_storeu_ps(values + (j + c) * kWidenedPanelRows + h * kWidenedLanes + 8 * g, _mm256_castsi256_ps(v[c]));
      }
#endif
    for (; j < kc; ++j)
      for (int r = 0; r < kWidenedLanes; ++r) values[j * kWidenedPanelRows + h * kWidenedLanes + r] = rows[r * kc + j];
  }
}

template <typename Widen>
void widened_panel_product(const WidenedProduct& p, const Widen& widen, WidenedPanel& panel, int64_t n0) {
  const float* values = panel.values.data();
  for (int64_t k0 = 0; k0 < p.k; k0 += kWidenedChunk) {
    const int64_t kc = std::min(kWidenedChunk, p.k - k0);
    widen_panel(p, widen, panel, n0, k0, kc);
    int64_t m0 = 0;
    for (; m0 + kWidenedTileRows <= p.m; m0 += kWidenedTileRows)
      widened_tile<kWidenedTileRows>(p, values, n0, m0, k0, kc, k0 == 0);
    widened_tail<kWidenedTileRows - 1>(p, values, n0, m0, k0, kc, k0 == 0, p.m - m0);
  }
}

// The product, panels shared between the caller and the pool; widen() may run on any thread.
template <typename Widen>
void widened_gemm(xla::ffi::ThreadPool& pool, const WidenedProduct& p, const Widen& widen) {
  if (p.m == 0 || p.n == 0 || p.k == 0) {
    std::fill(p.y, p.y + p.m * p.n, 0.0f);
    return;
  }
  share_panels(
      pool, (p.n + kWidenedPanelRows - 1) / kWidenedPanelRows, [&p] { return WidenedPanel(p.k); },
      [&](int64_t c, WidenedPanel& panel) { widened_panel_product(p, widen, panel, c * kWidenedPanelRows); });
}

}  // namespace pyhlo_kernels
