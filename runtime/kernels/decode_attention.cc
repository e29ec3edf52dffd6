// pyhlo_decode_attention: one query token per batch line attending over its KV cache.
//
// For line i and query head j (reading kv head j / (h / kvh), as HF's repeat_kv):
//   out[i, j, 0, :] = softmax_t(scale * q[i, j, 0, :] . k[i, kv, t, :]) v[i, kv, t, :]
// over the cache slots pad[i] <= t <= slot[i]. It reads the slots in place, so a decode
// step attends to exactly the filled part of the cache without copying a prefix of it
// (XLA materializes a slice of the cache before its dot). Sums and softmax are f32. The
// lines' kv heads are shared out over XLA's intra-op threads.
//
// Operands: q f32[b, h, 1, d]; k, v f32 or bf16 [B, kvh, S, d] (bf16 also as its bits, u16),
// or packed int8 rows s8[B, kvh, S, d + 4] (d values, then the 4 bytes of the row's f32 scale:
// the row is scale * values); slot s32[b] (each row's newest slot: lines may be at different
// lengths under continuous batching); pad s32[b]; scale f32[]; lines s32[b], the cache line
// each query row reads (row i line i for a whole batch; continuous batching's programs for
// some of the lines name theirs). Result: f32[b, h, 1, d].
//
// f32 and bf16 rows of 64 or 128 values take an AVX-512 form where the CPU has it
// (attend_head_16); others, loops that compilers vectorize as they can.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_operands.h"
#include "half.h"
#include "row_chunks.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PYHLO_ATTENTION_AVX512 1
#endif

namespace ffi = xla::ffi;

namespace {

using pyhlo_kernels::load;
using pyhlo_kernels::row_scale;

// sum_e a[e] * b[e] with 16 independent partial sums, which compilers vectorize.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float part[16] = {0};
  int64_t e = 0;
  for (; e + 16 <= n; e += 16)
    for (int j = 0; j < 16; ++j) part[j] += a[e + j] * load(b, e + j);
  float sum = 0.0f;
  for (; e < n; ++e) sum += a[e] * load(b, e);
  for (int j = 0; j < 16; ++j) sum += part[j];
  return sum;
}

// The cache slots line i attends to: first..last (none where first > last).
struct Slots {
  int64_t first, last;
};

inline Slots attended_slots(const int32_t* slot, const int32_t* pad, int64_t i, int64_t s) {
  return {pad[i] < 0 ? 0 : pad[i], slot[i] < s - 1 ? slot[i] : s - 1};
}

#ifdef PYHLO_ATTENTION_AVX512
// 16 cache values widened to f32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Asks for the cache row kAheadBytes past `row` (`bytes` long), one request a line.
constexpr int64_t kAheadBytes = 2048;
inline void ahead(const void* row, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(row) + kAheadBytes + line, _MM_HINT_T0);
}

// Asks for a row read later (into the second-level cache), one request a line.
inline void later(const void* row, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(row) + line, _MM_HINT_T1);
}

// attend_head's work for f32 or bf16 rows of 16 * Vecs values: each query head's values and
// its output held in registers across the slots, the cache rows asked for ahead (a head's
// rows are one short stream the hardware prefetchers barely start on); a group's later
// heads find the rows in the second-level cache. Against the generic loops, 24 layers' caches
// of SmolLM2-1.7B's shape at 160 slots (the EPYC host, alternating runs): bf16 121-126 -> 87-105
// us a layer, f32 160-174 -> 127-162. While it reads the keys it also asks for the values of
// the same slots, and while it reads the values the keys of the line's next KV head (`next_kc`,
// or none): each stream starts warm, and two run at once. At 300 slots (best of 9, alternating
// runs): bf16 130-140 -> 86-91 us a layer, f32 189-228 -> 158-174; at 160, bf16 63-68 -> 36-51.
template <int Vecs, typename T>
void attend_head_16(const float* qc, const T* kc, const T* vc, float* oc, int64_t group, int64_t s,
                    int64_t stride, Slots slots, float scale, float* scores, float* total, const T* next_kc) {
  const int64_t d = 16 * Vecs, row_bytes = d * int64_t(sizeof(T));
  for (int64_t g = 0; g < group; ++g) {
    __m512 qv[Vecs];
    for (int j = 0; j < Vecs; ++j) qv[j] = _mm512_loadu_ps(qc + g * d + 16 * j);
    float* sg = scores + g * s;
    float top = -INFINITY;
    for (int64_t t = slots.first; t <= slots.last; ++t) {
      const T* row = kc + t * stride;
      ahead(row, row_bytes);
      if (g == 0) later(vc + t * stride, row_bytes);
      __m512 acc = _mm512_mul_ps(qv[0], load16(row));
      for (int j = 1; j < Vecs; ++j) acc = _mm512_fmadd_ps(qv[j], load16(row + 16 * j), acc);
      const float score = _mm512_reduce_add_ps(acc) * scale;
      sg[t] = score;
      top = score > top ? score : top;
    }
    float sum = 0.0f;
    for (int64_t t = slots.first; t <= slots.last; ++t) {
      sg[t] = std::exp(sg[t] - top);
      sum += sg[t];
    }
    total[g] = sum;
    const float inverse = 1.0f / sum;
    __m512 ov[Vecs];
    for (int j = 0; j < Vecs; ++j) ov[j] = _mm512_setzero_ps();
    for (int64_t t = slots.first; t <= slots.last; ++t) {
      const T* row = vc + t * stride;
      ahead(row, row_bytes);
      if (next_kc != nullptr && g + 1 == group) later(next_kc + t * stride, row_bytes);
      const __m512 weight = _mm512_set1_ps(sg[t] * inverse);
      for (int j = 0; j < Vecs; ++j) ov[j] = _mm512_fmadd_ps(weight, load16(row + 16 * j), ov[j]);
    }
    for (int j = 0; j < Vecs; ++j) _mm512_storeu_ps(oc + g * d + 16 * j, ov[j]);
  }
}
#endif

// Line i's kv head c and the query heads that share it. Each cache row (`stride` elements
// apart) is read once for all of them. `scores` holds group * s floats, `top` and `total` group.
template <typename T>
void attend_head(const float* q, const T* k, const T* v, float* out, int64_t i, int64_t c, int64_t h,
                 int64_t kvh, int64_t s, int64_t d, int64_t stride, const int32_t* slot, const int32_t* pad,
                 const int32_t* lines, float scale, float* scores, float* top, float* total) {
  const int64_t group = h / kvh;
  const auto [first, last] = attended_slots(slot, pad, i, s);
  const float* qc = q + (i * h + c * group) * d;     // the group's query heads, one after another
  float* oc = out + (i * h + c * group) * d;
  const int64_t line = lines[i];
  const T* kc = k + (line * kvh + c) * s * stride;
  const T* vc = v + (line * kvh + c) * s * stride;
  std::fill(oc, oc + group * d, 0.0f);
  if (first > last) return;
#ifdef PYHLO_ATTENTION_AVX512
  if constexpr (!std::is_same_v<T, int8_t>) {
    if (d == 64 || d == 128) {
      const T* next_kc = c + 1 < kvh ? kc + s * stride : nullptr;
      (d == 64 ? attend_head_16<4, T> : attend_head_16<8, T>)(qc, kc, vc, oc, group, s, stride, {first, last},
                                                             scale, scores, total, next_kc);
      return;
    }
  }
#endif
  std::fill(top, top + group, -INFINITY);
  for (int64_t t = first; t <= last; ++t) {
    const T* row = kc + t * stride;
    const float row_factor = row_scale(row, d) * scale;
    for (int64_t g = 0; g < group; ++g) {
      const float score = dot(qc + g * d, row, d) * row_factor;
      scores[g * s + t] = score;
      top[g] = score > top[g] ? score : top[g];
    }
  }
  std::fill(total, total + group, 0.0f);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = first; t <= last; ++t) {
      scores[g * s + t] = std::exp(scores[g * s + t] - top[g]);
      total[g] += scores[g * s + t];
    }
  for (int64_t t = first; t <= last; ++t) {
    const T* row = vc + t * stride;
    const float row_factor = row_scale(row, d);
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * s + t] / total[g] * row_factor;
      float* og = oc + g * d;
      for (int64_t e = 0; e < d; ++e) og[e] += weight * load(row, e);
    }
  }
}

// Every line's kv heads, shared out over XLA's intra-op threads like a product's weight rows
// (a pair's cache rows are what a thread streams). On one thread, this kernel took 14 % of a
// batch-4 decode step of SmolLM2-135M (int8 Q4_1) while the other core waited.
template <typename T>
ffi::Error attend(ffi::ThreadPool& pool, const float* q, const T* k, const T* v, float* out, int64_t b, int64_t h,
                  int64_t kvh, int64_t s, int64_t d, int64_t stride, const int32_t* slot, const int32_t* pad,
                  const int32_t* lines, float scale) {
  int64_t longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    const Slots line = attended_slots(slot, pad, i, s);
    longest = std::max<int64_t>(longest, line.last - line.first + 1);
  }
  const int64_t pair_bytes = 2 * std::max<int64_t>(longest, 1) * stride * int64_t(sizeof(T));
  const int64_t group = h / kvh;
  return pyhlo_kernels::run_row_chunks(pool, b * kvh, pair_bytes, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> scores(group * s), top(group), total(group);
    for (int64_t pair = begin; pair < end; ++pair)
      attend_head(q, k, v, out, pair / kvh, pair % kvh, h, kvh, s, d, stride, slot, pad, lines, scale,
                  scores.data(), top.data(), total.data());
  }, k, /*product=*/false);
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> pad,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> lines,
                           ffi::Result<ffi::AnyBuffer> out) {
  ffi::Error checked = pyhlo_kernels::check_attention_operands("pyhlo_decode_attention", q, k, v, slot, pad, lines,
                                                                out->element_type(), /*queries=*/1);
  if (checked.failure()) return checked;
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto type = k.element_type();
  const int64_t b = qd[0], h = qd[1], d = qd[3], kvh = kd[1], s = kd[2], stride = kd[3];
  const float* qp = static_cast<const float*>(q.untyped_data());
  float* op = static_cast<float*>(out->untyped_data());
  const int32_t* at = slot.typed_data();
  const float sc = scale.typed_data()[0];
  if (type == ffi::DataType::F32)
    return attend(pool, qp, static_cast<const float*>(k.untyped_data()), static_cast<const float*>(v.untyped_data()),
                  op, b, h, kvh, s, d, stride, at, pad.typed_data(), lines.typed_data(), sc);
  if (type == ffi::DataType::BF16 || type == ffi::DataType::U16)   // u16: a bf16 cache's bits
    return attend(pool, qp, static_cast<const uint16_t*>(k.untyped_data()),
                  static_cast<const uint16_t*>(v.untyped_data()), op, b, h, kvh, s, d, stride, at,
                  pad.typed_data(), lines.typed_data(), sc);
  return attend(pool, qp, static_cast<const int8_t*>(k.untyped_data()), static_cast<const int8_t*>(v.untyped_data()),
                op, b, h, kvh, s, d, stride, at, pad.typed_data(), lines.typed_data(), sc);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PyhloDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
