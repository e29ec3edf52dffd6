// Bytes widened to f32 on AVX2 without crossing a vector's halves: 16 bytes held in both
// halves (both_halves), then vpshufb puts 8 of them in the 32-bit lanes, bytes `first` ..
// `first` + 3 in the low half and `first` + 4 .. `first` + 7 in the high one (byte_lanes).
// vpmovzxbd, which crosses the halves, ran one a cycle on a Zen 3 host against two vpshufb.
// For the block kernels of matvec.cc and the K-quant kernels of kquants.h.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace pyhlo_kernels {

// The vpshufb control that takes bytes first .. first + 7 (first 0 or 8) to lanes 0 .. 7, each
// in its lane's byte 0 (the others zero).
inline __m256i byte_lanes(int first) {
  return _mm256_add_epi32(_mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                           4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1),
                          _mm256_set1_epi32(first));
}

// The same with each byte in its lane's byte 3, for signed bytes: an arithmetic shift by 24
// then sign-extends them (signed_lanes_f32).
inline __m256i top_byte_lanes(int first) { return _mm256_slli_epi32(byte_lanes(first), 24); }

// 16 bytes at `at` in both halves of a vector.
inline __m256i both_halves(const void* at) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(at)));
}

// The unsigned bytes `pick` (a byte_lanes control) selects, as 8 f32.
inline __m256 lanes_f32(__m256i bytes, __m256i pick) { return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(bytes, pick)); }

// The signed bytes `pick_top` (a top_byte_lanes control) selects, as 8 f32.
inline __m256 signed_lanes_f32(__m256i bytes, __m256i pick_top) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(bytes, pick_top), 24));
}

}  // namespace pyhlo_kernels
#endif
