"""The fused path on GPU and TPU (and XLA's kernel on CPU where the library's own cannot
take a call): ``jax.nn.dot_product_attention`` (XLA's kernel, cuDNN) and Pallas splash
attention, with this library's fully-masked-row policy.  ``kernel_for`` names the kernel
that ``functional.route`` reports and ``attend`` runs.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import Array

from jax_attention._canonical import bias_allows, expand_to, length_mask
from jax_attention._reference import Precision
from jax_attention.masks import _and_masks as combine_masks
from jax_attention.masks import causal_mask


def kernel_for(q: Any, k: Any, v: Any, *, plain: bool) -> str:
    """The kernel of the fused path for these inputs: ``"splash"`` on TPU where the
    shapes suit it and no dense mask, bias or lengths reach the kernel (``plain``),
    ``"cudnn"`` where ``cudnn_supports`` says so, else ``"xla"``; judged at the common
    width that ``attend`` pads q, k and v to."""
    width = max(q.shape[-1], v.shape[-1])
    q, k, v = (jax.ShapeDtypeStruct((*t.shape[:-1], width), t.dtype) for t in (q, k, v))
    if (jax.default_backend() == "tpu" and plain and k.shape[-3:-2] == q.shape[-3:-2]
            and splash_supports(q, k, v)):
        return "splash"
    return "cudnn" if cudnn_supports(q, k, v) else "xla"


def bthd(t: Array, batch: int) -> Array:
    """(..., H, T, D) -> (B, T, H, D), the leading dimensions flattened into ``batch``
    (unbatched (T, D): one head): the layout of the fused kernels.  k and v may have
    fewer heads than q."""
    return jnp.swapaxes(t.reshape(batch, t.shape[-3] if t.ndim >= 3 else 1, *t.shape[-2:]), 1, 2)


def attend(
    q: Array, k: Array, v: Array, *, mask: Array | None, causal: bool, kv_lengths: Array | None,
    scale: float, precision: Precision, kernel: str, bias: Array | None = None, layout: str = "bhsd",
) -> Array:
    """``jax.nn.dot_product_attention`` on (..., H, T, D) inputs, or (..., T, H, D) ones with
    ``layout="bshd"`` (the kernel's own layout: passed as they are, the output in it too),
    with this library's fully-masked-row policy (zeros, finite gradients) and
    causal/padding passed to the kernel as ``is_causal`` / sequence lengths rather than
    dense masks.  ``mask`` and ``bias`` are (..., H, T, S) in either layout.

    ``kernel`` (``"splash"``, ``"cudnn"`` or ``"xla"``) is ``functional.route``'s, from
    ``kernel_for``: cuDNN where ``cudnn_supports`` says it can, XLA's kernel elsewhere.  The
    XLA kernel gets float32 inputs with the scale folded into q (its
    ``logits * scale`` fuses into the softmax's subtraction: NaN for logits of 1e10, and
    its float16 matmul does not compile on CPU under jit); cuDNN gets half precision as
    it is.  A value width Dv != D is zero-padded to a common width and the output
    sliced: zero columns change neither the scores nor the other output columns."""
    tokens_first = layout == "bshd"
    if kernel == "splash" and tokens_first:  # splash takes (H, T, D): once in, once out
        out = attend(*(jnp.swapaxes(t, -3, -2) for t in (q, k, v)), mask=mask, causal=causal,
                     kv_lengths=kv_lengths, scale=scale, precision=precision, kernel=kernel, bias=bias)
        return jnp.swapaxes(out, -3, -2)
    width, v_width = q.shape[-1], v.shape[-1]
    if v_width < width:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, width - v_width)])
    elif v_width > width:
        pad = [(0, 0)] * (q.ndim - 1) + [(0, v_width - width)]
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    if tokens_first:  # (..., T, H, D): the kernel's layout, the leading dimensions flattened
        heads, q_len, kv_len, lead = q.shape[-2], q.shape[-3], k.shape[-3], (*q.shape[:-3], q.shape[-2])
    else:
        heads, q_len, kv_len, lead = q.shape[-3] if q.ndim >= 3 else 1, q.shape[-2], k.shape[-2], q.shape[:-2]
    batch = math.prod(q.shape[:-3])
    dense, live = _dense_mask(mask, causal, kv_lengths, lead, q_len, kv_len, q.ndim)
    dense = None if dense is None else dense.reshape(batch, heads, q_len, kv_len)
    lengths = None if kv_lengths is None else jnp.maximum(kv_lengths, 1).astype(jnp.int32)
    if bias is not None:  # (B, H, T, S), added by the kernel to the scaled scores
        # Its -inf entries are in the mask already (``bias_allows``): 0 in their place
        # keeps a row that attends to everything (see ``_dense_mask``) finite, its gradient too.
        bias = jnp.where(bias_allows(bias), bias, jnp.zeros((), bias.dtype))
        bias = jnp.broadcast_to(bias, (*lead, q_len, kv_len)).reshape(batch, heads, q_len, kv_len)
    if kernel == "splash":  # no dense mask, bias or lengths (``kernel_for``)
        out = splash_attention(q, k, v, causal=causal, scale=scale)
        return out[..., :v_width]
    implementation: Literal["xla", "cudnn"] = "cudnn" if kernel == "cudnn" else "xla"
    out_dtype = v.dtype
    if kernel == "xla":
        q, k, v = q.astype(jnp.float32) * scale, k.astype(jnp.float32), v.astype(jnp.float32)
        scale = 1.0
        bias = None if bias is None else bias.astype(jnp.float32)
    elif bias is not None:
        bias = bias.astype(q.dtype)
    q4, k4, v4 = (t.reshape(batch, *t.shape[-3:]) if tokens_first else bthd(t, batch) for t in (q, k, v))
    with jax.default_matmul_precision(_precision_name(precision)):
        out = jax.nn.dot_product_attention(
            q4, k4, v4, bias=bias, mask=dense, scale=scale, is_causal=causal,
            key_value_seq_lengths=lengths, implementation=implementation,
        )  # (B, T, H, Dv)
    out = (out if tokens_first else jnp.swapaxes(out, 1, 2)).reshape(*q.shape[:-1], v.shape[-1])[..., :v_width]
    out = out.astype(out_dtype)
    if live is None:
        return out
    return jnp.where(jnp.swapaxes(live, -3, -2) if tokens_first else live, out, jnp.zeros((), out.dtype))


def _dense_mask(mask: Array | None, causal: bool, kv_lengths: Array | None, lead: tuple[int, ...], q_len: int,
                kv_len: int, ndim: int) -> tuple[Array | None, Array | None]:
    """The kernel's dense mask (``lead`` + (T, S)), None where the call has none, and the
    rows (..., H, T, 1) with something to attend to (None: all have).  A row with nothing
    to attend to attends to everything in the dense mask, finite, and ``attend`` zeroes
    its output: finite values and gradients."""
    live = None
    dense = None
    if mask is not None:
        dense = jnp.broadcast_to(mask, (*mask.shape[:-2], q_len, kv_len))
        full = combine_masks(dense, None if not causal else expand_to(causal_mask(q_len, kv_len), ndim))
        full = combine_masks(full, None if kv_lengths is None else length_mask(kv_lengths, kv_len, ndim))
        assert full is not None  # dense is not None
        live = full.any(axis=-1, keepdims=True)
        dense = jnp.broadcast_to(dense | ~live, (*lead, q_len, kv_len))
    if kv_lengths is not None:
        empty = (kv_lengths > 0).reshape((-1,) + (1,) * (ndim - 1))
        live = empty if live is None else live & empty
    return dense, live


def cudnn_supports(q: Array, k: Array, v: Array) -> bool:
    """Whether cuDNN's fused attention takes these inputs (after the value-width padding
    in ``attend``): an NVIDIA GPU, float16 or bfloat16, a head width that is a multiple
    of 8 and at most 256 (Hopper and later; 128 before), and even sequence lengths (its
    backward kernel refuses odd ones, and whether a call will be differentiated is not
    known here).  Anything else runs ``jax.nn.dot_product_attention``'s XLA kernel in
    float32 (checked on an H100 with jax 0.11.2: Q = KV = 77 raised "Unsupported sequence
    length" from cuDNN)."""
    if jax.default_backend() != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    widest = 256 if float(capability) >= 9.0 else 128
    width, q_len, kv_len = q.shape[-1], q.shape[-2], k.shape[-2]
    return width % 8 == 0 and width <= widest and q_len % 2 == 0 and kv_len % 2 == 0


def splash_supports(q: Array, k: Array, v: Array) -> bool:
    """Whether the TPU splash-attention kernel takes these shapes (whole 128-blocks, one
    width for q, k and v) and the installed jax has it."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the jax build
        return False
    q_len, kv_len, width = q.shape[-2], k.shape[-2], q.shape[-1]
    return q.ndim >= 3 and q_len % 128 == 0 and kv_len % 128 == 0 and width % 128 == 0 and v.shape[-1] == width


def splash_attention(
    q: Array, k: Array, v: Array, *, causal: bool, scale: float, interpret: bool = False
) -> Array:
    """The Pallas splash-attention kernel (TPU) on (..., H, T, D): a causal mask is a
    block-sparse mask object, so the hidden blocks are skipped.  ``interpret=True`` runs
    the kernel in the Pallas interpreter (any backend; how it is tested on CPU)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    heads, q_len, kv_len = q.shape[-3], q.shape[-2], k.shape[-2]
    one = masks.CausalMask((q_len, kv_len)) if causal else masks.FullMask((q_len, kv_len))
    kernel = kernels.make_splash_mha(
        mask=masks.MultiHeadMask([one] * heads), head_shards=1, q_seq_shards=1, interpret=interpret,
    )
    batch = math.prod(q.shape[:-3])
    # The kernel takes pre-scaled queries and one example (H, T, D); vmap over the batch.
    q3, k3, v3 = ((t.reshape(batch, heads, *t.shape[-2:])) for t in ((q * scale).astype(q.dtype), k, v))
    out = jax.vmap(kernel)(q3, k3, v3)
    return out.reshape(*q.shape[:-1], v.shape[-1]).astype(v.dtype)


def _precision_name(precision: Precision) -> str | None:
    if precision is None or isinstance(precision, str):
        return precision
    return str(precision).split(".")[-1].lower()  # jax.lax.Precision.HIGHEST -> "highest"
