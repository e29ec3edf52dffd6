// The operands of the kernels over llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks split into arrays
// (matvec.cc's pyhlo_matvec_<form>[_x8], gemm_blocks.cc's pyhlo_gemm_<form>_x8): one check and
// one message for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

// What the operands must be, for the error a kernel returns when they are not.
inline std::string block_operands_needed(const char* kernels) {
  return std::string(kernels) +
         ": need f32 x[..., K] (K a multiple of 32), s8 values [N, K] (Q8_0) or u8 values [N, K/2] (Q4), "
         "f16 scales [N, K/32] and, for Q4_1, f16 mins [N, K/32]";
}

// x f32[..., K] with K a multiple of 32; values s8 [N, K] (q8) or u8 [N, K/2]; f16 scales
// [N, K/32]; f16 mins as the scales, where given; y f32.
inline bool block_operands_fit(bool q8, xla::ffi::AnyBuffer& x, xla::ffi::AnyBuffer& w,
                               xla::ffi::AnyBuffer& scales, xla::ffi::AnyBuffer* mins, xla::ffi::AnyBuffer& y) {
  namespace ffi = xla::ffi;
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const int64_t per_byte = q8 ? 1 : 2;
  if (x.element_type() != ffi::DataType::F32 || y.element_type() != ffi::DataType::F32 || x_dims.size() < 1 ||
      w.element_type() != (q8 ? ffi::DataType::S8 : ffi::DataType::U8) || w_dims.size() != 2)
    return false;
  const int64_t k = x_dims[x_dims.size() - 1];
  return k == w_dims[1] * per_byte && k % 32 == 0 && scales.element_type() == ffi::DataType::F16 &&
         scales.element_count() == static_cast<size_t>(w_dims[0] * (k / 32)) &&
         (mins == nullptr ||
          (mins->element_type() == ffi::DataType::F16 && mins->element_count() == scales.element_count()));
}

}  // namespace pyhlo_kernels
