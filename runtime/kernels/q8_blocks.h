// llama.cpp's forms of 32-value blocks (Q5_0, Q5_1, Q8_0, Q4_0, Q4_1, IQ4_NL; IQ4_XS's
// sub-blocks) multiplied with int8 activations, as its CPU backend multiplies them: the
// activations rounded per 32 values as its x86 quantize_row_q8_0 / quantize_row_q8_1 round them
// (Q8_1 also keeps s = d * sum q, for the forms with a minimum), each block's product an
// integer sum scaled once.
//
// A weight block here is 32 signed integers w (the file's value less its centre: Q5_0's q - 16,
// Q4_0's q - 8, IQ4's table entry; Q5_1 and Q4_1 unsigned q) with its scale d_w and, for the
// forms with one, its minimum m_w: value j = d_w * w[j] (+ m_w).
//
// Paths: AVX-512 (BW, VL; vpdpbusd on VNNI where the CPU has it), AVX2, portable, as the compiler
// flags allow.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "vector_sum.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PYHLO_Q8B_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_Q8B_AVX2 1
#endif

namespace pyhlo_kernels {

constexpr int kBlockValues = 32;

// f32 to IEEE half bits, to nearest (ties to even), as llama.cpp stores a block's scale:
// F16C's conversion where the CPU has it, else bit arithmetic.
inline uint16_t f32_to_half(float value) {
#if defined(__F16C__)
  return _cvtss_sh(value, 0);   // 0: round to nearest even
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return uint16_t(sign | 0x7E00u);   // NaN
  if (bits >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds past 65504: infinity
  if (bits < 0x38800000u) {                                  // below 2^-14: a subnormal half
    float magnitude;
    std::memcpy(&magnitude, &bits, sizeof(magnitude));
    return uint16_t(sign | uint16_t(std::nearbyint(magnitude * 16777216.0f)));   // in units of 2^-24
  }
  uint32_t rebiased = bits - 0x38000000u;                    // exponent 127 -> 15
  rebiased += 0xFFFu + ((rebiased >> 13) & 1u);              // 23 -> 10 bits, ties to even
  return uint16_t(sign | uint16_t(rebiased >> 13));
#endif
}

inline float to_half_and_back(float value) { return half_to_f32(f32_to_half(value)); }

// One activation row rounded per 32 values as llama.cpp's x86 quantize_row_q8_1 rounds it (its
// quantize_row_q8_0 gives the same q and d): amax = max |x|, d = amax / 127 stored as f16, q =
// the nearest integer (ties to even) to x * (127 / amax); s = d * sum q (d before its f16
// rounding) stored as f16. d and s are returned as floats; a block of zeros is all zero.
inline void quantize_q8_1(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / kBlockValues; ++b, x += kBlockValues, q += kBlockValues) {
#ifdef PYHLO_Q8B_AVX512
    // The same numbers 16 at a time (the conversion rounds to nearest, ties to even, as
    // nearbyint; the saturating packs clamp).
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float scale = amax / 127.f, inverse = amax != 0 ? 127.f / amax : 0.0f;
    auto rounded = [&](__m512 v) {
      const __m512i i = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inverse)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
    };
    const __m512i q0 = rounded(x0), q1 = rounded(x1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(PYHLO_Q8B_AVX2)
    // The same numbers 8 at a time (the conversion rounds to nearest, ties to even; the
    // saturating packs clamp, as llama.cpp's AVX2 form).
    __m256 v[4];
    __m256 largest = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      largest = _mm256_max_ps(largest, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
    }
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    four = _mm_max_ss(four, _mm_movehdup_ps(four));
    const float amax = _mm_cvtss_f32(four);
    const float scale = amax / 127.f, inverse = amax != 0 ? 127.f / amax : 0.0f;
    __m256i q32[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      total = _mm256_add_epi32(total, q32[i]);
    }
    // Packing works within 128-bit lanes: the permute puts the 8 groups of 4 back in order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
    const int sum = _mm_cvtsi128_si32(sum4);
#else
    float amax = 0;
    for (int j = 0; j < kBlockValues; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float scale = amax / 127.f, inverse = amax != 0 ? 127.f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < kBlockValues; ++j) {
      const float v = std::nearbyint(x[j] * inverse);
      q[j] = int8_t(v > 127.f ? 127 : v < -128.f ? -128 : int(v));   // as llama.cpp's saturating packs
      sum += q[j];
    }
#endif
    d[b] = to_half_and_back(scale);
    s[b] = to_half_and_back(scale * float(sum));
  }
}

#if defined(PYHLO_Q8B_AVX512) || defined(PYHLO_Q8B_AVX2)
// One block's integer sum, 8 lanes: |w| times x with w's sign (unsigned by signed bytes, the
// form vpdpbusd and vpmaddubsw take; |w| <= 128 and |x| <= 127, so no 16-bit sum saturates).
inline __m256i block_sum_8(__m256i w, __m256i x) {
  const __m256i magnitude = _mm256_sign_epi8(w, w), signed_x = _mm256_sign_epi8(x, w);
#if defined(PYHLO_Q8B_AVX512) && defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
#endif
}
#endif

// sum over `blocks` blocks of 32: d_w[b] * d_x[b] * sum_j w[j] * x[j], plus m_w[b] * s_x[b]
// where the form has minimums (m_w not null), as llama.cpp's vec_dot_q5_1_q8_1 and the others.
inline float dot_q8_32(const int8_t* w, const float* w_d, const float* w_m, const int8_t* x, const float* x_d,
                       const float* x_s, int64_t blocks) {
  float minimums = 0;
  if (w_m != nullptr) {
    int64_t b = 0;
#if defined(PYHLO_Q8B_AVX512) || defined(PYHLO_Q8B_AVX2)
    // Eight blocks at a time, not one chain of dependent scalar adds.
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= blocks; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w_m + b), _mm256_loadu_ps(x_s + b), acc);
    minimums = sum8(acc);
#endif
    for (; b < blocks; ++b) minimums += w_m[b] * x_s[b];
  }
#ifdef PYHLO_Q8B_AVX512
  // Two blocks a step: lanes 0-7 the first block's sum, 8-15 the second's.
  __m512 acc = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const __m512i wv = _mm512_loadu_si512(w + kBlockValues * b), xv = _mm512_loadu_si512(x + kBlockValues * b);
    const __m512i signed_x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
#ifdef __AVX512VNNI__
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), signed_x);
#else
    const __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(wv), signed_x), _mm512_set1_epi16(1));
#endif
    const __m512 scale = _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_set1_ps(w_d[b] * x_d[b]),
                                              _mm512_set1_ps(w_d[b + 1] * x_d[b + 1]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc);
  }
  float total = _mm512_reduce_add_ps(acc);
  if (b < blocks) {
    const __m256i sum = block_sum_8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlockValues * b)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlockValues * b)));
    total += sum8(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(w_d[b] * x_d[b])));
  }
  return total + minimums;
#elif defined(PYHLO_Q8B_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i sum = block_sum_8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlockValues * b)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + kBlockValues * b)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(w_d[b] * x_d[b]), acc);
  }
  return sum8(acc) + minimums;
#else
  float total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int j = 0; j < kBlockValues; ++j) sum += int32_t(w[kBlockValues * b + j]) * x[kBlockValues * b + j];
    total += w_d[b] * x_d[b] * float(sum);
  }
  return total + minimums;
#endif
}

}  // namespace pyhlo_kernels
