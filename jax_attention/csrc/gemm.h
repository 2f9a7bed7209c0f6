// The kernel's float32 matrix products (row-major), on one register-tiled micro-kernel
// written with GCC's vector extensions and the compiler free to contract multiply-adds.
//
//  * gemm():  C[M x N] = (accumulate ? C : 0) + A[M x K] B[K x N], operands read in
//    place, one thread.  The attention's products on tiles that are already in cache.
//  * sgemm(): C[M x N] = op(A) op(B), op(X) = X or X^T, packed and shared over a thread
//    pool (the projections x W, dy W^T and x^T dy).
//
// The micro-kernel keeps an MR x NR tile of C in registers (NR = NV vectors of kv; with
// AVX-512, 6 x 64: 24 zmm accumulators and 4 of B, A broadcast straight from memory) and
// runs over K.  Each element of C is a sum over K in a fixed order, independent of the
// number of threads and of scheduling.
//
// sgemm's blocking (BLIS-like, for AVX-512 cores with 48 KiB L1d / 2 MiB L2):
//  * K is cut into blocks of KC.  B is packed into NR-wide panels (KC x NR, contiguous,
//    row p of the panel = NR consecutive floats, zero padded at the N edge).  This is
//    where trans_b is absorbed.  A KC x NR panel is reused by all micro-rows of a task,
//    the MR x KC micro-panel of A by the NR-wide sweep.
//  * A: when !trans_a the micro-kernel reads A in place (MR rows, stride lda; each
//    broadcast walks a row contiguously), so the big-M operand of the forward / dx
//    products is never copied.  When trans_a the A chunk (stored K x M) is copied,
//    row by row (contiguous vector copies), into a K-major buffer whose stride is
//    padded to avoid L1 set conflicts; the kernel then broadcasts MR consecutive floats.
//  * Parallelism: the output is cut into tasks = (row chunk) x (column chunk).
//    - big M (forward / dx): B is packed once (first parallel pass) and shared; tasks are
//      row chunks of ~ 64..192 rows x all of N.
//    - small M (dW: M, N ~ 256..768, K huge): tasks are output blocks, each packing its
//      own slices of A and B per K block (no global packing of a huge B); with few such
//      blocks and a long K, K is split too and the partial sums added in a fixed order.
#pragma once
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "scratch.h"
#include "vec.h"

namespace twin {

#ifndef TWIN_GEMM_MR
#ifdef __AVX512F__
#define TWIN_GEMM_MR 6   // 6 x 64: 24 zmm accumulators
#define TWIN_GEMM_NV 4
#else
#define TWIN_GEMM_MR 6   // 6 x 16: 12 ymm accumulators
#define TWIN_GEMM_NV 2
#endif
#endif
#ifndef TWIN_GEMM_DWB
#define TWIN_GEMM_DWB 512
#endif
#ifndef TWIN_GEMM_WANT
#define TWIN_GEMM_WANT 8
#endif
#ifndef TWIN_GEMM_KC
#define TWIN_GEMM_KC 256
#endif

constexpr int kMR = TWIN_GEMM_MR;
constexpr int kNV = TWIN_GEMM_NV;
constexpr int kNR = kKernelLanes * kNV;
static_assert(kNR % 16 == 0, "NR must be a multiple of 16");
constexpr int64_t kKC = TWIN_GEMM_KC;

// How a micro-kernel call meets what C holds, when it accumulates.
enum class Accumulate {
  kFromC,     // the sums start from C's values: C + a0 b0 + a1 b1 + ... (gemm)
  kAddAfter,  // the sums start from zero and are added to C at the end (sgemm's K blocks)
};

// C[MR x NR] (+)= A[MR x kc] B[kc x NR], NR = NV vectors; B's row p at b + p * ldb.
//   KMAJ:  A(i, p) = a[p * lda + i]   (packed / transposed A)
//   !KMAJ: A(i, p) = a[i * lda + p]   (row-major A read in place)
// Inner loop (AVX-512, 6 x 64): 4 B loads, 6 broadcasts, 24 vfmadd231ps, no spills.
template <int MR, int NV, bool KMAJ, Accumulate kMode>
__attribute__((always_inline)) inline void micro(int64_t kc, const float* __restrict a, int64_t lda,
                                                 const float* __restrict b, int64_t ldb, float* __restrict c,
                                                 int64_t ldc, bool acc) {
  constexpr int W = kKernelLanes;
  kv r[MR][NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) r[i][j] = kMode == Accumulate::kFromC && acc ? kload(c + i * ldc + W * j) : kv{};
  for (int64_t p = 0; p < kc; ++p) {
    kv bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = kload(b + p * ldb + W * j);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const kv av = ksplat(KMAJ ? a[p * lda + i] : a[i * lda + p]);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) r[i][j] += av * bv[j];
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      float* q = c + i * ldc + W * j;
      kstore(q, kMode == Accumulate::kAddAfter && acc ? kload(q) + r[i][j] : r[i][j]);
    }
}

// ---------------------------------------------------------------- gemm (in place)

// Rows of C in 6-row micro-kernel calls, the last few in one call of their own.
template <int NV>
void gemm_panel(int64_t M, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                int64_t ldc, bool accumulate) {
  constexpr Accumulate kMode = Accumulate::kFromC;
  constexpr int kRows = 6;  // rows of C per call: 6 x NV accumulators, NV of B, one broadcast
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) micro<kRows, NV, false, kMode>(K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  const float* a = A + i * lda;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: micro<5, NV, false, kMode>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 4: micro<4, NV, false, kMode>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 3: micro<3, NV, false, kMode>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 2: micro<2, NV, false, kMode>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 1: micro<1, NV, false, kMode>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    default: break;
  }
}

// C[M x N] = (accumulate ? C : 0) + A[M x K] B[K x N], N a multiple of 16.  Column
// panels outer, rows inner: a (K x panel) block of B stays in cache for all rows.  The
// panel is as wide as the register file allows a 6-row tile: 64 columns with AVX-512
// (24 of 32 zmm accumulate), 16 with 16 registers (AVX2: 12 of 16 ymm; NEON: 6 x 16 in
// 24 of 32 q registers), where a wider panel would spill the accumulators every step.
#ifdef __AVX512F__
constexpr int64_t kGemmPanel = 64;
#else
constexpr int64_t kGemmPanel = 16;
#endif
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool accumulate) {
  constexpr int kPer16 = 16 / kKernelLanes;  // kernel vectors in 16 floats
  for (int64_t j = 0; j < N; j += kGemmPanel) {
    const float* b = B + j;
    float* c = C + j;
    switch (std::min<int64_t>(kGemmPanel, N - j) / 16) {
      case 4: gemm_panel<4 * kPer16>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
      case 3: gemm_panel<3 * kPer16>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
      case 2: gemm_panel<2 * kPer16>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
      default: gemm_panel<1 * kPer16>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
    }
  }
}

// ---------------------------------------------------------------- copies

// A whole kLanes x kLanes block through registers (16 x 16 with AVX-512, 8 x 8
// otherwise): log2(kLanes) rounds of two-vector shuffles (vpermt2ps; vshufps and
// vperm2f128 with AVX2), round d exchanging the d x d blocks off the diagonal of every
// 2d x 2d block.
inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
  vf r[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) r[i] = load(src + i * lds);
#pragma GCC unroll 4
  for (int d = kLanes / 2; d >= 1; d /= 2) {
    vi lo, hi;  // lanes [0, kLanes) from the first operand, [kLanes, 2 kLanes) from the second
    for (int j = 0; j < kLanes; ++j) {
      lo[j] = (j & d) ? kLanes + j - d : j;
      hi[j] = (j & d) ? kLanes + j : j + d;
    }
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) {
      if (i & d) continue;
      const vf a = r[i], b = r[i + d];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i + d] = __builtin_shuffle(a, b, hi);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) store(dst + i * ldd, r[i]);
}

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols (a copy, transposed).
inline void transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd) {
  constexpr int64_t kB = kLanes;
  for (int64_t r0 = 0; r0 < rows; r0 += kB)
    for (int64_t c0 = 0; c0 < cols; c0 += kB) {
      const int64_t r1 = std::min(rows, r0 + kB), c1 = std::min(cols, c0 + kB);
      if (r1 - r0 == kB && c1 - c0 == kB) {
        transpose_block(src + r0 * lds + c0, lds, dst + c0 * ldd + r0, ldd);
        continue;
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[c * ldd + r] = src[r * lds + c];
    }
}

// rows x cols of src into dst (ldd >= cols), the columns up to ldd and the rows up to
// padded_rows filled with zeros.
inline void pack(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd,
                 int64_t padded_rows) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * ldd, src + r * lds, cols * sizeof(float));
    std::fill(dst + r * ldd + cols, dst + (r + 1) * ldd, 0.0f);
  }
  std::fill(dst + rows * ldd, dst + padded_rows * ldd, 0.0f);
}

// ---------------------------------------------------------------- sgemm (packed, parallel)

// Pack panel of op(B): rows [pc, pc+kc), columns [j0, j0+nr) (nr <= NR) into dst[kc x NR].
inline void pack_b_panel(bool tb, const float* B, int64_t ldb, int64_t pc, int64_t kc, int64_t j0,
                         int64_t nr, float* __restrict dst) {
  if (!tb) {
    if (nr == kNR) {
      for (int64_t p = 0; p < kc; ++p) {
        const float* s = B + (pc + p) * ldb + j0;
#pragma GCC unroll 8
        for (int j = 0; j < kNR; j += kLanes) store(dst + p * kNR + j, load(s + j));
      }
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        const float* s = B + (pc + p) * ldb + j0;
        float* d = dst + p * kNR;
        for (int64_t j = 0; j < nr; ++j) d[j] = s[j];
        for (int64_t j = nr; j < kNR; ++j) d[j] = 0.f;
      }
    }
  } else {
    // op(B)(p, j) = B[j*ldb + p]: transpose in 16 x 16 blocks through registers/L1.
    for (int64_t p0 = 0; p0 < kc; p0 += 16) {
      const int64_t pe = std::min<int64_t>(16, kc - p0);
      for (int64_t j = 0; j < nr; ++j) {
        const float* s = B + (j0 + j) * ldb + pc + p0;
        for (int64_t p = 0; p < pe; ++p) dst[(p0 + p) * kNR + j] = s[p];
      }
      for (int64_t j = nr; j < kNR; ++j)
        for (int64_t p = 0; p < pe; ++p) dst[(p0 + p) * kNR + j] = 0.f;
    }
  }
}

// Pack op(A) rows [i0, i1), K range [pc, pc+kc), for trans_a (A stored K x M) into MR-row
// micro-panels: panel r at dst + r*pstr holds element (i, p) at p*MR + i (rows past i1 are 0).
// The loop runs over p outside, so each step reads one contiguous row segment of A (no
// strided sweeps through L1-aliasing rows); each micro-panel gets MR floats via one 8-float
// (or 16-float) load and an overlapping store -- the tail written past MR is overwritten by
// step p+1, and pstr leaves 16 floats of slack after the panel.
inline void pack_a_t(const float* A, int64_t lda, int64_t pc, int64_t kc, int64_t i0, int64_t i1,
                     int64_t npanels, int64_t pstr, float* __restrict dst) {
  // Panels [0, nfast) can use the wide copy: full rows and the wide load stays inside [i0, i1).
  constexpr int W = kMR <= 8 ? 8 : 16;
  int64_t nfast = 0;
  if (kMR <= 16)
    while (nfast < npanels && i0 + nfast * kMR + W <= i1) ++nfast;
  for (int64_t p = 0; p < kc; ++p) {
    const float* s = A + (pc + p) * lda + i0;
    float* d = dst + p * kMR;
    int64_t r = 0;
    if (W == 8) {
      for (; r < nfast; ++r)
        *reinterpret_cast<vf8u*>(d + r * pstr) = *reinterpret_cast<const vf8u*>(s + r * kMR);
    } else {
      for (; r < nfast; ++r)
        for (int w = 0; w < W; w += 8)
          *reinterpret_cast<vf8u*>(d + r * pstr + w) = *reinterpret_cast<const vf8u*>(s + r * kMR + w);
    }
    for (; r < npanels; ++r)
      for (int64_t i = 0; i < kMR; ++i) {
        const int64_t row = r * kMR + i;
        d[r * pstr + i] = i0 + row < i1 ? s[row] : 0.f;
      }
  }
}

// Pack one partial micro-row of row-major op(A) (mr < MR rows) into dst[p*MR + i], zero padded.
inline void pack_a_edge(bool ta, const float* A, int64_t lda, int64_t i0, int64_t mr, int64_t pc,
                        int64_t kc, float* __restrict dst) {
  for (int64_t p = 0; p < kc; ++p)
    for (int64_t i = 0; i < kMR; ++i)
      dst[p * kMR + i] = i < mr ? (ta ? A[(pc + p) * lda + i0 + i] : A[(i0 + i) * lda + pc + p]) : 0.f;
}

template <bool KMAJ>
inline void tile(int64_t kc, const float* a, int64_t lda, const float* bp, float* C, int64_t ldc,
                 int64_t mr, int64_t nr, bool acc) {
  if (mr == kMR && nr == kNR) {
    micro<kMR, kNV, KMAJ, Accumulate::kAddAfter>(kc, a, lda, bp, kNR, C, ldc, acc);
  } else {
    alignas(64) float t[kMR * kNR];
    micro<kMR, kNV, KMAJ, Accumulate::kAddAfter>(kc, a, lda, bp, kNR, t, kNR, false);
    for (int64_t i = 0; i < mr; ++i)
      for (int64_t j = 0; j < nr; ++j) C[i * ldc + j] = acc ? C[i * ldc + j] + t[i * kNR + j] : t[i * kNR + j];
  }
}

// Software prefetch spread over a stretch of work: regions of rows (nrows rows of
// `nfloats` floats at stride `ld` floats), a few cache lines issued at each step() so that
// memory reads overlap with the FMAs instead of stalling the work that reads them next.
// Here: the next K block's un-packed A / B rows, over the micro-tiles of the current block
// (into L1).  The attention kernel's backward: a unit's likely successor's operands (L2).
template <int kLocality = 3>
struct Prefetcher {
  struct Region { const float* base; int64_t nrows, ld, lines; };
  static constexpr int kRegions = 5;
  Region reg[kRegions];
  int nreg = 0;
  int64_t cur_reg = 0, cur_row = 0, cur_line = 0, per_tile = 0;
  void add(const float* base, int64_t nrows, int64_t ld, int64_t nfloats) {
    if (nrows > 0 && nfloats > 0 && nreg < kRegions) reg[nreg++] = Region{base, nrows, ld, (nfloats + 15) / 16};
  }
  // Spread the lines over ntiles steps (all of them at finish() when ntiles is 0).
  void start(int64_t ntiles) {
    int64_t total = 0;
    for (int r = 0; r < nreg; ++r) total += reg[r].nrows * reg[r].lines;
    per_tile = ntiles > 0 ? (total + ntiles - 1) / ntiles : 0;
  }
  inline void step() { issue(per_tile); }
  // Whatever the steps left.
  void finish() { issue(INT64_MAX); }

 private:
  inline void issue(int64_t count) {
    for (int64_t n = 0; n < count && cur_reg < nreg; ++n) {
      const Region& r = reg[cur_reg];
      __builtin_prefetch(r.base + cur_row * r.ld + cur_line * 16, 0, kLocality);
      if (++cur_line == r.lines) {
        cur_line = 0;
        if (++cur_row == r.nrows) { cur_row = 0; ++cur_reg; }
      }
    }
  }
};

struct Plan {
  int64_t mp, np;  // micro-rows, panels
  int64_t rc, cc;  // row chunks, column chunks
  int64_t ks;      // K slices (partial sums, reduced in fixed order)
  bool prepack;    // B packed once, shared by all tasks
};

inline Plan make_plan(int64_t M, int64_t N, int64_t K) {
  Plan pl;
  pl.mp = (M + kMR - 1) / kMR;
  pl.np = (N + kNR - 1) / kNR;
  pl.ks = 1;
  const double flops = 2.0 * double(M) * double(N) * double(K);
  // Not more tasks than useful work (>= ~1 MFLOP each).
  const int64_t max_tasks = std::max<int64_t>(1, int64_t(flops / 1e6));
  // Big M (forward / dx): row chunks of ~128 rows x up to ~768 columns, B packed once.
  pl.cc = std::max<int64_t>(1, (N + 767) / 768);
  pl.rc = std::max<int64_t>(1, (M + 127) / 128);
  if (pl.rc < 3) {
    // Small M (dW): output blocks of up to ~256 x 256, each task packs its own A/B slices.
    // If that gives few tasks and K is long, split K too (>= 512 per slice) so that every
    // input element is read from memory once and there are ~8 tasks for load balance.
    pl.rc = std::max<int64_t>(1, (M + TWIN_GEMM_DWB - 1) / TWIN_GEMM_DWB);
    pl.cc = std::max<int64_t>(1, (N + TWIN_GEMM_DWB - 1) / TWIN_GEMM_DWB);
    const int64_t want = TWIN_GEMM_WANT;
    if (pl.rc * pl.cc < want) pl.ks = std::max<int64_t>(1, std::min(want / (pl.rc * pl.cc), K / 512));
  }
  while (pl.rc * pl.cc * pl.ks > max_tasks && (pl.rc > 1 || pl.cc > 1 || pl.ks > 1)) {
    if (pl.ks > 1) pl.ks = (pl.ks + 1) / 2;
    else if (pl.rc >= pl.cc) pl.rc = (pl.rc + 1) / 2;
    else pl.cc = (pl.cc + 1) / 2;
  }
  pl.rc = std::min(pl.rc, pl.mp);
  pl.cc = std::min(pl.cc, pl.np);
  pl.prepack = pl.rc >= 3 && pl.ks == 1;
  return pl;
}

template <typename Run>
void sgemm(Run&& run, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
           int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(float) * size_t(N));
    return;
  }
  const Plan pl = make_plan(M, N, K);
  const int64_t npad = pl.np * kNR;
  const int64_t nkb = (K + kKC - 1) / kKC;

  // Pass 1 (big M): pack all of op(B) once.  Layout: K block kb starts at kb*KC*npad, and
  // holds np panels of kc x NR each.
  const Scratch shared_b(kGemmSharedB, pl.prepack ? size_t(K) * size_t(npad) : 0);
  float* const bglob = shared_b.get();
  if (pl.prepack) {
    const int64_t ntask = nkb * pl.np;
    run(ntask, [&](int64_t t) {
      const int64_t kb = t / pl.np, jp = t % pl.np;
      const int64_t pc = kb * kKC, kc = std::min(kKC, K - pc);
      pack_b_panel(trans_b, B, ldb, pc, kc, jp * kNR, std::min<int64_t>(kNR, N - jp * kNR),
                   bglob + pc * npad + jp * kc * kNR);
    });
  }
  // K slices s > 0 write partial sums here (M x N each); slice 0 writes C.
  const Scratch partial(kGemmPartial, pl.ks > 1 ? size_t(pl.ks - 1) * size_t(M) * size_t(N) : 0);
  float* const part = partial.get();

  // Pass 2: output tasks (row chunk, column chunk, K slice).
  run(pl.rc * pl.cc * pl.ks, [&](int64_t t) {
    const int64_t si = t % pl.ks, ci = (t / pl.ks) % pl.cc, ri = t / (pl.ks * pl.cc);
    const int64_t r0 = pl.mp * ri / pl.rc, r1 = pl.mp * (ri + 1) / pl.rc;  // micro-rows
    const int64_t c0 = pl.np * ci / pl.cc, c1 = pl.np * (ci + 1) / pl.cc;  // panels
    const int64_t k0 = (K * si / pl.ks) & ~int64_t(15), k1 = si + 1 == pl.ks ? K : (K * (si + 1) / pl.ks) & ~int64_t(15);
    if (r0 >= r1 || c0 >= c1) return;
    float* Ct = si == 0 ? C : part + (si - 1) * M * N;
    const int64_t ldct = si == 0 ? ldc : N;
    if (k0 >= k1) {  // empty slice (tiny K): contributes zeros
      for (int64_t i = r0 * kMR; i < std::min(M, r1 * kMR); ++i)
        for (int64_t j = c0 * kNR; j < std::min(N, c1 * kNR); ++j) Ct[i * ldct + j] = 0.f;
      return;
    }
    const int64_t i0 = r0 * kMR, i1 = std::min(M, r1 * kMR);
    const int64_t rows_pad = (r1 - r0) * kMR;
    const int64_t kcmax = std::min(kKC, k1 - k0);
    const int64_t pstr = kMR * kcmax + 16;  // A micro-panel stride (with slack)
    // A's panels with 16 floats of slack past the last: pack_a_t's wide stores overrun.
    const Scratch a_panels(kGemmA, trans_a ? size_t(pstr) * size_t(r1 - r0) + 16 : 0);
    const Scratch b_panels(kGemmB, pl.prepack ? 0 : size_t((c1 - c0) * kNR) * size_t(kcmax));
    const Scratch edge_panel(kGemmEdge, size_t(kMR) * size_t(kKC));
    float* const abuf = a_panels.get();
    float* const bbuf = b_panels.get();
    float* const ebuf = edge_panel.get();
    for (int64_t pc = k0; pc < k1; pc += kKC) {
      const int64_t kc = std::min(kKC, k1 - pc);
      const bool acc = pc > k0;
      const float* bp;
      if (pl.prepack) {
        bp = bglob + pc * npad + c0 * kc * kNR;
      } else {
        for (int64_t jp = c0; jp < c1; ++jp)
          pack_b_panel(trans_b, B, ldb, pc, kc, jp * kNR, std::min<int64_t>(kNR, N - jp * kNR),
                       bbuf + (jp - c0) * kc * kNR);
        bp = bbuf;
      }
      if (trans_a) pack_a_t(A, lda, pc, kc, i0, i1, r1 - r0, pstr, abuf);
      // Edge micro-row of an in-place row-major A: pack it (zero padded) once per K block.
      const bool edge = !trans_a && (i1 - i0) < rows_pad;
      if (edge) pack_a_edge(false, A, lda, (r1 - 1) * kMR, i1 - (r1 - 1) * kMR, pc, kc, ebuf);
      Prefetcher<> pf;
      const int64_t pn = pc + kc;
      if (pn < k1 && !pl.prepack) {
        const int64_t kcn = std::min(kKC, k1 - pn), j0 = c0 * kNR, j1 = std::min(N, c1 * kNR);
        if (trans_b) pf.add(B + j0 * ldb + pn, j1 - j0, ldb, kcn);
        else pf.add(B + pn * ldb + j0, kcn, ldb, j1 - j0);
        if (trans_a) pf.add(A + pn * lda + i0, kcn, lda, i1 - i0);
        else pf.add(A + i0 * lda + pn, i1 - i0, lda, kcn);
        pf.start((c1 - c0) * (r1 - r0));
      }
      for (int64_t jp = c0; jp < c1; ++jp) {
        const float* bpanel = bp + (jp - c0) * kc * kNR;
        const int64_t j = jp * kNR, nr = std::min<int64_t>(kNR, N - j);
        for (int64_t ir = r0; ir < r1; ++ir) {
          const int64_t i = ir * kMR, mr = std::min<int64_t>(kMR, M - i);
          float* c = Ct + i * ldct + j;
          pf.step();
          if (trans_a) {
            tile<true>(kc, abuf + (ir - r0) * pstr, kMR, bpanel, c, ldct, mr, nr, acc);
          } else if (mr < kMR) {
            tile<true>(kc, ebuf, kMR, bpanel, c, ldct, mr, nr, acc);
          } else {
            tile<false>(kc, A + i * lda + pc, lda, bpanel, c, ldct, mr, nr, acc);
          }
        }
      }
    }
  });

  // Pass 3 (K split): C += partial[1] + partial[2] + ... in this fixed order, by row blocks.
  if (pl.ks > 1) {
    const int64_t rows_per = std::max<int64_t>(1, 16384 / N);
    const int64_t nt = (M + rows_per - 1) / rows_per;
    run(nt, [&](int64_t t) {
      for (int64_t i = t * rows_per; i < std::min(M, (t + 1) * rows_per); ++i) {
        float* c = C + i * ldc;
        for (int64_t s = 0; s + 1 < pl.ks; ++s) {
          const float* q = part + s * M * N + i * N;
          int64_t j = 0;
          for (; j + kLanes <= N; j += kLanes) store(c + j, load(c + j) + load(q + j));
          for (; j < N; ++j) c[j] += q[j];
        }
      }
    });
  }
}

}  // namespace twin

#pragma GCC diagnostic pop
