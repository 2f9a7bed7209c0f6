// twin_gemm: self-contained single-precision GEMM (row-major), C++17 + GCC vector extensions.
//
//   C[M x N] = op(A) op(B),  op(X) = X or X^T.  C is overwritten.
//
// Blocking (BLIS-like, tuned for AVX-512 cores with 48 KiB L1d / 2 MiB L2):
//  * Register tile MR x NR (NR = 16*NV floats).  With AVX-512 the default is 6 x 64:
//    24 zmm accumulators + 4 B vectors; A values are broadcast straight from memory
//    (vfmadd231ps zmm, zmm, [mem]{1to16}), so no register is spent on them.
//    Under AVX2 (x86-64-v3) a 16-float vector is two ymm registers, so the tile is 6 x 16.
//  * K is cut into blocks of KC.  B is packed into NR-wide panels (KC x NR, contiguous,
//    row p of the panel = NR consecutive floats, zero padded at the N edge).  This is
//    where trans_b is absorbed.  A KC x NR panel (64 KiB for 256 x 64) is reused by all
//    micro-rows of a task (it streams from L1/L2), the MR x KC micro-panel of A by the
//    NR-wide sweep.
//  * A: when !trans_a the micro-kernel reads A in place (MR rows, stride lda; each
//    broadcast walks a row contiguously), so the big-M operand of the forward / dx
//    products is never copied.  When trans_a the A chunk (stored K x M) is copied,
//    row by row (contiguous vector copies), into a K-major buffer whose stride is
//    padded to avoid L1 set conflicts; the kernel then broadcasts MR consecutive floats.
//  * Parallelism: the output is cut into tasks = (row chunk) x (column chunk).
//    - big M (forward / dx): B is packed once (first parallel pass) and shared; tasks are
//      row chunks of ~ 64..192 rows x all of N.
//    - small M (dW: M, N ~ 256..768, K huge): tasks are ~128 x ~128..256 output blocks,
//      each packing its own slices of A and B per K block (no global packing of a huge B).
//    Every output element is computed by exactly one task with a fixed K order, so the
//    result is independent of the number of threads and of scheduling.
//  * Scratch: thread_local vectors, grown on demand and reused across calls; the two that
//    grow with the operands (packed B, partial sums) are freed past 16 MiB.
#pragma once
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace twin_gemm {
namespace detail {

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));

// Micro-kernel vector: 16 floats (one zmm) with AVX-512; 8 floats (one ymm) otherwise, because
// GCC keeps arrays of 64-byte vectors in memory (spills) when it has to split them into ymm halves.
#ifdef __AVX512F__
#define TWIN_GEMM_VW 16
#else
#define TWIN_GEMM_VW 8
#endif
typedef float kv __attribute__((vector_size(4 * TWIN_GEMM_VW)));
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
constexpr int kVW = TWIN_GEMM_VW;
constexpr int kNR = kVW * kNV;
static_assert(kNR % 16 == 0, "NR must be a multiple of 16");
constexpr int64_t kKC = TWIN_GEMM_KC;

static inline vf loadu(const float* p) { return *reinterpret_cast<const vfu*>(p); }
static inline void storeu(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

#if TWIN_GEMM_VW == 16
static inline kv ksplat(float s) { return kv{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
#else
static inline kv ksplat(float s) { return kv{s, s, s, s, s, s, s, s}; }
#endif
typedef float kvu __attribute__((vector_size(4 * TWIN_GEMM_VW), aligned(4)));

// Micro-kernel: C[MR x NR] (+)= A[MR x kc] * Bp[kc x NR], NR = NV vectors of kVW floats.
//   KMAJ:  A(i,p) = a[p*lda + i]   (packed / transposed A)
//   !KMAJ: A(i,p) = a[i*lda + p]   (row-major A read in place)
//   Bp: packed panel, row p at b + p*NR, 64-byte aligned.
// Inner loop (AVX-512, 6x64): 4 aligned B loads, 6 vbroadcastss, 24 vfmadd231ps, no spills.
template <int MR, int NV, bool KMAJ>
__attribute__((always_inline)) inline void micro(int64_t kc, const float* __restrict a, int64_t lda,
                                                 const float* __restrict b, float* __restrict c,
                                                 int64_t ldc, bool acc) {
  constexpr int NR = kVW * NV;
  kv r[MR][NV];
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) r[i][j] = kv{};
  for (int64_t p = 0; p < kc; ++p) {
    kv bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = *reinterpret_cast<const kv*>(b + p * NR + kVW * j);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const float s = KMAJ ? a[p * lda + i] : a[i * lda + p];
      const kv av = ksplat(s);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) r[i][j] += av * bv[j];
    }
  }
  if (acc) {
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        kvu* q = reinterpret_cast<kvu*>(c + i * ldc + kVW * j);
        *q = *q + r[i][j];
      }
  } else {
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) *reinterpret_cast<kvu*>(c + i * ldc + kVW * j) = r[i][j];
  }
}

// Thread-local scratch (slot 0: A, 1: B, 2: shared packed B, 3: edge A, 4: K-split partial
// sums), kept between calls so that a training step's products reuse the same pages.
inline std::vector<float>* scratch_slots() {
  thread_local std::vector<float> bufs[5];
  return bufs;
}

// Slots 2 and 4 (the calling thread's) grow with the operands: past kKeptFloats (16 MiB)
// they are freed when the call returns rather than held for the life of the thread.
constexpr size_t kKeptFloats = size_t{4} << 20;
inline void release_large_scratch() {
  for (int slot : {2, 4}) {
    std::vector<float>& v = scratch_slots()[slot];
    if (v.capacity() > kKeptFloats) std::vector<float>().swap(v);
  }
}

// A 64-byte aligned buffer of n floats in a slot.
inline float* scratch(int slot, size_t n) {
  std::vector<float>& v = scratch_slots()[slot];
  if (v.size() < n + 16) v.resize(n + 16);
  uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// Pack panel of op(B): rows [pc, pc+kc), columns [j0, j0+nr) (nr <= NR) into dst[kc x NR].
inline void pack_b_panel(bool tb, const float* B, int64_t ldb, int64_t pc, int64_t kc, int64_t j0,
                         int64_t nr, float* __restrict dst) {
  if (!tb) {
    if (nr == kNR) {
      for (int64_t p = 0; p < kc; ++p) {
        const float* s = B + (pc + p) * ldb + j0;
#pragma GCC unroll 8
        for (int j = 0; j < kNR; j += 16) *reinterpret_cast<vf*>(dst + p * kNR + j) = loadu(s + j);
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
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8u __attribute__((vector_size(32), aligned(4)));
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
      for (; r < nfast; ++r) storeu(d + r * pstr, loadu(s + r * kMR));
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
    micro<kMR, kNV, KMAJ>(kc, a, lda, bp, C, ldc, acc);
  } else {
    alignas(64) float t[kMR * kNR];
    micro<kMR, kNV, KMAJ>(kc, a, lda, bp, t, kNR, false);
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

}  // namespace detail

template <typename Run>
void sgemm(Run&& run, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
           int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc) {
  using namespace detail;
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
  float* bglob = nullptr;
  if (pl.prepack) {
    bglob = scratch(2, size_t(K) * size_t(npad));
    const int64_t ntask = nkb * pl.np;
    run(ntask, [&](int64_t t) {
      const int64_t kb = t / pl.np, jp = t % pl.np;
      const int64_t pc = kb * kKC, kc = std::min(kKC, K - pc);
      pack_b_panel(trans_b, B, ldb, pc, kc, jp * kNR, std::min<int64_t>(kNR, N - jp * kNR),
                   bglob + pc * npad + jp * kc * kNR);
    });
  }
  // K slices s > 0 write partial sums here (M x N each); slice 0 writes C.
  float* part = pl.ks > 1 ? scratch(4, size_t(pl.ks - 1) * size_t(M) * size_t(N)) : nullptr;

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
    float* abuf = trans_a ? scratch(0, size_t(pstr) * size_t(r1 - r0)) : nullptr;
    float* bbuf = pl.prepack ? nullptr : scratch(1, size_t((c1 - c0) * kNR) * size_t(kcmax));
    float* ebuf = scratch(3, size_t(kMR) * size_t(kKC));
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
          for (; j + 16 <= N; j += 16) storeu(c + j, loadu(c + j) + loadu(q + j));
          for (; j < N; ++j) c[j] += q[j];
        }
      }
    });
  }
  release_large_scratch();
}

}  // namespace twin_gemm

#pragma GCC diagnostic pop
