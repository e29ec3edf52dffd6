// A weight whose rows come in several GGUF forms, as pyhlo/ops/gguf_blocks.py's
// pack_mixed_rows lays it out: u8 [N, W] read as one run of bytes, the rows' blocks back to
// back from the start, then each row's offset (u32, little-endian) from byte N * (W - 5),
// then each row's form code (ROW_CODES) from byte N * (W - 1). The matrix-vector kernels
// (matvec_gguf.cc) and the K-quant GEMM (gemm_kquants.cc) read it through MixedRows.
#pragma once

#include <cstdint>
#include <cstring>

namespace pyhlo_kernels {

constexpr int64_t kRowTail = 5;   // a row's offset and code

struct MixedRows {
  const uint8_t* data = nullptr;
  int64_t n = 0;
  int64_t body = 0;               // bytes the rows may take: N * (W - kRowTail)

  MixedRows() = default;
  MixedRows(const uint8_t* bytes, int64_t rows, int64_t width)
      : data(bytes), n(rows), body(rows * (width - kRowTail)) {}

  int code(int64_t i) const { return data[body + 4 * n + i]; }
  int64_t offset(int64_t i) const {
    uint32_t at;
    std::memcpy(&at, data + body + 4 * i, sizeof(at));
    return at;
  }
  const uint8_t* row(int64_t i) const { return data + offset(i); }
  // Whether row i's `bytes` lie within the rows' bytes: a bad offset is refused, never read.
  bool holds(int64_t i, int64_t bytes) const { return offset(i) + bytes <= body; }
};

}  // namespace pyhlo_kernels
