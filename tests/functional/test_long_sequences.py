"""Long sequences on JAX's CPU paths: the blockwise path's tiles from 4096 keys on.

From ``_paths.LONG_SEQUENCE`` keys, the blockwise path walks (rows, keys) tiles in loops with
an online softmax, forward and backward.  Its memory then does not grow with S x S: the
buffers XLA plans for a causal forward + backward at S = 32768 are checked against the
size of one S x S score matrix.  Its numbers are checked at the real tile size against
the reference path, with windows and tile edges that do not fall on tile boundaries;
``test_structure_options`` runs every structure option through the same form in tiny
tiles against the float64 oracle.

PyTorch's blockwise path (not its ``auto``, which is SDPA) bounds its training memory by
checkpointing each query block; that is checked here on what autograd saves.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.harness import compare
from parity_tests.tolerances import GRAD_PARITY, PARITY
from tests.support import needs_jax, needs_torch


def _loss(implementation: str, **options):  # type: ignore[no-untyped-def]
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    def loss(q, k, v):  # type: ignore[no-untyped-def]
        out = dot_product_attention(q, k, v, implementation=implementation, **options)
        return (out * jnp.cos(jnp.arange(out.shape[-2], dtype=out.dtype))[None, None, :, None]).sum()

    return loss


@needs_jax
def test_auto_takes_the_tiles_from_4096_keys():
    from jax_attention import _paths

    assert _paths.blockwise_plan(4095, 4095)[1:] == (None, None)
    assert _paths.blockwise_plan(1, 4096)[1:] == (_paths.LONG_TILE, _paths.LONG_BACKWARD_TILE)
    assert _paths.blockwise_plan(32768, 32768)[1] == _paths.LONG_TILE


@needs_jax
@pytest.mark.parametrize("path", ["blockwise", "auto"])
def test_training_memory_at_32768_keys_is_not_quadratic(path):
    """Causal forward + backward, one head of width 64, S = 32768: the temporaries XLA
    plans stay below 1/64 of one S x S float32 score matrix (4 GiB).  On CPU ``auto`` is
    the library's kernel, whose own buffers are O(S * D) (K and V repacked, the query
    head's operands); the benchmark's resident peak measures them."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "cpu":
        pytest.skip("a CPU path")
    s = 32768
    x = jax.ShapeDtypeStruct((1, 1, s, 64), jnp.float32)
    grad = jax.jit(jax.grad(_loss(path, causal=True), argnums=(0, 1, 2)))
    stats = grad.lower(x, x, x).compile().memory_analysis()
    assert stats is not None
    square = s * s * 4
    assert stats.temp_size_in_bytes < square / 64, (stats.temp_size_in_bytes, square)


@needs_jax
@pytest.mark.parametrize("options", [
    {"causal": True},
    {"window": (700, 300)},
    {"causal": True, "window": (1000, None), "alignment": "bottom_right"},
    {"kv_lengths": [4200, 2500], "causal": True},
], ids=["causal", "window", "causal-window-bottomright", "lengths-causal"])
def test_real_tiles_against_the_reference_path(options):
    """T = 4100, S = 4300 (neither a multiple of a tile), B 2, H 1, head width 16, float32:
    output and gradients of the tiled form (``blockwise`` from 4096 keys) against the reference
    path at float32 twin tolerance."""
    import jax
    import jax.numpy as jnp

    from jax_attention import _paths, functional

    rng = np.random.default_rng(7)
    t, s = 4100, 4300
    assert _paths.blockwise_plan(t, s)[1] is not None
    q = jnp.asarray(rng.standard_normal((2, 1, t, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 1, s, 16)), jnp.float32) for _ in range(2))
    results = {}
    for path in ("blockwise", "reference"):

        def run(q, k, v, path=path):  # type: ignore[no-untyped-def]
            # the output and the gradients of sum(out * cos(row)) (_loss's) in one program
            out, vjp = jax.vjp(lambda q, k, v: functional.dot_product_attention(
                q, k, v, implementation=path, **options), q, k, v)
            weight = jnp.cos(jnp.arange(out.shape[-2], dtype=out.dtype))[None, None, :, None]
            return out, vjp(jnp.broadcast_to(weight, out.shape))

        out, grads = jax.jit(run)(q, k, v)
        results[path] = {"output": np.asarray(out), **{f"grad {n}": np.asarray(g) for n, g in zip("qkv", grads, strict=True)}}
    got, want = results["blockwise"], results["reference"]
    findings = [compare(name, got[name], want[name], (GRAD_PARITY if name.startswith("grad") else PARITY)["float32"])
                for name in ("output", "grad q", "grad k", "grad v")]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)


@needs_torch
@pytest.mark.parametrize("options", [{"causal": True}, {"window": (100, 50)}, {"bias": True, "softcap": 30.0}],
                         ids=["causal", "window", "bias-softcap"])
def test_torch_blockwise_training_keeps_no_weights(options):
    """What autograd keeps for the backward of PyTorch's blockwise path (B1 H2, T = S =
    1024, blocks of 128) is the inputs, not the weights: the distinct storages saved stay
    below one head's T x S float32 matrix, where the weights of all blocks would be 2 of
    them (8 MiB).  The gradients are those of the reference path."""
    import torch

    from torch_attention.functional import dot_product_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 32, generator=generator, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 1024, 1024, generator=generator, requires_grad=True) if options.get("bias") else None
    kwargs = {**options, "bias": bias}
    storages: dict[int, int] = {}

    def pack(t):  # type: ignore[no-untyped-def]
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dot_product_attention(q, k, v, implementation="blockwise", **kwargs)
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v, bias) if t is not None}
    kept = sum(n for ptr, n in storages.items() if ptr not in inputs)
    assert kept < 1024 * 1024 * 4, kept

    weights = torch.cos(torch.arange(1024.0))[None, None, :, None]
    wrt = [t for t in (q, k, v, bias) if t is not None]
    grads = torch.autograd.grad((out * weights).sum(), wrt)
    reference = dot_product_attention(q, k, v, implementation="reference", **kwargs)
    expected = torch.autograd.grad((reference * weights).sum(), wrt)
    findings = [compare("output", out.detach().numpy(), reference.detach().numpy(), PARITY["float32"])]
    findings += [compare(f"grad {name}", got.numpy(), want.numpy(), GRAD_PARITY["float32"])
                 for name, got, want in zip("qkvb", grads, expected, strict=False)]
    assert all(f.ok for f in findings), "\n".join(f.describe() for f in findings if not f.ok)
