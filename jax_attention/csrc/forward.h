// The forward: out = softmax(q k^T) v a block of query rows at a time, and each row's
// maximum and sum for the backward.
//
// The math is that of jax_attention.functional's blockwise path: float32 throughout,
// scores never stored beyond one (rows x keys) tile, and the online softmax of
// online_softmax.h.  Work is shared by (batch, head, query block).  Attention sinks join
// each row's normaliser once its keys are summed (finish_row).
#pragma once
#include <algorithm>
#include <cstdint>

#include "attention.h"
#include "gemm.h"
#include "online_softmax.h"
#include "scratch.h"
#include "vec.h"

namespace twin {

constexpr int64_t kFwdRows = 96;   // query rows of a forward block
constexpr int64_t kFwdKeys = 512;  // keys of a forward tile, at most

// The keys and values of every (batch, key/value head), laid out for the forward's
// products: K transposed a tile at a time (tile t of head u is the (D, keys) block at
// kt + (u * tiles + t) * D * ld) and V with rows of whole vectors (head u at
// vp + u * tiles * keys * Dvp), both zero past the example's length.  V is read where it
// lies instead (rows ldv = Hkv * Dv floats apart) when that is the same: every example at
// full length, and S and Dv whole vectors, so that the products read no key past S and
// no padding, and a head's values span at most kInPlaceSpan bytes of memory.  The copy
// is a noticeable share of a short forward; but a head's rows read in place are spread
// over S * Hkv * Dv floats, and past the reach of the TLB the reads of every tile wait
// on page walks, so long sequences copy.
constexpr int64_t kInPlaceSpan = int64_t{8} << 20;

struct PackedKV {
  int64_t keys, ld, tiles, Dvp;
  bool v_in_place;
  int64_t ldv;
  const float* v;
  Scratch kt, vp;

  static bool reads_v_in_place(const Problem& pb) {
    if (pb.kv_len % kPad != 0 || pb.v_width % kPad != 0) return false;
    if (pb.kv_len * pb.kv_heads * pb.v_width * int64_t{sizeof(float)} > kInPlaceSpan) return false;
    for (int64_t b = 0; b < pb.batch; ++b)
      if (pb.length(b) < pb.kv_len) return false;
    return true;
  }

  PackedKV(const Problem& pb, ffi::ThreadPool& pool, const float* k, const float* v_)
      : keys(std::min(kFwdKeys, round_up(pb.kv_len, kPad))),
        // a leading dimension that is not a multiple of 64 floats, so that the rows of a
        // tile do not all fall into the same cache sets
        ld(keys + kPad),
        tiles(tiles_of(pb.kv_len, keys)),
        Dvp(round_up(pb.v_width, kPad)),
        v_in_place(reads_v_in_place(pb)),
        ldv(v_in_place ? pb.kv_heads * pb.v_width : Dvp),
        v(v_),
        kt(kForwardK, pb.batch * pb.kv_heads * tiles * pb.width * ld),
        vp(kForwardV, v_in_place ? 0 : pb.batch * pb.kv_heads * tiles * keys * Dvp) {
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

static void forward_block(const Problem& pb, const ForwardArgs& a, int64_t b, int64_t h, int64_t r0) {
  const int64_t D = pb.width, Dv = pb.v_width, Dvp = a.kv->Dvp, keys = a.kv->keys;
  const int64_t rows = std::min(kFwdRows, pb.q_len - r0);
  const int64_t unit = b * pb.kv_heads + h / pb.group(), head = b * pb.heads + h;
  const float scale = pb.scale, neg_inf = -__builtin_inff();
  // This thread's working memory, kept between tasks: the block's queries, one tile's
  // scores, the weighted sum of values, and the rows' running maxima and sums.
  const int64_t q_size = round_up(rows * D, kPad), s_size = round_up(rows * keys, kPad);
  const int64_t acc_size = rows * Dvp, ml_size = round_up(rows, kPad);
  const Scratch work(kForwardBlock, q_size + s_size + acc_size + 2 * ml_size);
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
    const int64_t c0 = t * keys, n = std::min(keys, hi - c0), cols = round_up(n, kPad);
    gemm(rows, cols, D, Q, ldq, a.kv->kt_of(unit, t, D), a.kv->ld, s, cols, false);  // q k^T
    hide(pb, b, r0, rows, c0, n, cols, s, cols);
    softmax_tile(rows, cols, scale, s, m, l, acc, Dvp);
    gemm(rows, Dvp, cols, s, cols, a.kv->v_of(pb, b, h / pb.group(), t), a.kv->ldv, acc, Dvp, true);  // p v
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t stat = head * pb.q_len + r0 + i;
    finish_row(pb, h, acc + i * Dvp, m[i], l[i], a.out + pb.q_row(b, h, r0 + i) * Dv, a.row_max + stat,
               a.row_sum + stat);
  }
}

static ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> sinks,
                          float scale, int64_t offset, int64_t left, int64_t right, ffi::ResultBuffer<ffi::F32> out,
                          ffi::ResultBuffer<ffi::F32> row_max, ffi::ResultBuffer<ffi::F32> row_sum) {
  if (!consistent(q, k, v, lengths, sinks))
    return ffi::Error::InvalidArgument("twin_attention_flash_fwd: inconsistent shapes");
  const Problem pb = problem(q, k, v, lengths, sinks, scale, offset, left, right);
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

}  // namespace twin
