// Vector helpers shared by the kernel's files, written with GCC's vector extensions (GCC
// and Clang): the compiler maps them to the instruction set of the -march in effect.
//
//   vf:  kLanes floats, one register of the widest kind the build has: 16 with AVX-512,
//        8 otherwise (one ymm with AVX2, two q registers with NEON).  A wider generic
//        vector than the registers is split by the compiler, lane by lane through memory
//        where it selects or converts, which made the AVX2 build's softmax 3x slower.
//   vi:  kLanes int32 lanes, for masks and lane indices.
//   kv:  the GEMM micro-kernel's vector, the same width.
//   kPad: 16 floats (64 bytes, a cache line), the unit the kernel pads rows and tiles to,
//        on every build; a multiple of kLanes, so whole vectors cover a padded row.
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

constexpr int kPad = 16;
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
static_assert(kPad % kLanes == 0, "a padded row must be whole vectors");
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef float vfu __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
// A broadcast (an initialiser, which the compilers turn into one instruction; a loop
// over the lanes became a chain of inserts).
#ifdef __AVX512F__
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
#endif
// 0, 1, ..., kLanes - 1.
inline vi lane_indices() {
  vi v;
#pragma GCC unroll 16
  for (int j = 0; j < kLanes; ++j) v[j] = j;
  return v;
}
// The lanes' sum, lane 0 first.
inline float sum_lanes(vf x) {
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += x[j];
  return sum;
}
inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

constexpr int kKernelLanes = kLanes;
typedef vf kv;
inline kv kload(const float* p) { return load(p); }
inline void kstore(float* p, kv x) { store(p, x); }
inline kv ksplat(float s) { return splat(s); }

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
