// pyhlo_rotary_cos_sin: the cos and sin tables of rotary embeddings, once for a program's
// positions.
//
//   out[0, p, e] = cos(positions[p] * freqs[e]),  out[1, p, e] = sin(positions[p] * freqs[e])
//
// the angle an f32 product, as HF computes it. Computed in the program, XLA:CPU fuses the cos
// and sin into each consumer (it counts them as cheap) and so evaluates them again for every
// head of q and k in every layer: on SmolLM2-1.7B's shape, the rotation of k with its cache
// write took 23 us and q's 14 us a layer, against 2-3 us once the tables are read.
//
// Operands: positions s32[P] (any shape of P elements), freqs f32[E]. Result: f32[2, P, E].
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error RotaryCosSin(ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> freqs,
                        ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t n = static_cast<int64_t>(positions.element_count());
  const int64_t e = static_cast<int64_t>(freqs.element_count());
  if (out->element_count() != static_cast<size_t>(2 * n * e))
    return ffi::Error::InvalidArgument("pyhlo_rotary_cos_sin: the result must be f32[2, positions, freqs]");
  const int32_t* at = positions.typed_data();
  const float* f = freqs.typed_data();
  float* cos_out = out->typed_data();
  float* sin_out = cos_out + n * e;
  for (int64_t p = 0; p < n; ++p)
    for (int64_t j = 0; j < e; ++j) {
      const float angle = float(at[p]) * f[j];
      cos_out[p * e + j] = std::cos(angle);
      sin_out[p * e + j] = std::sin(angle);
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PyhloRotaryCosSin, RotaryCosSin,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
