// The vector layer the CPU kernels share (kernels/native/*.cpp): vectors of W floats, W fixed per build
// (per CPU: AVX-512, else AVX2 with FMA, else a plain loop), and the fixed-order reductions a row's bits
// rest on. kernels/native_build.py keys each build by the headers here as well as by its source.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace native {

#if defined(__AVX512F__)
constexpr int W = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vpow2(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
inline vec vpow2(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#else
constexpr int W = 4;
struct vec {
  float x[W];
};
inline vec vzero() { return vec{}; }
inline vec vset(float a) {
  vec r;
  for (float& x : r.x) x = a;
  return r;
}
inline vec vload(const float* p) {
  vec r;
  std::memcpy(r.x, p, sizeof r.x);
  return r;
}
inline void vstore(float* p, vec a) { std::memcpy(p, a.x, sizeof a.x); }
inline vec vfma(vec a, vec b, vec c) {
  for (int i = 0; i < W; ++i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return c;
}
inline vec vadd(vec a, vec b) {
  for (int i = 0; i < W; ++i) a.x[i] += b.x[i];
  return a;
}
inline vec vmul(vec a, vec b) {
  for (int i = 0; i < W; ++i) a.x[i] *= b.x[i];
  return a;
}
inline vec vmax(vec a, vec b) {
  for (int i = 0; i < W; ++i) a.x[i] = std::max(a.x[i], b.x[i]);
  return a;
}
inline vec vfloor(vec a) {
  for (float& x : a.x) x = std::floor(x);
  return a;
}
inline vec vpow2(vec n) {
  vec r;
  for (int i = 0; i < W; ++i) {
    uint32_t bits = uint32_t(int32_t(n.x[i]) + 127) << 23;
    std::memcpy(&r.x[i], &bits, sizeof bits);
  }
  return r;
}
#endif

// The W lanes of a added in a fixed tree (lane i + lane i + W/2, then the same on the half), in registers.
#if defined(__AVX512F__)
inline __m256 half_sum(vec a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 half_sum(vec a) { return a; }
#endif

inline float hsum(vec a) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  __m256 eight = half_sum(a);
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
#else
  for (int width = W / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) a.x[i] += a.x[i + width];
  return a.x[0];
#endif
}

// out[k] = hsum(a[k]) for each of W vectors, bit for bit: the same tree's adds, W sums at a time (each level
// adds the same pairs of lanes for two vectors at once, and the last puts every sum in its place).
inline void hsum_lanes(const vec* a, float* out) {
#if defined(__AVX512F__)
  vec level1[8], level2[4], level3[2];
  for (int i = 0; i < 8; ++i)  // lane i + lane i + 8: [a[2i]'s 8 | a[2i+1]'s 8]
    level1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // + 4: quarters [a[4i]'s 4, a[4i+1]'s, a[4i+2]'s, a[4i+3]'s]
    level2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(level1[2 * i], level1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(level1[2 * i], level1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // + 2: quarter q [a[8i+q]'s 2, a[8i+4+q]'s 2]
    level3[i] = _mm512_add_ps(_mm512_shuffle_ps(level2[2 * i], level2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(level2[2 * i], level2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + 1: lane 4q + r holds a[4r + q]'s sum
  vec sums = _mm512_add_ps(_mm512_shuffle_ps(level3[0], level3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_ps(level3[0], level3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i place = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(place, sums));
#elif defined(__AVX2__) && defined(__FMA__)
  vec level1[4], level2[2];
  for (int i = 0; i < 4; ++i)  // lane i + lane i + 4: [a[2i]'s 4 | a[2i+1]'s 4]
    level1[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // + 2: half h [a[4i+h]'s 2, a[4i+2+h]'s 2]
    level2[i] = _mm256_add_ps(_mm256_shuffle_ps(level1[2 * i], level1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(level1[2 * i], level1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + 1: lane 4h + r holds a[2r + h]'s sum
  vec sums = _mm256_add_ps(_mm256_shuffle_ps(level2[0], level2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm256_shuffle_ps(level2[0], level2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  for (int i = 0; i < W; ++i) out[i] = hsum(a[i]);
#endif
}

inline float hmax(vec a) {
  float lanes[W];
  vstore(lanes, a);
  float top = lanes[0];
  for (int i = 1; i < W; ++i) top = std::max(top, lanes[i]);
  return top;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace native
