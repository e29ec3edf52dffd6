// pyhlo_prefill_attention: several new tokens per batch line (a prompt, or a chunk of one)
// attending over their KV cache, causally.
//
// Query j of row i sits at cache slot slot[i] + j and sees the slots t with
//   max(pad[i], slot[i] + j - window + 1 if window > 0) <= t <= slot[i] + j
// (query head c reading kv head c / (h / kvh), as HF's repeat_kv):
//   out[i, c, j, :] = softmax_t(scale * q[i, c, j, :] . k[line, kv, t, :]) v[line, kv, t, :]
// with line = lines[i]. A query that sees no slot gets zeros. Sums and softmax are f32.
//
// The program's own attention computes every query against every slot of its bucket, the
// masked ones too, and writes the scores out between its dots (SmolLM2-135M's heads, a
// 1,024-token prompt on AMD Zen 3: 84 ms a layer, 2.5 of the prompt's 3.4 s). Here each
// line's kv head is first laid out once for all its queries: its keys turned to [d][16] a
// block of 16 slots, its values as f32 rows. Then each job (a line's kv head and a block of
// its query tokens, the group of query heads that share the kv head together) computes the
// scores of its rows against the slots its last token sees, on register tiles of 6 rows by
// 16 slots; the softmax of each row over the slots it sees; and the weighted values on tiles
// of 6 rows by 16 of the d values. Jobs are shared out over XLA's intra-op threads.
//
// Operands: q f32[b, h, n, d]; k, v f32 or bf16 [B, kvh, S, d] (bf16 also as its bits, u16),
// or packed int8 rows s8[B, kvh, S, d + 4] (d values, then the row's f32 scale); slot s32[b];
// pad s32[b]; scale f32[]; lines s32[b]; window s32[] (0: none). Result f32[b, h, n, d].
// The tiles take AVX2 with FMA (AVX-512 machines run them too); elsewhere loops that compilers
// vectorize as they can (PyhloPrefillAttentionFast says which).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_operands.h"
#include "half.h"
#include "row_chunks.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYHLO_PREFILL_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSlotBlock = 16;   // slots a block of turned keys holds
constexpr int kTileRows = 6;         // query rows of a tile
constexpr int64_t kQueryRows = 48;   // query rows (tokens times the group's heads) a job aims at

// A cache row's d values as f32 (a packed int8 row times its scale).
template <typename T>
void widen_row(const T* row, int64_t d, float* out) {
  const float factor = pyhlo_kernels::row_scale(row, d);
  for (int64_t e = 0; e < d; ++e) out[e] = pyhlo_kernels::load(row, e) * factor;
}

// The operands and the shapes every job reads.
template <typename T>
struct Problem {
  const float* q;
  const T* k;
  const T* v;
  float* out;
  int64_t b, h, n, d, kvh, s, stride, group;
  const int32_t *slot, *pad, *lines;
  float scale;
  int64_t window;
  int64_t slots;         // slots any query sees: 0 .. slots - 1
  int64_t token_block;   // query tokens a job takes
  int64_t token_blocks;  // jobs per line's kv head
  float* keys;           // [b * kvh][blocks of 16 slots][d][16]
  float* values;         // [b * kvh][slots][d]

  int64_t key_blocks() const { return (slots + kSlotBlock - 1) / kSlotBlock; }
  // The slots query j of row i sees: first .. last (none where first > last).
  int64_t first_slot(int64_t i, int64_t j) const {
    int64_t first = std::max<int64_t>(pad[i], 0);
    if (window > 0) first = std::max<int64_t>(first, slot[i] + j - window + 1);
    return first;
  }
  int64_t last_slot(int64_t i, int64_t j) const { return std::min<int64_t>(slot[i] + j, s - 1); }
};

// Row i's kv head c laid out: keys turned by blocks of 16 slots, values as f32 rows.
template <typename T>
void lay_out(const Problem<T>& p, int64_t pair) {
  const int64_t i = pair / p.kvh, c = pair % p.kvh, d = p.d;
  const T* kc = p.k + (int64_t(p.lines[i]) * p.kvh + c) * p.s * p.stride;
  const T* vc = p.v + (int64_t(p.lines[i]) * p.kvh + c) * p.s * p.stride;
  float* keys = p.keys + pair * p.key_blocks() * kSlotBlock * d;
  float* values = p.values + pair * p.slots * d;
  std::vector<float> row(d);
  for (int64_t t = 0; t < p.key_blocks() * kSlotBlock; ++t) {
    float* block = keys + (t / kSlotBlock) * d * kSlotBlock + t % kSlotBlock;
    if (t < p.slots) {
      widen_row(kc + t * p.stride, d, row.data());
      widen_row(vc + t * p.stride, d, values + t * d);
    } else {
      std::fill(row.begin(), row.end(), 0.0f);
    }
    for (int64_t e = 0; e < d; ++e) block[e * kSlotBlock] = row[e];
  }
}

// out[r * out_stride + c] = sum_j a[r * a_stride + j] * b[j * b_stride + c] for R rows, j < len
// and c < columns: the scores of R query rows against a block of 16 turned keys (a the rows, b
// the block, len d), and their weighted values, 16 of the d values at a time (a the weights, b
// the value rows, len the slots). 16 columns take the AVX2 tile, its sums in registers.
template <int R>
void tile_product(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t len,
                  int64_t columns, float* out, int64_t out_stride) {
#ifdef PYHLO_PREFILL_AVX2
  if (columns == 16) {
    __m256 acc[2][R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const __m256 b0 = _mm256_loadu_ps(b + j * b_stride);
      const __m256 b1 = _mm256_loadu_ps(b + j * b_stride + 8);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(a + r * a_stride + j);
        acc[0][r] = _mm256_fmadd_ps(x, b0, acc[0][r]);
        acc[1][r] = _mm256_fmadd_ps(x, b1, acc[1][r]);
      }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * out_stride, acc[0][r]);
      _mm256_storeu_ps(out + r * out_stride + 8, acc[1][r]);
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < columns; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < len; ++j) sum += a[r * a_stride + j] * b[j * b_stride + c];
      out[r * out_stride + c] = sum;
    }
}

// exp(x) for x <= 0, to about 2 ulp; 0 below -87 (where f32's exp is subnormal or 0).
#ifdef PYHLO_PREFILL_AVX2
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  // x = n ln 2 + r, |r| <= ln 2 / 2; ln 2 in two parts so that r is exact enough.
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  // e^r by its Taylor polynomial to r^7 (Horner).
  __m256 e = _mm256_set1_ps(1.0f / 5040);
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 720));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 120));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 24));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 6));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(e, _mm256_castsi256_ps(two_n)));
}
#endif

// scores[first .. last] -> exp(score - max) (0 elsewhere in 0 .. width - 1); their sum.
float exponentiate(float* scores, int64_t first, int64_t last, int64_t width) {
  float top = -INFINITY;
  for (int64_t t = first; t <= last; ++t) top = std::max(top, scores[t]);
  std::fill(scores, scores + first, 0.0f);
  std::fill(scores + last + 1, scores + width, 0.0f);
  float sum = 0.0f;
  int64_t t = first;
#ifdef PYHLO_PREFILL_AVX2
  __m256 total = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top);
  for (; t + 8 <= last + 1; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
    _mm256_storeu_ps(scores + t, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (float lane : lanes) sum += lane;
#endif
  for (; t <= last; ++t) {
    scores[t] = std::exp(scores[t] - top);
    sum += scores[t];
  }
  return sum;
}

template <int R, typename Tile>
void tail_tiles(int64_t rows, const Tile& tile) {
  if constexpr (R > 0) {
    if (rows == R) return tile(std::integral_constant<int, R>{});
    tail_tiles<R - 1>(rows, tile);
  }
}

// Runs tile(std::integral_constant<int, R>{}, r0) over rows 0 .. n_rows - 1 by tiles of 6.
template <typename Tile>
void by_tiles(int64_t n_rows, const Tile& tile) {
  int64_t r0 = 0;
  for (; r0 + kTileRows <= n_rows; r0 += kTileRows) tile(std::integral_constant<int, kTileRows>{}, r0);
  if (r0 < n_rows)
    tail_tiles<kTileRows - 1>(n_rows - r0, [&](auto rows) { tile(rows, r0); });
}

// Per thread: the job's query rows, scores, outputs and each row's 1 / (sum of its weights).
struct Scratch {
  std::vector<float> rows, scores, out, inverse;
};

// Row i's kv head c, query tokens j0 .. j1 - 1 of every head of its group.
template <typename T>
void attend_block(const Problem<T>& p, int64_t job, Scratch& scratch) {
  const int64_t pair = job / p.token_blocks, i = pair / p.kvh, c = pair % p.kvh, d = p.d;
  const int64_t j0 = (job % p.token_blocks) * p.token_block, j1 = std::min(p.n, j0 + p.token_block);
  const int64_t tokens = j1 - j0, n_rows = p.group * tokens;
  // The slots any of the block's rows sees: lo .. hi, from a whole block of 16.
  const int64_t lo = p.first_slot(i, j0) / kSlotBlock * kSlotBlock, hi = p.last_slot(i, j1 - 1);
  const int64_t width = hi >= lo ? hi - lo + 1 : 0;
  const int64_t stride = (width + kSlotBlock - 1) / kSlotBlock * kSlotBlock;
  scratch.rows.resize(n_rows * d);
  scratch.scores.resize(n_rows * std::max<int64_t>(stride, 1));
  scratch.out.resize(n_rows * d);
  scratch.inverse.resize(n_rows);
  float* rows = scratch.rows.data();
  for (int64_t g = 0; g < p.group; ++g)   // row g * tokens + (j - j0): head c * group + g, token j
    for (int64_t j = j0; j < j1; ++j) {
      const float* query = p.q + ((i * p.h + c * p.group + g) * p.n + j) * d;
      float* row = rows + (g * tokens + j - j0) * d;
      for (int64_t e = 0; e < d; ++e) row[e] = query[e] * p.scale;
    }
  const float* keys = p.keys + pair * p.key_blocks() * kSlotBlock * d;
  const float* values = p.values + pair * p.slots * d;
  float* scores = scratch.scores.data();
  for (int64_t block = 0; block < stride / kSlotBlock; ++block) {
    const float* turned = keys + (lo / kSlotBlock + block) * d * kSlotBlock;
    by_tiles(n_rows, [&](auto tile_rows, int64_t r0) {
      tile_product<decltype(tile_rows)::value>(rows + r0 * d, d, turned, kSlotBlock, d, kSlotBlock,
                                               scores + r0 * stride + block * kSlotBlock, stride);
    });
  }
  float* inverse = scratch.inverse.data();
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t j = j0 + r % tokens;
    const int64_t first = p.first_slot(i, j) - lo, last = p.last_slot(i, j) - lo;
    if (width == 0 || first > last) {
      std::fill(scores + r * stride, scores + (r + 1) * stride, 0.0f);
      inverse[r] = 0.0f;
      continue;
    }
    inverse[r] = 1.0f / exponentiate(scores + r * stride, first, last, stride);
  }
  float* out = scratch.out.data();
  for (int64_t c0 = 0; c0 < d; c0 += 16) {
    const int64_t columns = std::min<int64_t>(16, d - c0);
    by_tiles(n_rows, [&](auto tile_rows, int64_t r0) {
      tile_product<decltype(tile_rows)::value>(scores + r0 * stride, stride, values + lo * d + c0, d, width,
                                               columns, out + r0 * d + c0, d);
    });
  }
  for (int64_t g = 0; g < p.group; ++g)
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t r = g * tokens + j - j0;
      float* target = p.out + ((i * p.h + c * p.group + g) * p.n + j) * d;
      for (int64_t e = 0; e < d; ++e) target[e] = out[r * d + e] * inverse[r];
    }
}

template <typename T>
ffi::Error attend(ffi::ThreadPool& pool, Problem<T> p) {
  p.slots = 0;
  for (int64_t i = 0; i < p.b; ++i) p.slots = std::max(p.slots, p.last_slot(i, p.n - 1) + 1);
  const int64_t pairs = p.b * p.kvh;
  if (p.slots <= 0 || pairs == 0) {
    std::fill(p.out, p.out + p.b * p.h * p.n * p.d, 0.0f);
    return ffi::Error::Success();
  }
  std::vector<float> keys(pairs * p.key_blocks() * kSlotBlock * p.d), values(pairs * p.slots * p.d);
  p.keys = keys.data();
  p.values = values.data();
  p.token_block = std::max<int64_t>(1, kQueryRows / p.group);
  p.token_blocks = (p.n + p.token_block - 1) / p.token_block;
  // Each job a chunk of its own (a pair's layout, a block's attention): their costs differ.
  const int64_t whole = pyhlo_kernels::kMinChunkBytes;
  ffi::Error laid = pyhlo_kernels::run_row_chunks(pool, pairs, whole, 1, [&p](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) lay_out(p, pair);
  }, p.k, /*product=*/false);
  if (laid.failure()) return laid;
  return pyhlo_kernels::run_row_chunks(pool, pairs * p.token_blocks, whole, 1, [&p](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t job = begin; job < end; ++job) attend_block(p, job, scratch);
  }, p.q, /*product=*/false);
}

ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> pad, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::S32> lines, ffi::Buffer<ffi::S32> window,
                            ffi::Result<ffi::AnyBuffer> out) {
  ffi::Error checked = pyhlo_kernels::check_attention_operands("pyhlo_prefill_attention", q, k, v, slot, pad, lines,
                                                                out->element_type(), /*queries=*/0);
  if (checked.failure()) return checked;
  if (window.element_count() != 1)
    return ffi::Error::InvalidArgument("pyhlo_prefill_attention: window must be one s32 value (0: none)");
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto type = k.element_type();
  const auto problem = [&](auto* cache) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
    return Problem<T>{static_cast<const float*>(q.untyped_data()),
                      static_cast<const T*>(k.untyped_data()),
                      static_cast<const T*>(v.untyped_data()),
                      static_cast<float*>(out->untyped_data()),
                      qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], kd[3], qd[1] / kd[1],
                      slot.typed_data(), pad.typed_data(), lines.typed_data(), scale.typed_data()[0],
                      window.typed_data()[0], 0, 1, 1, nullptr, nullptr};
  };
  if (qd[0] * qd[1] * qd[2] == 0) return ffi::Error::Success();
  if (type == ffi::DataType::F32) return attend(pool, problem(static_cast<const float*>(nullptr)));
  if (type == ffi::DataType::BF16 || type == ffi::DataType::U16)   // u16: a bf16 cache's bits
    return attend(pool, problem(static_cast<const uint16_t*>(nullptr)));
  return attend(pool, problem(static_cast<const int8_t*>(nullptr)));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PyhloPrefillAttention, PrefillAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

// Whether the kernel's tiles have their vector form on this build (1): AVX2 with FMA.
extern "C" int PyhloPrefillAttentionFast() {
#ifdef PYHLO_PREFILL_AVX2
  return 1;
#else
  return 0;
#endif
}
