// pyhlo_gemm_q8_0, _q4_0, _q4_1: y[m, n] = sum_k x[m, k] * w[n, k] for many rows of f32
// activations (a prefill), w in llama.cpp's GGUF block forms split into arrays as the
// pyhlo_matvec_<form> targets take them (runtime/kernels/matvec.cc has the layout). Exact: the
// weights are widened to f32 as the program's own dequantization widens them (d * (q - 8) for
// Q4_0, d * q + m for Q4_1, d * q for Q8_0) and x stays f32; only the order of the sums differs.
// pyhlo_gemm_s8: the same for int8 weights with one f32 scale per row (pyhlo_matvec_s8's operands:
// NeuronConfig.quant), widened as scale * q.
//
// Widening a weight inside the program writes the whole f32 weight out and reads it back for
// XLA's dot. Here each thread widens a panel of 32 weight rows, kChunk values of k at a time,
// into a buffer that stays in its cache (value j of the 32 rows side by side: 128 KB), once for
// all activation rows, and multiplies it by tiles of 12 activation rows: per value of k, two
// vector loads of the panel and 12 broadcast activations meet in 24 multiply-adds, the 24 sums
// (32 weight rows by 12 activation rows) in registers across the chunk.
//
// Panels are split between the caller and XLA's intra-op thread pool (gemm_panels.h). Paths:
// AVX-512 where the CPU has it; elsewhere a portable form on the same panels, correct but not
// fast (the lowering takes this kernel only where it has the AVX-512 form).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_operands.h"
#include "gemm_panels.h"
#include "half.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PYHLO_GEMM_EXACT_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Form { kQ8_0, kQ4_0, kQ4_1, kS8 };
constexpr int64_t kBlock = 32;
constexpr int kLanes = 16;
constexpr int kPanelRows = 2 * kLanes;   // weight rows of a panel
constexpr int kTileRows = 12;            // activation rows of a tile
constexpr int64_t kChunk = 1024;         // values of k a panel holds at a time

using pyhlo_kernels::half_to_f32;

struct Problem {
  Form form;
  int64_t m, n, k, nb;
  const void* w;                 // s8 [N, K] (Q8_0, S8) or u8 [N, K/2] (Q4)
  const uint16_t* scales;        // f16 [N, K/32] (not S8)
  const float* row_scales;       // f32 [N] (S8)
  const uint16_t* mins;          // f16 [N, K/32] (Q4_1)
  const float* x;                // [M, K]
  float* y;                      // [M, N]
};

// Block b of row n widened to f32 into out[32].
void widen_block(const Problem& p, int64_t n, int64_t b, float* out) {
  const float d = half_to_f32(p.scales[n * p.nb + b]);
  if (p.form == kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(p.w) + n * p.k + b * kBlock;
    for (int j = 0; j < kBlock; ++j) out[j] = d * float(q[j]);
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.w) + n * (p.k / 2) + b * (kBlock / 2);
  if (p.form == kQ4_0) {
    for (int j = 0; j < kBlock / 2; ++j) {
      out[j] = d * float(int(q[j] & 0xF) - 8);
      out[j + kBlock / 2] = d * float(int(q[j] >> 4) - 8);
    }
    return;
  }
  const float m = half_to_f32(p.mins[n * p.nb + b]);
  for (int j = 0; j < kBlock / 2; ++j) {
    out[j] = d * float(q[j] & 0xF) + m;
    out[j + kBlock / 2] = d * float(q[j] >> 4) + m;
  }
}

// Values k0 .. k0 + kc - 1 of weight rows n0 .. n0 + 31 into panel[kc][32] (rows past N zero);
// k0 is a multiple of 32 and, but for S8, so is kc.
void pack(const Problem& p, int64_t n0, int64_t k0, int64_t kc, float* panel) {
  float block[kBlock];
  for (int r = 0; r < kPanelRows; ++r) {
    const bool real = n0 + r < p.n;
    if (p.form == kS8) {
      const int8_t* q = static_cast<const int8_t*>(p.w) + (n0 + r) * p.k + k0;
      const float d = real ? p.row_scales[n0 + r] : 0.0f;
      for (int64_t j = 0; j < kc; ++j) panel[j * kPanelRows + r] = real ? d * float(q[j]) : 0.0f;
      continue;
    }
    for (int64_t b = 0; b < kc / kBlock; ++b) {
      if (real) widen_block(p, n0 + r, k0 / kBlock + b, block);
      for (int j = 0; j < kBlock; ++j) panel[(b * kBlock + j) * kPanelRows + r] = real ? block[j] : 0.0f;
    }
  }
}

// y[m0 .. m0 + R - 1][n0 .. n0 + 31] (those below N) plus (or, for the first chunk, set to) the
// sums of the panel's kc values.
template <int R>
void tile(const Problem& p, const float* panel, int64_t n0, int64_t m0, int64_t k0, int64_t kc, bool first) {
  const float* x = p.x + m0 * p.k + k0;
#ifdef PYHLO_GEMM_EXACT_AVX512
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h) {
    const int64_t real = std::clamp<int64_t>(p.n - (n0 + h * kLanes), 0, kLanes);
    const __mmask16 mask = real >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << real) - 1);
    for (int r = 0; r < R; ++r)
      acc[h][r] = first ? _mm512_setzero_ps()
                        : _mm512_maskz_loadu_ps(mask, p.y + (m0 + r) * p.n + n0 + h * kLanes);
  }
  for (int64_t j = 0; j < kc; ++j) {
    const __m512 w0 = _mm512_loadu_ps(panel + j * kPanelRows);
    const __m512 w1 = _mm512_loadu_ps(panel + j * kPanelRows + kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * p.k + j]);
      acc[0][r] = _mm512_fmadd_ps(w0, xv, acc[0][r]);
      acc[1][r] = _mm512_fmadd_ps(w1, xv, acc[1][r]);
    }
  }
  pyhlo_kernels::store_tile<R>(p.y, p.n, n0, m0, acc);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelRows && n0 + c < p.n; ++c) {
      float sum = first ? 0.0f : p.y[(m0 + r) * p.n + n0 + c];
      for (int64_t j = 0; j < kc; ++j) sum += panel[j * kPanelRows + c] * x[r * p.k + j];
      p.y[(m0 + r) * p.n + n0 + c] = sum;
    }
#endif
}

template <int R>
void tail(const Problem& p, const float* panel, int64_t n0, int64_t m0, int64_t k0, int64_t kc, bool first,
          int64_t rows) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(p, panel, n0, m0, k0, kc, first);
    tail<R - 1>(p, panel, n0, m0, k0, kc, first, rows);
  }
}

void panel_product(const Problem& p, std::vector<float>& panel, int64_t n0) {
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, p.k - k0);
    pack(p, n0, k0, kc, panel.data());
    int64_t m0 = 0;
    for (; m0 + kTileRows <= p.m; m0 += kTileRows) tile<kTileRows>(p, panel.data(), n0, m0, k0, kc, k0 == 0);
    tail<kTileRows - 1>(p, panel.data(), n0, m0, k0, kc, k0 == 0, p.m - m0);
  }
}

void multiply(ffi::ThreadPool& pool, const Problem& p) {
  if (p.m == 0 || p.n == 0) return;
  pyhlo_kernels::share_panels(
      pool, (p.n + kPanelRows - 1) / kPanelRows,
      [&p] { return std::vector<float>(std::min(kChunk, p.k) * kPanelRows); },
      [&p](int64_t c, std::vector<float>& panel) { panel_product(p, panel, c * kPanelRows); });
}

ffi::Error Run(ffi::ThreadPool& pool, Form form, ffi::AnyBuffer& x, ffi::AnyBuffer& w, ffi::AnyBuffer& scales,
               ffi::AnyBuffer* mins, ffi::Result<ffi::AnyBuffer>& y) {
  if (!pyhlo_kernels::block_operands_fit(form == kQ8_0, x, w, scales, mins, *y))
    return ffi::Error::InvalidArgument(pyhlo_kernels::block_operands_needed("pyhlo_gemm_q8_0/q4_0/q4_1"));
  Problem p{};
  p.form = form;
  p.k = w.dimensions()[1] * (form == kQ8_0 ? 1 : 2);
  p.nb = p.k / kBlock;
  p.n = w.dimensions()[0];
  p.m = x.element_count() / p.k;
  p.w = w.untyped_data();
  p.scales = static_cast<const uint16_t*>(scales.untyped_data());
  p.mins = mins != nullptr ? static_cast<const uint16_t*>(mins->untyped_data()) : nullptr;
  p.x = static_cast<const float*>(x.untyped_data());
  p.y = static_cast<float*>(y->untyped_data());
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_gemm_q8_0/q4_0/q4_1: y must have x's rows and N columns");
  multiply(pool, p);
  return ffi::Error::Success();
}

ffi::Error GemmS8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                  ffi::Result<ffi::AnyBuffer> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const bool fit = x.element_type() == ffi::DataType::F32 && y->element_type() == ffi::DataType::F32 &&
                   w.element_type() == ffi::DataType::S8 && scale.element_type() == ffi::DataType::F32 &&
                   x_dims.size() >= 1 && w_dims.size() == 2 && x_dims[x_dims.size() - 1] == w_dims[1] &&
                   scale.element_count() == static_cast<size_t>(w_dims[0]);
  if (!fit) return ffi::Error::InvalidArgument("pyhlo_gemm_s8: need f32 x[..., K], s8 w[N, K] and f32 scale[N]");
  Problem p{};
  p.form = kS8;
  p.k = w_dims[1];
  p.n = w_dims[0];
  p.m = p.k == 0 ? 0 : x.element_count() / p.k;
  p.w = w.untyped_data();
  p.row_scales = static_cast<const float*>(scale.untyped_data());
  p.x = static_cast<const float*>(x.untyped_data());
  p.y = static_cast<float*>(y->untyped_data());
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_gemm_s8: y must have x's rows and N columns");
  multiply(pool, p);
  return ffi::Error::Success();
}

ffi::Error GemmQ8_0(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                    ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, kQ8_0, x, w, scales, nullptr, y);
}

ffi::Error GemmQ4_0(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                    ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, kQ4_0, x, w, scales, nullptr, y);
}

ffi::Error GemmQ4_1(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                    ffi::AnyBuffer mins, ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, kQ4_1, x, w, scales, &mins, y);
}

}  // namespace

#define PYHLO_GEMM_EXACT_HANDLER(symbol, function, ...)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, function,                                             \
                                ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() __VA_ARGS__.Ret<ffi::AnyBuffer>())

PYHLO_GEMM_EXACT_HANDLER(PyhloGemmQ8_0, GemmQ8_0, .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_GEMM_EXACT_HANDLER(PyhloGemmQ4_0, GemmQ4_0, .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_GEMM_EXACT_HANDLER(PyhloGemmS8, GemmS8, .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_GEMM_EXACT_HANDLER(PyhloGemmQ4_1, GemmQ4_1,
                         .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());

// Whether this build has the AVX-512 form (1) or only the portable one (0), which is correct
// but slower than XLA's dot: the lowering takes the kernel only in the first case.
extern "C" int PyhloGemmExactAvx512() {
#ifdef PYHLO_GEMM_EXACT_AVX512
  return 1;
#else
  return 0;
#endif
}
