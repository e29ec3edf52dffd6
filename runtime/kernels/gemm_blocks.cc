// pyhlo_gemm_q8_0_x8, _q4_0_x8, _q4_1_x8: y[m, n] = sum_k x[m, k] * w[n, k] for many rows of
// activations (a prefill), w in llama.cpp's GGUF block forms split into arrays as the
// pyhlo_matvec_<form>_x8 targets take them (runtime/kernels/matvec.cc has the layout), x
// rounded to int8 per 32 values as those targets round it (d = max |x| / 127, q = round(x / d)).
// pyhlo_gemm_s8_x8: the same for int8 weights with one f32 scale per row (pyhlo_matvec_s8's
// operands: NeuronConfig.quant), packed as Q8_0 blocks whose scales are the row's.
//
// pyhlo_gemm_q5_0_x8, _q5_1_x8, _iq4_nl_x8: the same for the forms of 32-value blocks a GGUF
// file's bytes keep (u8 w[N, K / 32 * bytes], as the pyhlo_matvec_<form>_x8 targets of
// matvec_gguf.cc take them), x rounded as those targets round it for these forms (llama.cpp's
// Q8_1: block32_forms.h, q8_blocks.h), so the result equals theirs up to the order of the f32
// sums; pyhlo_gemm_gguf_rows32_x8 for a weight whose rows come in several of these forms and
// Q8_0 / Q4_0 / Q4_1 (mixed_rows.h; llama.cpp's Q4_K_M gives attn_v Q8_0 in some layers, Q5_0
// in others where rows are not whole super-blocks). Each panel's rows are first read into
// block32_forms.h's integers, then packed as Q8_0's.
//
// pyhlo_gemm_q8_0, _q4_0, _q4_1, _s8 (no _x8): the exact products of the same operands, x kept
// f32 and the weights widened to f32 as the program's own dequantization widens them (d * (q -
// 8) for Q4_0, d * q + m for Q4_1, d * q for Q8_0, scale * q for S8) a panel at a time
// (widened_panels.h); only the order of the sums differs.
//
// The matrix-vector kernels read each weight row once and are bound by memory; with a hundred
// rows of activations the integer products bind instead, so this kernel keeps them in registers
// the way llamafile's tinyBLAS does: a tile of 32 weight rows by 4 activation rows, each block's
// int32 sums in 8 vectors. To make one vpdpbusd serve 16 weight rows, each thread first
// repacks a panel of 32 weight rows (in its cache, once for all activation rows): per block,
// the weights as signed bytes in groups of 4 consecutive values, the 16 rows of a vector side by
// side (Q4_0's nibbles become q - 8; Q4_1's stay q, its minimum added through the sums of the
// rounded x), with each row's f32 scale and minimum. vpdpbusd multiplies unsigned by signed
// bytes, so x enters as q + 128, and each block's int32 sums start from -128 * sum of the
// weights, which the panel keeps. A block's sums are then scaled by d_w * d_x into f32.
//
// Panels are split between the caller and XLA's intra-op thread pool (gemm_panels.h). Paths: AVX-512 VNNI
// where the CPU has it; AVX2 on the same panels packed 8 rows to a vector (vpmaddubsw, tile()
// below); elsewhere a portable form, correct but not fast (the lowering takes these kernels
// only where they have a vector form: PyhloGemmBlocksFast, PyhloGemmExactFast).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "block32_forms.h"
#include "block_operands.h"
#include "gemm_panels.h"
#include "half.h"
#include "mixed_rows.h"
#include "q8_blocks.h"
#include "widened_panels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PYHLO_GEMM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_GEMM_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// kFile: forms of 32-value blocks as a GGUF file's bytes (block32_forms.h), one or rows of several.
enum Form { kQ8_0, kQ4_0, kQ4_1, kS8, kFile };
constexpr int64_t kBlock = 32;
constexpr int kLanes = 16;               // int32 lanes of a vector: weight rows side by side
constexpr int kPanelRows = 2 * kLanes;   // weight rows of a panel (two vectors)
#if defined(PYHLO_GEMM_AVX2)
constexpr int kTileRows = 2;             // activation rows of a tile (AVX2: 16 vector registers)
#else
constexpr int kTileRows = 4;             // activation rows of a tile
#endif
constexpr int kQuads = kBlock / 4;       // groups of 4 values in a block

using pyhlo_kernels::half_to_f32;

struct Problem {
  Form form;
  int64_t m, n, k, nb;
  const void* w;                 // s8 [N, K] (Q8_0, S8) or u8 [N, K/2] (Q4)
  const uint16_t* scales;        // f16 [N, K/32] (not S8)
  const float* row_scales;       // f32 [N] (S8)
  const uint16_t* mins;          // f16 [N, K/32] (Q4_1)
  const float* block_d;          // f32 [N, K/32]: each block's scale, in place of `scales` (kFile's panels)
  const float* block_m;          // f32 [N, K/32]: each block's minimum, in place of `mins`
  // kFile: the file's bytes, every row of form `code` (u8 [N, K / 32 * bytes]) or rows of mixed forms.
  const uint8_t* file;
  int code;
  bool mixed;
  pyhlo_kernels::MixedRows rows;
  bool wide;                     // some weight |w| > 16: a quad's int16 pairs cannot add up over a block
  bool with_min;                 // some rows have minimums (Q4_1, Q5_1)
  const uint8_t* xq;             // [M, K]: rounded x + 128
  const float* xd;               // [M, K/32]: the rounding's scales
  const float* xsum;             // [M, K/32]: d * sum of the rounded values (Q4_1)
  float* y;                      // [M, N]
};

// A panel of kPanelRows weight rows, block after block. Rows past N are zeros.
struct Panel {
  std::vector<int8_t> values;    // [nb][kQuads][kPanelRows][4]
  std::vector<int32_t> bias;     // [nb][kPanelRows]: -128 * sum of the block's weights
  std::vector<float> d;          // [nb][kPanelRows]
  std::vector<float> min;        // [nb][kPanelRows] (Q4_1)

  // kFile: the panel's rows as block32_forms.h's integers [kPanelRows][K], scales and minimums
  // [kPanelRows][nb], packed from there as Q8_0's.
  std::vector<int8_t> file_values;
  std::vector<float> file_d, file_m;

  Panel(int64_t nb, bool file)
      : values(nb * kQuads * kPanelRows * 4), bias(nb * kPanelRows), d(nb * kPanelRows),
        min(nb * kPanelRows), file_values(file ? kPanelRows * nb * kBlock : 0),
        file_d(file ? kPanelRows * nb : 0), file_m(file ? kPanelRows * nb : 0) {}
};

// Whether the form keeps a weight in a byte (Q8_0, S8) rather than a nibble (Q4).
inline bool bytes_per_value(Form form) { return form == kQ8_0 || form == kS8; }

// Scale of block b of row n.
inline float block_scale(const Problem& p, int64_t n, int64_t b) {
  if (p.block_d != nullptr) return p.block_d[n * p.nb + b];
  return p.form == kS8 ? p.row_scales[n] : half_to_f32(p.scales[n * p.nb + b]);
}

inline float block_min(const Problem& p, int64_t n, int64_t b) {
  if (p.block_m != nullptr) return p.block_m[n * p.nb + b];
  return p.mins != nullptr ? half_to_f32(p.mins[n * p.nb + b]) : 0.0f;
}

// Whether a tile sums each quad's int16 pairs into int32 at once (weights up to 128) rather
// than over a whole block (nibble forms, Q5_0: 8 quads of 2 * 16 * 127 fit in int16).
inline bool wide_weights(const Problem& p) { return p.form == kFile ? p.wide : bytes_per_value(p.form); }

inline bool has_minimums(const Problem& p) { return p.form == kQ4_1 || (p.form == kFile && p.with_min); }

// Weight row n of a kFile problem and its form's code.
inline const uint8_t* file_row(const Problem& p, int64_t n, int* code) {
  if (!p.mixed) {
    *code = p.code;
    return p.file + n * p.nb * pyhlo_kernels::block32_bytes(p.code);
  }
  *code = p.rows.code(n);
  return p.rows.row(n);
}

// Weight j of block b of row n as the packed panel holds it.
inline int8_t packed_weight(const Problem& p, int64_t n, int64_t b, int j) {
  if (bytes_per_value(p.form)) return static_cast<const int8_t*>(p.w)[n * p.k + b * kBlock + j];
  const uint8_t byte = static_cast<const uint8_t*>(p.w)[n * (p.k / 2) + b * (kBlock / 2) + j % (kBlock / 2)];
  const int q = j < kBlock / 2 ? byte & 0xF : byte >> 4;
  return int8_t(p.form == kQ4_0 ? q - 8 : q);
}

void pack(const Problem& p, int64_t n0, Panel& panel);

// A kFile panel: its rows read into integers, then packed as Q8_0's (a problem of those rows alone).
void pack_file(const Problem& p, int64_t n0, Panel& panel) {
  const int64_t nb = p.nb, rows = std::min<int64_t>(kPanelRows, p.n - n0);
  for (int64_t r = 0; r < rows; ++r) {
    int code;
    const uint8_t* row = file_row(p, n0 + r, &code);
    const int bytes = pyhlo_kernels::block32_bytes(code);
    for (int64_t b = 0; b < nb; ++b)
      pyhlo_kernels::block32_to_int8(code, row + b * bytes, panel.file_values.data() + (r * nb + b) * kBlock,
                                     panel.file_d.data() + r * nb + b, panel.file_m.data() + r * nb + b);
    if (!pyhlo_kernels::block32_has_min(code)) std::fill_n(panel.file_m.data() + r * nb, nb, 0.0f);
  }
  Problem view = p;
  view.form = kQ8_0;
  view.n = rows;
  view.w = panel.file_values.data();
  view.block_d = panel.file_d.data();
  view.block_m = panel.file_m.data();
  pack(view, 0, panel);
}

void pack(const Problem& p, int64_t n0, Panel& panel) {
  if (p.form == kFile) return pack_file(p, n0, panel);
  const int64_t nb = p.nb, rows = std::min<int64_t>(kPanelRows, p.n - n0);
  std::vector<float> row_d(nb), row_min(nb);
  for (int r = 0; r < kPanelRows; ++r) {
    const bool real = r < rows;
    for (int64_t b = 0; b < nb; ++b) {
      row_d[b] = real ? block_scale(p, n0 + r, b) : 0.0f;
      row_min[b] = real ? block_min(p, n0 + r, b) : 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      panel.d[b * kPanelRows + r] = row_d[b];
      panel.min[b * kPanelRows + r] = row_min[b];
    }
  }
#ifdef PYHLO_GEMM_VNNI
  // 16 rows' blocks transposed in registers so that a vector holds one group of 4 values of
  // every row (gathering them measured several times slower); the sums of the weights come
  // from vpdpbusd against 128s.
  const __m512i x128 = _mm512_set1_epi8(char(0x80)), nibble = _mm512_set1_epi8(0x0F);
  const int64_t stride = bytes_per_value(p.form) ? p.k : p.k / 2;
  for (int half = 0; half < 2; ++half) {
    const int64_t first = n0 + half * kLanes;
    const int64_t real = std::clamp<int64_t>(p.n - first, 0, kLanes);
    if (real == 0) {
      for (int64_t b = 0; b < nb; ++b) {
        for (int quad = 0; quad < kQuads; ++quad)
          _mm512_storeu_si512(panel.values.data() + ((b * kQuads + quad) * kPanelRows + half * kLanes) * 4,
                              _mm512_setzero_si512());
        _mm512_storeu_si512(panel.bias.data() + b * kPanelRows + half * kLanes, _mm512_setzero_si512());
      }
      continue;
    }
    const __mmask16 mask = real >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << real) - 1);
    const char* rows[kLanes];
    for (int r = 0; r < kLanes; ++r)   // rows past N read row `first` again, then are masked to zero
      rows[r] = static_cast<const char*>(p.w) + (first + (r < real ? r : 0)) * stride;
    for (int64_t b = 0; b < nb; ++b) {
      __m512i v[kQuads];
      if (bytes_per_value(p.form)) {
        pyhlo_kernels::transpose_16x4(rows, b * kBlock, v);
        pyhlo_kernels::transpose_16x4(rows, b * kBlock + 16, v + 4);
      } else {
        pyhlo_kernels::transpose_16x4(rows, b * (kBlock / 2), v);
        for (int quad = 0; quad < 4; ++quad) {
          v[quad + 4] = _mm512_and_si512(_mm512_srli_epi16(v[quad], 4), nibble);
          v[quad] = _mm512_and_si512(v[quad], nibble);
        }
      }
      int8_t* out = panel.values.data() + b * kQuads * kPanelRows * 4 + half * kLanes * 4;
      __m512i sum = _mm512_setzero_si512();
      for (int quad = 0; quad < kQuads; ++quad) {
        if (p.form == kQ4_0) v[quad] = _mm512_sub_epi8(v[quad], _mm512_set1_epi8(8));
        v[quad] = _mm512_maskz_mov_epi32(mask, v[quad]);
        _mm512_storeu_si512(out + quad * kPanelRows * 4, v[quad]);
        sum = _mm512_dpbusd_epi32(sum, x128, v[quad]);
      }
      _mm512_storeu_si512(panel.bias.data() + b * kPanelRows + half * kLanes,
                          _mm512_sub_epi32(_mm512_setzero_si512(), sum));
    }
  }
#elif defined(PYHLO_GEMM_AVX2)
  // 8 rows at a time, their blocks transposed in registers as above (8 groups of 4 values of
  // 8 rows); x enters signed (tile() below), so the sums need no bias (panel.bias stays unused).
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const int64_t stride = bytes_per_value(p.form) ? p.k : p.k / 2;
  for (int group = 0; group < kPanelRows / 8; ++group) {
    const int64_t first = n0 + group * 8;
    const int64_t real = std::clamp<int64_t>(p.n - first, 0, 8);
    for (int64_t b = 0; b < nb; ++b) {
      __m256i v[8];
      for (int r = 0; r < 8; ++r) {
        if (r >= real) {
          v[r] = _mm256_setzero_si256();
          continue;
        }
        const char* row = static_cast<const char*>(p.w) + (first + r) * stride;
        if (bytes_per_value(p.form)) {
          v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
        } else {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2)));
          v[r] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
          if (p.form == kQ4_0) v[r] = _mm256_sub_epi8(v[r], _mm256_set1_epi8(8));
        }
      }
      pyhlo_kernels::transpose_8x8_epi32(v);
      int8_t* out = panel.values.data() + b * kQuads * kPanelRows * 4 + group * 8 * 4;
      for (int quad = 0; quad < kQuads; ++quad)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + quad * kPanelRows * 4), v[quad]);
    }
  }
#else
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < kPanelRows; ++r) {
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int8_t v = r < rows ? packed_weight(p, n0 + r, b, j) : 0;
        panel.values[((b * kQuads + j / 4) * kPanelRows + r) * 4 + j % 4] = v;
        sum += v;
      }
      panel.bias[b * kPanelRows + r] = -128 * sum;
    }
#endif
}

#ifdef PYHLO_GEMM_VNNI
template <int R>
void tile(const Problem& p, const Panel& panel, int64_t n0, int64_t m0) {
  const int64_t nb = p.nb, k = p.k;
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = panel.values.data() + b * kQuads * kPanelRows * 4;
    const __m512i bias0 = _mm512_loadu_si512(panel.bias.data() + b * kPanelRows);
    const __m512i bias1 = _mm512_loadu_si512(panel.bias.data() + b * kPanelRows + kLanes);
    __m512i sum[2][R];
    for (int r = 0; r < R; ++r) sum[0][r] = bias0, sum[1][r] = bias1;
    for (int quad = 0; quad < kQuads; ++quad) {
      __m512i w0 = _mm512_loadu_si512(wb + quad * kPanelRows * 4);
      __m512i w1 = _mm512_loadu_si512(wb + quad * kPanelRows * 4 + kLanes * 4);
      // In registers, not read again by every vpdpbusd (what the compiler picks otherwise): a
      // 64-byte load per instruction measured the bottleneck.
      asm("" : "+v"(w0), "+v"(w1));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, p.xq + (m0 + r) * k + b * kBlock + quad * 4, sizeof(four));
        const __m512i x = _mm512_set1_epi32(four);
        sum[0][r] = _mm512_dpbusd_epi32(sum[0][r], x, w0);
        sum[1][r] = _mm512_dpbusd_epi32(sum[1][r], x, w1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(panel.d.data() + b * kPanelRows);
    const __m512 d1 = _mm512_loadu_ps(panel.d.data() + b * kPanelRows + kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(p.xd[(m0 + r) * nb + b]);
      acc[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0][r]), _mm512_mul_ps(d0, dx), acc[0][r]);
      acc[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[1][r]), _mm512_mul_ps(d1, dx), acc[1][r]);
    }
    if (has_minimums(p)) {
      const __m512 min0 = _mm512_loadu_ps(panel.min.data() + b * kPanelRows);
      const __m512 min1 = _mm512_loadu_ps(panel.min.data() + b * kPanelRows + kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(p.xsum[(m0 + r) * nb + b]);
        acc[0][r] = _mm512_fmadd_ps(min0, xs, acc[0][r]);
        acc[1][r] = _mm512_fmadd_ps(min1, xs, acc[1][r]);
      }
    }
  }
  pyhlo_kernels::store_tile<R>(p.y, p.n, n0, m0, acc);
}
#elif defined(PYHLO_GEMM_AVX2)
// AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes into pairs summed in
// saturating int16, and vpmaddwd against ones widens them to int32. A pair of x + 128 and a
// byte weight could pass int16's range, so x enters signed and the unsigned operand is |w|,
// with x given w's sign (vpsignb): a pair stays within 2 * 128 * 127. The nibble forms' weights
// (|w| <= 15) let a block's 8 groups add up in int16 (8 * 2 * 15 * 127 fits), widened once.
// A pass covers kPassVectors of the panel's 4 vectors of 8 rows, R activation rows.
constexpr int kPassVectors = 2;

template <int R, bool ByteWeights>
void tile_pass(const Problem& p, const Panel& panel, int64_t n0, int64_t m0, int v0) {
  constexpr int V = kPassVectors;
  const int64_t nb = p.nb, k = p.k;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[V][R];
  #pragma GCC unroll 16
  for (int v = 0; v < V; ++v)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[v][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = panel.values.data() + b * kQuads * kPanelRows * 4 + v0 * 32;
    __m256i sum[V][R];
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v)
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) sum[v][r] = _mm256_setzero_si256();
    for (int quad = 0; quad < kQuads; ++quad) {
      __m256i w[V], magnitude[V];
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) {
        w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + quad * kPanelRows * 4 + v * 32));
        magnitude[v] = _mm256_abs_epi8(w[v]);
      }
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, p.xq + (m0 + r) * k + b * kBlock + quad * 4, sizeof(four));
        const __m256i x = _mm256_set1_epi32(four ^ int32_t(0x80808080u));   // q + 128 -> q
        #pragma GCC unroll 16
        for (int v = 0; v < V; ++v) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude[v], _mm256_sign_epi8(x, w[v]));
          sum[v][r] = ByteWeights ? _mm256_add_epi32(sum[v][r], _mm256_madd_epi16(pairs, ones))
                                  : _mm256_add_epi16(sum[v][r], pairs);
        }
      }
    }
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const __m256 d = _mm256_loadu_ps(panel.d.data() + b * kPanelRows + (v0 + v) * 8);
      const __m256 min = _mm256_loadu_ps(panel.min.data() + b * kPanelRows + (v0 + v) * 8);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i total = ByteWeights ? sum[v][r] : _mm256_madd_epi16(sum[v][r], ones);
        const __m256 dx = _mm256_set1_ps(p.xd[(m0 + r) * nb + b]);
        acc[v][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[v][r]);
        if (has_minimums(p)) acc[v][r] = _mm256_fmadd_ps(min, _mm256_set1_ps(p.xsum[(m0 + r) * nb + b]), acc[v][r]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const int64_t first = n0 + (v0 + v) * 8;
    const int64_t real = std::clamp<int64_t>(p.n - first, 0, 8);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      float* out = p.y + (m0 + r) * p.n + first;
      if (real == 8) {
        _mm256_storeu_ps(out, acc[v][r]);
      } else if (real > 0) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[v][r]);
        std::memcpy(out, lanes, real * sizeof(float));
      }
    }
  }
}

template <int R>
void tile(const Problem& p, const Panel& panel, int64_t n0, int64_t m0) {
  for (int v0 = 0; v0 < kPanelRows / 8 && n0 + v0 * 8 < p.n; v0 += kPassVectors) {
    if (wide_weights(p)) tile_pass<R, true>(p, panel, n0, m0, v0);
    else tile_pass<R, false>(p, panel, n0, m0, v0);
  }
}
#else
template <int R>
void tile(const Problem& p, const Panel& panel, int64_t n0, int64_t m0) {
  const int64_t nb = p.nb, k = p.k;
  float acc[R][kPanelRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = panel.values.data() + b * kQuads * kPanelRows * 4;
    for (int r = 0; r < R; ++r) {
      int32_t sum[kPanelRows];
      for (int c = 0; c < kPanelRows; ++c) sum[c] = panel.bias[b * kPanelRows + c];
      const uint8_t* x = p.xq + (m0 + r) * k + b * kBlock;
      for (int quad = 0; quad < kQuads; ++quad)
        for (int c = 0; c < kPanelRows; ++c)
          for (int j = 0; j < 4; ++j)
            sum[c] += int32_t(x[quad * 4 + j]) * wb[(quad * kPanelRows + c) * 4 + j];
      const float dx = p.xd[(m0 + r) * nb + b];
      const float xs = has_minimums(p) ? p.xsum[(m0 + r) * nb + b] : 0.0f;
      for (int c = 0; c < kPanelRows; ++c)
        acc[r][c] += float(sum[c]) * (panel.d[b * kPanelRows + c] * dx) + panel.min[b * kPanelRows + c] * xs;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelRows && n0 + c < p.n; ++c) p.y[(m0 + r) * p.n + n0 + c] = acc[r][c];
}
#endif

void panel_product(const Problem& p, Panel& panel, int64_t n0) {
  pack(p, n0, panel);
  int64_t m0 = 0;
  for (; m0 + kTileRows <= p.m; m0 += kTileRows) tile<kTileRows>(p, panel, n0, m0);
  switch (p.m - m0) {
    case 3: tile<3>(p, panel, n0, m0); break;
    case 2: tile<2>(p, panel, n0, m0); break;
    case 1: tile<1>(p, panel, n0, m0); break;
    default: break;
  }
}

// x rounded per 32 values, as the matvec _x8 targets round it: d = max |x| / 127, q =
// round(x * (1 / d)) half to even; kept as q + 128 (unsigned bytes for vpdpbusd).
void round_activations(const float* x, int64_t m, int64_t k, uint8_t* xq, float* xd, float* xsum) {
  const int64_t nb = k / kBlock;
  for (int64_t i = 0; i < m * nb; ++i) {
    const float* xb = x + i * kBlock;
    uint8_t* qb = xq + i * kBlock;
#ifdef PYHLO_GEMM_VNNI
    const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
    const __m512i qa = _mm512_min_epi32(high, _mm512_max_epi32(low, _mm512_cvtps_epi32(
        _mm512_mul_ps(a, _mm512_set1_ps(inverse)))));
    const __m512i qc = _mm512_min_epi32(high, _mm512_max_epi32(low, _mm512_cvtps_epi32(
        _mm512_mul_ps(c, _mm512_set1_ps(inverse)))));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
    const __m512i shift = _mm512_set1_epi32(128);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(_mm512_add_epi32(qa, shift)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(qc, shift)));
#elif defined(PYHLO_GEMM_AVX2)
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
    amax4 = _mm_max_ss(amax4, _mm_movehdup_ps(amax4));
    const float amax = _mm_cvtss_f32(amax4);
    const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    __m256i q[4], total8 = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {   // |x * inverse| <= 127 up to rounding: the clamp of the portable form
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
      q[i] = _mm256_min_epi32(_mm256_set1_epi32(127), _mm256_max_epi32(_mm256_set1_epi32(-127), q[i]));
      total8 = _mm256_add_epi32(total8, q[i]);
    }
    // Packing works within 128-bit lanes: the permute puts the 8 groups of 4 back in order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_xor_si256(bytes, _mm256_set1_epi8(char(0x80))));
    __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(total8), _mm256_extracti128_si256(total8, 1));
    total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, 0x4E));
    total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, 0xB1));
    const int32_t total = _mm_cvtsi128_si32(total4);
#else
    float amax = 0;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    int32_t total = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t q = std::max(-127, std::min(127, int32_t(std::nearbyint(xb[j] * inverse))));
      qb[j] = uint8_t(q + 128);
      total += q;
    }
#endif
    xd[i] = d;
    xsum[i] = d * float(total);
  }
}

// The exact form's widening: block b of row n as f32 into out[32].
void widen_block(const Problem& p, int64_t n, int64_t b, float* out) {
  const float d = half_to_f32(p.scales[n * p.nb + b]);
#ifdef PYHLO_WIDENED_AVX512
  // The same products as below, 16 at a time.
  const __m512 scale = _mm512_set1_ps(d);
  if (p.form == kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(p.w) + n * p.k + b * kBlock;
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * half));
      _mm512_storeu_ps(out + 16 * half, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))));
    }
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.w) + n * (p.k / 2) + b * (kBlock / 2);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), high = _mm512_srli_epi32(bytes, 4);
  if (p.form == kQ4_0) {
    low = _mm512_sub_epi32(low, _mm512_set1_epi32(8));
    high = _mm512_sub_epi32(high, _mm512_set1_epi32(8));
    _mm512_storeu_ps(out, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(low)));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(high)));
    return;
  }
  const __m512 m = _mm512_set1_ps(half_to_f32(p.mins[n * p.nb + b]));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(low)), m));
  _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(high)), m));
#elif defined(PYHLO_WIDENED_AVX2)
  // The same products, 8 at a time.
  const __m256 scale = _mm256_set1_ps(d);
  if (p.form == kQ8_0) {
    const int8_t* q = static_cast<const int8_t*>(p.w) + n * p.k + b * kBlock;
    for (int e = 0; e < 4; ++e) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * e));
      _mm256_storeu_ps(out + 8 * e, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
    }
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(p.w) + n * (p.k / 2) + b * (kBlock / 2);
  const __m256 m = _mm256_set1_ps(p.form == kQ4_1 ? half_to_f32(p.mins[n * p.nb + b]) : 0.0f);
  const __m256i centre = _mm256_set1_epi32(p.form == kQ4_0 ? 8 : 0), nibble = _mm256_set1_epi32(0xF);
  for (int e = 0; e < 2; ++e) {   // bytes 8e .. 8e + 7: values 8e .. 8e + 7 (low), 16 + 8e .. (high)
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * e)));
    const __m256i low = _mm256_sub_epi32(_mm256_and_si256(bytes, nibble), centre);
    const __m256i high = _mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), centre);
    _mm256_storeu_ps(out + 8 * e, _mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(low)), m));
    _mm256_storeu_ps(out + 16 + 8 * e, _mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(high)), m));
  }
#else
  for (int j = 0; j < kBlock; ++j) {
    const int8_t v = packed_weight(p, n, b, j);
    out[j] = p.form == kQ4_1 ? d * float(v) + half_to_f32(p.mins[n * p.nb + b]) : d * float(v);
  }
#endif
}

// Values k0 .. k0 + kc - 1 of weight row n as f32 into out; k0 is a multiple of 32 and, but for
// S8, so is kc.
void widen(const Problem& p, int64_t n, int64_t k0, int64_t kc, float* out) {
  if (p.form == kS8) {
    const int8_t* q = static_cast<const int8_t*>(p.w) + n * p.k + k0;
    for (int64_t j = 0; j < kc; ++j) out[j] = p.row_scales[n] * float(q[j]);
    return;
  }
  for (int64_t b = 0; b < kc / kBlock; ++b) widen_block(p, n, k0 / kBlock + b, out + b * kBlock);
}

// The product of p (its weights and output set): exact, on panels of widened weights; else x
// rounded and the packed panels shared between the threads.
void multiply(ffi::ThreadPool& pool, Problem& p, const float* x, bool exact) {
  if (exact) {
    pyhlo_kernels::widened_gemm(pool, pyhlo_kernels::WidenedProduct{p.m, p.n, p.k, x, p.y},
                                [&p](int64_t n, int64_t k0, int64_t kc, float* out) { widen(p, n, k0, kc, out); });
    return;
  }
  if (p.m == 0 || p.n == 0) return;
  std::vector<uint8_t> xq(p.m * p.k);
  std::vector<float> xd(p.m * p.nb), xsum(p.m * p.nb);
  if (p.form == kFile) {
    // As the matrix-vector kernels round x for these forms (llama.cpp's Q8_1), kept as q + 128.
    for (int64_t m = 0; m < p.m; ++m)
      pyhlo_kernels::quantize_q8_1(x + m * p.k, p.k, reinterpret_cast<int8_t*>(xq.data()) + m * p.k,
                                   xd.data() + m * p.nb, xsum.data() + m * p.nb);
    for (uint8_t& q : xq) q ^= 0x80;
  } else {
    round_activations(x, p.m, p.k, xq.data(), xd.data(), xsum.data());
  }
  p.xq = xq.data();
  p.xd = xd.data();
  p.xsum = xsum.data();
  pyhlo_kernels::share_panels(
      pool, (p.n + kPanelRows - 1) / kPanelRows, [&p] { return Panel(p.nb, p.form == kFile); },
      [&p](int64_t c, Panel& panel) { panel_product(p, panel, c * kPanelRows); });
}

ffi::Error Run(ffi::ThreadPool& pool, Form form, bool exact, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
               ffi::AnyBuffer& scales, ffi::AnyBuffer* mins, ffi::Result<ffi::AnyBuffer>& y) {
  const auto w_dims = w.dimensions();
  const int64_t per_byte = form == kQ8_0 ? 1 : 2;
  if (!pyhlo_kernels::block_operands_fit(form == kQ8_0, x, w, scales, mins, *y))
    return ffi::Error::InvalidArgument(pyhlo_kernels::block_operands_needed("pyhlo_gemm_q8_0/q4_0/q4_1[_x8]"));
  Problem p{};
  p.form = form;
  p.k = w_dims[1] * per_byte;
  p.nb = p.k / kBlock;
  p.n = w_dims[0];
  p.m = x.element_count() / p.k;
  p.w = w.untyped_data();
  p.scales = static_cast<const uint16_t*>(scales.untyped_data());
  p.mins = mins != nullptr ? static_cast<const uint16_t*>(mins->untyped_data()) : nullptr;
  p.y = static_cast<float*>(y->untyped_data());
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_gemm_q8_0/q4_0/q4_1[_x8]: y must have x's rows and N columns");
  multiply(pool, p, static_cast<const float*>(x.untyped_data()), exact);
  return ffi::Error::Success();
}

// int8 weights with a scale per row: x f32[..., K], s8 w[N, K], f32 scale[N], y f32 [x's rows,
// N]; the _x8 form rounds x per 32 values, so K must be a multiple of 32 there.
template <bool Exact>
ffi::Error GemmS8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                  ffi::Result<ffi::AnyBuffer> y) {
  const char* name = Exact ? "pyhlo_gemm_s8" : "pyhlo_gemm_s8_x8";
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const bool fit = x.element_type() == ffi::DataType::F32 && y->element_type() == ffi::DataType::F32 &&
                   w.element_type() == ffi::DataType::S8 && scale.element_type() == ffi::DataType::F32 &&
                   x_dims.size() >= 1 && w_dims.size() == 2 && x_dims[x_dims.size() - 1] == w_dims[1] &&
                   (Exact || w_dims[1] % kBlock == 0) && w_dims[1] > 0 &&
                   scale.element_count() == static_cast<size_t>(w_dims[0]);
  if (!fit)
    return ffi::Error::InvalidArgument(std::string(name) + ": need f32 x[..., K]" + (Exact ? "" : " (K a multiple of 32)") +
                                       ", s8 w[N, K] and f32 scale[N]");
  Problem p{};
  p.form = kS8;
  p.k = w_dims[1];
  p.nb = p.k / kBlock;
  p.n = w_dims[0];
  p.m = x.element_count() / p.k;
  p.w = w.untyped_data();
  p.row_scales = static_cast<const float*>(scale.untyped_data());
  p.y = static_cast<float*>(y->untyped_data());
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument(std::string(name) + ": y must have x's rows and N columns");
  multiply(pool, p, static_cast<const float*>(x.untyped_data()), Exact);
  return ffi::Error::Success();
}

// The forms of 32-value blocks as a GGUF file's bytes: x f32[..., K] (K a multiple of 32), u8
// w[N, K / 32 * bytes] of form Code, or (Code -1) rows of mixed forms (mixed_rows.h), every row's
// code one of block32_forms.h's forms and its blocks within the rows' bytes (checked first: the
// codes and offsets are two short runs of bytes at the end).
template <int Code>
ffi::Error GemmFileX8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  constexpr bool mixed = Code < 0;
  const char* name = mixed ? "pyhlo_gemm_gguf_rows32_x8" : "pyhlo_gemm_q5_0/q5_1/iq4_nl_x8";
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const int64_t k = x_dims.size() ? x_dims[x_dims.size() - 1] : 0;
  if (x.element_type() != ffi::DataType::F32 || y->element_type() != ffi::DataType::F32 ||
      w.element_type() != ffi::DataType::U8 || w_dims.size() != 2 || k % kBlock != 0 ||
      (!mixed && w_dims[1] != k / kBlock * pyhlo_kernels::block32_bytes(Code)) ||
      (mixed && w_dims[1] < pyhlo_kernels::kRowTail))
    return ffi::Error::InvalidArgument(std::string(name) + ": need f32 x[..., K] (K a multiple of 32) and u8 " +
                                       (mixed ? "w[N, widest row + 5]" : "w[N, K / 32 * bytes] of whole blocks"));
  Problem p{};
  p.form = kFile;
  p.k = k;
  p.nb = k / kBlock;
  p.n = w_dims[0];
  p.m = k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / k;
  p.file = static_cast<const uint8_t*>(w.untyped_data());
  p.code = Code;
  p.mixed = mixed;
  p.wide = pyhlo_kernels::block32_largest(Code) > 16;
  p.with_min = pyhlo_kernels::block32_has_min(Code);
  p.y = static_cast<float*>(y->untyped_data());
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument(std::string(name) + ": y must have x's rows and N columns");
  if (mixed) {
    p.rows = pyhlo_kernels::MixedRows(p.file, w_dims[0], w_dims[1]);
    p.wide = p.with_min = false;
    for (int64_t n = 0; n < p.n; ++n) {
      const int code = p.rows.code(n), bytes = pyhlo_kernels::block32_bytes(code);
      if (bytes == 0 || !p.rows.holds(n, p.nb * bytes))
        return ffi::Error::InvalidArgument(
            "pyhlo_gemm_gguf_rows32_x8: a row's code names no form of 32-value blocks (Q5_0, Q5_1, IQ4_NL, Q8_0, "
            "Q4_0, Q4_1) whose blocks lie within the rows' bytes at the row's offset; lay rows out with "
            "pyhlo.ops.gguf_blocks.pack_mixed_rows");
      p.wide = p.wide || pyhlo_kernels::block32_largest(code) > 16;
      p.with_min = p.with_min || pyhlo_kernels::block32_has_min(code);
    }
  }
  multiply(pool, p, static_cast<const float*>(x.untyped_data()), false);
  return ffi::Error::Success();
}

// Q8_0 / Q4_0 (x, values, scales) and Q4_1 (with mins), exact or with int8 activations.
template <Form F, bool Exact>
ffi::Error GemmBlocks(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                      ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, F, Exact, x, w, scales, nullptr, y);
}

template <bool Exact>
ffi::Error GemmQ4_1(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                    ffi::AnyBuffer mins, ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, kQ4_1, Exact, x, w, scales, &mins, y);
}

}  // namespace

#define PYHLO_GEMM_HANDLER(symbol, function, ...)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, function,                                             \
                                ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() __VA_ARGS__.Ret<ffi::AnyBuffer>())
#define PYHLO_THREE_ARGS .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()

PYHLO_GEMM_HANDLER(PyhloGemmQ8_0X8, (GemmBlocks<kQ8_0, false>), PYHLO_THREE_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmQ4_0X8, (GemmBlocks<kQ4_0, false>), PYHLO_THREE_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmQ4_1X8, GemmQ4_1<false>, PYHLO_THREE_ARGS.Arg<ffi::AnyBuffer>());
PYHLO_GEMM_HANDLER(PyhloGemmS8X8, GemmS8<false>, PYHLO_THREE_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmQ8_0, (GemmBlocks<kQ8_0, true>), PYHLO_THREE_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmQ4_0, (GemmBlocks<kQ4_0, true>), PYHLO_THREE_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmQ4_1, GemmQ4_1<true>, PYHLO_THREE_ARGS.Arg<ffi::AnyBuffer>());
PYHLO_GEMM_HANDLER(PyhloGemmS8, GemmS8<true>, PYHLO_THREE_ARGS);
#define PYHLO_TWO_ARGS .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
PYHLO_GEMM_HANDLER(PyhloGemmQ5_0X8, GemmFileX8<pyhlo_kernels::kB32Q5_0>, PYHLO_TWO_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmQ5_1X8, GemmFileX8<pyhlo_kernels::kB32Q5_1>, PYHLO_TWO_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmIQ4_NLX8, GemmFileX8<pyhlo_kernels::kB32IQ4_NL>, PYHLO_TWO_ARGS);
PYHLO_GEMM_HANDLER(PyhloGemmGgufRows32X8, GemmFileX8<-1>, PYHLO_TWO_ARGS);   // each row's form from its last byte

// Whether this build's int8 GEMMs here have a vector form, VNNI or AVX2 (1), or only the
// portable one (0), which is correct but slower than XLA's dot: the lowering takes them only
// in the first case.
extern "C" int PyhloGemmBlocksFast() {
#if defined(PYHLO_GEMM_VNNI) || defined(PYHLO_GEMM_AVX2)
  return 1;
#else
  return 0;
#endif
}

// Whether this build has the exact GEMMs' vector form, AVX-512 or AVX2 (1), or only the
// portable one (0), which is correct but slower than XLA's dot: the lowering takes the exact
// GEMMs (here and matvec_gguf.cc's) only in the first case.
extern "C" int PyhloGemmExactFast() { return pyhlo_kernels::widened_gemm_is_fast() ? 1 : 0; }
