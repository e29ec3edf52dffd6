// pyhlo_gemm_bf16: y[m, n] = sum_k x[m, k] * w[n, k] for many rows of f32 activations (a
// prefill) and bf16 weights [N, K], exact: each weight widened to f32 (its 16 bits become the
// high half of the f32, as XLA converts bf16), products and sums in f32; only the order of the
// sums differs from the program's own dot.
//
// Without the CPU's bf16 dot instructions, XLA:CPU's dot of bf16 weights measured below its f32
// rate (SmolLM2-1.7B's shape in bf16, 128-token prompt, AMD Zen 3: 24.4 tokens/s where
// llama.cpp took 30.5). Here each thread widens a panel of 32 weight rows in its cache once for
// all activation rows and multiplies it on the f32 tiles of the other exact GEMMs
// (widened_panels.h). Where the CPU has AVX512_BF16, XLA's dot takes vdpbf16ps and this kernel
// is not the fast one (PyhloGemmBf16Fast says so, and the lowering keeps XLA's dot).
#include <cstdint>

#include "half.h"
#include "widened_panels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Values k0 .. k0 + kc - 1 of row n of w (bf16 bits) as f32 into out.
void widen_bf16(const uint16_t* w, int64_t k, int64_t n, int64_t k0, int64_t kc, float* out) {
  const uint16_t* row = w + n * k + k0;
  int64_t j = 0;
#if defined(__AVX2__)
  for (; j + 8 <= kc; j += 8) _mm256_storeu_ps(out + j, pyhlo_kernels::bf16x8_to_f32(row + j));
#endif
  for (; j < kc; ++j) out[j] = pyhlo_kernels::bf16_to_f32(row[j]);
}

ffi::Error GemmBf16(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const bool fit = x.element_type() == ffi::DataType::F32 && w.element_type() == ffi::DataType::BF16 &&
                   y->element_type() == ffi::DataType::F32 && x_dims.size() >= 1 && w_dims.size() == 2 &&
                   x_dims[x_dims.size() - 1] == w_dims[1] && w_dims[1] > 0;
  if (!fit) return ffi::Error::InvalidArgument("pyhlo_gemm_bf16: need f32 x[..., K], bf16 w[N, K] and f32 y");
  const int64_t k = w_dims[1], n = w_dims[0], m = static_cast<int64_t>(x.element_count()) / k;
  if (y->element_count() != static_cast<size_t>(m * n))
    return ffi::Error::InvalidArgument("pyhlo_gemm_bf16: y must have x's rows and N columns");
  const auto* weights = static_cast<const uint16_t*>(w.untyped_data());
  pyhlo_kernels::widened_gemm(
      pool, pyhlo_kernels::WidenedProduct{m, n, k, static_cast<const float*>(x.untyped_data()),
                                          static_cast<float*>(y->untyped_data())},
      [weights, k](int64_t row, int64_t k0, int64_t kc, float* out) { widen_bf16(weights, k, row, k0, kc, out); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PyhloGemmBf16, GemmBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// Whether this kernel is the fast way to a bf16 prefill product on this build (1): the widened
// tiles have a vector form (AVX-512 or AVX2 with FMA) and the CPU has no bf16 dot instructions
// for XLA's own dot to use.
extern "C" int PyhloGemmBf16Fast() {
#if defined(__AVX512BF16__)
  return 0;
#else
  return pyhlo_kernels::widened_gemm_is_fast() ? 1 : 0;
#endif
}
