// The sum of a vector's 8 floats, for the kernels' AVX2 paths (and the 256-bit halves of the
// AVX-512 ones). One definition for every kernel that reduces 8-float sums.
#pragma once

#if defined(__AVX__)
#include <immintrin.h>

namespace pyhlo_kernels {

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pyhlo_kernels
#endif
