// FlashAttention for XLA's CPU backend, forward and backward, as XLA FFI handlers.
//
// Built on first use by jax_attention/_cpu_kernel.py with the machine's C++ compiler
// (-O3 -march=native) and registered as the custom-call targets
// "twin_attention_flash_fwd" and "twin_attention_flash_bwd".  The math is that of
// jax_attention.functional's blockwise path: float32 throughout, scores never stored
// beyond one (rows x keys) tile, the softmax's row maximum taken over the unscaled
// scores and exp((s - max) * scale), a row with nothing to attend to giving zeros.
//
// Layouts (row-major, the dimension names of functional.py): tokens before heads, as
// the modules' projections produce them, so that no transpose is needed around a call:
//   q (B, T, H, D)   k (B, S, Hkv, D)   v (B, S, Hkv, Dv)   lengths (B,) int32
//   out (B, T, H, Dv)   row_max, row_sum (B, H, T)
// Query head h reads key/value head h / (H / Hkv).  Query i (at key position
// i + offset) sees key j iff i + offset - left <= j <= i + offset + right and
// j < lengths[b]; left / right < 0 mean unbounded on that side.
//
// The products run on a register-tiled kernel written with GCC's vector extensions
// (16 floats a vector: one AVX-512 register, or two AVX2 ones), with the compiler free
// to contract multiply-adds.  Work is shared over XLA's intra-op thread pool: the
// forward by (batch, head, query block), the backward by (batch, key/value head), whose
// tasks own their dK and dV and the dQ of their group of query heads.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// ---------------------------------------------------------------- products

// C[MR x 16 NV] = (accumulate ? C : 0) + A[MR x K] B[K x 16 NV]; A, B, C row-major.
template <int MR, int NV>
inline void micro(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                  int64_t ldc, bool accumulate) {
  vf c[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) c[i][j] = accumulate ? load(C + i * ldc + j * kLanes) : vf{};
  for (int64_t p = 0; p < K; ++p) {
    vf b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) b[j] = load(B + p * ldb + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const vf a = splat(A[i * lda + p]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) c[i][j] += a * b[j];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) store(C + i * ldc + j * kLanes, c[i][j]);
}

constexpr int kRows = 6;  // rows of C per kernel call: 6 x 4 accumulators + 4 of B

template <int NV>
void panel(int64_t M, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
           int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) micro<kRows, NV>(K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  const float* a = A + i * lda;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: micro<5, NV>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 4: micro<4, NV>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 3: micro<3, NV>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 2: micro<2, NV>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    case 1: micro<1, NV>(K, a, lda, B, ldb, c, ldc, accumulate); break;
    default: break;
  }
}

// C[M x N] = (accumulate ? C : 0) + A[M x K] B[K x N], N a multiple of 16.  Column
// panels of 64 outer, rows inner: a (K x 64) panel of B stays in cache for all rows.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < N; j += 4 * kLanes) {
    const float* b = B + j;
    float* c = C + j;
    switch (std::min<int64_t>(4, (N - j) / kLanes)) {
      case 4: panel<4>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
      case 3: panel<3>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
      case 2: panel<2>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
      default: panel<1>(M, K, A, lda, b, ldb, c, ldc, accumulate); break;
    }
  }
}

#ifdef __AVX512F__
// A whole 16 x 16 block through registers: four rounds of two-vector shuffles
// (vpermt2ps), round d exchanging the d x d blocks off the diagonal of every 2d x 2d block.
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  vf r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = load(src + i * lds);
#pragma GCC unroll 4
  for (int d = 8; d >= 1; d /= 2) {
    vi lo, hi;  // lanes 0-15 from the first operand, 16-31 from the second
    for (int j = 0; j < 16; ++j) {
      lo[j] = (j & d) ? 16 + j - d : j;
      hi[j] = (j & d) ? 16 + j : j + d;
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i & d) continue;
      const vf a = r[i], b = r[i + d];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i + d] = __builtin_shuffle(a, b, hi);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) store(dst + i * ldd, r[i]);
}
#endif

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols (a copy, transposed).
void transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd) {
  constexpr int64_t kB = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kB)
    for (int64_t c0 = 0; c0 < cols; c0 += kB) {
      const int64_t r1 = std::min(rows, r0 + kB), c1 = std::min(cols, c0 + kB);
#ifdef __AVX512F__
      if (r1 - r0 == kB && c1 - c0 == kB) {
        transpose16(src + r0 * lds + c0, lds, dst + c0 * ldd + r0, ldd);
        continue;
      }
#endif
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[c * ldd + r] = src[r * lds + c];
    }
}

// rows x cols of src into dst (ldd >= cols), the columns up to ldd and the rows up to
// padded_rows filled with zeros.
void pack(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd,
          int64_t padded_rows) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * ldd, src + r * lds, cols * sizeof(float));
    std::fill(dst + r * ldd + cols, dst + (r + 1) * ldd, 0.0f);
  }
  std::fill(dst + rows * ldd, dst + padded_rows * ldd, 0.0f);
}

// ---------------------------------------------------------------- exp

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

// ---------------------------------------------------------------- structure

struct Problem {
  int64_t batch, heads, kv_heads, q_len, kv_len, width, v_width;
  float scale;
  int64_t offset, left, right;  // left / right < 0: unbounded
  const int32_t* lengths;

  int64_t group() const { return heads / kv_heads; }
  // Row r of head h of example b in a (B, T, H, width) array, and its row stride.
  int64_t q_row(int64_t b, int64_t h, int64_t r) const { return (b * q_len + r) * heads + h; }
  int64_t kv_row(int64_t b, int64_t hk, int64_t c) const { return (b * kv_len + c) * kv_heads + hk; }
  int64_t length(int64_t b) const { return std::clamp<int64_t>(lengths[b], 0, kv_len); }
  // Keys [first, last) that query row r of example b sees.
  int64_t first(int64_t r) const { return left < 0 ? 0 : std::max<int64_t>(0, r + offset - left); }
  int64_t last(int64_t b, int64_t r) const {
    const int64_t len = length(b);
    return right < 0 ? len : std::clamp<int64_t>(r + offset + right + 1, 0, len);
  }
};

// Keys of [c0, c0 + cols) outside [first(r), last(b, r)) for row r of the block rows
// [r0, r0 + rows) set to -inf in s (rows x cols, ld); the padding columns past
// n_valid too.
void hide(const Problem& pb, int64_t b, int64_t r0, int64_t rows, int64_t c0, int64_t n_valid,
          int64_t cols, float* s, int64_t ld) {
  const int64_t lo = pb.first(r0 + rows - 1), hi = pb.last(b, r0);  // what every row sees
  if (lo <= c0 && hi >= c0 + cols && n_valid == cols) return;
  const float neg_inf = -__builtin_inff();
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t a = std::max<int64_t>(pb.first(r0 + i) - c0, 0);
    const int64_t z = std::clamp<int64_t>(pb.last(b, r0 + i) - c0, 0, n_valid);
    float* row = s + i * ld;
    if (z <= a) {
      std::fill(row, row + cols, neg_inf);
      continue;
    }
    std::fill(row, row + a, neg_inf);
    std::fill(row + z, row + cols, neg_inf);
  }
}

// ---------------------------------------------------------------- threads

// Runs f(0) .. f(n - 1) on the calling thread and the pool's: each participant takes
// the next index until none is left, so the caller finishes alone if the pool is busy.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& f) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &f]() {
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= n) return;
      f(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

// ---------------------------------------------------------------- scratch

// Scratch memory that the calling thread keeps between calls, up to kKeptScratch
// floats a slot: a training step's calls reuse the same pages.  Freed each time, the
// allocator hands large blocks back to the operating system and every call faults them
// in again, which cost a third of the time of some calls at short sequences.  Larger
// requests (from S = 16384 at head width 64) get memory of their own, freed on return:
// their work dwarfs the faults, and each of XLA's threads keeping tens of MiB did not
// pay (at S = 32768 the process grew by 0.73 GiB instead of 0.47).
constexpr size_t kKeptScratch = size_t{4} << 20;  // floats: 16 MiB

// Slots: 0 and 1, the forward's packed K and V (held by the calling thread for a whole
// call); 2, a forward task's own working memory.
class Scratch {
 public:
  Scratch(int slot, size_t n) {
    thread_local std::unique_ptr<float[]> kept[3];
    thread_local size_t kept_size[3] = {0, 0, 0};
    if (n > kKeptScratch) {
      own_.reset(new float[n]);
      data_ = own_.get();
      return;
    }
    if (kept_size[slot] < n) {
      kept[slot].reset(new float[n]);
      kept_size[slot] = n;
    }
    data_ = kept[slot].get();
  }
  float* get() const { return data_; }

 private:
  std::unique_ptr<float[]> own_;
  float* data_;
};

// ---------------------------------------------------------------- forward

constexpr int64_t kFwdRows = 96;   // query rows of a forward block
constexpr int64_t kFwdKeys = 512;  // keys of a forward tile, at most

int64_t tiles_of(int64_t n, int64_t size) { return (n + size - 1) / size; }

// The keys and values of every (batch, key/value head), laid out for the forward's
// products: K transposed a tile at a time (tile t of head u is the (D, keys) block at
// kt + (u * tiles + t) * D * ld) and V with rows of whole vectors (head u at
// vp + u * tiles * keys * Dvp), both zero past the example's length.  V is read where it
// lies instead (rows ldv = Hkv * Dv floats apart) when that is the same: every example at
// full length, and S and Dv whole vectors, so that the products read no key past S and
// no padding, and a head's values span at most kInPlaceSpan bytes of memory.  Copying
// them cost a tenth of the forward at B32 H4 S128; but a head's rows read in place are
// spread over S * Hkv * Dv floats, and past the reach of the TLB the reads of every tile
// wait on page walks: the kernel's forward at B1 H4 S32768 took 3.06-3.10 s reading V in
// place against 2.86-2.96 copying it, at S16384 0.72-0.75 against 0.71-0.72 (level at
// B1 H8 S4096, 8 MiB, and below).
constexpr int64_t kInPlaceSpan = int64_t{8} << 20;

struct PackedKV {
  int64_t keys, ld, tiles, Dvp;
  bool v_in_place;
  int64_t ldv;
  const float* v;
  Scratch kt, vp;

  static bool reads_v_in_place(const Problem& pb) {
    if (pb.kv_len % kLanes != 0 || pb.v_width % kLanes != 0) return false;
    if (pb.kv_len * pb.kv_heads * pb.v_width * int64_t{sizeof(float)} > kInPlaceSpan) return false;
    for (int64_t b = 0; b < pb.batch; ++b)
      if (pb.length(b) < pb.kv_len) return false;
    return true;
  }

  PackedKV(const Problem& pb, ffi::ThreadPool& pool, const float* k, const float* v_)
      : keys(std::min(kFwdKeys, round_up(pb.kv_len, kLanes))),
        // a leading dimension that is not a multiple of 64 floats, so that the rows of a
        // tile do not all fall into the same cache sets
        ld(keys + kLanes),
        tiles(tiles_of(pb.kv_len, keys)),
        Dvp(round_up(pb.v_width, kLanes)),
        v_in_place(reads_v_in_place(pb)),
        ldv(v_in_place ? pb.kv_heads * pb.v_width : Dvp),
        v(v_),
        kt(0, pb.batch * pb.kv_heads * tiles * pb.width * ld),
        vp(1, v_in_place ? 0 : pb.batch * pb.kv_heads * tiles * keys * Dvp) {
    const int64_t D = pb.width, Dv = pb.v_width;
    parallel_for(pool, pb.batch * pb.kv_heads, [&](int64_t u) {
      const int64_t b = u / pb.kv_heads, hk = u % pb.kv_heads;
      for (int64_t t = 0; t < tiles; ++t) {
        // Keys past the example's length are never read: zeros in their place.
        const int64_t c0 = t * keys, n = std::clamp<int64_t>(pb.length(b) - c0, 0, keys);
        float* dst = kt_of(u, t, D);
        transpose(n, D, k + pb.kv_row(b, hk, c0) * D, pb.kv_heads * D, dst, ld);
        for (int64_t d = 0; d < D; ++d) std::fill(dst + d * ld + n, dst + (d + 1) * ld, 0.0f);
        if (!v_in_place) pack(n, Dv, v + pb.kv_row(b, hk, c0) * Dv, pb.kv_heads * Dv, vp_of(u, t), Dvp, keys);
      }
    });
  }
  float* kt_of(int64_t u, int64_t t, int64_t D) const { return kt.get() + (u * tiles + t) * D * ld; }
  float* vp_of(int64_t u, int64_t t) const { return vp.get() + (u * tiles + t) * keys * Dvp; }
  // Tile t of (b, hk)'s values: rows ldv floats apart.
  const float* v_of(const Problem& pb, int64_t b, int64_t hk, int64_t t) const {
    return v_in_place ? v + pb.kv_row(b, hk, t * keys) * pb.v_width : vp_of(b * pb.kv_heads + hk, t);
  }
};

struct ForwardArgs {
  const float* q;
  const PackedKV* kv;
  float *out, *row_max, *row_sum;
};

void forward_block(const Problem& pb, const ForwardArgs& a, int64_t b, int64_t h, int64_t r0) {
  const int64_t D = pb.width, Dv = pb.v_width, Dvp = a.kv->Dvp, keys = a.kv->keys;
  const int64_t rows = std::min(kFwdRows, pb.q_len - r0);
  const int64_t unit = b * pb.kv_heads + h / pb.group(), head = b * pb.heads + h;
  const float scale = pb.scale, neg_inf = -__builtin_inff();
  // This thread's working memory, kept between tasks: the block's queries, one tile's
  // scores, the weighted sum of values, and the rows' running maxima and sums.
  const int64_t q_size = round_up(rows * D, kLanes), s_size = round_up(rows * keys, kLanes);
  const int64_t acc_size = rows * Dvp, ml_size = round_up(rows, kLanes);
  const Scratch work(2, q_size + s_size + acc_size + 2 * ml_size);
  float* const Q = work.get();
  float* const s = Q + q_size;  // written whole by each tile's q k^T before it is read
  float* const acc = s + s_size;
  float* const m = acc + acc_size;
  float* const l = m + ml_size;
  std::fill(acc, acc + acc_size, 0.0f);
  std::fill(m, m + rows, neg_inf);
  std::fill(l, l + rows, 0.0f);
  // The block's queries, copied out of the (B, T, H, D) array: read in place, rows H * D
  // floats apart (1 KiB at H4 D64) fall into a quarter of the L1 cache's sets, and each
  // tile's product reads them again from further out.
  pack(rows, D, a.q + pb.q_row(b, h, r0) * D, pb.heads * D, Q, D, rows);
  const int64_t ldq = D;

  const int64_t lo = pb.first(r0), hi = pb.last(b, r0 + rows - 1);
  for (int64_t t = lo / keys; t * keys < hi; ++t) {
    // Keys [c0, c0 + n) of the tile, up to the last that a row of the block sees.
    const int64_t c0 = t * keys, n = std::min(keys, hi - c0), cols = round_up(n, kLanes);
    gemm(rows, cols, D, Q, ldq, a.kv->kt_of(unit, t, D), a.kv->ld, s, cols, false);  // q k^T
    hide(pb, b, r0, rows, c0, n, cols, s, cols);
    for (int64_t i = 0; i < rows; ++i) {
      float* row = s + i * cols;
      vf mx = splat(neg_inf);
      for (int64_t c = 0; c < cols; c += kLanes) {
        const vf x = load(row + c);
        mx = x > mx ? x : mx;
      }
      float tile_max = mx[0];
      for (int j = 1; j < kLanes; ++j) tile_max = std::max(tile_max, mx[j]);
      const float m_new = std::max(m[i], tile_max);
      if (m_new == neg_inf) {  // nothing seen yet: zero weights
        std::fill(row, row + cols, 0.0f);
        continue;
      }
      vf sum = vf{};
      for (int64_t c = 0; c < cols; c += kLanes) {
        const vf p = exp_nonpositive((load(row + c) - m_new) * scale);
        store(row + c, p);
        sum += p;
      }
      const float tile_sum = sum_lanes(sum);
      if (m[i] != m_new) {  // the maximum grew: rescale what was summed so far
        const float rescale = m[i] == neg_inf ? 0.0f : exp_nonpositive(splat((m[i] - m_new) * scale))[0];
        l[i] *= rescale;
        float* o = acc + i * Dvp;
        for (int64_t c = 0; c < Dvp; c += kLanes) store(o + c, load(o + c) * rescale);
        m[i] = m_new;
      }
      l[i] += tile_sum;
    }
    gemm(rows, Dvp, cols, s, cols, a.kv->v_of(pb, b, h / pb.group(), t), a.kv->ldv, acc, Dvp, true);  // p v
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* O = a.out + pb.q_row(b, h, r0 + i) * Dv;
    for (int64_t c = 0; c < Dv; ++c) O[c] = l[i] == 0.0f ? 0.0f : acc[i * Dvp + c] / l[i];
    a.row_max[head * pb.q_len + r0 + i] = l[i] == 0.0f ? 0.0f : m[i];
    a.row_sum[head * pb.q_len + r0 + i] = l[i];
  }
}

bool consistent(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                const ffi::Buffer<ffi::S32>& lengths) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  return qd.size() == 4 && kd.size() == 4 && vd.size() == 4 && kd[0] == qd[0] && vd[0] == qd[0] &&
         kd[2] == vd[2] && kd[2] > 0 && qd[2] % kd[2] == 0 && kd[1] == vd[1] && kd[3] == qd[3] &&
         lengths.element_count() == static_cast<size_t>(qd[0]);
}

Problem problem(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                const ffi::Buffer<ffi::S32>& lengths, float scale, int64_t offset, int64_t left, int64_t right) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  return Problem{qd[0], qd[2], kd[2], qd[1], kd[1], qd[3], vd[3], scale, offset, left, right, lengths.typed_data()};
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, float scale, int64_t offset,
                   int64_t left, int64_t right, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> row_max, ffi::ResultBuffer<ffi::F32> row_sum) {
  if (!consistent(q, k, v, lengths)) return ffi::Error::InvalidArgument("twin_attention_flash_fwd: inconsistent shapes");
  const Problem pb = problem(q, k, v, lengths, scale, offset, left, right);
  const PackedKV kv(pb, pool, k.typed_data(), v.typed_data());
  const ForwardArgs args{q.typed_data(), &kv, out->typed_data(), row_max->typed_data(), row_sum->typed_data()};
  const int64_t blocks = tiles_of(pb.q_len, kFwdRows);
  // Later blocks first: under a causal mask they see the most keys.
  parallel_for(pool, pb.batch * pb.heads * blocks, [&](int64_t i) {
    const int64_t head = i / blocks;
    forward_block(pb, args, head / pb.heads, head % pb.heads, (blocks - 1 - i % blocks) * kFwdRows);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- backward
//
// Everything is computed transposed, keys as rows: S^T = K Q^T, P^T, dP^T = V dO^T and
// dS^T, so that dV += P^T dO, dK += dS^T Q and dQ^T += K^T dS^T are products of
// row-major operands with no transpose inside the loops.  Queries are taken in blocks
// of kBwdRows (a multiple of 16: the vector width of those products), keys in tiles.

constexpr int64_t kBwdRows = 64;   // query rows of a backward block
// Keys of a backward tile: 128, or 64 up to 512 keys.  At short lengths the causal
// diagonal is a large share of the work, and a (128 keys x 64 queries) tile on it computes
// twice what its rows see: forward + backward at B32 H4 S128 took 13.5 ms with 64 against
// 15.4-21.7 with 128, at B8 H8 S512 55.9 against 59.4; at S = 1024, 128 was ahead (99 / 102).
constexpr int64_t kBwdKeys = 128, kBwdShortKeys = 64, kShortKeys = 512;
int64_t backward_keys(const Problem& pb) { return pb.kv_len <= kShortKeys ? kBwdShortKeys : kBwdKeys; }

struct BackwardArgs {
  const float *q, *k, *v, *out, *d_out, *row_max, *row_sum;
  float *dq, *dk, *dv;
  float* dq_parts;  // (chunks, B, T, H, D) when a unit's key tiles are split, else null
  int64_t chunks;
};

// One query head's operands, padded to whole blocks: rows past T have 1 / l = 0 (hidden).
struct HeadOperands {
  std::vector<float> q, qt, d_out, d_out_t, m, inv_l, delta, dqt;
};

void prepare_head(const Problem& pb, const BackwardArgs& a, int64_t b, int64_t h, HeadOperands& op) {
  const int64_t D = pb.width, Dv = pb.v_width, Dp = round_up(D, kLanes), Dvp = round_up(Dv, kLanes);
  const int64_t T = pb.q_len, R = kBwdRows, Tp = round_up(T, R), blocks = Tp / R, head = b * pb.heads + h;
  const int64_t ldq = pb.heads * D, ldo = pb.heads * Dv;
  const float* Q = a.q + pb.q_row(b, h, 0) * D;
  const float* dO = a.d_out + pb.q_row(b, h, 0) * Dv;
  const float* O = a.out + pb.q_row(b, h, 0) * Dv;
  op.q.resize(Tp * Dp);
  op.d_out.resize(Tp * Dvp);
  pack(T, D, Q, ldq, op.q.data(), Dp, Tp);
  pack(T, Dv, dO, ldo, op.d_out.data(), Dvp, Tp);
  op.qt.assign(blocks * D * R, 0.0f);  // block i: (D, R) at i * D * R
  op.d_out_t.assign(blocks * Dv * R, 0.0f);
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t rows = std::min(R, T - i * R);
    transpose(rows, D, op.q.data() + i * R * Dp, Dp, op.qt.data() + i * D * R, R);
    transpose(rows, Dv, op.d_out.data() + i * R * Dvp, Dvp, op.d_out_t.data() + i * Dv * R, R);
  }
  op.m.assign(Tp, 0.0f);
  op.inv_l.assign(Tp, 0.0f);  // 0 for a row with nothing to attend to, and past T: zero weights
  op.delta.assign(Tp, 0.0f);
  std::copy(a.row_max + head * T, a.row_max + (head + 1) * T, op.m.begin());
  for (int64_t r = 0; r < T; ++r) {
    const float l = a.row_sum[head * T + r];
    op.inv_l[r] = l == 0.0f ? 0.0f : 1.0f / l;
  }
  // delta = rowsum(dO * O): dO from its packed copy, whole vectors, then the rest.
  const int64_t whole = Dv / kLanes * kLanes;
  for (int64_t r = 0; r < T; ++r) {
    const float* dor = op.d_out.data() + r * Dvp;
    const float* orow = O + r * ldo;
    vf acc{};
    for (int64_t c = 0; c < whole; c += kLanes) acc += load(dor + c) * load(orow + c);
    float sum = sum_lanes(acc);
    for (int64_t c = whole; c < Dv; ++c) sum += dor[c] * orow[c];
    op.delta[r] = sum;
  }
  op.dqt.assign(blocks * D * R, 0.0f);
}

// The key tiles t = chunk, chunk + chunks, ... of key/value head (b, hk): dK and dV of
// those tiles, and their share of dQ for the group's query heads.  (next_b, next_hk): the
// unit to prefetch for, or next_b < 0.
void backward_unit(const Problem& pb, const BackwardArgs& a, int64_t b, int64_t hk, int64_t chunk,
                   int64_t next_b, int64_t next_hk) {
  const int64_t D = pb.width, Dv = pb.v_width, Dp = round_up(D, kLanes), Dvp = round_up(Dv, kLanes);
  const int64_t T = pb.q_len, G = pb.group(), R = kBwdRows, blocks = tiles_of(T, R);
  const int64_t len = pb.length(b), ldk = pb.kv_heads * D, ldv = pb.kv_heads * Dv;
  const int64_t keys = backward_keys(pb);
  // The operands of the unit that this thread will most likely take next (q, dO and O of
  // its query heads, its first two key tiles), fetched into L2 while this one computes:
  // their first reads (the copies of q, dO, k and v, delta's pass over O) otherwise wait
  // on memory, a fifth of the backward's time at B32 H4 S128.
  twin_gemm::detail::Prefetcher<2> ahead;
  if (next_b >= 0) {
    // The group's query heads are side by side in a row: G * D floats of q, G * Dv of dO and O.
    ahead.add(a.q + pb.q_row(next_b, next_hk * G, 0) * D, T, pb.heads * D, G * D);
    ahead.add(a.d_out + pb.q_row(next_b, next_hk * G, 0) * Dv, T, pb.heads * Dv, G * Dv);
    ahead.add(a.out + pb.q_row(next_b, next_hk * G, 0) * Dv, T, pb.heads * Dv, G * Dv);
    const int64_t rows = std::min(pb.length(next_b), 2 * keys);  // its first two key tiles
    ahead.add(a.k + pb.kv_row(next_b, next_hk, 0) * D, rows, ldk, D);
    ahead.add(a.v + pb.kv_row(next_b, next_hk, 0) * Dv, rows, ldv, Dv);
    ahead.start(blocks * tiles_of(len, keys) * G / 2);  // about the (tile, block, head) steps below
  }
  std::vector<HeadOperands> heads(G);
  for (int64_t j = 0; j < G; ++j) prepare_head(pb, a, b, hk * G + j, heads[j]);

  std::vector<float> kp(keys * D), vp(keys * Dv), kt(D * keys);
  std::vector<float> pt(keys * R), dst(keys * R), dk(keys * Dp), dv(keys * Dvp);
  const float scale = pb.scale;
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t t = chunk; t * keys < len; t += a.chunks) {
    const int64_t c0 = t * keys, n = std::min(keys, len - c0);
    pack(n, D, a.k + pb.kv_row(b, hk, c0) * D, ldk, kp.data(), D, n);  // (n, D)
    pack(n, Dv, a.v + pb.kv_row(b, hk, c0) * Dv, ldv, vp.data(), Dv, n);
    transpose(n, D, kp.data(), D, kt.data(), keys);  // (D, n)
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t r0 = i * R, rows = std::min(R, T - r0);
      if (pb.first(r0) >= c0 + n || pb.last(b, r0 + rows - 1) <= c0) continue;  // no row sees the tile
      const bool edge = !(pb.first(r0 + rows - 1) <= c0 && pb.last(b, r0) >= c0 + n);
      for (int64_t j = 0; j < G; ++j) {
        HeadOperands& op = heads[j];
        gemm(n, R, D, kp.data(), D, op.qt.data() + i * D * R, R, pt.data(), R, false);          // s^T = k q^T
        gemm(n, R, Dv, vp.data(), Dv, op.d_out_t.data() + i * Dv * R, R, dst.data(), R, false);  // dp^T = v do^T
        for (int64_t c = 0; c < n; ++c) {
          // Rows [first, last) of the block see key c0 + c.
          int64_t first = 0, last = R;
          if (edge) {
            const int64_t key = c0 + c;
            if (pb.right >= 0) first = std::max<int64_t>(first, key - pb.offset - pb.right - r0);
            if (pb.left >= 0) last = std::min<int64_t>(last, key - pb.offset + pb.left + 1 - r0);
          }
          float* pr = pt.data() + c * R;
          float* dr = dst.data() + c * R;
          for (int64_t r = 0; r < R; r += kLanes) {
            const vi seen = (lane + static_cast<int32_t>(r) >= static_cast<int32_t>(first)) &
                            (lane + static_cast<int32_t>(r) < static_cast<int32_t>(last));
            const vf p = exp_nonpositive((load(pr + r) - load(op.m.data() + r0 + r)) * scale) *
                         load(op.inv_l.data() + r0 + r);
            const vf w = seen ? p : vf{};
            store(pr + r, w);
            store(dr + r, w * (load(dr + r) - load(op.delta.data() + r0 + r)) * scale);
          }
        }
        gemm(n, Dvp, R, pt.data(), R, op.d_out.data() + r0 * Dvp, Dvp, dv.data(), Dvp, true);  // dv += p^T do
        gemm(n, Dp, R, dst.data(), R, op.q.data() + r0 * Dp, Dp, dk.data(), Dp, true);        // dk += ds^T q
        gemm(D, R, n, kt.data(), keys, dst.data(), R, op.dqt.data() + i * D * R, R, true);  // dq^T += k^T ds^T
        ahead.step();
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(a.dk + pb.kv_row(b, hk, c0 + r) * D, dk.data() + r * Dp, D * sizeof(float));
      std::memcpy(a.dv + pb.kv_row(b, hk, c0 + r) * Dv, dv.data() + r * Dvp, Dv * sizeof(float));
    }
  }
  ahead.finish();
  float* dq = a.dq_parts ? a.dq_parts + chunk * pb.batch * T * pb.heads * D : a.dq;
  for (int64_t j = 0; j < G; ++j)
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t rows = std::min(R, T - i * R);
      transpose(D, rows, heads[j].dqt.data() + i * D * R, R, dq + pb.q_row(b, hk * G + j, i * R) * D, pb.heads * D);
    }
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> out,
                    ffi::Buffer<ffi::F32> d_out, ffi::Buffer<ffi::F32> row_max, ffi::Buffer<ffi::F32> row_sum,
                    float scale, int64_t offset, int64_t left, int64_t right, ffi::ResultBuffer<ffi::F32> dq,
                    ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv) {
  if (!consistent(q, k, v, lengths)) return ffi::Error::InvalidArgument("twin_attention_flash_bwd: inconsistent shapes");
  const Problem pb = problem(q, k, v, lengths, scale, offset, left, right);
  // Keys past a length get zero gradients; the tiles write the rest.
  for (int64_t b = 0; b < pb.batch; ++b) {
    const int64_t from = pb.kv_row(b, 0, pb.length(b)), to = pb.kv_row(b + 1, 0, 0);
    std::fill(dk->typed_data() + from * pb.width, dk->typed_data() + to * pb.width, 0.0f);
    std::fill(dv->typed_data() + from * pb.v_width, dv->typed_data() + to * pb.v_width, 0.0f);
  }
  const int64_t units = pb.batch * pb.kv_heads;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Too few (batch, kv head) units for the threads: each unit's key tiles are dealt
  // round-robin to parts, each with a dQ of its own, summed at the end.
  const int64_t chunks = units >= threads ? 1 : tiles_of(threads, units);
  const int64_t size = pb.batch * pb.heads * pb.q_len * pb.width;
  std::vector<float> parts(chunks > 1 ? chunks * size : 0);
  const BackwardArgs args{q.typed_data(), k.typed_data(), v.typed_data(), out.typed_data(), d_out.typed_data(),
                          row_max.typed_data(), row_sum.typed_data(), dq->typed_data(), dk->typed_data(),
                          dv->typed_data(), chunks > 1 ? parts.data() : nullptr, chunks};
  parallel_for(pool, units * chunks, [&](int64_t i) {
    const int64_t unit = i / chunks;
    // Work is dealt in order, so a thread's next unit is likely `threads` units on.
    const int64_t next = chunks == 1 && unit + threads < units ? unit + threads : -1;
    backward_unit(pb, args, unit / pb.kv_heads, unit % pb.kv_heads, i % chunks,
                  next < 0 ? -1 : next / pb.kv_heads, next < 0 ? -1 : next % pb.kv_heads);
  });
  if (chunks > 1) {
    float* total = dq->typed_data();
    std::copy(parts.begin(), parts.begin() + size, total);
    for (int64_t part = 1; part < chunks; ++part)
      for (int64_t e = 0; e < size; ++e) total[e] += parts[part * size + e];
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- projections

// c = op(a) op(b), op(x) = x or x^T: a projection x W (NN) and its gradients dy W^T (NT)
// and x^T dy (TN), on gemm.h's packed, register-tiled product.
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, bool trans_a,
                  bool trans_b, ffi::ResultBuffer<ffi::F32> c) {
  const auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error::InvalidArgument("twin_attention_matmul: operands must be matrices");
  const int64_t M = trans_a ? ad[1] : ad[0], K = trans_a ? ad[0] : ad[1], N = trans_b ? bd[0] : bd[1];
  if ((trans_b ? bd[1] : bd[0]) != K || cd[0] != M || cd[1] != N)
    return ffi::Error::InvalidArgument("twin_attention_matmul: inconsistent shapes");
  auto run = [&pool](int64_t n, auto&& f) { parallel_for(pool, n, f); };
  twin_gemm::sgemm(run, trans_a, trans_b, M, N, K, a.typed_data(), ad[1], b.typed_data(), bd[1], c->typed_data(), N);
  return ffi::Error::Success();
}

}  // namespace

// The instruction set this library was compiled for, from the compiler's own macros (the
// -march in effect, native or $TWIN_ATTENTION_MARCH): the kernel is tuned for AVX-512, and
// jax_attention's "auto" takes it only there (_cpu_kernel.auto_declines).
extern "C" const char* TwinAttentionInstructionSet() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__)
  return "AVX2";
#elif defined(__AVX__)
  return "AVX";
#elif defined(__SSE2__)
  return "SSE2";
#elif defined(__ARM_NEON)
  return "NEON";
#else
  return "generic";
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(TwinAttentionMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a (M, K), or (K, M) with trans_a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b (K, N), or (N, K) with trans_b
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // c (M, N)

XLA_FFI_DEFINE_HANDLER_SYMBOL(TwinAttentionFlashFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (B, S, Hkv, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v (B, S, Hkv, Dv)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths (B,)
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // row_max
                                  .Ret<ffi::Buffer<ffi::F32>>());  // row_sum

XLA_FFI_DEFINE_HANDLER_SYMBOL(TwinAttentionFlashBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::F32>>()  // out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d_out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row_max
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row_sum
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dv
