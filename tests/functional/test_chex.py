"""The JAX side in chex's idioms.

1. ``chex.variants(with_jit=True, without_jit=True)``: the functional core on every path
   gives the float64 oracle's output (causal + padding mask + ``kv_lengths``, a query row
   with nothing to attend to), and gradients equal to the reference path's, traced or
   eager; dropout drawn from a key is the same under jit as eagerly.
2. ``chex.assert_max_traces``: the functional core under ``jax.jit`` traces once per shape
   and option set, not once per call (new values of q, k, v, the mask and the lengths
   are cache hits); a module under ``nnx.jit`` traces once per mode, and in training
   mode its dropout stream advances without retracing.
3. ``chex.assert_trees_all_equal`` / ``assert_trees_all_close`` on parameter trees
   (``nnx.state(module, nnx.Param)``): a round trip Flax -> PyTorch -> Flax and
   ``load_torch_state_dict`` copy every parameter exactly (equality, which is stronger
   than closeness: a copy does no arithmetic); one SGD step taken in each framework
   leaves the two parameter trees within ``PARITY["float32"]``, and the gradient trees
   agree within ``GRAD_PARITY["float32"]``.

The ``chex.TestCase`` classes (absl ``parameterized``) are collected by pytest as
unittest classes: that is how ``chex.variants`` works under pytest with chex 0.1.9x (a
plain function decorated with ``chex.variants`` is not collected).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest

from parity_tests.reference import attention as oracle
from parity_tests.tolerances import GRAD_PARITY, ORACLE, PARITY
from tests.support import HAS_JAX, needs_both, needs_jax

chex = pytest.importorskip("chex")
from absl.testing import parameterized  # noqa: E402  (a dependency of chex)

if HAS_JAX:
    import jax
    import jax.numpy as jnp
    from flax import nnx

PATHS = ("reference", "fused", "blockwise", "auto")
B, H, T, S, D = 2, 2, 3, 5, 4


def problem(seed: int = 0) -> dict[str, np.ndarray]:
    """q (B, H, T, D), k and v (B, H, S, D), a padding mask (B, 1, 1, S) and lengths (B,)
    that leave query 0 of example 1 nothing to attend to under the causal mask."""
    rng = np.random.default_rng(seed)
    mask = np.ones((B, 1, 1, S), bool)
    mask[1, ..., 0] = False
    return {
        "q": rng.standard_normal((B, H, T, D)).astype(np.float32),
        "k": rng.standard_normal((B, H, S, D)).astype(np.float32),
        "v": rng.standard_normal((B, H, S, D)).astype(np.float32),
        "mask": mask,
        "kv_lengths": np.array([S, S - 1 - seed % 2], np.int32),
    }


def allowed_keys(p: dict[str, np.ndarray]) -> np.ndarray:
    """(B, 1, T, S): mask & lengths & causal (top-left)."""
    lengths = np.arange(S)[None, :] < p["kv_lengths"][:, None]
    return p["mask"] & lengths[:, None, None, :] & np.tril(np.ones((T, S), bool))


def attend(path: str, **options: Any) -> Any:
    """The JAX core with options bound (static), arrays as arguments (traced under jit)."""
    from jax_attention.functional import dot_product_attention

    return functools.partial(dot_product_attention, causal=True, implementation=path, **options)


def jax_arrays(p: dict[str, np.ndarray]) -> dict[str, Any]:
    return {name: jnp.asarray(a) for name, a in p.items()}


# =========================================================================== 1. chex.variants


@needs_jax
class FunctionalCoreVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*PATHS)
    def test_matches_the_float64_oracle(self, path: str) -> None:
        p = problem()
        a = jax_arrays(p)
        out = self.variant(attend(path))(a["q"], a["k"], a["v"], mask=a["mask"], kv_lengths=a["kv_lengths"])
        allowed = allowed_keys(p)
        want, _ = oracle(p["q"], p["k"], p["v"], scale=1 / math.sqrt(D), mask=allowed)
        chex.assert_shape(out, (B, H, T, D))
        chex.assert_type(out, jnp.float32)
        chex.assert_tree_all_finite(out)
        tol = ORACLE["float32"]
        chex.assert_trees_all_close(out, want.astype(np.float32), rtol=tol.rtol, atol=tol.atol)
        assert not allowed[1, 0, 0].any()
        np.testing.assert_array_equal(np.asarray(out)[1, :, 0], 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*PATHS)
    def test_gradients_match_the_reference_path(self, path: str) -> None:
        a = jax_arrays(problem())
        cotangent = jnp.asarray(np.random.default_rng(1).standard_normal((B, H, T, D)).astype(np.float32))

        def loss(core: Any) -> Any:
            def value(q: Any, k: Any, v: Any, mask: Any, kv_lengths: Any) -> Any:
                return jnp.sum(core(q, k, v, mask=mask, kv_lengths=kv_lengths) * cotangent)

            return jax.grad(value, argnums=(0, 1, 2))

        args = (a["q"], a["k"], a["v"], a["mask"], a["kv_lengths"])
        grads = self.variant(loss(attend(path)))(*args)
        want = loss(attend("reference"))(*args)
        chex.assert_tree_all_finite(grads)
        tol = GRAD_PARITY["float32"]
        chex.assert_trees_all_close(grads, want, rtol=tol.rtol, atol=tol.atol)
        # The masked-out query row and the keys nobody may see get exactly no gradient.
        dq, dk, _ = (np.asarray(g) for g in grads)
        np.testing.assert_array_equal(dq[1, :, 0], 0.0)
        np.testing.assert_array_equal(dk[1, :, 0], 0.0)  # blocked by the padding mask

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("reference", "auto")
    def test_dropout_from_a_key_is_the_same_traced_or_eager(self, path: str) -> None:
        a = jax_arrays(problem())
        core = attend(path, dropout_rate=0.5, deterministic=False)
        args = (a["q"], a["k"], a["v"])
        key = jax.random.key(0)
        out = self.variant(core)(*args, rng=key)
        chex.assert_trees_all_close(out, core(*args, rng=key), rtol=PARITY["float32"].rtol,
                                    atol=PARITY["float32"].atol)
        assert not np.allclose(np.asarray(out), np.asarray(self.variant(core)(*args, rng=jax.random.key(1))))


# =========================================================================== 2. retracing


@needs_jax
@pytest.mark.parametrize("path", PATHS)
def test_functional_core_traces_once_per_shape_and_options(path: str) -> None:
    from jax_attention.functional import dot_product_attention

    chex.clear_trace_counter()

    @functools.partial(jax.jit, static_argnames=("causal",))
    @chex.assert_max_traces(n=2)
    def core(q: Any, k: Any, v: Any, mask: Any, kv_lengths: Any, *, causal: bool) -> Any:
        return dot_product_attention(
            q, k, v, mask=mask, kv_lengths=kv_lengths, causal=causal, implementation=path
        )

    outs = []
    for causal in (False, True):  # one trace per option set...
        for seed in range(3):  # ...not one per call: new q, k, v, mask and lengths values
            a = jax_arrays(problem(seed))
            a["mask"] = jnp.asarray(np.random.default_rng(seed).random((B, 1, 1, S)) < 0.7)
            outs.append(np.asarray(core(a["q"], a["k"], a["v"], a["mask"], a["kv_lengths"], causal=causal)))
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[0], outs[3])
    a = jax_arrays(problem())
    with pytest.raises(AssertionError, match="traced > 2 times"):  # a new shape is a third trace
        core(a["q"][:, :, :2], a["k"], a["v"], a["mask"], a["kv_lengths"], causal=False)


MODULE_ARGS = {  # the same positional order as PyTorch; dropout 0.5 where there is one
    "CausalAttention": (8, 4, 6, 0.5, True),
    "MultiHeadAttentionWrapper": (8, 4, 6, 0.5, 2, True),
    "MultiHeadAttention": (8, 8, 6, 0.5, 2, True),
}


@needs_jax
@pytest.mark.parametrize("name", list(MODULE_ARGS))
def test_module_under_nnx_jit_traces_once_per_mode(name: str) -> None:
    import jax_attention

    chex.clear_trace_counter()
    module = getattr(jax_attention, name)(*MODULE_ARGS[name], rngs=nnx.Rngs(0))

    @nnx.jit
    @chex.assert_max_traces(n=2)
    def forward(m: Any, x: Any, mask: Any) -> Any:
        return m(x, mask)

    rng = np.random.default_rng(0)

    def call() -> np.ndarray:
        x = jnp.asarray(rng.standard_normal((2, 5, 8)).astype(np.float32))
        mask = jnp.asarray(rng.random((2, 1, 5, 5)) < 0.8)
        return np.asarray(forward(module, x, mask))

    module.eval()
    evaluated = [call() for _ in range(3)]  # trace 1
    module.train()
    x = jnp.asarray(rng.standard_normal((2, 5, 8)).astype(np.float32))
    mask = jnp.ones((2, 1, 5, 5), bool)
    trained = [np.asarray(forward(module, x, mask)) for _ in range(3)]  # trace 2, then hits
    assert not np.allclose(evaluated[0], evaluated[1])
    # Same input, the dropout stream advanced between calls: new draws, no retrace.
    assert not np.allclose(trained[0], trained[1]) and not np.allclose(trained[1], trained[2])
    with pytest.raises(AssertionError, match="traced > 2 times"):
        forward(module, x[:, :4], mask[..., :4, :4])


# =========================================================================== 3. parameter trees

# (class name, positional args as in PyTorch): every variant that has parameters
TREE_VARIANTS = {
    "SelfAttention_v1": (8, 4),
    "SelfAttention_v2": (8, 4, True),
    "CausalAttention": (8, 4, 6, 0.0, True),
    "Head": (8, 4, 6, 0.0),
    "MultiHeadAttentionWrapper": (8, 4, 6, 0.0, 2, True),
    "MultiHeadAttention": (8, 8, 6, 0.0, 2, True),
}


def params(module: Any) -> Any:
    return nnx.state(module, nnx.Param)


@needs_both
@pytest.mark.parametrize("name", list(TREE_VARIANTS))
def test_round_trip_through_pytorch_keeps_the_parameter_tree(name: str) -> None:
    import jax_attention
    from parity_tests import to_flax, to_torch

    module = getattr(jax_attention, name)(*TREE_VARIANTS[name], rngs=nnx.Rngs(3))
    back = to_flax(to_torch(module), rngs=nnx.Rngs(4))  # a different init: every value is copied
    chex.assert_trees_all_equal_structs(params(back), params(module))
    chex.assert_trees_all_equal_dtypes(params(back), params(module))
    chex.assert_trees_all_equal(params(back), params(module))


@needs_both
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_keeps_half_precision_parameters_exactly(dtype: str) -> None:
    """PyTorch -> Flax -> PyTorch -> Flax in the parameters' own dtype: no value rounds
    (bfloat16 travels through NumPy as ml_dtypes.bfloat16 or float32, both exact)."""
    import torch

    import torch_attention
    from parity_tests import to_flax, to_torch

    torch.manual_seed(0)
    tm = torch_attention.MultiHeadAttention(8, 8, 6, 0.0, 2, True, dtype=getattr(torch, dtype))
    first = to_flax(tm)
    second = to_flax(to_torch(first), rngs=nnx.Rngs(5))
    chex.assert_trees_all_equal_dtypes(params(second), params(first))
    chex.assert_trees_all_equal(params(second), params(first))
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(params(first))} == {dtype}
    want = {n: p.detach().float().numpy() for n, p in tm.named_parameters()}
    got = {  # Flax layout back to PyTorch's by hand: kernel (in, out) = weight (out, in) transposed
        f"{name}.{'weight' if kind == 'kernel' else kind}":
            np.asarray(leaf, np.float32).T if kind == "kernel" else np.asarray(leaf, np.float32)
        for name, sub in nnx.to_pure_dict(params(second)).items() for kind, leaf in sub.items()
    }
    chex.assert_trees_all_equal(got, want)


@needs_both
def test_load_torch_state_dict_gives_the_declared_tree() -> None:
    """Written out by hand for MultiHeadAttention: kernels are the transposed weights."""
    import torch

    import jax_attention
    import torch_attention
    from jax_attention.interop import load_torch_state_dict

    torch.manual_seed(0)
    tm = torch_attention.MultiHeadAttention(8, 8, 6, 0.0, 2, True)
    sd = {k: v.detach().numpy() for k, v in tm.state_dict().items()}
    fm = load_torch_state_dict(jax_attention.MultiHeadAttention(8, 8, 6, 0.0, 2, True, rngs=nnx.Rngs(1)), sd)
    want = {
        name: {"kernel": sd[f"{name}.weight"].T, "bias": sd[f"{name}.bias"]}
        for name in ("W_query", "W_key", "W_value", "out_proj")
    }
    got = nnx.to_pure_dict(params(fm))
    chex.assert_trees_all_equal(got, want)


@needs_both
def test_loaded_parameters_do_not_alias_the_torch_tensors() -> None:
    """A twin made by ``to_flax`` owns its parameters: an in-place update of the PyTorch
    module (an optimizer step) must not reach the Flax tree (on CPU, ``jnp.asarray`` of
    a NumPy view of a tensor can share its memory)."""
    import torch

    import torch_attention
    from parity_tests import to_flax

    torch.manual_seed(0)
    tm = torch_attention.MultiHeadAttention(8, 8, 6, 0.0, 2, True)
    fm = to_flax(tm)
    snapshot = jax.tree.map(np.array, nnx.to_pure_dict(params(fm)))
    with torch.no_grad():
        for p in tm.parameters():
            p += 1.0
    chex.assert_trees_all_equal(nnx.to_pure_dict(params(fm)), snapshot)


@needs_both
def test_one_sgd_step_in_each_framework_gives_the_same_tree() -> None:
    import torch

    import torch_attention
    from jax_attention.interop import state_from_torch
    from parity_tests import to_flax

    lr = 0.5
    torch.manual_seed(0)
    tm = torch_attention.MultiHeadAttention(8, 8, 6, 0.0, 2, True).eval()
    fm = to_flax(tm)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    mask = rng.random((2, 1, 5, 5)) < 0.8
    cotangent = rng.standard_normal((2, 5, 8)).astype(np.float32)

    # The Flax step first: it must not depend on whether the twin's arrays alias the
    # PyTorch tensors (that has its own test above).
    def loss(m: Any) -> Any:
        return jnp.sum(m(jnp.asarray(x), jnp.asarray(mask)) * jnp.asarray(cotangent))

    flax_grads = nnx.grad(loss)(fm)
    before = jax.tree.map(np.array, nnx.to_pure_dict(params(fm)))
    nnx.update(fm, jax.tree.map(lambda p, g: p - lr * g, params(fm), flax_grads))

    (tm(torch.from_numpy(x), torch.from_numpy(mask)) * torch.from_numpy(cotangent)).sum().backward()
    torch_grads = {n: p.grad.numpy().copy() for n, p in tm.named_parameters()}  # type: ignore[union-attr]
    with torch.no_grad():
        for p in tm.parameters():
            p -= lr * p.grad  # type: ignore[operator]

    tol = GRAD_PARITY["float32"]
    converted = state_from_torch(torch_grads, "MultiHeadAttention", tm.config)
    chex.assert_trees_all_close(flax_grads, converted, rtol=tol.rtol, atol=tol.atol)
    tol = PARITY["float32"]
    chex.assert_trees_all_close(params(fm), params(to_flax(tm)), rtol=tol.rtol, atol=tol.atol)
    with pytest.raises(AssertionError):  # the step moved the parameters
        chex.assert_trees_all_close(nnx.to_pure_dict(params(fm)), before, rtol=tol.rtol, atol=tol.atol)
