// FlashAttention for XLA's CPU backend, forward and backward, and a float32 matrix
// product, as XLA FFI handlers: the one translation unit of the kernel's library.
//
// Built on first use by jax_attention/_cpu_kernel.py with the machine's C++ compiler
// (-O3 -march=native) and registered as the custom-call targets
// "twin_attention_flash_fwd", "twin_attention_flash_bwd", "twin_attention_decode_fwd"
// and "twin_attention_matmul".
//
//   vec.h        vector types and helpers (GCC vector extensions), exp
//   scratch.h    working memory: per-thread buffers kept between calls
//   gemm.h       the matrix products: in place on cached tiles, and packed in parallel
//   attention.h  the problem's geometry, masking, operand checks, the parallel loop
//   online_softmax.h  the forwards' online softmax: a tile's weights, a finished row
//   forward.h    the forward handler
//   decode.h     the forward of few query rows (a decode step), keys read in place
//   backward.h   the backward handler
//   this file    the projections' handler and the FFI registrations

#include <cstdint>

#include "attention.h"
#include "backward.h"
#include "decode.h"
#include "forward.h"
#include "gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace twin {

// c = op(a) op(b), op(x) = x or x^T: a projection x W (NN) and its gradients dy W^T (NT)
// and x^T dy (TN), on gemm.h's packed, parallel product.
static ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, bool trans_a,
                         bool trans_b, ffi::ResultBuffer<ffi::F32> c) {
  const auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error::InvalidArgument("twin_attention_matmul: operands must be matrices");
  const int64_t M = trans_a ? ad[1] : ad[0], K = trans_a ? ad[0] : ad[1], N = trans_b ? bd[0] : bd[1];
  if ((trans_b ? bd[1] : bd[0]) != K || cd[0] != M || cd[1] != N)
    return ffi::Error::InvalidArgument("twin_attention_matmul: inconsistent shapes");
  auto run = [&pool](int64_t n, auto&& f) { parallel_for(pool, n, f); };
  sgemm(run, trans_a, trans_b, M, N, K, a.typed_data(), ad[1], b.typed_data(), bd[1], c->typed_data(), N);
  return ffi::Error::Success();
}

}  // namespace twin

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(TwinAttentionMatmul, twin::Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a (M, K), or (K, M) with trans_a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b (K, N), or (N, K) with trans_b
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // c (M, N)

XLA_FFI_DEFINE_HANDLER_SYMBOL(TwinAttentionFlashFwd, twin::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (B, S, Hkv, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v (B, S, Hkv, Dv)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths (B,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks (H,), or (0,): none
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // row_max
                                  .Ret<ffi::Buffer<ffi::F32>>());  // row_sum

XLA_FFI_DEFINE_HANDLER_SYMBOL(TwinAttentionDecodeFwd, twin::Decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, D), or (B, H, T, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (B, S, Hkv, D), or (B, Hkv, S, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v (B, S, Hkv, Dv), or (B, Hkv, S, Dv)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths (B,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks (H,), or (0,): none
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Attr<bool>("heads_first")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out, in q's layout
                                  .Ret<ffi::Buffer<ffi::F32>>()  // row_max (B, H, T)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // row_sum (B, H, T)

XLA_FFI_DEFINE_HANDLER_SYMBOL(TwinAttentionFlashBwd, twin::Backward,
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
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks (H,), or (0,): none
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("left")
                                  .Attr<int64_t>("right")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dsinks, the shape of sinks
