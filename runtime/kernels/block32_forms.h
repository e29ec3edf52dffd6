// llama.cpp's forms of 32-value blocks as a GGUF file stores them (Q5_0, Q5_1, IQ4_NL, Q8_0,
// Q4_0, Q4_1; pyhlo/ops/gguf_blocks.py has the layouts), read as q8_blocks.h's weight blocks:
// 32 signed integers w (the file's value less its centre: Q5_0's q - 16, Q4_0's q - 8, IQ4_NL's
// table entry, Q8_0's byte; Q5_1's and Q4_1's unsigned q) with the block's scale d and, for the
// forms with one, its minimum m: value j = d * w[j] (+ m).
//
// block32_to_int8 writes a block's integers out (the GEMM's panels, the matrix-vector kernel's
// pieces where no row kernel runs). dot_block32_rows multiplies whole weight rows by a few
// activation rows rounded as llama.cpp's Q8_1 (q8_blocks.h's quantize_q8_1), each block unpacked
// in registers and multiplied at once, as llama.cpp's vec_dot kernels do (decode streams its
// weights that way): the same integer sums as dot_q8_32's, the f32 sums in another order.
// Its exact form (f32 activations) widens each value in registers to the gguf package's f32
// reading of it (d * w, + m: exact products, one rounding of the sum), with f32 sums.
//
// Paths: AVX2 for the row kernel (with AVX-512 builds too: 32 values are one AVX2 vector);
// elsewhere has_block32_row_kernel() is false and callers use block32_to_int8 and dot_q8_32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "vector_sum.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_B32_AVX2 1
#endif

namespace pyhlo_kernels {

// The forms' codes, as pyhlo/ops/gguf_blocks.py's ROW_CODES (and matvec_gguf.cc's Form) name them.
enum Block32Form : int { kB32Q5_0 = 0, kB32Q5_1 = 1, kB32IQ4_NL = 7, kB32Q8_0 = 9, kB32Q4_0 = 10, kB32Q4_1 = 11 };

constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Bytes of a block of the form with this code; 0 for a code that names none of these forms.
constexpr int block32_bytes(int code) {
  switch (code) {
    case kB32Q5_0: return 22;
    case kB32Q5_1: return 24;
    case kB32IQ4_NL: return 18;
    case kB32Q8_0: return 34;
    case kB32Q4_0: return 18;
    case kB32Q4_1: return 20;
    default: return 0;
  }
}

constexpr bool block32_has_min(int code) { return code == kB32Q5_1 || code == kB32Q4_1; }

// The largest |w| of the form's integers (Q5_0's 16, Q4_0's 8, Q5_1's 31 ...).
inline int block32_largest(int code) {
  switch (code) {
    case kB32Q5_0: return 16;
    case kB32Q5_1: return 31;
    case kB32Q4_0: return 8;
    case kB32Q4_1: return 15;
    default: return 128;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_to_f32(h);
}

#ifdef PYHLO_B32_AVX2
// 16 bytes of nibbles as 32 byte values 0..15: the low nibbles, then the high.
inline __m256i nibbles_32(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), nibble = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
}

// Bit j of `bits` as byte j, all ones where set: each byte of `bits` copied to 8 lanes, one bit
// tested per lane.
inline __m256i bits_32(const uint8_t* at) {
  uint32_t bits;
  std::memcpy(&bits, at, sizeof(bits));
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// A block's 32 integers w in one vector.
template <int Code>
inline __m256i block32_vector(const uint8_t* b) {
  if constexpr (Code == kB32Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else if constexpr (Code == kB32Q4_0) {
    return _mm256_sub_epi8(nibbles_32(b + 2), _mm256_set1_epi8(8));
  } else if constexpr (Code == kB32Q4_1) {
    return nibbles_32(b + 4);
  } else if constexpr (Code == kB32IQ4_NL) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    return _mm256_shuffle_epi8(table, nibbles_32(b + 2));
  } else if constexpr (Code == kB32Q5_1) {
    return _mm256_or_si256(nibbles_32(b + 8), _mm256_and_si256(bits_32(b + 4), _mm256_set1_epi8(0x10)));
  } else {   // Q5_0: q - 16 is the nibble where the high bit is set, else the nibble less 16
    return _mm256_or_si256(nibbles_32(b + 6), _mm256_andnot_si256(bits_32(b + 2), _mm256_set1_epi8(char(0xF0))));
  }
}
#endif

// Q5_0's or Q5_1's 32 values as bytes (0..31): the nibbles (low, then high) and bit j of the
// block's 32-bit `high` as 16.
inline void q5_values(const uint8_t* b, bool with_min, uint8_t* q) {
#ifdef PYHLO_B32_AVX2
  const __m256i high = _mm256_and_si256(bits_32(b + (with_min ? 4 : 2)), _mm256_set1_epi8(0x10));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_or_si256(nibbles_32(b + (with_min ? 8 : 6)), high));
#else
  uint32_t high;
  std::memcpy(&high, b + (with_min ? 4 : 2), sizeof(high));
  const uint8_t* qs = b + (with_min ? 8 : 6);
  for (int j = 0; j < 16; ++j) {
    q[j] = uint8_t((qs[j] & 0xF) | (((high >> j) & 1) << 4));
    q[j + 16] = uint8_t((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4));
  }
#endif
}

// One block of the form `code` at `b` as its integers in q[32], its scale in d and, for Q5_1
// and Q4_1, its minimum in m.
inline void block32_to_int8(int code, const uint8_t* b, int8_t* q, float* d, float* m) {
  d[0] = half_at(b);
  if (block32_has_min(code)) m[0] = half_at(b + 2);
#ifdef PYHLO_B32_AVX2
  __m256i v;
  switch (code) {
    case kB32Q5_0: v = block32_vector<kB32Q5_0>(b); break;
    case kB32Q5_1: v = block32_vector<kB32Q5_1>(b); break;
    case kB32IQ4_NL: v = block32_vector<kB32IQ4_NL>(b); break;
    case kB32Q8_0: v = block32_vector<kB32Q8_0>(b); break;
    case kB32Q4_0: v = block32_vector<kB32Q4_0>(b); break;
    default: v = block32_vector<kB32Q4_1>(b); break;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
#else
  switch (code) {
    case kB32Q5_0:
    case kB32Q5_1: {
      const bool with_min = code == kB32Q5_1;
      uint8_t values[32];
      q5_values(b, with_min, values);
      for (int j = 0; j < 32; ++j) q[j] = int8_t(int(values[j]) - (with_min ? 0 : 16));
      break;
    }
    case kB32Q8_0:
      std::memcpy(q, b + 2, 32);
      break;
    case kB32IQ4_NL:
      for (int j = 0; j < 16; ++j) {
        q[j] = kIQ4Values[b[2 + j] & 0xF];
        q[j + 16] = kIQ4Values[b[2 + j] >> 4];
      }
      break;
    default: {   // Q4_0, Q4_1
      const bool with_min = code == kB32Q4_1;
      const uint8_t* qs = b + (with_min ? 4 : 2);
      const int centre = with_min ? 0 : 8;
      for (int j = 0; j < 16; ++j) {
        q[j] = int8_t((qs[j] & 0xF) - centre);
        q[j + 16] = int8_t((qs[j] >> 4) - centre);
      }
      break;
    }
  }
#endif
}

// Activation rows rounded as llama.cpp's Q8_1 (quantize_q8_1): the integers [rows, k], each 32's
// scale d and d * sum q [rows, k / 32].
struct Q8_1Rows {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k;
};

inline bool has_block32_row_kernel() {
#ifdef PYHLO_B32_AVX2
  return true;
#else
  return false;
#endif
}

// Weight rows of one form, `count` of them `stride` bytes apart from `first`, each `blocks`
// blocks; their products go to out[r * out_stride + i] for activation row r and weight row i.
struct Block32Rows {
  const uint8_t* first;
  int64_t stride, count, blocks;
  float* out;
  int64_t out_stride;
};

#ifdef PYHLO_B32_AVX2
// Weight row `row` (form Code) times R activation rows into out[r * out_stride]. Two blocks a
// step, each with accumulators of its own: the FMAs of one do not wait on the other's.
template <int Code, int R>
inline void dot_block32_row(const uint8_t* row, int64_t blocks, const Q8_1Rows& x, float* out, int64_t out_stride) {
  constexpr int64_t bytes = block32_bytes(Code);
  constexpr bool with_min = block32_has_min(Code);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][R];
  float minimums[R] = {};
  for (int u = 0; u < 2; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm256_setzero_ps();
  auto step = [&](int u, int64_t b) {
    const uint8_t* block = row + b * bytes;
    const __m256i v = block32_vector<Code>(block);
    // Unsigned forms multiply as they are; signed ones as |w| times x with w's sign (vpmaddubsw
    // takes unsigned by signed bytes; no pair of |w| <= 128 and |x| <= 127 passes int16).
    const __m256i magnitude = with_min ? v : _mm256_sign_epi8(v, v);
    const float d = half_at(block);
    const float m = with_min ? half_at(block + 2) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + r * x.k + b * 32));
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, with_min ? xv : _mm256_sign_epi8(xv, v));
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[u][r] = _mm256_fmadd_ps(sum, _mm256_set1_ps(d * x.d[r * (x.k / 32) + b]), acc[u][r]);
      if (with_min) minimums[r] += m * x.s[r * (x.k / 32) + b];
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    step(0, b);
    step(1, b + 1);
  }
  if (b < blocks) step(0, b);
  for (int r = 0; r < R; ++r) out[r * out_stride] = sum8(_mm256_add_ps(acc[0][r], acc[1][r])) + minimums[r];
}

// The exact form: the sum of (d * w[j] (+ m)) * x[r][j] over weight row `row`, for R activation
// rows of f32 x (k values apart); each block's 32 values widened 8 at a time, two accumulators a
// row.
template <int Code, int R>
inline void dot_block32_f32_row(const uint8_t* row, int64_t blocks, const float* x, int64_t k, float* out,
                                int64_t out_stride) {
  constexpr int64_t bytes = block32_bytes(Code);
  constexpr bool with_min = block32_has_min(Code);
  __m256 acc[2][R];
  for (int u = 0; u < 2; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bytes;
    const __m256i v = block32_vector<Code>(block);
    const __m256 d = _mm256_set1_ps(half_at(block));
    const __m256 m = _mm256_set1_ps(with_min ? half_at(block + 2) : 0.0f);
    const __m128i halves[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
    for (int e = 0; e < 4; ++e) {
      const __m128i eight = e % 2 ? _mm_unpackhi_epi64(halves[e / 2], halves[e / 2]) : halves[e / 2];
      const __m256 q = _mm256_cvtepi32_ps(with_min ? _mm256_cvtepu8_epi32(eight) : _mm256_cvtepi8_epi32(eight));
      // d * q is exact (11 bits by at most 8), so the sum with m rounds once, as numpy's.
      const __m256 value = with_min ? _mm256_add_ps(_mm256_mul_ps(d, q), m) : _mm256_mul_ps(d, q);
      for (int r = 0; r < R; ++r)
        acc[e % 2][r] = _mm256_fmadd_ps(value, _mm256_loadu_ps(x + r * k + b * 32 + 8 * e), acc[e % 2][r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = sum8(_mm256_add_ps(acc[0][r], acc[1][r]));
}

// Every weight row of `w` (form Code) times the activation rows, R at a time (their sums stay in
// registers), all rows in one call: the constants and the call are paid once, not per row (a
// row of 576 values is 18 blocks; one call a row took a third of such a product's time). The
// int8 form with Q8_1 activations `x8`, else the exact form with f32 activations `xf`.
template <int Code, bool Int8>
void dot_block32_rows_of(const Block32Rows& w, const Q8_1Rows& x8, const float* xf, int64_t rows) {
  constexpr int kMost = 4;
  for (int64_t i = 0; i < w.count; ++i) {
    const uint8_t* row = w.first + i * w.stride;
    for (int64_t r0 = 0; r0 < rows; r0 += kMost) {   // a weight row read once, from cache after
      const Q8_1Rows x = Int8 ? Q8_1Rows{x8.q + r0 * x8.k, x8.d + r0 * (x8.k / 32), x8.s + r0 * (x8.k / 32), x8.k}
                              : x8;
      const float* f = Int8 ? nullptr : xf + r0 * x8.k;
      float* out = w.out + r0 * w.out_stride;
      switch (std::min<int64_t>(kMost, rows - r0)) {
#define PYHLO_B32_ROWS(R)                                                                        \
  case R:                                                                                        \
    if constexpr (Int8) dot_block32_row<Code, R>(row, w.blocks, x, out + i, w.out_stride);      \
    else dot_block32_f32_row<Code, R>(row, w.blocks, f, x8.k, out + i, w.out_stride);           \
    break;
        PYHLO_B32_ROWS(4)
        PYHLO_B32_ROWS(3)
        PYHLO_B32_ROWS(2)
        PYHLO_B32_ROWS(1)
#undef PYHLO_B32_ROWS
        default: break;
      }
    }
  }
}
#endif

// Weight rows `w` of the form `code` times activation rows 0 .. rows - 1: with int8 activations
// x8 (xf null), or exact with f32 activations xf [rows, x8.k] (x8 gives only k). Only where
// has_block32_row_kernel().
inline void dot_block32_rows(int code, const Block32Rows& w, const Q8_1Rows& x8, const float* xf, int64_t rows) {
#ifdef PYHLO_B32_AVX2
  const bool int8 = xf == nullptr;
  switch (code) {
#define PYHLO_B32_FORM(C) \
  case C: return int8 ? dot_block32_rows_of<C, true>(w, x8, xf, rows) : dot_block32_rows_of<C, false>(w, x8, xf, rows);
    PYHLO_B32_FORM(kB32Q5_0)
    PYHLO_B32_FORM(kB32Q5_1)
    PYHLO_B32_FORM(kB32IQ4_NL)
    PYHLO_B32_FORM(kB32Q8_0)
    PYHLO_B32_FORM(kB32Q4_0)
    PYHLO_B32_FORM(kB32Q4_1)
#undef PYHLO_B32_FORM
    default: break;
  }
#else
  (void)code, (void)w, (void)x8, (void)xf, (void)rows;
#endif
}

}  // namespace pyhlo_kernels
