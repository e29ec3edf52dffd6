// pyhlo_gemm_q8_0, _q4_0, _q4_1: y[m, n] = sum_k x[m, k] * w[n, k] for many rows of f32
// activations (a prefill), w in llama.cpp's GGUF block forms split into arrays as the
// pyhlo_matvec_<form> targets take them (runtime/kernels/matvec.cc has the layout). Exact: the
// weights are widened to f32 as the program's own dequantization widens them (d * (q - 8) for
// Q4_0, d * q + m for Q4_1, d * q for Q8_0) and x stays f32; only the order of the sums differs.
// pyhlo_gemm_s8: the same for int8 weights with one f32 scale per row (pyhlo_matvec_s8's operands:
// NeuronConfig.quant), widened as scale * q. The product: widened_panels.h.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_operands.h"
#include "half.h"
#include "widened_panels.h"

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Form { kQ8_0, kQ4_0, kQ4_1, kS8 };
constexpr int64_t kBlock = 32;

using pyhlo_kernels::half_to_f32;

struct Problem {
  Form form;
  int64_t m, n, k, nb;
  const void* w;                 // s8 [N, K] (Q8_0, S8) or u8 [N, K/2] (Q4)
  const uint16_t* scales;        // f16 [N, K/32] (not S8)
  const float* row_scales;       // f32 [N] (S8)
  const uint16_t* mins;          // f16 [N, K/32] (Q4_1)
};

// Block b of row n widened to f32 into out[32].
void widen_block(const Problem& p, int64_t n, int64_t b, float* out) {
  const float d = half_to_f32(p.scales[n * p.nb + b]);
#ifdef PYHLO_WIDENED_AVX512
  // The same products as below, 16 at a time (each exact in f32 but for the one rounding).
  const __m512 scale = _mm512_set1_ps(d);
  if (p.form == kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(p.w) + n * p.k + b * kBlock;
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * half));
      _mm512_storeu_ps(out + 16 * half, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))));
    }
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.w) + n * (p.k / 2) + b * (kBlock / 2);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), high = _mm512_srli_epi32(bytes, 4);
  if (p.form == kQ4_0) {
    low = _mm512_sub_epi32(low, _mm512_set1_epi32(8));
    high = _mm512_sub_epi32(high, _mm512_set1_epi32(8));
    _mm512_storeu_ps(out, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(low)));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(high)));
    return;
  }
  // d * q + m rounded twice, as the scalar form: a fused multiply-add would round once.
  const __m512 m = _mm512_set1_ps(half_to_f32(p.mins[n * p.nb + b]));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(low)), m));
  _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(high)), m));
#else
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
#endif
}

// Values k0 .. k0 + kc - 1 of weight row n as f32 into out; k0 is a multiple of 32 and, but for
// S8, so is kc.
void widen(const Problem& p, int64_t n, int64_t k0, int64_t kc, float* out) {
  if (p.form == kS8) {
    const int8_t* q = static_cast<const int8_t*>(p.w) + n * p.k + k0;
    const float d = p.row_scales[n];
    for (int64_t j = 0; j < kc; ++j) out[j] = d * float(q[j]);
    return;
  }
  for (int64_t b = 0; b < kc / kBlock; ++b) widen_block(p, n, k0 / kBlock + b, out + b * kBlock);
}

void multiply(ffi::ThreadPool& pool, const Problem& p, ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& y) {
  const pyhlo_kernels::WidenedProduct product{p.m, p.n, p.k, static_cast<const float*>(x.untyped_data()),
                                              static_cast<float*>(y->untyped_data())};
  pyhlo_kernels::widened_gemm(pool, product,
                              [&p](int64_t n, int64_t k0, int64_t kc, float* out) { widen(p, n, k0, kc, out); });
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
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_gemm_q8_0/q4_0/q4_1: y must have x's rows and N columns");
  multiply(pool, p, x, y);
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
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_gemm_s8: y must have x's rows and N columns");
  multiply(pool, p, x, y);
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
// but slower than XLA's dot: the lowering takes the exact GEMMs (here and matvec_gguf.cc's)
// only in the first case.
extern "C" int PyhloGemmExactAvx512() { return pyhlo_kernels::widened_gemm_is_fast() ? 1 : 0; }
