// pyhlo_matvec_<form>: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows of activations, w kept
// as a GGUF file stores it: each row of K values is whole blocks of one of llama.cpp's forms
// (Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; pyhlo/ops/gguf_blocks.py has the
// layouts), u8 [N, K / values * bytes].
//
// pyhlo_matvec_gguf_rows: the same for a weight whose rows come in several forms (llama.cpp's
// Q4_K_M gives the layers of one weight different types): u8 [N, widest row + 5], the rows
// back to back, then each row's offset and the code of its form (mixed_rows.h; the Form order
// below, pyhlo/ops/gguf_blocks.py's ROW_CODES; Q8_0, Q4_0 and Q4_1 as their file bytes too).
//
// The exact form: each block is dequantized to f32 as the gguf package's numpy reading does
// (the same products, each exact in f32), once for all activation rows, and multiplied by
// them with f32 sums; a K-quant's values are scaled per 16 as there and its minimums come
// through the sums of x over each 16 (kquants.h). Weight rows are split between the caller
// and XLA's thread pool, and each is taken 2048 values at a time.
//
// The int8-activation form (the _x8 targets: pyhlo_matvec_q4_k_x8, pyhlo_matvec_q5_0_x8 ...,
// pyhlo_matvec_gguf_rows_x8), as llama.cpp multiplies each form: x rounded per 256 values as its
// Q8_K (kquants.h) for the K-quants and IQ4_XS, per 32 as its Q8_0 / Q8_1 (q8_blocks.h) for
// Q5_0, Q5_1, IQ4_NL, Q8_0, Q4_0 and Q4_1; each block's product a sum of integer products scaled
// once. Rows of mixed forms round x each way their forms need, once per call. With AVX-512 or
// AVX2, a Q4_K, Q5_K or Q6_K row is multiplied whole by kquants.h's row kernels, unpacked in
// registers (up to 8 activation rows a pass); the other forms, a piece at a time as above.
//
// pyhlo_gemm_<form>, pyhlo_gemm_gguf_rows: the exact product for many activation rows (a
// prefill), each row's values widened to f32 as the exact form's (a K-quant's minimum added to
// each value) a panel at a time, once for all activation rows (widened_panels.h).
//
// Paths: AVX-512 or AVX2 + FMA where the CPU has them, elsewhere portable forms that
// compilers vectorize as they can. The K-quants are unpacked with AVX-512 or AVX2
// (kquants.h), Q5_0 and Q5_1 with AVX2, IQ4's table entries for int8 with vpshufb, the other
// forms in plain C++.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <vector>

#include "block32_forms.h"
#include "half.h"
#include "kquants.h"
#include "mixed_rows.h"
#include "q8_blocks.h"
#include "row_chunks.h"
#include "widened_panels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_GGUF_AVX2 1
#elif defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using pyhlo_kernels::KQuant;
using pyhlo_kernels::SuperBlock;

enum Form { kQ5_0, kQ5_1, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kIQ4_NL, kIQ4_XS, kQ8_0, kQ4_0, kQ4_1, kForms };

struct Layout {
  int values;
  int bytes;
};

constexpr Layout kLayouts[] = {{32, 22}, {32, 24}, {256, 84}, {256, 110}, {256, 144},
                               {256, 176}, {256, 210}, {32, 18}, {256, 136}, {32, 34}, {32, 18}, {32, 20}};
constexpr int kChunkAlign = 4;
using pyhlo_kernels::half_at;
using pyhlo_kernels::kIQ4Values;
using pyhlo_kernels::q5_values;

// One block of `form` at `b` as f32 values in `out`.
void dequantize(Form form, const uint8_t* b, float* out) {
  switch (form) {
    case kQ5_0:
    case kQ5_1: {
      // Integer values first, then floats: two simple loops that compilers vectorize.
      const bool with_min = form == kQ5_1;
      const float d = half_at(b), m = with_min ? half_at(b + 2) : 0.0f;
      alignas(32) uint8_t q[32];
      q5_values(b, with_min, q);
#ifdef PYHLO_GGUF_AVX2
      const __m256 scale = _mm256_set1_ps(d), offset = _mm256_set1_ps(with_min ? m : 0.0f);
      const __m256i centre = _mm256_set1_epi32(with_min ? 0 : 16);
      for (int part = 0; part < 4; ++part) {
        const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * part));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(eight), centre));
        // d * q (+ m): the product is exact, so an FMA rounds as the multiply and add do.
        _mm256_storeu_ps(out + 8 * part, _mm256_add_ps(_mm256_mul_ps(scale, v), offset));
      }
#else
      if (with_min) {
        for (int j = 0; j < 32; ++j) out[j] = d * float(q[j]) + m;
      } else {
        for (int j = 0; j < 32; ++j) out[j] = d * float(int(q[j]) - 16);
      }
#endif
      break;
    }
    case kQ8_0: {
      const float d = half_at(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) out[j] = d * float(q[j]);
      break;
    }
    case kQ4_0:
    case kQ4_1: {
      const bool with_min = form == kQ4_1;
      const float d = half_at(b), m = with_min ? half_at(b + 2) : 0.0f;
      const uint8_t* qs = b + (with_min ? 4 : 2);
      if (with_min) {
        for (int j = 0; j < 16; ++j) {
          out[j] = d * float(qs[j] & 0xF) + m;
          out[j + 16] = d * float(qs[j] >> 4) + m;
        }
      } else {
        for (int j = 0; j < 16; ++j) {
          out[j] = d * float(int(qs[j] & 0xF) - 8);
          out[j + 16] = d * float(int(qs[j] >> 4) - 8);
        }
      }
      break;
    }
    case kQ2_K:
    case kQ3_K:
    case kQ4_K:
    case kQ5_K:
    case kQ6_K:   // K-quants: pyhlo_kernels::unpack() and to_floats()
    case kForms:
      break;
    case kIQ4_NL: {
      const float d = half_at(b);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * float(kIQ4Values[b[2 + j] & 0xF]);
        out[j + 16] = d * float(kIQ4Values[b[2 + j] >> 4]);
      }
      break;
    }
    case kIQ4_XS: {
      const float d = half_at(b);
      uint16_t top;
      std::memcpy(&top, b + 2, sizeof(top));
      const uint8_t* low = b + 4;
      const uint8_t* qs = b + 8;
      for (int j = 0; j < 8; ++j) {
        const int ls = ((low[j / 2] >> (4 * (j % 2))) & 0xF) | (((top >> (2 * j)) & 3) << 4);
        const float scale = d * float(ls - 32);
        for (int i = 0; i < 16; ++i) {
          out[j * 32 + i] = scale * float(kIQ4Values[qs[j * 16 + i] & 0xF]);
          out[j * 32 + 16 + i] = scale * float(kIQ4Values[qs[j * 16 + i] >> 4]);
        }
      }
      break;
    }
  }
}

// The int8-activation form: one block of a form other than the K-quants at `b` as signed
// integers (pyhlo_kernels::dot_q8_32's weight blocks of 32), each 32's scale in `d` and, for
// Q5_1 and Q4_1, its minimum in `m`; integers as llama.cpp's vec_dot kernels take them.
void to_int8(Form form, const uint8_t* b, int8_t* q, float* d, float* m) {
  if (form != kIQ4_XS) return pyhlo_kernels::block32_to_int8(int(form), b, q, d, m);
  // IQ4_XS: 8 sub-blocks of 32, each as IQ4_NL's, scaled by its 6-bit scale less 32 times d
  // (exact in f32: 11 bits by 6).
  const float scale = half_at(b);
  uint16_t top = 0;
  std::memcpy(&top, b + 2, sizeof(top));
  for (int j = 0; j < 8; ++j) {
    const uint8_t* qs = b + 8 + 16 * j;
#ifdef PYHLO_GGUF_AVX2
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), nibble = _mm_set1_epi8(0x0F);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * j), _mm_shuffle_epi8(table, _mm_and_si128(packed, nibble)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * j + 16),
                     _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(packed, 4), nibble)));
#else
    for (int i = 0; i < 16; ++i) {
      q[32 * j + i] = kIQ4Values[qs[i] & 0xF];
      q[32 * j + 16 + i] = kIQ4Values[qs[i] >> 4];
    }
#endif
    d[j] = scale * float((((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((top >> (2 * j)) & 3) << 4)) - 32);
  }
}

// sum_i w[i] * x[i] over `n` values, n a multiple of 32.
float dot(const float* w, const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < n; i += 32)
    for (int u = 0; u < 2; ++u)
      acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16 * u), _mm512_loadu_ps(x + i + 16 * u), acc[u]);
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
#elif defined(PYHLO_GGUF_AVX2)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < n; i += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8 * u), _mm256_loadu_ps(x + i + 8 * u), acc[u]);
  return pyhlo_kernels::sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#else
  float part[16] = {0};
  for (int64_t i = 0; i < n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += w[i + j] * x[i + j];
  float sum = 0;
  for (int j = 0; j < 16; ++j) sum += part[j];
  return sum;
#endif
}

struct Problem {
  Form form;
  const float* x;
  const uint8_t* w;
  float* y;
  int64_t m, n, k;
  bool mixed = false;    // rows of mixed forms (`rows`); else every row `form`
  pyhlo_kernels::MixedRows rows;
  const float* x_sums = nullptr;        // exact K-quant products: the sums of each 16 of x [m, K / 16]
  // The _x8 targets: x rounded as llama.cpp's Q8_K (pyhlo_kernels::quantize_q8_k), per row:
  const int8_t* x_q8 = nullptr;         // [m, K]
  const int8_t* x_q8_nibbles = nullptr; // [m, K]: x_q8 in a Q4_K / Q5_K super-block's nibble order
  const float* x_q8_scale = nullptr;    // [m, K / 256]
  const int16_t* x_q8_sums = nullptr;   // [m, K / 16]
  const float* x_q8_d32 = nullptr;      // [m, K / 32]: x_q8_scale for each 32 (IQ4_XS's sub-blocks)
  // and x rounded per 32 values as llama.cpp's Q8_1 (pyhlo_kernels::quantize_q8_1), per row:
  const int8_t* x_q32 = nullptr;        // [m, K]
  const float* x_q32_d = nullptr;       // [m, K / 32]
  const float* x_q32_s = nullptr;       // [m, K / 32]
  bool int8_x = false;                  // the _x8 targets
  std::atomic<bool>* bad_row = nullptr; // rows of mixed forms: set where a row's code names no form
};

bool is_k_quant(Form form) { return form >= kQ2_K && form <= kQ6_K; }

// The int8-activation form rounds x per 256 values (llama.cpp's Q8_K) for the K-quants and
// IQ4_XS, per 32 (Q8_0 / Q8_1) for the others, as llama.cpp's vec_dot_type of each.
bool takes_q8_k(Form form) { return is_k_quant(form) || form == kIQ4_XS; }

KQuant k_quant(Form form) { return KQuant(int(form) - int(kQ2_K)); }

// Values of a weight row taken at a time: unpacked, they and the activations they meet stay
// in the first-level cache (a whole row of 8192 floats did not, and read at half the speed).
constexpr int64_t kPieceValues = 2048;

// Each piece of a weight row is dequantized into a buffer once, then multiplied by every
// activation row. A K-quant piece is unpacked instead (kquants.h) and multiplied by up to
// kGroup activation rows at a time in f32, or with rounded activations as integers.
constexpr int kGroup = 4;

// Activation rows up to which a block-of-32 form's row is multiplied whole by block32_forms.h's
// row kernels (int8 or exact) (each block unpacked in registers once per 4 activation rows);
// past it, a piece at a time as above (each block unpacked once for all).
constexpr int64_t kBlock32RowsMost = 8;

void k_quant_piece(const Problem& p, const SuperBlock* unpacked, int64_t blocks, int64_t start, float* sums) {
  const int64_t super_blocks = p.k / pyhlo_kernels::kSuperValues, first = start / pyhlo_kernels::kSuperValues;
  if (p.int8_x) {
    for (int64_t m = 0; m < p.m; ++m)
      sums[m] += pyhlo_kernels::dot_q8_k(unpacked, p.x_q8 + m * p.k + start, p.x_q8_scale + m * super_blocks + first,
                                         p.x_q8_sums + m * (p.k / 16) + start / 16, blocks);
    return;
  }
  for (int64_t m0 = 0; m0 < p.m; m0 += kGroup) {
    const float* x[kGroup];
    const float* x_sums[kGroup];
    const int group = int(std::min<int64_t>(kGroup, p.m - m0));
    for (int g = 0; g < group; ++g) {
      x[g] = p.x + (m0 + g) * p.k + start;
      x_sums[g] = p.x_sums + (m0 + g) * (p.k / 16) + start / 16;
    }
    switch (group) {
      case 4: pyhlo_kernels::dot_f32<4>(unpacked, blocks, x, x_sums, sums + m0); break;
      case 3: pyhlo_kernels::dot_f32<3>(unpacked, blocks, x, x_sums, sums + m0); break;
      case 2: pyhlo_kernels::dot_f32<2>(unpacked, blocks, x, x_sums, sums + m0); break;
      default: pyhlo_kernels::dot_f32<1>(unpacked, blocks, x, x_sums, sums + m0); break;
    }
  }
}

// A row of mixed forms names a form whose blocks of K values lie within the rows' bytes.
bool row_fits(const Problem& p, int64_t n, Form code) {
  return code < kForms && p.k % kLayouts[code].values == 0 &&
         p.rows.holds(n, p.k / kLayouts[code].values * kLayouts[code].bytes);
}

// The buffers of a row taken a piece at a time (allocated on a thread's first such row: rows the
// row kernels take need none).
struct PieceBuffers {
  std::unique_ptr<float[]> values{new float[kPieceValues]};
  std::unique_ptr<SuperBlock[]> unpacked{new SuperBlock[kPieceValues / pyhlo_kernels::kSuperValues]};
  std::unique_ptr<int8_t[]> q8{new int8_t[kPieceValues]};
  std::unique_ptr<float[]> block_d{new float[kPieceValues / 32]}, block_m{new float[kPieceValues / 32]};
};

void weight_rows(const Problem& p, int64_t begin, int64_t end) {
  const pyhlo_kernels::Q8_1Rows x32{p.x_q32, p.x_q32_d, p.x_q32_s, p.k};
  const float* exact_x = p.int8_x ? nullptr : p.x;
  const bool by_row_kernel = p.m <= kBlock32RowsMost && pyhlo_kernels::has_block32_row_kernel();
  if (!p.mixed && !takes_q8_k(p.form) && by_row_kernel) {
    // Every row of one form of 32-value blocks: the row kernel takes them all in one call.
    const int64_t row_bytes = p.k / 32 * kLayouts[p.form].bytes;
    pyhlo_kernels::dot_block32_rows(int(p.form), {p.w + begin * row_bytes, row_bytes, end - begin, p.k / 32,
                                                  p.y + begin, p.n}, x32, exact_x, p.m);
    return;
  }
  std::unique_ptr<PieceBuffers> buffers;
  float few_sums[kBlock32RowsMost];
  std::vector<float> more_sums(p.m > kBlock32RowsMost ? p.m : 0);
  float* const sums = p.m > kBlock32RowsMost ? more_sums.data() : few_sums;
  const bool integer = p.int8_x;
  for (int64_t n = begin; n < end; ++n) {
    const Form form = p.mixed ? Form(p.rows.code(n)) : p.form;
    if (p.mixed && !row_fits(p, n, form)) {
      // Checked as each row is read, on the thread that reads it, not in a pass of its own.
      p.bad_row->store(true, std::memory_order_relaxed);
      for (int64_t m = 0; m < p.m; ++m) p.y[m * p.n + n] = NAN;
      continue;
    }
    const Layout layout = kLayouts[form];
    const uint8_t* row = p.mixed ? p.rows.row(n) : p.w + n * (p.k / layout.values * layout.bytes);
    std::fill_n(sums, p.m, 0.0f);
    if (integer && is_k_quant(form) && pyhlo_kernels::has_row_kernel(k_quant(form))) {
      // Unpacked in registers, the whole row at once: nothing stored between unpacking and
      // multiplying, and each super-block read once for every activation row.
      const pyhlo_kernels::Q8KRows x{p.x_q8, p.x_q8_nibbles, p.x_q8_scale, p.x_q8_sums, p.k};
      pyhlo_kernels::dot_q8_k_rows(k_quant(form), row, p.k / pyhlo_kernels::kSuperValues, x, p.m, sums);
      for (int64_t m = 0; m < p.m; ++m) p.y[m * p.n + n] = sums[m];
      continue;
    }
    if (!takes_q8_k(form) && by_row_kernel) {
      // The same, a block at a time (decode: one to a few activation rows), int8 or exact.
      pyhlo_kernels::dot_block32_rows(int(form), {row, 0, 1, p.k / 32, p.y + n, p.n}, x32, exact_x, p.m);
      continue;
    }
    if (!integer && is_k_quant(form) && pyhlo_kernels::has_exact_row_kernel(k_quant(form))) {
      pyhlo_kernels::dot_f32_rows(k_quant(form), row, p.k / pyhlo_kernels::kSuperValues, p.x, p.x_sums, p.k, p.m,
                                  sums);
      for (int64_t m = 0; m < p.m; ++m) p.y[m * p.n + n] = sums[m];
      continue;
    }
    if (!buffers) buffers.reset(new PieceBuffers);
    float* const values = buffers->values.get();
    SuperBlock* const unpacked = buffers->unpacked.get();
    int8_t* const q8 = buffers->q8.get();
    float* const block_d = buffers->block_d.get();
    float* const block_m = buffers->block_m.get();
    for (int64_t start = 0; start < p.k; start += kPieceValues) {
      const int64_t length = std::min(kPieceValues, p.k - start), first = start / layout.values;
      const int64_t blocks = length / layout.values;
      const uint8_t* piece = row + first * layout.bytes;
      if (is_k_quant(form)) {
        for (int64_t b = 0; b < blocks; ++b)
          pyhlo_kernels::unpack(k_quant(form), piece + b * layout.bytes, &unpacked[b], integer);
        k_quant_piece(p, unpacked, blocks, start, sums);
        continue;
      }
      if (integer) {
        const int per_block = layout.values / 32;
        for (int64_t b = 0; b < blocks; ++b)
          to_int8(form, piece + b * layout.bytes, q8 + b * layout.values, block_d + b * per_block,
                  block_m + b * per_block);
        const bool per_256 = takes_q8_k(form), with_min = form == kQ5_1 || form == kQ4_1;
        const int8_t* xq = per_256 ? p.x_q8 : p.x_q32;
        const float* xd = per_256 ? p.x_q8_d32 : p.x_q32_d;
        for (int64_t m = 0; m < p.m; ++m)
          sums[m] += pyhlo_kernels::dot_q8_32(q8, block_d, with_min ? block_m : nullptr,
                                              xq + m * p.k + start, xd + m * (p.k / 32) + start / 32,
                                              with_min ? p.x_q32_s + m * (p.k / 32) + start / 32 : nullptr,
                                              length / 32);
        continue;
      }
      for (int64_t b = 0; b < blocks; ++b) dequantize(form, piece + b * layout.bytes, values + b * layout.values);
      for (int64_t m = 0; m < p.m; ++m) sums[m] += dot(values, p.x + m * p.k + start, length);
    }
    for (int64_t m = 0; m < p.m; ++m) p.y[m * p.n + n] = sums[m];
  }
}

// The exact GEMM's widening: values k0 .. k0 + kc - 1 (whole blocks) of weight row n as f32, a
// K-quant's as (d * scale) * (q - centre) + dlow * low, its sums' terms in dot_f32. A row of
// mixed forms whose code names no form that fits is NaN (and the call an error).
void widen_row(const Problem& p, int64_t n, int64_t k0, int64_t kc, float* out) {
  const Form form = p.mixed ? Form(p.rows.code(n)) : p.form;
  if (p.mixed && !row_fits(p, n, form)) {
    p.bad_row->store(true, std::memory_order_relaxed);
    std::fill(out, out + kc, NAN);
    return;
  }
  const Layout layout = kLayouts[form];
  const uint8_t* row = p.mixed ? p.rows.row(n) : p.w + n * (p.k / layout.values * layout.bytes);
  for (int64_t b = k0 / layout.values; b < (k0 + kc) / layout.values; ++b) {
    float* o = out + b * layout.values - k0;
    if (!is_k_quant(form)) {
      dequantize(form, row + b * layout.bytes, o);
      continue;
    }
    SuperBlock s;
    pyhlo_kernels::unpack(k_quant(form), row + b * layout.bytes, &s, false);
    for (int j = 0; j < 16; ++j) {
      const float step = s.d * float(s.scale[j]), offset = s.centre ? 0.0f : s.dlow * float(s.low[j]);
      for (int i = 0; i < 16; ++i) o[16 * j + i] = step * float(int(s.q[16 * j + i]) - s.centre) + offset;
    }
  }
}

ffi::Error Dispatch(ffi::ThreadPool& pool, const Problem& p) {
  const Layout layout = kLayouts[p.form == kForms ? kQ8_0 : p.form];
  const int64_t row_bytes = p.mixed ? p.rows.body / std::max<int64_t>(1, p.n) : p.k / layout.values * layout.bytes;
  return pyhlo_kernels::run_row_chunks(pool, p.n, row_bytes, kChunkAlign,
                                       [p](int64_t begin, int64_t end) { weight_rows(p, begin, end); }, p.w);
}

constexpr const char* kBadRow =
    "pyhlo_matvec_gguf_rows / pyhlo_gemm_gguf_rows: a row's code names no GGUF form whose blocks fit the rows' "
    "bytes at the row's offset (lay rows out with pyhlo.ops.gguf_blocks.pack_mixed_rows)";

// x, w and y checked and described; `form` kForms: rows of mixed forms. int8_x: the _x8
// target; gemm: the exact GEMM.
ffi::Error Run(ffi::ThreadPool& pool, Form form, bool int8_x, bool gemm, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
               ffi::Result<ffi::AnyBuffer>& y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x.element_type() != ffi::DataType::F32 || y->element_type() != ffi::DataType::F32 || x_dims.size() < 1 ||
      w.element_type() != ffi::DataType::U8 || w_dims.size() != 2)
    return ffi::Error::InvalidArgument("pyhlo_matvec (GGUF blocks as stored): need f32 x[..., K] and u8 w[N, bytes]");
  Problem p{form, static_cast<const float*>(x.untyped_data()), static_cast<const uint8_t*>(w.untyped_data()),
            static_cast<float*>(y->untyped_data()), 0, w_dims[0], x_dims[x_dims.size() - 1]};
  p.m = p.k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / p.k;
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_matvec (GGUF blocks as stored): y must have x's rows and N columns");
  bool per_256 = false, per_32 = false;   // the forms met round x per 256 values, per 32
  if (form != kForms) {
    (takes_q8_k(form) ? per_256 : per_32) = true;
    const Layout layout = kLayouts[form];
    if (p.k % layout.values != 0 || w_dims[1] != p.k / layout.values * layout.bytes)
      return ffi::Error::InvalidArgument(
          "pyhlo_matvec (GGUF blocks as stored): need u8 w[N, K / values * bytes] of whole blocks");
  } else {
    // Each row's code and offset are checked as the row is read (weight_rows).
    if (w_dims[1] < pyhlo_kernels::kRowTail)
      return ffi::Error::InvalidArgument("pyhlo_matvec_gguf_rows: need u8 w[N, widest row + 5]");
    p.mixed = true;
    p.rows = pyhlo_kernels::MixedRows(p.w, w_dims[0], w_dims[1]);
    // The ways the rows' forms take x (their codes lie together: a short pass).
    for (int64_t n = 0; n < p.n; ++n)
      if (p.rows.code(n) < kForms) (takes_q8_k(Form(p.rows.code(n))) ? per_256 : per_32) = true;
    per_256 = per_256 && p.k % pyhlo_kernels::kSuperValues == 0;
    per_32 = per_32 && p.k % 32 == 0;
  }
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  std::atomic<bool> bad_row{false};
  p.bad_row = &bad_row;
  if (gemm) {
    pyhlo_kernels::widened_gemm(pool, pyhlo_kernels::WidenedProduct{p.m, p.n, p.k, p.x, p.y},
                                [&p](int64_t n, int64_t k0, int64_t kc, float* out) { widen_row(p, n, k0, kc, out); });
    return bad_row.load() ? ffi::Error::InvalidArgument(kBadRow) : ffi::Error::Success();
  }
  std::vector<int8_t> x_q8, x_q8_nibbles, x_q32;
  std::vector<float> x_q8_scale, x_q8_d32, x_sums, x_q32_d, x_q32_s;
  std::vector<int16_t> x_q8_sums;
  if (!int8_x && (form == kForms || is_k_quant(form))) {
    x_sums.assign(p.m * (p.k / 16), 0.0f);
    for (int64_t i = 0; i < p.m * (p.k / 16); ++i)
      for (int j = 0; j < 16; ++j) x_sums[i] += p.x[16 * i + j];
    p.x_sums = x_sums.data();
  }
  // The int8-activation form: x rounded once per call each way its rows' forms take it.
  p.int8_x = int8_x;
  if (int8_x && per_256) {
    const int64_t blocks = p.k / pyhlo_kernels::kSuperValues;
    x_q8.resize(p.m * p.k);
    x_q8_scale.resize(p.m * blocks);
    x_q8_sums.resize(p.m * (p.k / 16));
    x_q8_d32.resize(p.m * (p.k / 32));
    for (int64_t m = 0; m < p.m; ++m)
      pyhlo_kernels::quantize_q8_k(p.x + m * p.k, p.k, x_q8.data() + m * p.k, x_q8_scale.data() + m * blocks,
                                   x_q8_sums.data() + m * (p.k / 16));
    for (size_t i = 0; i < x_q8_d32.size(); ++i) x_q8_d32[i] = x_q8_scale[i / 8];
    x_q8_nibbles.resize(p.m * p.k);
    pyhlo_kernels::nibble_order_q8_k(x_q8.data(), p.m * p.k, x_q8_nibbles.data());
    p.x_q8 = x_q8.data();
    p.x_q8_nibbles = x_q8_nibbles.data();
    p.x_q8_scale = x_q8_scale.data();
    p.x_q8_sums = x_q8_sums.data();
    p.x_q8_d32 = x_q8_d32.data();
  }
  if (int8_x && per_32) {
    x_q32.resize(p.m * p.k);
    x_q32_d.resize(p.m * (p.k / 32));
    x_q32_s.resize(p.m * (p.k / 32));
    for (int64_t m = 0; m < p.m; ++m)
      pyhlo_kernels::quantize_q8_1(p.x + m * p.k, p.k, x_q32.data() + m * p.k, x_q32_d.data() + m * (p.k / 32),
                                   x_q32_s.data() + m * (p.k / 32));
    p.x_q32 = x_q32.data();
    p.x_q32_d = x_q32_d.data();
    p.x_q32_s = x_q32_s.data();
  }
  const ffi::Error done = Dispatch(pool, p);
  return bad_row.load() ? ffi::Error::InvalidArgument(kBadRow) : done;
}

template <Form F, bool Int8X>
ffi::Error MatvecGguf(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, F, Int8X, false, x, w, y);
}

template <Form F>
ffi::Error GemmGguf(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, F, false, true, x, w, y);
}

}  // namespace

// Every target here takes (x, w) and returns y.
#define PYHLO_GGUF_BIND(symbol, function)                                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, function,                                                \
                                ffi::Ffi::Bind()                                                 \
                                    .Ctx<ffi::ThreadPool>()                                      \
                                    .Arg<ffi::AnyBuffer>()                                       \
                                    .Arg<ffi::AnyBuffer>()                                       \
                                    .Ret<ffi::AnyBuffer>())
#define PYHLO_GGUF_HANDLER(symbol, form, int8_x) PYHLO_GGUF_BIND(symbol, (MatvecGguf<form, int8_x>))
#define PYHLO_GGUF_GEMM_HANDLER(symbol, form) PYHLO_GGUF_BIND(symbol, GemmGguf<form>)

PYHLO_GGUF_GEMM_HANDLER(PyhloGemmQ5_0, kQ5_0);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmQ5_1, kQ5_1);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmQ2_K, kQ2_K);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmQ3_K, kQ3_K);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmQ4_K, kQ4_K);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmQ5_K, kQ5_K);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmQ6_K, kQ6_K);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmIQ4_NL, kIQ4_NL);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmIQ4_XS, kIQ4_XS);
PYHLO_GGUF_GEMM_HANDLER(PyhloGemmGgufRows, kForms);
PYHLO_GGUF_HANDLER(PyhloMatvecQ5_0, kQ5_0, false);
PYHLO_GGUF_HANDLER(PyhloMatvecQ5_1, kQ5_1, false);
PYHLO_GGUF_HANDLER(PyhloMatvecQ2_K, kQ2_K, false);
PYHLO_GGUF_HANDLER(PyhloMatvecQ3_K, kQ3_K, false);
PYHLO_GGUF_HANDLER(PyhloMatvecQ4_K, kQ4_K, false);
PYHLO_GGUF_HANDLER(PyhloMatvecQ5_K, kQ5_K, false);
PYHLO_GGUF_HANDLER(PyhloMatvecQ6_K, kQ6_K, false);
PYHLO_GGUF_HANDLER(PyhloMatvecIQ4_NL, kIQ4_NL, false);
PYHLO_GGUF_HANDLER(PyhloMatvecIQ4_XS, kIQ4_XS, false);
PYHLO_GGUF_HANDLER(PyhloMatvecGgufRows, kForms, false);
PYHLO_GGUF_HANDLER(PyhloMatvecQ5_0X8, kQ5_0, true);
PYHLO_GGUF_HANDLER(PyhloMatvecQ5_1X8, kQ5_1, true);
PYHLO_GGUF_HANDLER(PyhloMatvecIQ4_NLX8, kIQ4_NL, true);
PYHLO_GGUF_HANDLER(PyhloMatvecIQ4_XSX8, kIQ4_XS, true);
PYHLO_GGUF_HANDLER(PyhloMatvecQ2_KX8, kQ2_K, true);
PYHLO_GGUF_HANDLER(PyhloMatvecQ3_KX8, kQ3_K, true);
PYHLO_GGUF_HANDLER(PyhloMatvecQ4_KX8, kQ4_K, true);
PYHLO_GGUF_HANDLER(PyhloMatvecQ5_KX8, kQ5_K, true);
PYHLO_GGUF_HANDLER(PyhloMatvecQ6_KX8, kQ6_K, true);
PYHLO_GGUF_HANDLER(PyhloMatvecGgufRowsX8, kForms, true);
