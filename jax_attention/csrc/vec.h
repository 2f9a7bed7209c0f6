// Vector helpers shared by the kernel's files, written with GCC's vector extensions (GCC
// and Clang): the compiler maps them to the instruction set of the -march in effect.
//
//   vf:  16 floats (one AVX-512 register, two AVX2 ones), the attention's row vectors.
//   vi:  16 int32 lanes, for masks and lane indices.
//   kv:  the GEMM micro-kernel's vector: 16 floats with AVX-512, 8 (one ymm) otherwise,
//        because GCC keeps arrays of 64-byte vectors in memory when it has to split them.
// Loads and stores are unaligned (4-byte aligned types): the kernel's rows start anywhere.
#pragma once
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace twin {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
// The lanes' sum, lane 0 first.
inline float sum_lanes(vf x) {
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += x[j];
  return sum;
}
inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

#ifdef __AVX512F__
constexpr int kKernelLanes = 16;
#else
constexpr int kKernelLanes = 8;
#endif
typedef float kv __attribute__((vector_size(4 * kKernelLanes)));
typedef float kvu __attribute__((vector_size(4 * kKernelLanes), aligned(4)));
inline kv kload(const float* p) { return *reinterpret_cast<const kvu*>(p); }
inline void kstore(float* p, kv x) { *reinterpret_cast<kvu*>(p) = x; }
#ifdef __AVX512F__
inline kv ksplat(float s) { return kv{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
#else
inline kv ksplat(float s) { return kv{s, s, s, s, s, s, s, s}; }
#endif

// 8 floats, for copies of short row segments.
typedef float vf8u __attribute__((vector_size(32), aligned(4)));

// exp(x) for x <= 0 (and -inf): Cephes' expf, a degree-5 polynomial on
// |r| <= ln(2)/2 after x = n ln 2 + r, within about 1 ulp.  Results below the smallest
// normal float (x < -87.3) are 0: beside a row's maximum, exp(0) = 1, they are below
// float32's resolution of the row sum.
inline vf exp_nonpositive(vf x) {
  const vi tiny = x < -87.3f;  // -inf (a hidden key) included; NaN stays NaN
  x = tiny ? splat(-87.3f) : x;
  const vf t = x * 1.44269504088896341f;
#ifdef __AVX512F__
  const vf fn = reinterpret_cast<vf>(_mm512_roundscale_ps(reinterpret_cast<__m512>(t), _MM_FROUND_TO_NEAREST_INT));
#else
  const vf fn = __builtin_convertvector(__builtin_convertvector(t - 0.5f, vi), vf);  // truncation: nearest, t <= 0
#endif
  vf r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  const vf z = r * r;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
#ifdef __AVX512F__
  const vf result = reinterpret_cast<vf>(_mm512_scalef_ps(reinterpret_cast<__m512>(y), reinterpret_cast<__m512>(fn)));
#else
  const vi bits = (__builtin_convertvector(fn, vi) + 127) << 23;  // 2^n, n >= -126 here
  vf result;
  std::memcpy(&result, &bits, sizeof(result));
  result *= y;
#endif
  return tiny ? vf{} : result;
}

}  // namespace twin

#pragma GCC diagnostic pop
