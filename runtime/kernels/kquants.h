// llama.cpp's K-quant super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256 values each) unpacked
// to one shape that both kernels of matvec_gguf.cc read, and the activations rounded as
// llama.cpp's Q8_K rounds them for the integer form.
//
// An unpacked super-block: value i = d * scale[i / 16] * q[i] + dlow * low[i / 16], q unsigned
// (0..63), scale and low small integers per 16 values. Q3_K and Q6_K store centred values (q -
// 4, q - 32); they say so by `centre`, with low = centre * scale and dlow = -d, so that the
// exact kernel multiplies by q - centre as the gguf package does and the integer one takes the
// centre through the sums of the rounded activations, as llama.cpp does.
//
// The integer form of Q4_K, Q5_K and Q6_K has a second way, with AVX-512 or AVX2: the row
// kernels (dot_q8_k_rows) unpack each super-block of the file's bytes in registers and multiply
// it at once, as llama.cpp's vec_dot kernels do, with the same integer sums; decode streams
// its weights that way, nothing stored between unpacking and multiplying.
//
// Paths: AVX-512 (BW, VL; the integer dot on VNNI where the CPU has it), AVX2, portable, as
// the compiler flags allow. Q4_K, Q5_K and Q6_K are unpacked with vector instructions, Q2_K
// and Q3_K in plain C++.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "byte_lanes.h"
#include "half.h"
#include "vector_sum.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PYHLO_KQ_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_KQ_AVX2 1
#endif

namespace pyhlo_kernels {

constexpr int kSuperValues = 256;

enum class KQuant { kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K };

struct SuperBlock {
  alignas(64) uint8_t q[kSuperValues];
  alignas(64) int16_t pair_scale[kSuperValues / 2];   // scale of values 2p and 2p + 1
  alignas(32) int16_t scale[16];
  alignas(32) int16_t low[16];
  float d, dlow;
  int centre;
};

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_to_f32(h);
}

// Q4_K / Q5_K: the 6-bit scales and minimums of the 8 sub-blocks of 32, from their 12 bytes
// (scale j < 4: bits 0-5 of byte j; j >= 4: the low nibble of byte j + 4 and bits 6-7 of byte
// j - 4; minimums likewise from bytes j + 4, and the high nibbles and byte j), each given to
// its two groups of 16. Rearranged four bytes at a time, as llama.cpp does.
inline void k4_scales(const uint8_t* packed, SuperBlock* s) {
  uint32_t words[4];
  std::memcpy(words, packed, 12);
  const uint32_t six = 0x3f3f3f3f, nibble = 0x0f0f0f0f, two = 0x03030303;
  words[3] = ((words[2] >> 4) & nibble) | (((words[1] >> 6) & two) << 4);
  const uint32_t mins = words[1] & six;
  words[1] = (words[2] & nibble) | (((words[0] >> 6) & two) << 4);
  words[2] = mins;
  words[0] &= six;
#if defined(PYHLO_KQ_AVX512) || defined(PYHLO_KQ_AVX2)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));   // 8 scales, 8 minimums
  _mm256_store_si256(reinterpret_cast<__m256i*>(s->scale), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes, bytes)));
  _mm256_store_si256(reinterpret_cast<__m256i*>(s->low), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(bytes, bytes)));
#else
  uint8_t bytes[16];
  std::memcpy(bytes, words, sizeof(bytes));
  for (int j = 0; j < 16; ++j) {
    s->scale[j] = bytes[j / 2];
    s->low[j] = bytes[8 + j / 2];
  }
#endif
}

inline void centred(int centre, SuperBlock* s) {
  s->centre = centre;
  s->dlow = -s->d;
  for (int j = 0; j < 16; ++j) s->low[j] = int16_t(centre * s->scale[j]);
}

inline void pair_scales(SuperBlock* s) {
#ifdef PYHLO_KQ_AVX512
  // Pair p of a group of 64 values c takes the scale of its 16 values: 4 c + p / 8.
  const __m512i scales = _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(s->scale)));
  alignas(64) static const int16_t eighth[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
  const __m512i index = _mm512_load_si512(eighth);
  for (int c = 0; c < 4; ++c)
    _mm512_store_si512(s->pair_scale + 32 * c,
                       _mm512_permutexvar_epi16(_mm512_add_epi16(index, _mm512_set1_epi16(int16_t(4 * c))), scales));
#else
  for (int p = 0; p < kSuperValues / 2; ++p) s->pair_scale[p] = s->scale[p / 8];
#endif
}

inline void unpack_q2_k(const uint8_t* b, SuperBlock* s) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  s->d = f16_at(b + 80);
  s->dlow = -f16_at(b + 82);
  s->centre = 0;
  // Value 128 r + 32 i + j: bits 2i of byte 32 r + j; 16 groups of 16, each a scale and a minimum.
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 32; ++j) s->q[128 * r + 32 * i + j] = uint8_t((qs[32 * r + j] >> (2 * i)) & 3);
  for (int j = 0; j < 16; ++j) {
    s->scale[j] = int16_t(scales[j] & 0xF);
    s->low[j] = int16_t(scales[j] >> 4);
  }
}

inline void unpack_q3_k(const uint8_t* b, SuperBlock* s) {
  const uint8_t* mask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* packed = b + 96;
  s->d = f16_at(b + 108);
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? packed[j] & 0xF : packed[j - 8] >> 4;
    const int top = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
    s->scale[j] = int16_t((low | (top << 4)) - 32);
  }
  // Value 128 r + 32 i + j: bits 2i of byte 32 r + j, plus 4 where bit 4 r + i of mask byte j is
  // set (the file's value is that minus 4).
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 32; ++j)
        s->q[128 * r + 32 * i + j] = uint8_t(((qs[32 * r + j] >> (2 * i)) & 3) | (((mask[j] >> (4 * r + i)) & 1) << 2));
  centred(4, s);
}

// Q4_K (high = nullptr) and Q5_K: value 64 c + l takes the low nibble of byte 32 c + l of qs,
// value 64 c + 32 + l its high nibble; Q5_K's value 32 j + l adds bit j of high[l] as 16.
inline void unpack_q45_k(const uint8_t* b, const uint8_t* high, const uint8_t* qs, SuperBlock* s) {
  s->d = f16_at(b);
  s->dlow = -f16_at(b + 2);
  s->centre = 0;
  k4_scales(b + 4, s);
#ifdef PYHLO_KQ_AVX512
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i top = high ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)))
                           : _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nibble)),
                                   _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), 1);
    if (high) {
      const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * c))),
                                              _mm256_set1_epi8(char(1 << (2 * c + 1))), 1);
      q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(top, bits), q, _mm512_set1_epi8(16));
    }
    _mm512_store_si512(s->q + 64 * c, q);
  }
#elif defined(PYHLO_KQ_AVX2)
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i top = high ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)) : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m256i q[2] = {_mm256_and_si256(bytes, nibble), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
    for (int h = 0; h < 2 && high; ++h) {
      const __m256i bit = _mm256_set1_epi8(char(1 << (2 * c + h)));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(top, bit), bit);
      q[h] = _mm256_or_si256(q[h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(s->q + 64 * c), q[0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(s->q + 64 * c + 32), q[1]);
  }
#else
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i) {
      const uint8_t byte = qs[(j / 2) * 32 + i];
      int q = j % 2 ? byte >> 4 : byte & 0xF;
      if (high) q |= ((high[i] >> j) & 1) << 4;
      s->q[j * 32 + i] = uint8_t(q);
    }
#endif
}

#ifdef PYHLO_KQ_AVX512
// A Q6_K super-block's 256 values (0..63, layout as unpack_q6_k's) in 4 vectors of 64, from its
// ql and qh. Within a 16-bit lane both bytes shift alike, and the bits taken (4 and 5 of each
// byte) come from the same byte: the first 32 values take bits 0-1 (shifted up 4), the next 32
// bits 2-3 (up 2); after a shift down by 4, bits 4-5 and 6-7.
inline void q6_k_vectors(const uint8_t* ql, const uint8_t* qh, __m512i q[4]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30);
  const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  for (int h = 0; h < 2; ++h) {
    const __m512i low = _mm512_loadu_si512(ql + 64 * h);
    const __m512i top = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h)));
    q[2 * h] = _mm512_or_si512(_mm512_and_si512(low, nibble), _mm512_and_si512(_mm512_sllv_epi16(top, up), pair));
    q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
                                   _mm512_and_si512(_mm512_sllv_epi16(_mm512_srli_epi16(top, 4), up), pair));
  }
}
#endif

// Q6_K: each half h of 128 values: value 32 s + i takes a nibble of byte 64 h + 32 (s % 2) + i
// of ql (low for s < 2) and, as 16 and 32, bits 2 s of byte 32 h + i of qh.
inline void unpack_q6_k(const uint8_t* b, SuperBlock* s) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  s->d = f16_at(b + 208);
  for (int j = 0; j < 16; ++j) s->scale[j] = int16_t(int8_t(b[192 + j]));
#ifdef PYHLO_KQ_AVX512
  __m512i q[4];
  q6_k_vectors(ql, qh, q);
  for (int v = 0; v < 4; ++v) _mm512_store_si512(s->q + 64 * v, q[v]);
#elif defined(PYHLO_KQ_AVX2)
  const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
    const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
    // Bits 2 s and 2 s + 1 of each byte of qh moved to bits 4 and 5 (a 16-bit shift keeps
    // them within their byte).
    const __m256i tops[4] = {_mm256_and_si256(_mm256_slli_epi16(top, 4), pair),
                             _mm256_and_si256(_mm256_slli_epi16(top, 2), pair), _mm256_and_si256(top, pair),
                             _mm256_and_si256(_mm256_srli_epi16(top, 2), pair)};
    const __m256i lows[4] = {_mm256_and_si256(a, nibble), _mm256_and_si256(c, nibble),
                             _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble),
                             _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble)};
    for (int part = 0; part < 4; ++part)
      _mm256_store_si256(reinterpret_cast<__m256i*>(s->q + 128 * h + 32 * part),
                         _mm256_or_si256(lows[part], tops[part]));
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 32; ++i) {
      const uint8_t a = ql[64 * h + i], c = ql[64 * h + 32 + i], top = qh[32 * h + i];
      s->q[128 * h + i] = uint8_t((a & 0xF) | ((top & 3) << 4));
      s->q[128 * h + 32 + i] = uint8_t((c & 0xF) | (((top >> 2) & 3) << 4));
      s->q[128 * h + 64 + i] = uint8_t((a >> 4) | (((top >> 4) & 3) << 4));
      s->q[128 * h + 96 + i] = uint8_t((c >> 4) | (((top >> 6) & 3) << 4));
    }
#endif
  centred(32, s);
}

// The super-block of `form` at `b`; with_pairs: pair_scale too (the integer dot reads it).
inline void unpack(KQuant form, const uint8_t* b, SuperBlock* s, bool with_pairs) {
  switch (form) {
    case KQuant::kQ2_K: unpack_q2_k(b, s); break;
    case KQuant::kQ3_K: unpack_q3_k(b, s); break;
    case KQuant::kQ4_K: unpack_q45_k(b, nullptr, b + 16, s); break;
    case KQuant::kQ5_K: unpack_q45_k(b, b + 16, b + 48, s); break;
    case KQuant::kQ6_K: unpack_q6_k(b, s); break;
  }
  if (with_pairs) pair_scales(s);
}

// One activation row rounded per 256 values as llama.cpp's quantize_row_q8_K does: the value
// of largest magnitude `max` (the first, if several), iscale = -127 / max, q = nearest
// integer to iscale * x (ties to even), at most 127; d = 1 / iscale (negative where max is
// positive: the signs cancel); bsum: the sums of q over each 16. A block of zeros is d = 0.
inline void quantize_q8_k(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsum) {
  for (int64_t b = 0; b < k / kSuperValues; ++b, x += kSuperValues, q += kSuperValues) {
    // The largest magnitude and the first value that has it.
#ifdef PYHLO_KQ_AVX512
    __m512 peak = _mm512_setzero_ps();
    for (int j = 0; j < kSuperValues; j += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    const float amax = _mm512_reduce_max_ps(peak);
    float max = amax;
    for (int j = 0; j < kSuperValues; j += 16) {
      const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (at) {
        max = x[j + __builtin_ctz(at)];
        break;
      }
    }
#else
    float max = 0, amax = 0;
    for (int j = 0; j < kSuperValues; ++j) {
      const float ax = x[j] < 0 ? -x[j] : x[j];
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
#endif
    if (amax == 0) {
      d[b] = 0;
      std::memset(q, 0, kSuperValues);
      std::memset(bsum + 16 * b, 0, 16 * sizeof(int16_t));
      continue;
    }
    const float iscale = -127.f / max;
    // The nearest integer to the rounded f32 product, ties to even (llama.cpp's nearest_int).
    // Not its 1.5 * 2^23 addition: compilers fuse that with the product into one FMA, which
    // skips the product's rounding and moves a value now and then by one.
#ifdef PYHLO_KQ_AVX512
    for (int j = 0; j < kSuperValues; j += 16) {
      const __m512 product = _mm512_mul_ps(_mm512_set1_ps(iscale), _mm512_loadu_ps(x + j));
      const __m512i v = _mm512_min_epi32(_mm512_cvt_roundps_epi32(product, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                         _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtsepi32_epi8(v));
      bsum[16 * b + j / 16] = int16_t(_mm512_reduce_add_epi32(v));
    }
#else
    for (int j = 0; j < kSuperValues; ++j) {
      const int v = int(std::nearbyint(iscale * x[j]));
      q[j] = int8_t(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; ++j) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[16 * j + i];
      bsum[16 * b + j] = int16_t(sum);
    }
#endif
    d[b] = 1 / iscale;
  }
}


// The exact product of unpacked super-blocks w with G activation rows x[g] (and the sums of
// each 16 of them, x_sums[g]), added to out[g]: sum_i (d * scale) * (q_i - centre) * x_i, plus
// (dlow * low) * (the sum of the 16 x) where the form is not centred; (d * scale) * (q - centre)
// is the gguf package's value of a centred form, rounded once as there (f32 sums either way).
template <int G>
void dot_f32(const SuperBlock* w, int64_t blocks, const float* const* x, const float* const* x_sums, float* out) {
#ifdef PYHLO_KQ_AVX512
  // Two sums a row, even and odd groups of 16, so that the multiply-adds do not wait on each other.
  __m512 acc[G][2];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const SuperBlock& s = w[b];
    alignas(64) float step[16];
    const __m512 d = _mm512_set1_ps(s.d);
    _mm512_store_ps(step, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
                                               _mm256_load_si256(reinterpret_cast<const __m256i*>(s.scale))))));
    const __m512i centre = _mm512_set1_epi32(s.centre);
    #pragma GCC unroll 16   // acc[g][j & 1] a fixed register, not a run-time index into memory
    for (int j = 0; j < 16; ++j) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(
          _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(s.q + 16 * j))), centre));
      const __m512 v = _mm512_mul_ps(q, _mm512_set1_ps(step[j]));
      for (int g = 0; g < G; ++g)
        acc[g][j & 1] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x[g] + b * kSuperValues + 16 * j), acc[g][j & 1]);
    }
    if (!s.centre) {
      const __m512 offsets = _mm512_mul_ps(_mm512_set1_ps(s.dlow), _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
                                               _mm256_load_si256(reinterpret_cast<const __m256i*>(s.low)))));
      for (int g = 0; g < G; ++g) acc[g][0] = _mm512_fmadd_ps(offsets, _mm512_loadu_ps(x_sums[g] + 16 * b), acc[g][0]);
    }
  }
  for (int g = 0; g < G; ++g) out[g] += _mm512_reduce_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]));
#elif defined(PYHLO_KQ_AVX2)
  // 16 values a group: their bytes in both halves of a vector, placed in 32-bit lanes by
  // vpshufb (byte_lanes.h), q - centre in
  // integers, times the group's d * scale. The loop over groups is unrolled so that each sum
  // is a register (a run-time index kept them in memory: a store on every multiply-add).
  const __m256i first = byte_lanes(0), second = byte_lanes(8);
  __m256 acc[G][2];
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const SuperBlock& s = w[b];
    alignas(32) float step[16];
    #pragma GCC unroll 2
    for (int half = 0; half < 2; ++half)
      _mm256_store_ps(step + 8 * half, _mm256_mul_ps(_mm256_set1_ps(s.d), _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                                           _mm_load_si128(reinterpret_cast<const __m128i*>(s.scale + 8 * half))))));
    const __m256i centre = _mm256_set1_epi32(s.centre);
    #pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const __m256i bytes = both_halves(s.q + 16 * j);
      const __m256 scale = _mm256_broadcast_ss(step + j);
      const __m256 v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_shuffle_epi8(bytes, first), centre)), scale);
      const __m256 v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_shuffle_epi8(bytes, second), centre)), scale);
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const float* xj = x[g] + b * kSuperValues + 16 * j;
        acc[g][0] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(xj), acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xj + 8), acc[g][1]);
      }
    }
    if (!s.centre) {
      #pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m256 offsets = _mm256_mul_ps(_mm256_set1_ps(s.dlow), _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                                                 _mm_load_si128(reinterpret_cast<const __m128i*>(s.low + 8 * half)))));
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
          acc[g][half] = _mm256_fmadd_ps(offsets, _mm256_loadu_ps(x_sums[g] + 16 * b + 8 * half), acc[g][half]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) out[g] += sum8(_mm256_add_ps(acc[g][0], acc[g][1]));
#else
  for (int64_t b = 0; b < blocks; ++b) {
    const SuperBlock& s = w[b];
    for (int g = 0; g < G; ++g) {
      const float* xb = x[g] + b * kSuperValues;
      float total = 0;
      for (int j = 0; j < 16; ++j) {
        const float step = s.d * float(s.scale[j]);
        for (int i = 0; i < 16; ++i) total += step * float(int(s.q[16 * j + i]) - s.centre) * xb[16 * j + i];
        if (!s.centre) total += s.dlow * float(s.low[j]) * x_sums[g][16 * b + j];
      }
      out[g] += total;
    }
  }
#endif
}

// sum over `blocks` unpacked super-blocks w of the product with one rounded activation row
// (q, d, bsum): per block, d_x * (d * sum_i scale * q_w * q_x + dlow * sum_16 low * bsum).
// Unsigned weights times signed activations, two products summed into 16 bits (at most
// 2 * 63 * 127, no saturation), then times the pair's scale into 32-bit sums (VNNI's
// vpdpwssd where the CPU has it).
inline float dot_q8_k(const SuperBlock* w, const int8_t* xq, const float* xd, const int16_t* xbsum,
                      int64_t blocks) {
#ifdef PYHLO_KQ_AVX512
  __m512 acc = _mm512_setzero_ps();
  __m256 acc_low = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const SuperBlock& s = w[b];
    const int8_t* x = xq + b * kSuperValues;
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i products = _mm512_maddubs_epi16(_mm512_load_si512(s.q + 64 * c), _mm512_loadu_si512(x + 64 * c));
      const __m512i scales = _mm512_load_si512(s.pair_scale + 32 * c);
#ifdef __AVX512VNNI__
      sum = _mm512_dpwssd_epi32(sum, products, scales);
#else
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(products, scales));
#endif
    }
    const __m256i lows = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(s.low)),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xbsum + 16 * b)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xd[b] * s.d), acc);
    acc_low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lows), _mm256_set1_ps(xd[b] * s.dlow), acc_low);
  }
  return _mm512_reduce_add_ps(acc) + sum8(acc_low);
#elif defined(PYHLO_KQ_AVX2)
  __m256 acc = _mm256_setzero_ps(), acc_low = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const SuperBlock& s = w[b];
    const int8_t* x = xq + b * kSuperValues;
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i products = _mm256_maddubs_epi16(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(s.q + 32 * c)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c)));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(
          products, _mm256_load_si256(reinterpret_cast<const __m256i*>(s.pair_scale + 16 * c))));
    }
    const __m256i lows = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(s.low)),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xbsum + 16 * b)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(xd[b] * s.d), acc);
    acc_low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lows), _mm256_set1_ps(xd[b] * s.dlow), acc_low);
  }
  return sum8(_mm256_add_ps(acc, acc_low));
#else
  float total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const SuperBlock& s = w[b];
    const int8_t* x = xq + b * kSuperValues;
    int32_t sum = 0, lows = 0;
    for (int j = 0; j < 16; ++j) {
      int32_t part = 0;
      for (int i = 0; i < 16; ++i) part += int32_t(s.q[16 * j + i]) * x[16 * j + i];
      sum += s.scale[j] * part;
      lows += s.low[j] * xbsum[16 * b + j];
    }
    total += xd[b] * s.d * float(sum) + xd[b] * s.dlow * float(lows);
  }
  return total;
#endif
}

// Rows of activations rounded as Q8_K (quantize_q8_k), for the row kernels below: row g's
// values at q + g * k, its scales at d + g * (k / 256), its sums of 16 at bsum + g * (k / 16);
// q_nibbles: the same values with each 128 in the order a Q4_K or Q5_K super-block keeps its
// nibbles in (nibble_order_q8_k); the pointers may start inside the rows (at a super-block).
struct Q8KRows {
  const int8_t* q;
  const int8_t* q_nibbles;
  const float* d;
  const int16_t* bsum;
  int64_t k;   // values in a whole row: the rows' stride
};

// Rounded activations q (k values, a multiple of 256) in the order of a Q4_K or Q5_K
// super-block's nibbles: 64 bytes of qs hold values 0-31 and 64-95 in their low nibbles, 32-63
// and 96-127 in their high ones, so each 128 values go as 0-31, 64-95, 32-63, 96-127, and the
// kernels multiply the nibbles where they lie.
inline void nibble_order_q8_k(const int8_t* q, int64_t k, int8_t* out) {
  for (int64_t i = 0; i < k; i += 128) {
    std::memcpy(out + i, q + i, 32);
    std::memcpy(out + i + 32, q + i + 64, 32);
    std::memcpy(out + i + 64, q + i + 32, 32);
    std::memcpy(out + i + 96, q + i + 96, 32);
  }
}

#if defined(PYHLO_KQ_AVX512) || defined(PYHLO_KQ_AVX2)
// k4_scales' rearrangement done in a register, with no round trip through memory: the 8
// scales in bytes 0-7, the 8 minimums in bytes 8-15, from the 12 bytes at `packed` (16 read:
// the 4 after them belong to the same super-block).
inline __m128i k4_scales_in_register(const uint8_t* packed) {
  const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));   // w0 w1 w2 (w3)
  // Lanes 0 and 2 (scales and minimums 0-3): w0, w1 & 0x3f...; lanes 1 and 3 (4-7): the
  // nibbles of w2 (low, then high) and bits 6-7 of w0, w1 as bits 4-5.
  const __m128i nibbles = _mm_srlv_epi32(_mm_shuffle_epi32(words, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i low = _mm_and_si128(nibbles, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(words, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                    _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(low, top);
}

// Bytes of the weight stream asked for ahead of the super-block in hand: a thread's rows lie
// one after another, so this runs into the next rows. A page ahead measured faster than 1 KB
// (about 17 against 13 GB/s from memory on one core of the EPYC host, weights on 4 KB pages).
constexpr int64_t kKQuantPrefetchAhead = 4096;

// Asks for the weight bytes kKQuantPrefetchAhead past the super-block of `bytes` at `block`.
inline void prefetch_ahead(const uint8_t* block, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block) + kKQuantPrefetchAhead + line, _MM_HINT_T0);
}
#endif

#ifdef PYHLO_KQ_AVX512
// The int8-activation product of a weight row kept as the file's bytes, each super-block
// unpacked in registers and multiplied at once, as llama.cpp's ggml_vec_dot_q4_K_q8_K (q5_K,
// q6_K) do: no SuperBlock is stored, and each super-block's weights, unpacked once, serve G
// activation rows. The integer sums are dot_q8_k's; only the order of the f32 sums differs.
//
// A super-block in registers: 4 vectors of 64 unsigned weights (Q6_K: values 64 v .. 64 v + 63;
// Q4_K and Q5_K: in nibble order, see nibble_order_q8_k) and for each the 16-bit scale of every
// pair of values (the 32 products vpmaddubsw gives); `lows` the 16-bit factor of each 16's
// activation sum (Q4_K, Q5_K: its minimum; Q6_K: its scale, the centre 32 taken off through
// those sums).
struct RegisterBlock {
  __m512i q[4];
  __m512i pair_scale[4];
  __m256i lows;
  float d, dmin;   // Q4_K, Q5_K: value = d * scale * q - dmin * minimum
};

// Byte shuffles (vpshufb, within 128-bit lanes) that give each pair p of values in vector v its
// 16-bit scale from a lane of 8 scales.
// Q4_K / Q5_K, scales per 32: vector 2 h + u holds sub-blocks 4 h + u (p < 16) and 4 h + u + 2;
// Q6_K, scales per 16: 4 v + p / 8, taken from a lane of scales 0-7 (v < 2) or 8-15.
inline __m512i pair_shuffle(int v, bool q6) {
  alignas(64) int8_t control[64];
  for (int p = 0; p < 32; ++p) {
    const int scale = q6 ? (4 * v + p / 8) % 8 : 4 * (v / 2) + v % 2 + (p < 16 ? 0 : 2);
    control[2 * p] = int8_t(2 * scale);
    control[2 * p + 1] = int8_t(2 * scale + 1);
  }
  return _mm512_load_si512(control);
}

// Q4_K (high = nullptr) and Q5_K: layouts as unpack_q45_k's.
inline void load_q45_k(const uint8_t* b, const uint8_t* high, const uint8_t* qs, const __m512i* shuffle,
                       RegisterBlock* r) {
  int32_t halves;
  std::memcpy(&halves, b, sizeof(halves));
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));   // d, dmin
  r->d = _mm_cvtss_f32(both);
  r->dmin = _mm_cvtss_f32(_mm_movehdup_ps(both));
  const __m128i bytes = k4_scales_in_register(b + 4);   // 8 scales, 8 minimums
  const __m512i scales = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(bytes));
  r->lows = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(bytes, bytes));   // each minimum for its two 16s
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i top = high ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)))
                           : _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i packed = _mm512_loadu_si512(qs + 64 * h);
    r->q[2 * h] = _mm512_and_si512(packed, nibble);
    r->q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  }
  for (int v = 0; v < 4; ++v) {
    if (high) {
      // Q5_K's fifth bit: bit j of high[l] for value 32 j + l, sub-block j.
      const int j = 4 * (v / 2) + v % 2;
      const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << j)), _mm256_set1_epi8(char(1 << (j + 2))), 1);
      r->q[v] = _mm512_mask_add_epi8(r->q[v], _mm512_test_epi8_mask(top, bits), r->q[v], _mm512_set1_epi8(16));
    }
    r->pair_scale[v] = _mm512_shuffle_epi8(scales, shuffle[v]);
  }
}

// Q6_K: layout as unpack_q6_k's.
inline void load_q6_k(const uint8_t* b, const __m512i* shuffle, RegisterBlock* r) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  r->d = f16_at(b + 208);
  r->lows = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  const __m512i scales[2] = {_mm512_broadcast_i32x4(_mm256_castsi256_si128(r->lows)),
                             _mm512_broadcast_i32x4(_mm256_extracti128_si256(r->lows, 1))};
  q6_k_vectors(ql, qh, r->q);
  for (int v = 0; v < 4; ++v) r->pair_scale[v] = _mm512_shuffle_epi8(scales[v / 2], shuffle[v]);
}

// sum += products * scales in 32-bit lanes (VNNI's vpdpwssd where the CPU has it).
inline __m512i add_scaled(__m512i sum, __m512i products, __m512i scales) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(sum, products, scales);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(products, scales));
#endif
}

// out[g] += the product of the weight row w (`blocks` super-blocks of F, the file's bytes)
// with activation row g of x, for g < G.
template <KQuant F, int G>
void dot_q8_k_row(const uint8_t* w, int64_t blocks, const Q8KRows& x, float* out) {
  constexpr bool q6 = F == KQuant::kQ6_K;
  constexpr int64_t bytes = F == KQuant::kQ4_K ? 144 : F == KQuant::kQ5_K ? 176 : 210;
  const int8_t* xq = q6 ? x.q : x.q_nibbles;
  __m512i shuffle[4];
  for (int v = 0; v < 4; ++v) shuffle[v] = pair_shuffle(v, q6);
  __m512 acc[G];
  __m256 acc_low[G];   // Q4_K, Q5_K: the minimums' terms
  for (int g = 0; g < G; ++g) {
    acc[g] = _mm512_setzero_ps();
    acc_low[g] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    prefetch_ahead(block, bytes);
    RegisterBlock r;
    if constexpr (F == KQuant::kQ4_K) load_q45_k(block, nullptr, block + 16, shuffle, &r);
    if constexpr (F == KQuant::kQ5_K) load_q45_k(block, block + 16, block + 48, shuffle, &r);
    if constexpr (q6) load_q6_k(block, shuffle, &r);
    for (int g = 0; g < G; ++g) {
      const int8_t* xg = xq + g * x.k + b * kSuperValues;
      __m512i sum = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v)
        sum = add_scaled(sum, _mm512_maddubs_epi16(r.q[v], _mm512_loadu_si512(xg + 64 * v)), r.pair_scale[v]);
      const __m256i lows = _mm256_madd_epi16(
          r.lows, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum + g * (x.k / 16) + 16 * b)));
      const float xd = x.d[g * (x.k / kSuperValues) + b];
      if constexpr (q6) {
        // The centre's sums (32 * scale * sum of 16) join the integer sum: within 2^29, no overflow.
        sum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(_mm256_slli_epi32(lows, 5)));
      } else {
        acc_low[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lows), _mm256_set1_ps(xd * r.dmin), acc_low[g]);
      }
      acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xd * r.d), acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) out[g] += _mm512_reduce_add_ps(acc[g]) - sum8(acc_low[g]);
}
#elif defined(PYHLO_KQ_AVX2)
// The same in 256-bit vectors: a super-block is 8 vectors of 32 values in their order (a Q4_K /
// Q5_K nibble run of 32 bytes is one sub-block of 32), taken one at a time against every
// activation row so that the sums of G rows and the vector in hand fit in the 16 registers.

// Vector i (values 32 i .. 32 i + 31) of the super-block of F at b, as unsigned bytes.
template <KQuant F>
inline __m256i weights_avx2(const uint8_t* b, int i) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if constexpr (F == KQuant::kQ6_K) {
    // ql byte 64 h + 32 (part % 2) + l, its low nibble for part < 2; qh byte 32 h + l, bits 2 part.
    const int h = i / 4, part = i % 4;
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (part % 2)));
    const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i nibbles = part < 2 ? _mm256_and_si256(low, nibble)
                                     : _mm256_and_si256(_mm256_srli_epi16(low, 4), nibble);
    const __m256i shifted = part == 0 ? _mm256_slli_epi16(top, 4) : part == 1 ? _mm256_slli_epi16(top, 2)
                            : part == 2 ? top : _mm256_srli_epi16(top, 2);
    return _mm256_or_si256(nibbles, _mm256_and_si256(shifted, _mm256_set1_epi8(0x30)));
  } else {
    const uint8_t* qs = b + (F == KQuant::kQ5_K ? 48 : 16);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (i / 2)));
    __m256i q = i % 2 ? _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble) : _mm256_and_si256(packed, nibble);
    if constexpr (F == KQuant::kQ5_K) {
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i bit = _mm256_set1_epi8(char(1 << i));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
      q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return q;
  }
}

// Byte shuffles giving the 16 pair products of vector i their 16-bit scale from a 128-bit lane
// of 8 scales. Q4_K / Q5_K: scale i (one a sub-block of 32); Q6_K: scales 2 i (first 8 pairs)
// and 2 i + 1, taken from the lane of scales 0-7 (i < 4) or 8-15.
inline void pair_shuffles_avx2(bool q6, __m256i* shuffles) {
  for (int i = 0; i < 8; ++i) {
    alignas(32) int8_t control[32];
    for (int p = 0; p < 16; ++p) {
      const int scale = q6 ? (2 * i + p / 8) % 8 : i;
      control[2 * p] = int8_t(2 * scale);
      control[2 * p + 1] = int8_t(2 * scale + 1);
    }
    shuffles[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(control));
  }
}

template <KQuant F, int G>
void dot_q8_k_row(const uint8_t* w, int64_t blocks, const Q8KRows& x, float* out) {
  constexpr bool q6 = F == KQuant::kQ6_K;
  constexpr int64_t bytes = F == KQuant::kQ4_K ? 144 : F == KQuant::kQ5_K ? 176 : 210;
  __m256i shuffles[8];
  pair_shuffles_avx2(q6, shuffles);
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    prefetch_ahead(block, bytes);
    float d, dmin = 0;
    __m256i lows, scales[2];   // scales: lanes of 8 16-bit scales (Q6_K: 0-7, 8-15)
    if constexpr (q6) {
      d = f16_at(block + 208);
      lows = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
      scales[0] = _mm256_permute2x128_si256(lows, lows, 0x00);
      scales[1] = _mm256_permute2x128_si256(lows, lows, 0x11);
    } else {
      d = f16_at(block);
      dmin = f16_at(block + 2);
      const __m128i packed = k4_scales_in_register(block + 4);   // 8 scales, 8 minimums
      scales[0] = scales[1] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
      lows = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(packed, packed));
    }
    __m256i sum[G];
    for (int g = 0; g < G; ++g) sum[g] = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      const __m256i q = weights_avx2<F>(block, i);
      const __m256i scale = _mm256_shuffle_epi8(scales[i / 4], shuffles[i]);
      for (int g = 0; g < G; ++g) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + g * x.k + b * kSuperValues + 32 * i));
        sum[g] = _mm256_add_epi32(sum[g], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256i low_sums = _mm256_madd_epi16(
          lows, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum + g * (x.k / 16) + 16 * b)));
      const float xd = x.d[g * (x.k / kSuperValues) + b];
      if constexpr (q6) {
        sum[g] = _mm256_sub_epi32(sum[g], _mm256_slli_epi32(low_sums, 5));
      } else {
        acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low_sums), _mm256_set1_ps(-xd * dmin), acc[g]);
      }
      acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[g]), _mm256_set1_ps(xd * d), acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) out[g] += sum8(acc[g]);
}
#endif

#if defined(PYHLO_KQ_AVX512) || defined(PYHLO_KQ_AVX2)

template <KQuant F>
void dot_q8_k_rows_of(const uint8_t* w, int64_t blocks, Q8KRows x, int64_t rows, float* out) {
#ifdef PYHLO_KQ_AVX512
  constexpr int kMost = 8;   // activation rows a pass: their sums stay in registers
#else
  constexpr int kMost = 4;
#endif
  for (; rows >= kMost; rows -= kMost, out += kMost) {
    dot_q8_k_row<F, kMost>(w, blocks, x, out);
    x.q += kMost * x.k;
    if (x.q_nibbles) x.q_nibbles += kMost * x.k;
    x.d += kMost * (x.k / kSuperValues);
    x.bsum += kMost * (x.k / 16);
  }
  switch (rows) {
    case 7: dot_q8_k_row<F, kMost == 8 ? 7 : 1>(w, blocks, x, out); break;
    case 6: dot_q8_k_row<F, kMost == 8 ? 6 : 1>(w, blocks, x, out); break;
    case 5: dot_q8_k_row<F, kMost == 8 ? 5 : 1>(w, blocks, x, out); break;
    case 4: dot_q8_k_row<F, kMost == 8 ? 4 : 1>(w, blocks, x, out); break;
    case 3: dot_q8_k_row<F, 3>(w, blocks, x, out); break;
    case 2: dot_q8_k_row<F, 2>(w, blocks, x, out); break;
    case 1: dot_q8_k_row<F, 1>(w, blocks, x, out); break;
    default: break;
  }
}
#endif

#ifdef PYHLO_KQ_AVX2
// The exact product (dot_f32's arithmetic: (d * scale) * (q - centre) times x in f32, plus
// (dlow * low) times the sums of each 16 x where the form is not centred) of a weight row of
// F's super-blocks as the file stores them, decoded in registers (weights_avx2) rather than
// unpacked into a SuperBlock and read back: on a Zen 3 host a 1.7 B Q4_K_M decode step spent
// a third of its time unpacking. Each vector of 32 values is split into four of 8 f32: its
// halves put in both halves of a vector (vpermq), bytes to 32-bit lanes by vpshufb.
template <KQuant F, int G>
void dot_f32_row(const uint8_t* w, int64_t blocks, const float* const* x, const float* const* x_sums, float* out) {
  constexpr bool q6 = F == KQuant::kQ6_K;
  constexpr int64_t bytes = F == KQuant::kQ4_K ? 144 : F == KQuant::kQ5_K ? 176 : 210;
  const __m256i first = byte_lanes(0), second = byte_lanes(8);
  constexpr int U = G == 1 ? 4 : 2;   // sums per activation row: chains of multiply-adds that do not wait on each other
  __m256 acc[G][U];
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    #pragma GCC unroll 4
    for (int u = 0; u < U; ++u) acc[g][u] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    prefetch_ahead(block, bytes);
    // step[j]: d * scale of the j-th 16 values; Q6_K's centre 32 enters as -32 * step (exact:
    // a power of two), so one multiply-add gives (q - 32) * step rounded once.
    alignas(32) float step[16], offset[16];
    if constexpr (q6) {
      const __m256 d = _mm256_set1_ps(f16_at(block + 208));
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      #pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m256 st = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8 * half))));
        _mm256_store_ps(step + 8 * half, st);
        _mm256_store_ps(offset + 8 * half, _mm256_mul_ps(st, _mm256_set1_ps(-32.f)));
      }
    } else {
      const __m256 d = _mm256_set1_ps(f16_at(block)), dlow = _mm256_set1_ps(-f16_at(block + 2));
      const __m128i packed = k4_scales_in_register(block + 4);   // 8 scales, 8 minimums
      const __m128i scales = _mm_unpacklo_epi8(packed, packed), lows = _mm_unpackhi_epi8(packed, packed);
      #pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        _mm256_store_ps(step + 8 * half,
                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales, 8 * half)))));
        const __m256 low = _mm256_mul_ps(dlow, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lows, 8 * half))));
        #pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
          acc[g][half] = _mm256_fmadd_ps(low, _mm256_loadu_ps(x_sums[g] + 16 * b + 8 * half), acc[g][half]);
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i q = weights_avx2<F>(block, i);   // values 32 i .. 32 i + 31
      const __m256i head = _mm256_permute4x64_epi64(q, 0x44), tail = _mm256_permute4x64_epi64(q, 0xEE);
      const __m256i picked[4] = {_mm256_shuffle_epi8(head, first), _mm256_shuffle_epi8(head, second),
                                 _mm256_shuffle_epi8(tail, first), _mm256_shuffle_epi8(tail, second)};
      __m256 v[4];
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 scale = _mm256_broadcast_ss(step + 2 * i + j / 2);
        v[j] = q6 ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(picked[j]), scale, _mm256_broadcast_ss(offset + 2 * i + j / 2))
                  : _mm256_mul_ps(_mm256_cvtepi32_ps(picked[j]), scale);
      }
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const float* xi = x[g] + b * kSuperValues + 32 * i;
        #pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[g][j % U] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xi + 8 * j), acc[g][j % U]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m256 sum = acc[g][0];
    #pragma GCC unroll 4
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[g][u]);
    out[g] += sum8(sum);
  }
}

template <KQuant F>
void dot_f32_rows_of(const uint8_t* w, int64_t blocks, const float* x, const float* x_sums, int64_t k, int64_t rows,
                     float* out) {
  constexpr int kMost = 4;
  for (int64_t m0 = 0; m0 < rows; m0 += kMost) {
    const float* xs[kMost];
    const float* sums[kMost];
    const int group = int(std::min<int64_t>(kMost, rows - m0));
    for (int g = 0; g < group; ++g) {
      xs[g] = x + (m0 + g) * k;
      sums[g] = x_sums + (m0 + g) * (k / 16);
    }
    switch (group) {
      case 4: dot_f32_row<F, 4>(w, blocks, xs, sums, out + m0); break;
      case 3: dot_f32_row<F, 3>(w, blocks, xs, sums, out + m0); break;
      case 2: dot_f32_row<F, 2>(w, blocks, xs, sums, out + m0); break;
      default: dot_f32_row<F, 1>(w, blocks, xs, sums, out + m0); break;
    }
  }
}
#endif

// The forms dot_f32_rows multiplies in registers on this build (the others: unpack(), then
// dot_f32()).
inline bool has_exact_row_kernel(KQuant form) {
#ifdef PYHLO_KQ_AVX2
  return form == KQuant::kQ4_K || form == KQuant::kQ5_K || form == KQuant::kQ6_K;
#else
  (void)form;
  return false;
#endif
}

// out[m] += the exact product of the weight row w (`blocks` super-blocks of `form`, the file's
// bytes) with activation row m of x ([rows, k]; x_sums [rows, k / 16]: the sums of each 16),
// for every m < rows; only for a form has_exact_row_kernel() names.
inline void dot_f32_rows(KQuant form, const uint8_t* w, int64_t blocks, const float* x, const float* x_sums,
                         int64_t k, int64_t rows, float* out) {
#ifdef PYHLO_KQ_AVX2
  switch (form) {
    case KQuant::kQ4_K: return dot_f32_rows_of<KQuant::kQ4_K>(w, blocks, x, x_sums, k, rows, out);
    case KQuant::kQ5_K: return dot_f32_rows_of<KQuant::kQ5_K>(w, blocks, x, x_sums, k, rows, out);
    case KQuant::kQ6_K: return dot_f32_rows_of<KQuant::kQ6_K>(w, blocks, x, x_sums, k, rows, out);
    default: break;
  }
#else
  (void)form, (void)w, (void)blocks, (void)x, (void)x_sums, (void)k, (void)rows, (void)out;
#endif
}

// The forms dot_q8_k_rows multiplies in registers on this build (the others: unpack(), then
// dot_q8_k()).
inline bool has_row_kernel(KQuant form) {
#if defined(PYHLO_KQ_AVX512) || defined(PYHLO_KQ_AVX2)
  return form == KQuant::kQ4_K || form == KQuant::kQ5_K || form == KQuant::kQ6_K;
#else
  (void)form;
  return false;
#endif
}

// out[m] += the product of the weight row w (`blocks` super-blocks of `form`, the file's bytes)
// with activation row m of x, for every m < rows; only for a form has_row_kernel() names (with
// AVX-512, Q4_K and Q5_K read x.q_nibbles; otherwise x.q).
inline void dot_q8_k_rows(KQuant form, const uint8_t* w, int64_t blocks, const Q8KRows& x, int64_t rows,
                          float* out) {
#if defined(PYHLO_KQ_AVX512) || defined(PYHLO_KQ_AVX2)
  switch (form) {
    case KQuant::kQ4_K: return dot_q8_k_rows_of<KQuant::kQ4_K>(w, blocks, x, rows, out);
    case KQuant::kQ5_K: return dot_q8_k_rows_of<KQuant::kQ5_K>(w, blocks, x, rows, out);
    case KQuant::kQ6_K: return dot_q8_k_rows_of<KQuant::kQ6_K>(w, blocks, x, rows, out);
    default: break;
  }
#endif
  (void)form, (void)w, (void)blocks, (void)x, (void)rows, (void)out;
}

}  // namespace pyhlo_kernels
