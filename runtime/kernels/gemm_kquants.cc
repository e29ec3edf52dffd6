// pyhlo_gemm_q2_k_x8 ... pyhlo_gemm_q6_k_x8: y[m, n] = sum_k x[m, k] * w[n, k] for many rows of
// activations (a prefill), w in one of llama.cpp's K-quant forms as a GGUF file stores it (u8
// [N, K / 256 * bytes], as the pyhlo_matvec_<form>_x8 targets take it), x rounded per 256
// values as llama.cpp's Q8_K (kquants.h's quantize_q8_k, as those targets round it). Each
// super-block's product is the same integer sums as theirs (kquants.h's dot_q8_k), scaled the
// same way, so the result equals theirs up to the order of the f32 sums.
//
// As gemm_blocks.cc does for Q8_0 / Q4_x: each thread repacks a panel of 32 weight rows once
// for all activation rows (every super-block unpacked by kquants.h: values 0..63 as unsigned
// bytes in groups of 4 consecutive values, the 16 rows of a vector side by side; each group of
// 16 values' integer scale, the minimums' integers in pairs, d and dlow per row), then runs
// tiles of 32 weight rows by 4 activation rows: vpdpbusd sums 16 unsigned weights times
// signed activations per group, vpmulld scales the group and the super-block's sum goes to
// f32 times d_w * d_x; the minimums (or a centred form's centre) come through the sums of
// each 16 rounded activations, two groups a vpdpwssd, times dlow * d_x.
//
// pyhlo_gemm_gguf_rows_x8: the same for a weight whose rows come in several K-quant forms
// (llama.cpp's Q4_K_M gives ffn_down Q6_K in some layers, Q4_K in others), laid out as
// matvec_gguf.cc's pyhlo_matvec_gguf_rows_x8 takes it: u8 [N, widest row + 5], the rows back
// to back, then each one's offset and form's code (mixed_rows.h). Rows of
// forms rounding x per 32 values (Q8_0, Q5_0 ...) stay on that matrix-vector kernel.
//
// AVX2 (no vpdpbusd) packs the same panels 8 rows to a vector and sums a quad of 4 values by
// vpmaddubsw (the unsigned values against the signed activations, into int16 pairs): quads
// add up in int16 as far as the form's largest value allows (Q4_K's 15: the 8 quads of a
// scale; Q5_K's 31: 4; Q6_K's 63: 2), and vpmaddwd against the group's scale, held twice in
// each 32-bit lane, widens them and scales them in one instruction.
//
// Paths: AVX-512 VNNI where the CPU has it, AVX2 elsewhere on x86; a portable form on the same
// panels otherwise, correct but not fast (the lowering keeps the matrix-vector kernel there).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_panels.h"
#include "kquants.h"
#include "mixed_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PYHLO_KQ_GEMM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_KQ_GEMM_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using pyhlo_kernels::KQuant;
using pyhlo_kernels::kSuperValues;
using pyhlo_kernels::SuperBlock;

constexpr int kLanes = 16;               // int32 lanes of a vector: weight rows side by side
constexpr int kPanelRows = 2 * kLanes;   // weight rows of a panel (two vectors)
#ifdef PYHLO_KQ_GEMM_AVX2
constexpr int kTileRows = 2;             // activation rows of a tile (AVX2: 16 vector registers)
#else
constexpr int kTileRows = 4;             // activation rows of a tile
#endif
constexpr int kGroups = kSuperValues / 16;   // groups of 16 values of a super-block, a scale each
constexpr int kPairs = kGroups / 2;          // pairs of groups: a minimum's vpdpwssd
constexpr int kQuads = kSuperValues / 4;     // groups of 4 values: a vpdpbusd
// Bytes of a super-block, Q2_K to Q6_K (KQuant's order).
constexpr int64_t kSuperBytes[] = {84, 110, 144, 176, 210};
// The largest unpacked value of each (they are unsigned: 0 .. 2^bits - 1).
constexpr int kLargestValue[] = {3, 7, 15, 31, 63};
// A row of mixed forms names Q2_K ... Q6_K by these codes (ROW_CODES, as matvec_gguf.cc's Form).
constexpr int kRowCodeQ2_K = 2;
constexpr int kRowCodes = 5;

struct Problem {
  KQuant form;
  int64_t m, n, k, nb;           // nb: super-blocks of a row
  const uint8_t* w;              // [N, nb * kSuperBytes[form]], or rows of mixed forms
  bool mixed = false;            // rows of mixed forms (`rows`); else every row `form`
  pyhlo_kernels::MixedRows rows;
  bool per_32 = false;           // every row Q4_K or Q5_K: a scale per 32 values
  int largest = 0;               // the largest unpacked value of the rows' forms (kLargestValue)
  const int8_t* xq;              // [M, K]: x rounded as Q8_K
  const float* xd;               // [M, nb]: the rounding's scales
  const int16_t* xsums;          // [M, K / 16]: sums of each 16 rounded values
  float* y;                      // [M, N]
};

// A panel of kPanelRows weight rows, super-block after super-block. Rows past N are zeros.
struct Panel {
  std::vector<uint8_t> values;   // [nb][kQuads][kPanelRows][4]
  std::vector<int32_t> scales;   // [nb][kGroups][kPanelRows] (AVX2: the int16 scale twice)
  std::vector<int32_t> lows;     // [nb][kPairs][kPanelRows]: the lows of groups 2p, 2p + 1 as int16s
  std::vector<float> d, dlow;    // [nb][kPanelRows]

  explicit Panel(int64_t nb)
      : values(nb * kQuads * kPanelRows * 4), scales(nb * kGroups * kPanelRows), lows(nb * kPairs * kPanelRows),
        d(nb * kPanelRows), dlow(nb * kPanelRows) {}
};

// Each row's scales, lows, d and dlow of super-block b into the panel's column r.
void pack_scales(const SuperBlock& s, int64_t b, int r, Panel& panel) {
  for (int j = 0; j < kGroups; ++j) {
#ifdef PYHLO_KQ_GEMM_AVX2
    const uint32_t half = uint16_t(s.scale[j]);   // both int16 halves: vpmaddwd's pair
    panel.scales[(b * kGroups + j) * kPanelRows + r] = int32_t(half | (half << 16));
#else
    panel.scales[(b * kGroups + j) * kPanelRows + r] = s.scale[j];
#endif
  }
  for (int j = 0; j < kPairs; ++j)
    panel.lows[(b * kPairs + j) * kPanelRows + r] =
        int32_t(uint32_t(uint16_t(s.low[2 * j])) | (uint32_t(uint16_t(s.low[2 * j + 1])) << 16));
  panel.d[b * kPanelRows + r] = s.d;
  panel.dlow[b * kPanelRows + r] = s.dlow;
}

// Weight row n's super-block b and its form.
inline const uint8_t* super_block(const Problem& p, int64_t n, int64_t b, KQuant* form) {
  if (!p.mixed) {
    *form = p.form;
    return p.w + (n * p.nb + b) * kSuperBytes[int(p.form)];
  }
  *form = KQuant(p.rows.code(n) - kRowCodeQ2_K);
  return p.rows.row(n) + b * kSuperBytes[int(*form)];
}

void pack(const Problem& p, int64_t n0, Panel& panel) {
  const int64_t nb = p.nb;
  KQuant form;
#ifdef PYHLO_KQ_GEMM_VNNI
  // 16 rows' super-blocks unpacked side by side, then transposed in registers (the values of
  // a scattered copy, 4 bytes at a time, measured a fifth of a 128-row product).
  SuperBlock s[kLanes];
  const char* rows[kLanes];
  for (int r = 0; r < kLanes; ++r) rows[r] = reinterpret_cast<const char*>(s[r].q);
  for (int half = 0; half < 2; ++half) {
    const int64_t first = n0 + half * kLanes;
    const int real = int(std::clamp<int64_t>(p.n - first, 0, kLanes));
    for (int r = real; r < kLanes; ++r) std::memset(&s[r], 0, sizeof(s[r]));   // rows past N: zeros
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < real; ++r) {
        const uint8_t* block = super_block(p, first + r, b, &form);
        pyhlo_kernels::unpack(form, block, &s[r], false);
      }
      uint8_t* values = panel.values.data() + b * kQuads * kPanelRows * 4 + half * kLanes * 4;
      for (int c = 0; c < kSuperValues / 16; ++c) {
        __m512i v[4];
        pyhlo_kernels::transpose_16x4(rows, 16 * c, v);
        for (int i = 0; i < 4; ++i) _mm512_storeu_si512(values + (4 * c + i) * kPanelRows * 4, v[i]);
      }
      for (int r = 0; r < kLanes; ++r) pack_scales(s[r], b, half * kLanes + r, panel);
    }
  }
#elif defined(PYHLO_KQ_GEMM_AVX2)
  // 8 rows' super-blocks unpacked side by side, then 8 quads of the 8 rows transposed in
  // registers at a time (gemm_panels.h).
  SuperBlock s[8];
  for (int group = 0; group < kPanelRows / 8; ++group) {
    const int64_t first = n0 + group * 8;
    const int real = int(std::clamp<int64_t>(p.n - first, 0, 8));
    for (int r = real; r < 8; ++r) std::memset(&s[r], 0, sizeof(s[r]));   // rows past N: zeros
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < real; ++r) {
        const uint8_t* block = super_block(p, first + r, b, &form);
        pyhlo_kernels::unpack(form, block, &s[r], false);
      }
      uint8_t* values = panel.values.data() + b * kQuads * kPanelRows * 4 + group * 8 * 4;
      for (int c = 0; c < kQuads / 8; ++c) {
        __m256i v[8];
        for (int r = 0; r < 8; ++r) v[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(s[r].q + 32 * c));
        pyhlo_kernels::transpose_8x8_epi32(v);
        for (int i = 0; i < 8; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + (8 * c + i) * kPanelRows * 4), v[i]);
      }
      for (int r = 0; r < 8; ++r) pack_scales(s[r], b, group * 8 + r, panel);
    }
  }
#else
  SuperBlock s;
  for (int r = 0; r < kPanelRows; ++r) {
    const bool real = n0 + r < p.n;
    if (!real) std::memset(&s, 0, sizeof(s));
    for (int64_t b = 0; b < nb; ++b) {
      if (real) {
        const uint8_t* block = super_block(p, n0 + r, b, &form);
        pyhlo_kernels::unpack(form, block, &s, false);
      }
      uint8_t* values = panel.values.data() + b * kQuads * kPanelRows * 4 + r * 4;
      for (int quad = 0; quad < kQuads; ++quad) std::memcpy(values + quad * kPanelRows * 4, s.q + 4 * quad, 4);
      pack_scales(s, b, r, panel);
    }
  }
#endif
}

inline int32_t four_bytes(const void* at) {
  int32_t v;
  std::memcpy(&v, at, sizeof(v));
  return v;
}

#ifdef PYHLO_KQ_GEMM_VNNI
// Span: the quads that share a scale, 4 (a scale per 16 values) or 8 (Q4_K and Q5_K give each
// 32 one scale: half the multiplies by scales).
template <int R, int Span>
void tile(const Problem& p, const Panel& panel, int64_t n0, int64_t m0) {
  const int64_t nb = p.nb;
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = panel.values.data() + b * kQuads * kPanelRows * 4;
    const int32_t* scales = panel.scales.data() + b * kGroups * kPanelRows;
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = p.xq + (m0 + r) * p.k + b * kSuperValues;
    __m512i total[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) total[h][r] = _mm512_setzero_si512();
    for (int g = 0; g < kGroups; g += Span / 4) {
      __m512i part[2][R];
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) part[h][r] = _mm512_setzero_si512();
      for (int quad = 4 * g; quad < 4 * g + Span; ++quad) {
        __m512i w0 = _mm512_loadu_si512(wb + quad * kPanelRows * 4);
        __m512i w1 = _mm512_loadu_si512(wb + quad * kPanelRows * 4 + kLanes * 4);
        // In registers, not read again by every vpdpbusd (gemm_blocks.cc measured that the bottleneck).
        asm("" : "+v"(w0), "+v"(w1));
        for (int r = 0; r < R; ++r) {
          const __m512i four = _mm512_set1_epi32(four_bytes(x[r] + quad * 4));
          part[0][r] = _mm512_dpbusd_epi32(part[0][r], w0, four);
          part[1][r] = _mm512_dpbusd_epi32(part[1][r], w1, four);
        }
      }
      const __m512i s0 = _mm512_loadu_si512(scales + g * kPanelRows);
      const __m512i s1 = _mm512_loadu_si512(scales + g * kPanelRows + kLanes);
      for (int r = 0; r < R; ++r) {
        total[0][r] = _mm512_add_epi32(total[0][r], _mm512_mullo_epi32(part[0][r], s0));
        total[1][r] = _mm512_add_epi32(total[1][r], _mm512_mullo_epi32(part[1][r], s1));
      }
    }
    __m512i low[2][R];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) low[h][r] = _mm512_setzero_si512();
    for (int j = 0; j < kPairs; ++j) {
      const __m512i l0 = _mm512_loadu_si512(panel.lows.data() + (b * kPairs + j) * kPanelRows);
      const __m512i l1 = _mm512_loadu_si512(panel.lows.data() + (b * kPairs + j) * kPanelRows + kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512i sums = _mm512_set1_epi32(four_bytes(p.xsums + (m0 + r) * (p.k / 16) + b * kGroups + 2 * j));
        low[0][r] = _mm512_dpwssd_epi32(low[0][r], l0, sums);
        low[1][r] = _mm512_dpwssd_epi32(low[1][r], l1, sums);
      }
    }
    const __m512 d[2] = {_mm512_loadu_ps(panel.d.data() + b * kPanelRows),
                         _mm512_loadu_ps(panel.d.data() + b * kPanelRows + kLanes)};
    const __m512 dlow[2] = {_mm512_loadu_ps(panel.dlow.data() + b * kPanelRows),
                            _mm512_loadu_ps(panel.dlow.data() + b * kPanelRows + kLanes)};
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(p.xd[(m0 + r) * nb + b]);
      for (int h = 0; h < 2; ++h) {
        acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[h][r]), _mm512_mul_ps(d[h], dx), acc[h][r]);
        acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low[h][r]), _mm512_mul_ps(dlow[h], dx), acc[h][r]);
      }
    }
  }
  pyhlo_kernels::store_tile<R>(p.y, p.n, n0, m0, acc);
}
#elif defined(PYHLO_KQ_GEMM_AVX2)
// A pass covers kPassVectors of the panel's 4 vectors of 8 rows, R activation rows. Chunk: the
// quads whose vpmaddubsw pairs add up in int16 before one vpmaddwd against their scale (they
// share it: Chunk <= Span). Bounds: a pair is at most 2 * 127 * the form's largest value, and
// Chunk of them must fit int16 (chunk_quads()); a group's sum times its scale, 32 groups a
// super-block, fits int32 with room to spare.
constexpr int kPassVectors = 2;

template <int R, int Chunk>
void tile_pass(const Problem& p, const Panel& panel, int64_t n0, int64_t m0, int v0) {
  constexpr int V = kPassVectors;
  const int64_t nb = p.nb;
  // The f32 sums, touched once a super-block, stay in memory: the registers go to the integer
  // sums (GCC otherwise kept those in memory, a load and a store a chunk).
  alignas(32) float acc[V][R][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = panel.values.data() + b * kQuads * kPanelRows * 4 + v0 * 32;
    const int32_t* scales = panel.scales.data() + b * kGroups * kPanelRows + v0 * 8;
    const int8_t* x[R];
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) x[r] = p.xq + (m0 + r) * p.k + b * kSuperValues;
    __m256i total[V][R];
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v)
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) total[v][r] = _mm256_setzero_si256();
    for (int quad0 = 0; quad0 < kQuads; quad0 += Chunk) {
      __m256i part[V][R];
      #pragma GCC unroll 16
      for (int i = 0; i < Chunk; ++i) {
        __m256i w[V];
        #pragma GCC unroll 16
        for (int v = 0; v < V; ++v)
          w[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (quad0 + i) * kPanelRows * 4 + v * 32));
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256i four = _mm256_set1_epi32(four_bytes(x[r] + (quad0 + i) * 4));
          #pragma GCC unroll 16
          for (int v = 0; v < V; ++v) {
            const __m256i pairs = _mm256_maddubs_epi16(w[v], four);
            part[v][r] = i == 0 ? pairs : _mm256_add_epi16(part[v][r], pairs);
          }
        }
      }
      #pragma GCC unroll 16
      for (int v = 0; v < V; ++v) {
        const __m256i scale = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + quad0 / 4 * kPanelRows + v * 8));
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) total[v][r] = _mm256_add_epi32(total[v][r], _mm256_madd_epi16(part[v][r], scale));
      }
    }
    __m256i low[V][R];
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v)
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) low[v][r] = _mm256_setzero_si256();
    for (int j = 0; j < kPairs; ++j) {
      const int32_t* lows = panel.lows.data() + (b * kPairs + j) * kPanelRows + v0 * 8;
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256i sums = _mm256_set1_epi32(four_bytes(p.xsums + (m0 + r) * (p.k / 16) + b * kGroups + 2 * j));
        #pragma GCC unroll 16
        for (int v = 0; v < V; ++v)
          low[v][r] = _mm256_add_epi32(low[v][r], _mm256_madd_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lows + v * 8)), sums));
      }
    }
    #pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const __m256 d = _mm256_loadu_ps(panel.d.data() + b * kPanelRows + (v0 + v) * 8);
      const __m256 dlow = _mm256_loadu_ps(panel.dlow.data() + b * kPanelRows + (v0 + v) * 8);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(p.xd[(m0 + r) * nb + b]);
        __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[v][r]), _mm256_mul_ps(d, dx), _mm256_load_ps(acc[v][r]));
        sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low[v][r]), _mm256_mul_ps(dlow, dx), sum);
        _mm256_store_ps(acc[v][r], sum);
      }
    }
  }
  #pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    const int64_t first = n0 + (v0 + v) * 8;
    const int64_t real = std::clamp<int64_t>(p.n - first, 0, 8);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (real > 0) std::memcpy(p.y + (m0 + r) * p.n + first, acc[v][r], real * sizeof(float));
    }
  }
}

template <int R, int Span, int Chunk>
void tile(const Problem& p, const Panel& panel, int64_t n0, int64_t m0) {
  static_assert(Chunk <= Span, "a chunk's quads share one scale");
  for (int v0 = 0; v0 < kPanelRows / 8 && n0 + v0 * 8 < p.n; v0 += kPassVectors) tile_pass<R, Chunk>(p, panel, n0, m0, v0);
}
#else
template <int R, int Span>
void tile(const Problem& p, const Panel& panel, int64_t n0, int64_t m0) {
  const int64_t nb = p.nb;
  float acc[R][kPanelRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = panel.values.data() + b * kQuads * kPanelRows * 4;
    for (int r = 0; r < R; ++r) {
      const int8_t* x = p.xq + (m0 + r) * p.k + b * kSuperValues;
      const int16_t* sums = p.xsums + (m0 + r) * (p.k / 16) + b * kGroups;
      const float dx = p.xd[(m0 + r) * nb + b];
      for (int c = 0; c < kPanelRows; ++c) {
        int32_t total = 0, low = 0;
        for (int g = 0; g < kGroups; ++g) {
          int32_t part = 0;
          for (int quad = 4 * g; quad < 4 * g + 4; ++quad)
            for (int j = 0; j < 4; ++j) part += int32_t(wb[(quad * kPanelRows + c) * 4 + j]) * x[quad * 4 + j];
          total += part * panel.scales[(b * kGroups + g) * kPanelRows + c];
        }
        for (int j = 0; j < kPairs; ++j) {
          const int32_t pair = panel.lows[(b * kPairs + j) * kPanelRows + c];
          low += int16_t(pair & 0xFFFF) * sums[2 * j] + int16_t(uint32_t(pair) >> 16) * sums[2 * j + 1];
        }
        acc[r][c] += float(total) * (panel.d[b * kPanelRows + c] * dx);
        acc[r][c] += float(low) * (panel.dlow[b * kPanelRows + c] * dx);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanelRows && n0 + c < p.n; ++c) p.y[(m0 + r) * p.n + n0 + c] = acc[r][c];
}
#endif

#ifdef PYHLO_KQ_GEMM_AVX2
// The quads of 4 values whose vpmaddubsw pairs fit int16 together (a power of two, at most
// Span): `largest` is the largest unpacked value of the weight's forms.
inline int chunk_quads(int largest, int span) {
  int chunk = span;
  while (chunk > 1 && chunk * 2 * 127 * largest > 32767) chunk /= 2;
  return chunk;
}

template <int Span, int Chunk>
void panel_product(const Problem& p, Panel& panel, int64_t n0) {
  pack(p, n0, panel);
  int64_t m0 = 0;
  for (; m0 + kTileRows <= p.m; m0 += kTileRows) tile<kTileRows, Span, Chunk>(p, panel, n0, m0);
  if (m0 < p.m) tile<1, Span, Chunk>(p, panel, n0, m0);   // kTileRows is 2
}

void run_panel(const Problem& p, Panel& panel, int64_t n0) {
  const int chunk = chunk_quads(p.largest, p.per_32 ? 8 : 4);
  if (p.per_32) {
    if (chunk == 8) return panel_product<8, 8>(p, panel, n0);
    return panel_product<8, 4>(p, panel, n0);   // Q5_K: 4 (a pair is at most 2 * 127 * 31)
  }
  if (chunk == 4) return panel_product<4, 4>(p, panel, n0);
  panel_product<4, 2>(p, panel, n0);            // Q6_K: 2
}
#else
template <int Span>
void panel_product(const Problem& p, Panel& panel, int64_t n0) {
  pack(p, n0, panel);
  int64_t m0 = 0;
  for (; m0 + kTileRows <= p.m; m0 += kTileRows) tile<kTileRows, Span>(p, panel, n0, m0);
  switch (p.m - m0) {
    case 3: tile<3, Span>(p, panel, n0, m0); break;
    case 2: tile<2, Span>(p, panel, n0, m0); break;
    case 1: tile<1, Span>(p, panel, n0, m0); break;
    default: break;
  }
}

void run_panel(const Problem& p, Panel& panel, int64_t n0) {
  if (p.per_32) return panel_product<8>(p, panel, n0);
  panel_product<4>(p, panel, n0);
}
#endif

// rows: a weight of rows of mixed forms (`form` unused).
ffi::Error Run(ffi::ThreadPool& pool, KQuant form, bool rows, ffi::AnyBuffer& x, ffi::AnyBuffer& w,
               ffi::Result<ffi::AnyBuffer>& y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const int64_t k = x_dims.size() ? x_dims[x_dims.size() - 1] : 0;
  if (x.element_type() != ffi::DataType::F32 || y->element_type() != ffi::DataType::F32 ||
      w.element_type() != ffi::DataType::U8 || w_dims.size() != 2 || k % kSuperValues != 0 ||
      (!rows && w_dims[1] != k / kSuperValues * kSuperBytes[int(form)]))
    return ffi::Error::InvalidArgument(
        "pyhlo_gemm_<K-quant>_x8: need f32 x[..., K] (K a multiple of 256) and u8 w[N, K / 256 * bytes] of "
        "whole super-blocks (rows of mixed forms: u8 w[N, widest row + 5])");
  Problem p;
  p.form = form;
  p.per_32 = form == KQuant::kQ4_K || form == KQuant::kQ5_K;
  p.largest = kLargestValue[int(form)];
  if (rows) {
    // Every row's code names a K-quant whose super-blocks lie within the rows' bytes (the
    // codes and offsets are two short runs of bytes at the end: this pass is cheap).
    if (w_dims[1] < pyhlo_kernels::kRowTail)
      return ffi::Error::InvalidArgument("pyhlo_gemm_gguf_rows_x8: need u8 w[N, widest row + 5]");
    p.mixed = true;
    p.rows = pyhlo_kernels::MixedRows(static_cast<const uint8_t*>(w.untyped_data()), w_dims[0], w_dims[1]);
    p.per_32 = true;
    p.largest = 0;
    for (int64_t n = 0; n < w_dims[0]; ++n) {
      const int code = p.rows.code(n) - kRowCodeQ2_K;
      if (code < 0 || code >= kRowCodes || !p.rows.holds(n, k / kSuperValues * kSuperBytes[code]))
        return ffi::Error::InvalidArgument(
            "pyhlo_gemm_gguf_rows_x8: a row's code names no K-quant (Q2_K ... Q6_K) whose super-blocks lie within "
            "the rows' bytes at the row's offset; rows of other forms take pyhlo_matvec_gguf_rows_x8");
      p.per_32 = p.per_32 && (KQuant(code) == KQuant::kQ4_K || KQuant(code) == KQuant::kQ5_K);
      p.largest = std::max(p.largest, kLargestValue[code]);
    }
  }
  p.k = k;
  p.nb = k / kSuperValues;
  p.n = w_dims[0];
  p.m = k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / k;
  p.w = static_cast<const uint8_t*>(w.untyped_data());
  p.y = static_cast<float*>(y->untyped_data());
  if (y->element_count() != static_cast<size_t>(p.m * p.n))
    return ffi::Error::InvalidArgument("pyhlo_gemm_<K-quant>_x8: y must have x's rows and N columns");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  std::vector<int8_t> xq(p.m * p.k);
  std::vector<float> xd(p.m * p.nb);
  std::vector<int16_t> xsums(p.m * (p.k / 16));
  const float* xf = static_cast<const float*>(x.untyped_data());
  // Rounded a few rows at a time by every thread too (one thread alone took about a twentieth
  // of a 128-row product).
  constexpr int64_t kRoundedRows = 8;
  pyhlo_kernels::share_panels(
      pool, (p.m + kRoundedRows - 1) / kRoundedRows, [] { return 0; },
      [&](int64_t c, int) {
        for (int64_t m = c * kRoundedRows; m < std::min(p.m, (c + 1) * kRoundedRows); ++m)
          pyhlo_kernels::quantize_q8_k(xf + m * p.k, p.k, xq.data() + m * p.k, xd.data() + m * p.nb,
                                       xsums.data() + m * (p.k / 16));
      });
  p.xq = xq.data();
  p.xd = xd.data();
  p.xsums = xsums.data();
  pyhlo_kernels::share_panels(
      pool, (p.n + kPanelRows - 1) / kPanelRows, [&p] { return Panel(p.nb); },
      [&p](int64_t c, Panel& panel) { run_panel(p, panel, c * kPanelRows); });
  return ffi::Error::Success();
}

template <KQuant F, bool Rows>
ffi::Error GemmKQuantX8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return Run(pool, F, Rows, x, w, y);
}

}  // namespace

#define PYHLO_KQ_GEMM_HANDLER(symbol, form, rows)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                       \
      symbol, (GemmKQuantX8<form, rows>),                                                              \
      ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>())

PYHLO_KQ_GEMM_HANDLER(PyhloGemmQ2_KX8, KQuant::kQ2_K, false);
PYHLO_KQ_GEMM_HANDLER(PyhloGemmQ3_KX8, KQuant::kQ3_K, false);
PYHLO_KQ_GEMM_HANDLER(PyhloGemmQ4_KX8, KQuant::kQ4_K, false);
PYHLO_KQ_GEMM_HANDLER(PyhloGemmQ5_KX8, KQuant::kQ5_K, false);
PYHLO_KQ_GEMM_HANDLER(PyhloGemmQ6_KX8, KQuant::kQ6_K, false);
PYHLO_KQ_GEMM_HANDLER(PyhloGemmGgufRowsX8, KQuant::kQ4_K, true);   // each row's form from its last byte

// Whether this build has a vector form of these GEMMs, AVX-512 VNNI or AVX2 (1), or only the
// portable one (0), slower than the matrix-vector kernel: the lowering takes them only in the
// first case.
extern "C" int PyhloGemmKQuantsFast() {
#if defined(PYHLO_KQ_GEMM_VNNI) || defined(PYHLO_KQ_GEMM_AVX2)
  return 1;
#else
  return 0;
#endif
}
