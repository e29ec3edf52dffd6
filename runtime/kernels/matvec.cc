// pyhlo_matvec: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows of activations.
//
// The decode step of a decoder multiplies a handful of activation rows (batch lines)
// by every weight matrix once, so it is bound by how fast the weights stream from
// memory. This kernel reads each weight row once for all activation rows, accumulates
// in f32, and splits the weight rows between the caller and XLA's intra-op thread pool.
// bf16 weights are widened to f32 in registers, or, when x holds bf16 values (a bf16
// model's activations) and the CPU has AVX512-BF16, multiplied in bf16 pairs into f32
// sums (vdpbf16ps), which takes a quarter of the instructions.
//
// Operands: x f32[..., K] (the leading dims are the activation rows), or bf16 with bf16
// weights, w f32 or bf16 [N, K] row-major ("out, in", like torch's Linear). Result: y f32[..., N].
//
// pyhlo_matvec_s8: the same with int8 weights and one f32 scale per weight row (per
// output channel, symmetric): y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]. Each int8 is
// widened to f32 in registers, so a weight row streams a quarter of the f32 bytes.
//
// pyhlo_matvec_q8_0, _q4_0, _q4_1: weights in llama.cpp's GGUF block forms, as the file
// stores them, split into arrays: each row of K values is K/32 blocks, each with an f16
// scale d (scales f16[N, K/32]) and for Q4_1 an f16 minimum m (mins f16[N, K/32]). Q8_0
// values are s8[N, K] (w = d * q); Q4 values are u8[N, K/2], byte j of a block's 16 holding
// value j in its low nibble and value j + 16 in its high one (Q4_0: w = d * (q - 8);
// Q4_1: w = d * q + m). Each block is widened to f32 in registers and its partial sum
// multiplied by d; the -8 and the minimums are applied through the sums of x over each
// block, computed once per call.
//
// Paths: AVX-512 (16 floats a vector) where the CPU has it; on AVX2 hosts (most laptops,
// AMD Zen 3 and older servers) the block kernels have an AVX2 + FMA + F16C form, 8 floats
// a vector; elsewhere a portable form that compilers vectorize as they can.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include "block_operands.h"
#include "byte_lanes.h"
#include "half.h"
#include "row_chunks.h"
#include "vector_sum.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PYHLO_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PYHLO_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kChunkAlign = 16;  // rows per chunk are a multiple of this: a cache line of y
constexpr int kMaxGroup = 4;      // activation rows handled together

struct Problem {
  const float* x;
  const float* x_even = nullptr;   // bf16 weights: x[:, 0::2] and x[:, 1::2], zero-padded
  const float* x_odd = nullptr;
  const uint16_t* x_bf16 = nullptr; // bf16 weights, x exactly bf16 and AVX512-BF16: x as bf16
  const void* w;
  const float* scale = nullptr;    // int8 weights: one scale per weight row
  float* y;
  int64_t m, n, k;
  bool w_is_bf16 = false;
  bool w_is_s8 = false;
  // GGUF block forms
  int form = 0;                      // kNone, kQ8_0, kQ4_0, kQ4_1
  const uint16_t* block_scale = nullptr;   // f16 [N, K/32]
  const uint16_t* block_min = nullptr;     // f16 [N, K/32] (Q4_1)
  const float* x_block_sum = nullptr;      // [m, K/32]: sum of x over each block (Q4 forms)
  // The _x8 targets: x rounded per 32 values to int8 (x ~ x_q8_scale[b] * x_q8), as
  // llama.cpp rounds activations; x_block_sum then holds the sums of the rounded values.
  const int8_t* x_q8 = nullptr;            // [m, x_stride]
  int64_t x_stride = 0;                    // K; on the VNNI path K rounded up to 128 (4 blocks)
  bool x_nibble_order = false;             // Q4 forms on the VNNI path: see x8_position
  const float* x_q8_lane_scale = nullptr;  // the VNNI path: x_q8_scale per lane, 4 a block (Q4
                                           // forms) or 8 (Q8_0), x_lane_stride a row
  int64_t x_lane_stride = 0;
  const uint8_t* x_q8_biased = nullptr;    // Q8_0 on the VNNI path: x_q8 + 128, as unsigned bytes
  const float* x_q8_scale = nullptr;       // [m, K/32]
};

enum BlockForm { kNone = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_1 = 3 };
constexpr int64_t kBlock = 32;
// How far ahead the block kernels ask for weight bytes: the rows a thread reads lie one after
// another, and the hardware prefetchers restart at every 4 KB page (measured on an Intel Xeon
// VM: SmolLM2 Q4_1 decode with int8 activations 11.0 -> 8.5 ms a step).
constexpr int64_t kPrefetchAhead = 1024;
// The Q4 forms with int8 activations, into the second-level cache 16 KB ahead: 1.7 B Q4_0
// decode 41.0-41.4 -> 38.1-40.1 ms a step on the EPYC host, the kernel alone from memory (2 MB
// pages) 19-29 -> 33-38 GB/s; the same for Q8_0 measured no better.
constexpr int64_t kNibblesPrefetchAhead = 16384;

using pyhlo_kernels::half_to_f32;
#ifdef PYHLO_AVX2
using pyhlo_kernels::sum8;
#endif


// The terms of a Q4 row that do not depend on its nibbles: -8 * sum_b d_b * xsum_b (Q4_0)
// or sum_b m_b * xsum_b (Q4_1), for activation row m.
inline float block_offset(const Problem& p, int64_t n, int64_t m) {
  const int64_t nb = p.k / kBlock;
  const float* xs = p.x_block_sum + m * nb;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // 16 blocks' f16 scales or minimums at a time, widened by vcvtph2ps.
  const uint16_t* terms = (p.form == kQ4_0 ? p.block_scale : p.block_min) + n * nb;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 mask = nb - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (nb - b)) - 1);
    const __m512 t = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, terms + b));
    acc = _mm512_fmadd_ps(t, _mm512_maskz_loadu_ps(mask, xs + b), acc);
  }
  const float sum = _mm512_reduce_add_ps(acc);
#elif defined(PYHLO_AVX2)
  // 8 blocks' f16 scales or minimums at a time (vcvtph2ps), the tail one by one.
  const uint16_t* terms = (p.form == kQ4_0 ? p.block_scale : p.block_min) + n * nb;
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(terms + b))),
                          _mm256_loadu_ps(xs + b), acc);
  float sum = sum8(acc);
  for (; b < nb; ++b) sum += _cvtsh_ss(terms[b]) * xs[b];
#else
  const uint16_t* terms = (p.form == kQ4_0 ? p.block_scale : p.block_min) + n * nb;
  float sum = 0;
  for (int64_t b = 0; b < nb; ++b) sum += half_to_f32(terms[b]) * xs[b];
#endif
  return p.form == kQ4_0 ? -8.0f * sum : sum;
}

// Where value j of block b lies in a row of rounded activations. The Q4 forms' kernel on the
// VNNI path reads x in the nibbles' order: per 4 blocks (128 values), each block's values 0-15
// (its low nibbles) then each block's 16-31 (its high nibbles), so the bytes of one 64-byte
// weight load, split into low and high nibbles, meet x with no shuffle and each block's sum
// lands in 4 lanes of its own. A last group of fewer than 4 blocks is padded with zeros.
inline int64_t x8_position(bool nibble_order, int64_t b, int64_t j) {
  if (!nibble_order) return b * kBlock + j;
  return b / 4 * 128 + (j < 16 ? 0 : 64) + b % 4 * 16 + j % 16;
}

// The _x8 targets' rounding of an activation row of k values, per 32 (llama.cpp's Q8_0): d =
// max |x| / 127, q = the nearest integer to x / d (ties to even) within +-127, each value put at
// x8_position in q; scale[b] = d and sums[b] = d * sum q for each block b.
inline void round_row(const float* x, int64_t k, bool nibble_order, int8_t* q, float* scale, float* sums) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
#ifdef PYHLO_AVX512
    // 16 values at a time; each 16 of a block lie together in either order.
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    auto rounded = [&](__m512 v) {
      const __m512i i = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inverse)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    };
    const __m512i q0 = rounded(x0), q1 = rounded(x1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + x8_position(nibble_order, b, 0)), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + x8_position(nibble_order, b, 16)), _mm512_cvtepi32_epi8(q1));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    float amax = 0;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    int32_t total = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t v = int32_t(std::nearbyint(xb[j] * inverse));
      const int8_t r = int8_t(std::max(-127, std::min(127, v)));
      q[x8_position(nibble_order, b, j)] = r;
      total += r;
    }
#endif
    scale[b] = d;
    sums[b] = d * float(total);
  }
}

// The _x8 targets: a block's product is an integer sum, sum_j q_w[j] * q_x[j], scaled by
// d_w * d_x; Q4's -8 or minimum comes through the sums of the rounded x (block_offset).
inline int32_t block_weight(const Problem& p, int64_t n, int64_t b, int j) {
  const int64_t k = p.k;
  if (p.form == kQ8_0) return static_cast<const int8_t*>(p.w)[n * k + b * kBlock + j];
  const uint8_t byte = static_cast<const uint8_t*>(p.w)[n * (k / 2) + b * (kBlock / 2) + j % (kBlock / 2)];
  return j < kBlock / 2 ? byte & 0xF : byte >> 4;
}

// One block's product, weight row n by activation row m: d_w * d_x * sum_j q_w[j] * q_x[j].
inline float block_product_x8(const Problem& p, int64_t n, int64_t m, int64_t b) {
  const int64_t nb = p.k / kBlock;
  int32_t dot = 0;
  const int8_t* xq = p.x_q8 + m * p.x_stride;
  for (int j = 0; j < kBlock; ++j) dot += block_weight(p, n, b, j) * xq[x8_position(p.x_nibble_order, b, j)];
  return half_to_f32(p.block_scale[n * nb + b]) * p.x_q8_scale[m * nb + b] * float(dot);
}

template <int G>
void row_blocks_x8_portable(const Problem& p, int64_t n, int64_t m0) {
  const int64_t nb = p.k / kBlock;
  for (int g = 0; g < G; ++g) {
    float sum = 0;
    for (int64_t b = 0; b < nb; ++b) sum += block_product_x8(p, n, m0 + g, b);
    if (p.form != kQ8_0) sum += block_offset(p, n, m0 + g);
    p.y[(m0 + g) * p.n + n] = sum;
  }
}

#if defined(PYHLO_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// Q8_0: four blocks a step, 128 weights against 128 int8 activations, vpdpbusd summing four
// unsigned-by-signed byte products into each int32 lane, 8 lanes per block, the activations
// the unsigned side (x + 128). The Q4 forms: row_blocks_x8_nibbles below.

// The first `count` bytes (none where count <= 0, all 64 past 64).
inline __mmask64 bytes_mask(int64_t count) {
  return count <= 0 ? __mmask64(0) : count >= 64 ? ~__mmask64(0) : (__mmask64(1) << count) - 1;
}

template <int G>
void row_blocks_x8_q8_0(const Problem& p, int64_t n, int64_t m0) {
  const int64_t k = p.k, nb = k / kBlock;
  const uint16_t* scales = p.block_scale + n * nb;
  const int8_t* row = static_cast<const int8_t*>(p.w) + n * k;
  // Lane i of a two-block product belongs to block i / 8.
  const __m512i lane_block = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  const __m512i zero = _mm512_setzero_si512();
  // Two sums per activation row keep the multiply-adds of consecutive steps independent.
  __m512 acc[G][2];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  // Two blocks: x comes as x + 128 (unsigned), so sum (x + 128) w, less 128 sum w (one
  // product, shared by the activation rows), is sum x w; each block's weight scale in its 8
  // lanes once, each row's x scales laid out the same way (x_q8_lane_scale). A row's step is
  // one integer product, a conversion, a multiply and a multiply-add.
  auto step = [&](int64_t b, const __m512i w, const __m128 d, int half) {
    const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, w));
    const __m512 d_lanes = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(d));
    for (int g = 0; g < G; ++g) {
      const uint8_t* x = p.x_q8_biased + (m0 + g) * p.x_stride + b * kBlock;
      const __m512i sums = _mm512_dpbusd_epi32(start, _mm512_loadu_si512(x), w);
      const __m512 x_lanes = _mm512_loadu_ps(p.x_q8_lane_scale + (m0 + g) * p.x_lane_stride + b * 8);
      acc[g][half] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d_lanes, x_lanes), acc[g][half]);
    }
  };
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    // The integer products keep up with memory: ask for the bytes ahead (the rows a thread
    // reads lie one after another).
    _mm_prefetch(reinterpret_cast<const char*>(row + b * kBlock) + kPrefetchAhead, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row + b * kBlock) + 64 + kPrefetchAhead, _MM_HINT_T0);
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + b)));
    step(b, _mm512_loadu_si512(row + b * kBlock), d, 0);
    step(b + 2, _mm512_loadu_si512(row + (b + 2) * kBlock), _mm_movehl_ps(d, d), 1);
  }
  if (b < nb) {
    // The last 1-3 blocks, the same steps on loads masked to them (zero weights and scales
    // past the row add nothing; x and its lane scales are padded). One at a time in scalar
    // code, they took half the kernel's time on a 576-wide row (18 blocks).
    const int64_t left = nb - b;
    const __m128 d = _mm_cvtph_ps(_mm_maskz_loadu_epi16(__mmask8((1u << left) - 1), scales + b));
    step(b, _mm512_maskz_loadu_epi8(bytes_mask(left * kBlock), row + b * kBlock), d, 0);
    if (left > 2)
      step(b + 2, _mm512_maskz_loadu_epi8(bytes_mask(left * kBlock - 2 * kBlock), row + (b + 2) * kBlock),
           _mm_movehl_ps(d, d), 1);
  }
  for (int g = 0; g < G; ++g) {
    p.y[(m0 + g) * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]));
  }
}

// The Q4 forms with x in the nibbles' order (x8_position): one 64-byte load holds 4 blocks'
// nibbles; its low nibbles times x's first 64 bytes plus its high nibbles times the next 64
// are the 4 blocks' integer sums, 4 lanes each, scaled by one multiply-add. Against moving
// the nibbles into x's natural order this takes about half the vector instructions a block.
template <int G>
void row_blocks_x8_nibbles(const Problem& p, int64_t n, int64_t m0) {
  const int64_t k = p.k, nb = k / kBlock;
  const uint16_t* scales = p.block_scale + n * nb;
  const uint8_t* row = static_cast<const uint8_t*>(p.w) + n * (k / 2);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i lane_block = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[G][2];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  // Each block's weight scale in its 4 lanes, once for all activation rows; each row's x scales
  // come laid out the same way (x_q8_lane_scale), so a row's step is two integer sums, one
  // conversion, one multiply and one multiply-add.
  auto step = [&](int64_t b, const __m512i bytes, const __m128 d, int half) {
    const __m512i low = _mm512_and_si512(bytes, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    const __m512 d_lanes = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(d));
    for (int g = 0; g < G; ++g) {
      const int8_t* x = p.x_q8 + (m0 + g) * p.x_stride + b * kBlock;
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(x)),
                                               high, _mm512_loadu_si512(x + 64));
      const __m512 x_lanes = _mm512_loadu_ps(p.x_q8_lane_scale + (m0 + g) * p.x_lane_stride + b * 4);
      acc[g][half] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d_lanes, x_lanes), acc[g][half]);
    }
  };
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b * (kBlock / 2)) + kNibblesPrefetchAhead, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(row + b * (kBlock / 2)) + 64 + kNibblesPrefetchAhead, _MM_HINT_T1);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
    step(b, _mm512_loadu_si512(row + b * (kBlock / 2)), _mm256_castps256_ps128(d), 0);
    step(b + 4, _mm512_loadu_si512(row + (b + 4) * (kBlock / 2)), _mm256_extractf128_ps(d, 1), 1);
  }
  for (; b < nb; b += 4) {
    // The last 1-7 blocks, 4 at a time on loads masked to them (zero bytes and zero scales
    // past the row add nothing; x is padded with zeros to its group of 4).
    const int64_t left = std::min<int64_t>(nb - b, 4);
    const __mmask8 blocks = __mmask8((1u << left) - 1);
    const __m128 d = _mm_cvtph_ps(_mm_maskz_loadu_epi16(blocks, scales + b));
    step(b, _mm512_maskz_loadu_epi8(bytes_mask(left * (kBlock / 2)), row + b * (kBlock / 2)), d, 0);
  }
  for (int g = 0; g < G; ++g) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]));
    sum += block_offset(p, n, m0 + g);
    p.y[(m0 + g) * p.n + n] = sum;
  }
}

template <int G>
void row_blocks_x8(const Problem& p, int64_t n, int64_t m0) {
  switch (p.form) {
    case kQ8_0: return row_blocks_x8_q8_0<G>(p, n, m0);
    default: return row_blocks_x8_nibbles<G>(p, n, m0);   // Q4_0, Q4_1
  }
}
#elif defined(PYHLO_AVX2)
// A block's weights as the unsigned side of vpmaddubsw, and (Q8_0) the signs x takes.
template <bool ByteWeights>
inline __m256i x8_magnitude(const char* block, __m256i* signs) {
  if constexpr (ByteWeights) {
    *signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    return _mm256_abs_epi8(*signs);
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
  }
}

// The 8 int32 sums of a block's 32 products with its 32 int8 activations (x at `x`).
template <bool ByteWeights>
inline __m256 x8_block_sums(__m256i magnitude, __m256i signs, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = _mm256_maddubs_epi16(magnitude, ByteWeights ? _mm256_sign_epi8(xv, signs) : xv);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// AVX2 (no vpdpbusd), x in its natural order: a block's 32 weights against its 32 int8
// activations by vpmaddubsw (unsigned by signed bytes into int16 pairs) and vpmaddwd against
// ones. The Q4 forms' nibbles (0..15) are the unsigned side as they are; Q8_0's weights are
// signed, so the unsigned side is |w| and x takes w's sign (vpsignb): a pair stays within
// int16 either way (2 * 128 * 127). Each block's int32 sums are scaled by d_w * d_x.
// Eight blocks at a time: their 8 scale products d_w * d_x in one vector multiply (each block
// then broadcasts its own from memory), two sums a row so that consecutive blocks' multiply-adds
// do not wait on each other, and the bytes asked for 1 KB ahead. One 8192 x 2048 Q4_0 product
// from memory on two Zen 3 cores: 990-1,030 -> 535-620 us (one block at a time, one sum, no
// prefetch, before); asking 16 KB ahead into the second-level cache, as the VNNI path does,
// measured 650-750 here. The even and odd blocks' sums are named arrays, with no lambda holding
// them: GCC kept a lambda's captured sums in memory at four rows and took each block's scale
// address from the stack (1.7 B Q4_0 decode, fastest of two runs each: 55-64 -> 44 ms a step;
// 135 M at batch 4 21-22 -> 17-19). 1.7 B Q4_0 decode with int8 activations, all told: 75 -> 44.
template <int G, bool ByteWeights>
void row_blocks_x8_avx2(const Problem& p, int64_t n, int64_t m0) {
  const int64_t k = p.k, nb = k / kBlock;
  const uint16_t* scales = p.block_scale + n * nb;
  const char* stream = static_cast<const char*>(p.w) + n * (ByteWeights ? k : k / 2);
  constexpr int64_t kBlockBytes = ByteWeights ? kBlock : kBlock / 2;
  const int8_t* xq[G];
  const float* xd[G];
  __m256 even[G], odd[G];   // the even blocks' sums and the odd ones'
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    xq[g] = p.x_q8 + (m0 + g) * p.x_stride;
    xd[g] = p.x_q8_scale + (m0 + g) * nb;
    even[g] = odd[g] = _mm256_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    #pragma GCC unroll 4
    for (int64_t line = 0; line < 8 * kBlockBytes; line += 64)
      _mm_prefetch(stream + b * kBlockBytes + line + kPrefetchAhead, _MM_HINT_T0);
    alignas(32) float d[G][8];
    const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) _mm256_store_ps(d[g], _mm256_mul_ps(d_w, _mm256_loadu_ps(xd[g] + b)));
    #pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      __m256i signs0 = _mm256_setzero_si256(), signs1 = _mm256_setzero_si256();
      const __m256i w0 = x8_magnitude<ByteWeights>(stream + (b + j) * kBlockBytes, &signs0);
      const __m256i w1 = x8_magnitude<ByteWeights>(stream + (b + j + 1) * kBlockBytes, &signs1);
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const int8_t* x = xq[g] + (b + j) * kBlock;
        even[g] = _mm256_fmadd_ps(x8_block_sums<ByteWeights>(w0, signs0, x), _mm256_broadcast_ss(&d[g][j]), even[g]);
        odd[g] = _mm256_fmadd_ps(x8_block_sums<ByteWeights>(w1, signs1, x + kBlock), _mm256_broadcast_ss(&d[g][j + 1]),
                                 odd[g]);
      }
    }
  }
  for (; b < nb; ++b) {
    __m256i signs = _mm256_setzero_si256();
    const __m256i w = x8_magnitude<ByteWeights>(stream + b * kBlockBytes, &signs);
    const float d_w = half_to_f32(scales[b]);
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
      even[g] = _mm256_fmadd_ps(x8_block_sums<ByteWeights>(w, signs, xq[g] + b * kBlock), _mm256_set1_ps(d_w * xd[g][b]),
                                even[g]);
  }
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    float sum = sum8(_mm256_add_ps(even[g], odd[g]));
    if constexpr (!ByteWeights) sum += block_offset(p, n, m0 + g);
    p.y[(m0 + g) * p.n + n] = sum;
  }
}

template <int G>
void row_blocks_x8(const Problem& p, int64_t n, int64_t m0) {
  if (p.form == kQ8_0) return row_blocks_x8_avx2<G, true>(p, n, m0);
  row_blocks_x8_avx2<G, false>(p, n, m0);   // Q4_0, Q4_1
}
#else
template <int G>
void row_blocks_x8(const Problem& p, int64_t n, int64_t m0) {
  row_blocks_x8_portable<G>(p, n, m0);
}
#endif

#ifdef PYHLO_AVX512
// Each weight row is read front to back, one row after the other, so a thread's reads
// are a single sequential stream (interleaving several rows measured half as fast).
// Four partial sums along k keep the multiply-adds independent.

// Asks for the weight bytes kPrefetchAhead past `at`: one call per 64 bytes read.
inline void ahead(const void* at) {
  _mm_prefetch(static_cast<const char*>(at) + kPrefetchAhead, _MM_HINT_T0);
}

inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

inline __mmask32 mask32(int64_t left) {
  return left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1ull << left) - 1);
}

template <int G>
void row_f32(const Problem& p, const float* w, int64_t n, int64_t m0) {
  __m512 acc[4][G];
  for (int u = 0; u < 4; ++u)
    for (int g = 0; g < G; ++g) acc[u][g] = _mm512_setzero_ps();
  const int64_t k = p.k;
  const float* row = w + n * k;
  for (int64_t k0 = 0; k0 < k; k0 += 64) {
    for (int u = 0; u < 4; ++u) {
      const int64_t at = k0 + 16 * u;
      if (at >= k) break;
      ahead(row + at);
      const __mmask16 mask = mask16(k - at);
      const __m512 wr = _mm512_maskz_loadu_ps(mask, row + at);
      for (int g = 0; g < G; ++g)
        acc[u][g] = _mm512_fmadd_ps(wr, _mm512_maskz_loadu_ps(mask, p.x + (m0 + g) * k + at), acc[u][g]);
    }
  }
  for (int g = 0; g < G; ++g)
    p.y[(m0 + g) * p.n + n] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]), _mm512_add_ps(acc[2][g], acc[3][g])));
}

// bf16 weights, 32 per load, read as 16 lanes of 32 bits. A bf16 is the top half of an
// f32: the high halves, low bits masked off, are the odd elements as f32, and the low
// halves shifted up are the even ones. x comes de-interleaved to match (p.x_even,
// p.x_odd), so no lane crosses another.
template <int G>
void row_bf16(const Problem& p, const uint16_t* w, int64_t n, int64_t m0) {
  __m512 acc[2][G];
  for (int u = 0; u < 2; ++u)
    for (int g = 0; g < G; ++g) acc[u][g] = _mm512_setzero_ps();
  const int64_t k = p.k, half = (k + 1) / 2;
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const uint16_t* row = w + n * k;
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    ahead(row + k0);
    const int64_t left = k - k0;
    const __mmask32 wmask = mask32(left);
    const __mmask16 xmask = mask16((left + 1) / 2);
    const __m512i lanes = _mm512_maskz_loadu_epi16(wmask, row + k0);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(lanes, high));
    for (int g = 0; g < G; ++g) {
      const int64_t at = (m0 + g) * half + k0 / 2;
      acc[0][g] = _mm512_fmadd_ps(even, _mm512_maskz_loadu_ps(xmask, p.x_even + at), acc[0][g]);
      acc[1][g] = _mm512_fmadd_ps(odd, _mm512_maskz_loadu_ps(xmask, p.x_odd + at), acc[1][g]);
    }
  }
  for (int g = 0; g < G; ++g)
    p.y[(m0 + g) * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]));
}

#ifdef __AVX512BF16__
// How far ahead the bf16-pair kernel asks for weight bytes. Measured (one thread, 12 weights
// of 8192 x 2048, on 4 KB and on 2 MB pages, AMD Zen 4): 128-256 bytes beat 1024 by 10-15%
// and no software prefetch by 5-10%.
constexpr int64_t kPrefetchAheadBf16 = 256;

// With AVX512-BF16 and x exactly representable in bf16 (a bf16 model's activations), one
// instruction multiplies 32 pairs and adds them into 16 f32 sums. 128 weights a step, four
// sums per activation row kept in registers (the masked loop this replaced spilled its
// sums to the stack, which capped it at ~30 GB/s even on weights in L1), the tail masked.
template <int G>
void row_dpbf16(const Problem& p, const uint16_t* w, int64_t n, int64_t m0) {
  __m512 acc[4][G];
  for (int u = 0; u < 4; ++u)
    for (int g = 0; g < G; ++g) acc[u][g] = _mm512_setzero_ps();
  const int64_t k = p.k;
  const uint16_t* row = w + n * k;
  const uint16_t* x = p.x_bf16 + m0 * k;
  int64_t k0 = 0;
  for (; k0 + 128 <= k; k0 += 128) {
    for (int u = 0; u < 4; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k0 + 32 * u) + kPrefetchAheadBf16, _MM_HINT_T0);
      const __m512bh wr = (__m512bh)_mm512_loadu_si512(row + k0 + 32 * u);
      for (int g = 0; g < G; ++g)
        acc[u][g] = _mm512_dpbf16_ps(acc[u][g], wr, (__m512bh)_mm512_loadu_si512(x + g * k + k0 + 32 * u));
    }
  }
  for (; k0 < k; k0 += 32) {
    const __mmask32 mask = mask32(k - k0);
    const __m512bh wr = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k0);
    for (int g = 0; g < G; ++g)
      acc[0][g] = _mm512_dpbf16_ps(acc[0][g], wr, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + g * k + k0));
  }
  for (int g = 0; g < G; ++g)
    p.y[(m0 + g) * p.n + n] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]), _mm512_add_ps(acc[2][g], acc[3][g])));
}
#endif

// int8 weights, 16 per load, widened to f32; the row's scale multiplies the sum once.
template <int G>
void row_s8(const Problem& p, const int8_t* w, int64_t n, int64_t m0) {
  __m512 acc[4][G];
  for (int u = 0; u < 4; ++u)
    for (int g = 0; g < G; ++g) acc[u][g] = _mm512_setzero_ps();
  const int64_t k = p.k;
  const int8_t* row = w + n * k;
  int64_t k0 = 0;
  for (; k0 + 64 <= k; k0 += 64) {
    ahead(row + k0);
    for (int u = 0; u < 4; ++u) {
      const int64_t at = k0 + 16 * u;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + at));
      const __m512 wr = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      for (int g = 0; g < G; ++g)
        acc[u][g] = _mm512_fmadd_ps(wr, _mm512_loadu_ps(p.x + (m0 + g) * k + at), acc[u][g]);
    }
  }
  for (; k0 < k; k0 += 16) {
    const int64_t left = k - k0;
    const __mmask16 mask = mask16(left);
    alignas(16) int8_t tail[16] = {0};
    std::memcpy(tail, row + k0, left < 16 ? left : 16);
    const __m512 wr = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tail))));
    for (int g = 0; g < G; ++g)
      acc[0][g] = _mm512_fmadd_ps(wr, _mm512_maskz_loadu_ps(mask, p.x + (m0 + g) * k + k0), acc[0][g]);
  }
  for (int g = 0; g < G; ++g)
    p.y[(m0 + g) * p.n + n] = p.scale[n] * _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[0][g], acc[1][g]), _mm512_add_ps(acc[2][g], acc[3][g])));
}

// GGUF blocks: 32 values widened to two vectors of 16 f32, multiplied by x, the partial
// sum scaled by the block's d; two accumulators (even and odd blocks) keep the chains short.
// They stay in registers: blocks go in pairs rather than by a run-time index into the two
// (which kept them in memory, a store and a load on every block's chain).
template <int G>
void row_blocks(const Problem& p, int64_t n, int64_t m0) {
  const int64_t k = p.k, nb = k / kBlock;
  const uint16_t* scales = p.block_scale + n * nb;
  __m512 even[G], odd[G];
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi32(0xF);
  const char* stream = static_cast<const char*>(p.w) + n * (p.form == kQ8_0 ? k : k / 2);
  const int64_t per_block = p.form == kQ8_0 ? kBlock : kBlock / 2;
  auto step = [&](int64_t b, __m512 (&acc)[G]) {
    __m512 lo, hi;
    if (p.form == kQ8_0) {
      const int8_t* q = static_cast<const int8_t*>(p.w) + n * k + b * kBlock;
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    } else {
      const uint8_t* q = static_cast<const uint8_t*>(p.w) + n * (k / 2) + b * (kBlock / 2);
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble));
      hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    }
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(scales[b]));
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float* x = p.x + (m0 + g) * k + b * kBlock;
      const __m512 part = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
      acc[g] = _mm512_fmadd_ps(part, d, acc[g]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    _mm_prefetch(stream + b * per_block + kPrefetchAhead, _MM_HINT_T0);
    step(b, even);
    step(b + 1, odd);
  }
  if (b < nb) {
    _mm_prefetch(stream + b * per_block + kPrefetchAhead, _MM_HINT_T0);
    step(b, even);
  }
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(even[g], odd[g]));
    if (p.form != kQ8_0) sum += block_offset(p, n, m0 + g);
    p.y[(m0 + g) * p.n + n] = sum;
  }
}

template <int G, typename W>
void row(const Problem& p, const W* w, int64_t n, int64_t m0) {
  if (p.x_q8 != nullptr) return row_blocks_x8<G>(p, n, m0);
  if (p.form != kNone) return row_blocks<G>(p, n, m0);
  if constexpr (std::is_same_v<W, int8_t>) {
    row_s8<G>(p, w, n, m0);
  } else if constexpr (sizeof(W) == 2) {
#ifdef __AVX512BF16__
    if (p.x_bf16 != nullptr) return row_dpbf16<G>(p, w, n, m0);
#endif
    row_bf16<G>(p, w, n, m0);
  } else {
    row_f32<G>(p, w, n, m0);
  }
}
#else
inline float to_f32(float v) { return v; }
inline float to_f32(int8_t v) { return float(v); }
inline float to_f32(uint16_t v) { return pyhlo_kernels::bf16_to_f32(v); }

#ifdef PYHLO_AVX2
// GGUF blocks on AVX2: each block's 32 values widened to f32 weights, w = d * q + m (Q4_0:
// m = -8 d; Q8_0: no m), the dequantized weight itself, then multiplied into x with one sum
// per 8 values of a block (two per activation row where G > 1), so that no sum waits on
// another. Bytes reach their 32-bit lanes by vpshufb (byte_lanes.h; with the row's d and m
// widened 8 at a time first, a Q4_1 block took 3.0-3.7 ns against 5.0-5.3, one thread, in
// cache or not). Q8_0's signed bytes go to the top byte of each lane and an arithmetic shift
// brings them down.
using pyhlo_kernels::both_halves;
using pyhlo_kernels::lanes_f32;
using pyhlo_kernels::signed_lanes_f32;

// The row's f16 values in [first, first + count) widened into out (count <= kRowSpan).
inline void widen_halves(const uint16_t* halves, int64_t count, float* out) {
  int64_t b = 0;
  for (; b + 8 <= count; b += 8)
    _mm256_store_ps(out + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + b))));
  for (; b < count; ++b) out[b] = _cvtsh_ss(halves[b]);
}

constexpr int64_t kRowSpan = 256;   // blocks whose d and m are widened at a time

// ByteWeights: Q8_0; else Q4_0 / Q4_1 (split at compile time: a test of the form on every
// block's path, with its jumps, cost a third of a block's time).
template <int G, bool ByteWeights>
void row_blocks_avx2(const Problem& p, int64_t n, int64_t m0) {
  constexpr int U = G == 1 ? 4 : 2;   // sums per activation row
  const int64_t k = p.k, nb = k / kBlock;
  const __m256i low_nibble = _mm256_set1_epi8(0x0F);
  const __m256i first = pyhlo_kernels::byte_lanes(0), second = pyhlo_kernels::byte_lanes(8);
  const __m256i first_top = pyhlo_kernels::top_byte_lanes(0), second_top = pyhlo_kernels::top_byte_lanes(8);
  __m256 acc[U][G];
  #pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) acc[u][g] = _mm256_setzero_ps();
  alignas(32) float d[kRowSpan], m[kRowSpan];
  for (int64_t span = 0; span < nb; span += kRowSpan) {
    const int64_t count = std::min(kRowSpan, nb - span);
    widen_halves(p.block_scale + n * nb + span, count, d);
    if (p.form == kQ4_1) widen_halves(p.block_min + n * nb + span, count, m);
    if (p.form == kQ4_0)
      for (int64_t b = 0; b < count; b += 8) _mm256_store_ps(m + b, _mm256_mul_ps(_mm256_load_ps(d + b), _mm256_set1_ps(-8.f)));
    for (int64_t i = 0; i < count; ++i) {
      const int64_t b = span + i;
      __m256 v[4];
      if constexpr (ByteWeights) {
        const int8_t* q = static_cast<const int8_t*>(p.w) + n * k + b * kBlock;
        _mm_prefetch(reinterpret_cast<const char*>(q) + kPrefetchAhead, _MM_HINT_T0);
        const __m256i head = both_halves(q), tail = both_halves(q + 16);
        const __m256 scale = _mm256_broadcast_ss(d + i);
        v[0] = _mm256_mul_ps(signed_lanes_f32(head, first_top), scale);
        v[1] = _mm256_mul_ps(signed_lanes_f32(head, second_top), scale);
        v[2] = _mm256_mul_ps(signed_lanes_f32(tail, first_top), scale);
        v[3] = _mm256_mul_ps(signed_lanes_f32(tail, second_top), scale);
      } else {
        const uint8_t* q = static_cast<const uint8_t*>(p.w) + n * (k / 2) + b * (kBlock / 2);
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(q) + kPrefetchAhead, _MM_HINT_T0);
        const __m256i bytes = both_halves(q);
        const __m256i low = _mm256_and_si256(bytes, low_nibble);                          // values 0-15
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibble);  // values 16-31
        const __m256 scale = _mm256_broadcast_ss(d + i), offset = _mm256_broadcast_ss(m + i);
        v[0] = _mm256_fmadd_ps(lanes_f32(low, first), scale, offset);
        v[1] = _mm256_fmadd_ps(lanes_f32(low, second), scale, offset);
        v[2] = _mm256_fmadd_ps(lanes_f32(high, first), scale, offset);
        v[3] = _mm256_fmadd_ps(lanes_f32(high, second), scale, offset);
      }
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const float* x = p.x + (m0 + g) * k + b * kBlock;
        #pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[j % U][g] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + 8 * j), acc[j % U][g]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m256 sum = acc[0][g];
    #pragma GCC unroll 4
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[u][g]);
    p.y[(m0 + g) * p.n + n] = sum8(sum);
  }
}

template <int G>
void row_blocks(const Problem& p, int64_t n, int64_t m0) {
  if (p.form == kQ8_0) return row_blocks_avx2<G, true>(p, n, m0);
  row_blocks_avx2<G, false>(p, n, m0);   // Q4_0, Q4_1
}

// f32, bf16 and int8 weights on AVX2: 8 values a vector (bf16 widened by a zero-extend and a
// shift, int8 by a sign-extend and a conversion), four sums a row at G = 1 and two at G > 1 so
// that no multiply-add waits on the last, the weights asked for kPrefetchAhead bytes ahead (the
// portable loop, as the compiler vectorizes it, asks for none: SmolLM2-1.7B's shape in
// bf16, decode on AMD Zen 3, 148-177 -> 125-134 ms a step, alternating runs).
inline __m256 widened8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 widened8(const uint16_t* w) { return pyhlo_kernels::bf16x8_to_f32(w); }
inline __m256 widened8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

template <int G, typename W>
void row_wide_avx2(const Problem& p, const W* w, int64_t n, int64_t m0) {
  constexpr int U = G == 1 ? 4 : 2;                       // sums per activation row
  constexpr int64_t kStep = 8 * U;                        // values a pass
  constexpr int64_t kStepBytes = kStep * int64_t(sizeof(W));
  const int64_t k = p.k;
  const W* row = w + n * k;
  __m256 acc[U][G];
  #pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
    #pragma GCC unroll 8
    for (int g = 0; g < G; ++g) acc[u][g] = _mm256_setzero_ps();
  int64_t k0 = 0;
  for (; k0 + kStep <= k; k0 += kStep) {
    const char* bytes = reinterpret_cast<const char*>(row + k0);
    #pragma GCC unroll 4
    for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(bytes + line + kPrefetchAhead, _MM_HINT_T0);
    #pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m256 weights = widened8(row + k0 + 8 * u);
      #pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
        acc[u][g] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(p.x + (m0 + g) * k + k0 + 8 * u), acc[u][g]);
    }
  }
  #pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m256 total = acc[0][g];
    #pragma GCC unroll 4
    for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[u][g]);
    float sum = sum8(total);
    for (int64_t j = k0; j < k; ++j) sum += to_f32(row[j]) * p.x[(m0 + g) * k + j];
    if constexpr (std::is_same_v<W, int8_t>) sum *= p.scale[n];
    p.y[(m0 + g) * p.n + n] = sum;
  }
}

#else
// GGUF blocks, portable form: each block widened to f32, its sum scaled by d.
template <int G>
void row_blocks(const Problem& p, int64_t n, int64_t m0) {
  const int64_t k = p.k, nb = k / kBlock;
  for (int g = 0; g < G; ++g) {
    const float* x = p.x + (m0 + g) * k;
    float sum = 0;
    for (int64_t b = 0; b < nb; ++b) {
      float values[kBlock];
      if (p.form == kQ8_0) {
        const int8_t* q = static_cast<const int8_t*>(p.w) + n * k + b * kBlock;
        for (int j = 0; j < kBlock; ++j) values[j] = float(q[j]);
      } else {
        const uint8_t* q = static_cast<const uint8_t*>(p.w) + n * (k / 2) + b * (kBlock / 2);
        for (int j = 0; j < kBlock / 2; ++j) {
          values[j] = float(q[j] & 0xF);
          values[j + kBlock / 2] = float(q[j] >> 4);
        }
      }
      float part = 0;
      for (int j = 0; j < kBlock; ++j) part += values[j] * x[b * kBlock + j];
      sum += half_to_f32(p.block_scale[n * nb + b]) * part;
    }
    if (p.form != kQ8_0) sum += block_offset(p, n, m0 + g);
    p.y[(m0 + g) * p.n + n] = sum;
  }
}

#endif  // PYHLO_AVX2

// The portable form: 16 independent partial sums, which compilers vectorize.
template <int G, typename W>
void row_portable(const Problem& p, const W* w, int64_t n, int64_t m0) {
  const int64_t k = p.k;
  const W* weights = w + n * k;
  for (int g = 0; g < G; ++g) {
    const float* xr = p.x + (m0 + g) * k;
    float part[16] = {0};
    int64_t k0 = 0;
    for (; k0 + 16 <= k; k0 += 16)
      for (int j = 0; j < 16; ++j) part[j] += to_f32(weights[k0 + j]) * xr[k0 + j];
    float sum = 0;
    for (; k0 < k; ++k0) sum += to_f32(weights[k0]) * xr[k0];
    for (int j = 0; j < 16; ++j) sum += part[j];
    if constexpr (std::is_same_v<W, int8_t>) sum *= p.scale[n];
    p.y[(m0 + g) * p.n + n] = sum;
  }
}

// f32, bf16 and int8 weights: AVX2's form above, but for f32 at one activation row, where the
// compiler's form of the portable loop was faster in most alternating runs (SmolLM2-135M f32
// decode, Zen 3: 22.3-25.3 against 23.3-26.8 ms a step); the portable form elsewhere (no AVX2,
// no AVX-512).
template <int G, typename W>
void row(const Problem& p, const W* w, int64_t n, int64_t m0) {
  if (p.x_q8 != nullptr) return row_blocks_x8<G>(p, n, m0);
  if (p.form != kNone) return row_blocks<G>(p, n, m0);
#ifdef PYHLO_AVX2
  if constexpr (std::is_same_v<W, float> && G == 1) {
    row_portable<G>(p, w, n, m0);
  } else {
    row_wide_avx2<G>(p, w, n, m0);
  }
#else
  row_portable<G>(p, w, n, m0);
#endif
}
#endif

template <typename W>
void weight_rows(const Problem& p, int64_t begin, int64_t end) {
  const W* w = static_cast<const W*>(p.w);
  for (int64_t n = begin; n < end; ++n) {
    int64_t m0 = 0;
    for (; m0 + kMaxGroup <= p.m; m0 += kMaxGroup) row<kMaxGroup>(p, w, n, m0);
    switch (p.m - m0) {
      case 3: row<3>(p, w, n, m0); break;
      case 2: row<2>(p, w, n, m0); break;
      case 1: row<1>(p, w, n, m0); break;
      default: break;
    }
  }
}

void weight_rows(const Problem& p, int64_t begin, int64_t end) {
  if (p.w_is_s8) {
    weight_rows<int8_t>(p, begin, end);
  } else if (p.w_is_bf16) {
    weight_rows<uint16_t>(p, begin, end);
  } else {
    weight_rows<float>(p, begin, end);
  }
}

// Bytes of weights in one row: what a thread streams for it.
int64_t row_bytes(const Problem& p) {
  if (p.form != kNone) return p.k / kBlock * (p.form == kQ8_0 ? 34 : p.form == kQ4_0 ? 18 : 20);
  return p.k * (p.w_is_s8 ? 1 : p.w_is_bf16 ? 2 : 4);
}

ffi::Error Dispatch(ffi::ThreadPool& pool, const Problem& p);

ffi::Error Run(ffi::ThreadPool& pool, ffi::AnyBuffer& x, ffi::AnyBuffer& w, const float* scale,
               ffi::Result<ffi::AnyBuffer>& y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  // bf16 x (a bf16 model's activations) goes with bf16 weights: passed as bf16, it stays
  // rounded (XLA:CPU drops an f32 -> bf16 -> f32 pair of converts, so rounding in the program
  // before an f32 x does not reach the kernel) and takes the bf16-pair path.
  const bool x_is_bf16 = x.element_type() == ffi::DataType::BF16;
  if ((x.element_type() != ffi::DataType::F32 && !(x_is_bf16 && w.element_type() == ffi::DataType::BF16)) ||
      y->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("pyhlo_matvec: x must be f32 (or bf16, with bf16 weights) and y f32");
  const bool s8 = w.element_type() == ffi::DataType::S8;
  if (s8 != (scale != nullptr) ||
      (!s8 && w.element_type() != ffi::DataType::F32 && w.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("pyhlo_matvec: w must be f32 or bf16, or s8 with scales (pyhlo_matvec_s8)");
  if (x_dims.size() < 1 || w_dims.size() != 2 || x_dims[x_dims.size() - 1] != w_dims[1])
    return ffi::Error::InvalidArgument("pyhlo_matvec: need x[..., K] and w[N, K]");

  Problem p;
  p.k = w_dims[1];
  p.n = w_dims[0];
  p.m = x.element_count() / (p.k == 0 ? 1 : p.k);
  p.x = static_cast<const float*>(x.untyped_data());
  p.w = w.untyped_data();
  p.y = static_cast<float*>(y->untyped_data());
  p.w_is_bf16 = w.element_type() == ffi::DataType::BF16;
  p.w_is_s8 = s8;
  p.scale = scale;
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_matvec: y must have x's rows and w's N columns");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  std::vector<float> x_even, x_odd, x_wide;
  std::vector<uint16_t> x_bf16;
  if (x_is_bf16) {
    const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
#if defined(PYHLO_AVX512) && defined(__AVX512BF16__)
    p.x_bf16 = xb;
#endif
    p.x = nullptr;
    if (p.x_bf16 == nullptr) {   // the widening paths read x as f32
      x_wide.resize(p.m * p.k);
      for (int64_t i = 0; i < p.m * p.k; ++i) x_wide[i] = pyhlo_kernels::bf16_to_f32(xb[i]);
      p.x = x_wide.data();
    }
  }
#if defined(PYHLO_AVX512) && defined(__AVX512BF16__)
  if (p.w_is_bf16 && !x_is_bf16) {
    // x is exactly bf16 when the low halves of all its f32s are zero: then the high halves
    // are x as bf16. 16 values a step.
    const int64_t total = p.m * p.k;
    x_bf16.resize(total);
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    bool exact = true;
    for (int64_t i = 0; i < total && exact; i += 16) {
      const __mmask16 mask = mask16(total - i);
      const __m512i bits = _mm512_maskz_loadu_epi32(mask, p.x + i);
      exact = _mm512_mask_test_epi32_mask(mask, bits, low) == 0;
      _mm256_mask_storeu_epi16(x_bf16.data() + i, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
    }
    if (exact) p.x_bf16 = x_bf16.data();
  }
#endif
#ifdef PYHLO_AVX512
  // Only the AVX-512 form of bf16 weights (row_bf16) reads x de-interleaved.
  if (p.w_is_bf16 && p.x_bf16 == nullptr) {
    const int64_t half = (p.k + 1) / 2;
    x_even.assign(p.m * half, 0.0f);
    x_odd.assign(p.m * half, 0.0f);
    for (int64_t m = 0; m < p.m; ++m)
      for (int64_t i = 0; i < p.k; ++i)
        (i % 2 ? x_odd : x_even)[m * half + i / 2] = p.x[m * p.k + i];
    p.x_even = x_even.data();
    p.x_odd = x_odd.data();
  }
#endif

  return Dispatch(pool, p);
}

// Splits the weight rows of `p` between the caller and the pool's threads.
ffi::Error Dispatch(ffi::ThreadPool& pool, const Problem& p) {
  return pyhlo_kernels::run_row_chunks(pool, p.n, row_bytes(p), kChunkAlign,
                                       [p](int64_t begin, int64_t end) { weight_rows(p, begin, end); }, p.w);
}

ffi::Error Matvec(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, x, w, nullptr, y);
}

ffi::Error MatvecS8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                    ffi::Result<ffi::AnyBuffer> y) {
  const auto w_dims = w.dimensions();
  if (w.element_type() != ffi::DataType::S8 || scale.element_type() != ffi::DataType::F32 || w_dims.size() != 2 ||
      scale.element_count() != static_cast<size_t>(w_dims[0]))
    return ffi::Error::InvalidArgument("pyhlo_matvec_s8: need s8 w[N, K] and f32 scale[N]");
  return Run(pool, x, w, static_cast<const float*>(scale.untyped_data()), y);
}

ffi::Error RunBlocks(ffi::ThreadPool& pool, BlockForm form, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
                     ffi::AnyBuffer& scales, ffi::AnyBuffer* mins, ffi::Result<ffi::AnyBuffer>& y,
                     bool int8_x = false) {
  const auto w_dims = w.dimensions();
  const int64_t per_byte = form == kQ8_0 ? 1 : 2;
  if (!pyhlo_kernels::block_operands_fit(form == kQ8_0, x, w, scales, mins, *y))
    return ffi::Error::InvalidArgument(pyhlo_kernels::block_operands_needed("pyhlo_matvec_q8_0/q4_0/q4_1"));
  Problem p;
  p.form = form;
  p.k = w_dims[1] * per_byte;
  p.n = w_dims[0];
  p.m = x.element_count() / p.k;
  p.x = static_cast<const float*>(x.untyped_data());
  p.w = w.untyped_data();
  p.y = static_cast<float*>(y->untyped_data());
  p.block_scale = static_cast<const uint16_t*>(scales.untyped_data());
  p.block_min = mins != nullptr ? static_cast<const uint16_t*>(mins->untyped_data()) : nullptr;
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_matvec_q8_0/q4_0/q4_1: y must have x's rows and N columns");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  std::vector<float> block_sums;
  std::vector<int8_t> x_q8;
  std::vector<float> x_q8_scale, x_q8_lane_scale;
  std::vector<uint8_t> x_q8_biased;
  if (int8_x) {
    // x rounded per 32 values: d = max |x| / 127, q = round(x / d) (half to even).
    const int64_t nb = p.k / kBlock;
    // The VNNI path reads x and its lane scales 4 blocks at a time: rows padded to that.
    bool vnni = false;
#if defined(PYHLO_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    vnni = true;
    p.x_nibble_order = form != kQ8_0;
#endif
    p.x_stride = vnni ? (p.k + 127) / 128 * 128 : p.k;
    x_q8.assign(p.m * p.x_stride, 0);
    x_q8_scale.resize(p.m * nb);
    block_sums.resize(p.m * nb);
    for (int64_t m = 0; m < p.m; ++m)
      round_row(p.x + m * p.k, p.k, p.x_nibble_order, x_q8.data() + m * p.x_stride, x_q8_scale.data() + m * nb,
                block_sums.data() + m * nb);
    if (vnni) {
      // Each block's scale in each of its lanes (4 a block in the nibbles' order, Q8_0 8),
      // rows padded with zeros like x.
      const int lanes = form == kQ8_0 ? 8 : 4;
      p.x_lane_stride = p.x_stride / kBlock * lanes;
      x_q8_lane_scale.assign(p.m * p.x_lane_stride, 0.0f);
      for (int64_t m = 0; m < p.m; ++m)
        for (int64_t b = 0; b < nb; ++b)
          for (int lane = 0; lane < lanes; ++lane)
            x_q8_lane_scale[m * p.x_lane_stride + b * lanes + lane] = x_q8_scale[m * nb + b];
      p.x_q8_lane_scale = x_q8_lane_scale.data();
      if (form == kQ8_0) {
        x_q8_biased.resize(x_q8.size());
        for (size_t i = 0; i < x_q8.size(); ++i) x_q8_biased[i] = uint8_t(x_q8[i]) ^ 0x80u;   // x + 128
        p.x_q8_biased = x_q8_biased.data();
      }
    }
    p.x_q8 = x_q8.data();
    p.x_q8_scale = x_q8_scale.data();
    p.x_block_sum = block_sums.data();
  } else if (form != kQ8_0) {
    const int64_t nb = p.k / kBlock;
    block_sums.assign(p.m * nb, 0.0f);
    for (int64_t m = 0; m < p.m; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        float sum = 0;
        for (int64_t j = 0; j < kBlock; ++j) sum += p.x[m * p.k + b * kBlock + j];
        block_sums[m * nb + b] = sum;
      }
    p.x_block_sum = block_sums.data();
  }
  return Dispatch(pool, p);
}

ffi::Error MatvecQ8_0(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                      ffi::Result<ffi::AnyBuffer> y) {
  return RunBlocks(pool, kQ8_0, x, w, scales, nullptr, y);
}

ffi::Error MatvecQ4_0(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                      ffi::Result<ffi::AnyBuffer> y) {
  return RunBlocks(pool, kQ4_0, x, w, scales, nullptr, y);
}

ffi::Error MatvecQ4_1(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                      ffi::AnyBuffer mins, ffi::Result<ffi::AnyBuffer> y) {
  return RunBlocks(pool, kQ4_1, x, w, scales, &mins, y);
}

ffi::Error MatvecQ8_0X8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                        ffi::Result<ffi::AnyBuffer> y) {
  return RunBlocks(pool, kQ8_0, x, w, scales, nullptr, y, true);
}

ffi::Error MatvecQ4_0X8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                        ffi::Result<ffi::AnyBuffer> y) {
  return RunBlocks(pool, kQ4_0, x, w, scales, nullptr, y, true);
}

ffi::Error MatvecQ4_1X8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                        ffi::AnyBuffer mins, ffi::Result<ffi::AnyBuffer> y) {
  return RunBlocks(pool, kQ4_1, x, w, scales, &mins, y, true);
}

}  // namespace

#define PYHLO_BLOCK_HANDLER(symbol, function, ...)                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, function,                                             \
                                ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() __VA_ARGS__.Ret<ffi::AnyBuffer>())

PYHLO_BLOCK_HANDLER(PyhloMatvecQ8_0, MatvecQ8_0, .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_BLOCK_HANDLER(PyhloMatvecQ4_0, MatvecQ4_0, .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_BLOCK_HANDLER(PyhloMatvecQ4_1, MatvecQ4_1,
                    .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_BLOCK_HANDLER(PyhloMatvecQ8_0X8, MatvecQ8_0X8, .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_BLOCK_HANDLER(PyhloMatvecQ4_0X8, MatvecQ4_0X8, .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());
PYHLO_BLOCK_HANDLER(PyhloMatvecQ4_1X8, MatvecQ4_1X8,
                    .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PyhloMatvec, Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PyhloMatvecS8, MatvecS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
