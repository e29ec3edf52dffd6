// The operands both attention kernels take (decode_attention.cc, prefill_attention.cc), checked
// in one place: f32 queries q[b, h, n, d] and an f32 result; caches k and v [B, kvh, S, d] of
// f32 or bf16 (or its bits, u16), or packed int8 rows [B, kvh, S, d + 4] (d values, then the
// row's f32 scale), h a multiple of kvh; each row's slot[b], pad[b] and cache line lines[b].
// And how a cache row reads: value i (load) times the row's factor (row_scale).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "half.h"

#include "xla/ffi/api/ffi.h"

namespace pyhlo_kernels {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const int8_t* p, int64_t i) { return float(p[i]); }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// The factor a stored row's values are multiplied by: 1, or a packed int8 row's own scale,
// which follows its d values.
inline float row_scale(const float*, int64_t) { return 1.0f; }
inline float row_scale(const uint16_t*, int64_t) { return 1.0f; }
inline float row_scale(const int8_t* row, int64_t d) {
  float out;
  std::memcpy(&out, row + d, sizeof(out));
  return out;
}

// Success, or an error that names `kernel` and what does not fit. `queries`: the query tokens a
// row must have (0: any number).
inline xla::ffi::Error check_attention_operands(const std::string& kernel, xla::ffi::AnyBuffer q,
                                                xla::ffi::AnyBuffer k, xla::ffi::AnyBuffer v,
                                                xla::ffi::Buffer<xla::ffi::S32> slot,
                                                xla::ffi::Buffer<xla::ffi::S32> pad,
                                                xla::ffi::Buffer<xla::ffi::S32> lines, xla::ffi::DataType out,
                                                int64_t queries) {
  using xla::ffi::DataType;
  using xla::ffi::Error;
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  if (q.element_type() != DataType::F32 || out != DataType::F32)
    return Error::InvalidArgument(kernel + ": q and the result must be f32");
  const auto type = k.element_type();
  if (type != v.element_type() ||
      (type != DataType::F32 && type != DataType::BF16 && type != DataType::U16 && type != DataType::S8))
    return Error::InvalidArgument(kernel + ": k and v must both be f32, bf16 (or its bits as u16) or packed s8 rows");
  const int64_t packed = type == DataType::S8 ? int64_t(sizeof(float)) : 0;
  if (qd.size() != 4 || kd.size() != 4 || (queries > 0 && qd[2] != queries) || qd[3] + packed != kd[3] ||
      qd[3] == 0 || kd[1] == 0 || qd[1] % kd[1] != 0 || v.element_count() != k.element_count() ||
      pad.element_count() != static_cast<size_t>(qd[0]) || slot.element_count() != static_cast<size_t>(qd[0]) ||
      lines.element_count() != static_cast<size_t>(qd[0]))
    return Error::InvalidArgument(kernel + ": need q[b, h, " + (queries > 0 ? std::to_string(queries) : "n") +
                                  ", d], k and v [B, kvh, S, d] (d + 4 for packed s8 rows) with h a multiple of "
                                  "kvh, slot[b], pad[b] and lines[b]");
  for (int64_t i = 0; i < qd[0]; ++i)
    if (lines.typed_data()[i] < 0 || lines.typed_data()[i] >= kd[0])
      return Error::InvalidArgument(kernel + ": a row's cache line is not one of the caches'");
  return Error::Success();
}

}  // namespace pyhlo_kernels
