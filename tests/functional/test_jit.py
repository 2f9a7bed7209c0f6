"""Compilation and Flax specifics: ``nnx.jit`` / ``jax.jit`` / ``torch.compile`` give the
eager numbers, compile once per shape, and Flax dropout follows ``nnx.Dropout``'s
conventions (``.eval()``/``.train()``, the call's ``deterministic=`` and ``rngs=``, the
module's own ``dropout`` stream, which advances under ``nnx.jit`` too).  One test runs a
module inside a ``flax.linen`` model through ``nnx.bridge.to_linen``.

Small shapes throughout: d_in 8, seq 5 (<= context_length 6), batch 2 (1 where dropout
draws: ``DROPOUT_SHAPE``).

Equality under jit is asserted *exactly*: measured on CPU, XLA's fusion does not change a
single bit of these outputs or weights, eager vs ``nnx.jit`` vs ``jax.jit``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import JIT_OFF_CPU
from tests.support import needs_jax, needs_torch

D_IN, SEQ, CONTEXT, BATCH = 8, 5, 6, 2
RATE = 0.5  # dropout rate of the variants that have dropout: many dropped weights

# Constructor arguments, the same positional order in both frameworks.
VARIANTS: dict[str, tuple[Any, ...]] = {
    "SimplifiedAttention": (),
    "SelfAttention_v1": (D_IN, 4),
    "SelfAttention_v2": (D_IN, 4, True),
    "CausalAttention": (D_IN, 4, CONTEXT, RATE, True),
    "Head": (D_IN, 4, CONTEXT, RATE),
    "MultiHeadAttentionWrapper": (D_IN, 4, CONTEXT, RATE, 2, True),
    "MultiHeadAttention": (D_IN, 8, CONTEXT, RATE, 2, True),
}
DROPOUT_VARIANTS = ("CausalAttention", "Head", "MultiHeadAttentionWrapper", "MultiHeadAttention")


def inputs(seed: int = 0, shape: tuple[int, ...] = (BATCH, SEQ, D_IN)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def bool_mask(seq: int = SEQ) -> np.ndarray:
    """(B, 1, T, T) bool, True = may attend: random, with row 0 of batch 1 fully masked."""
    mask = np.random.default_rng(1).random((BATCH, 1, seq, seq)) < 0.6
    mask[1, 0, 0] = False
    return mask


# =========================================================================== Flax


def flax_module(name: str, seed: int = 0) -> Any:
    from flax import nnx

    import jax_attention

    return getattr(jax_attention, name)(*VARIANTS[name], rngs=nnx.Rngs(seed))


def rng_counts(module: Any) -> dict[tuple[Any, ...], int]:
    """{path: count} of every RngCount in the module (one per dropout stream)."""
    from flax import nnx

    return {tuple(p): int(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module, nnx.RngCount))}


def assert_equal_tree(a: Any, b: Any) -> None:
    import jax

    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert_jit_equal(np.asarray(x), np.asarray(y))


def assert_jit_equal(a: np.ndarray, b: np.ndarray) -> None:
    """Eager against jit: bit for bit on the CPU, within ``JIT_OFF_CPU`` on a GPU or TPU,
    where XLA fuses differently under jit."""
    import jax

    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=JIT_OFF_CPU.rtol, atol=JIT_OFF_CPU.atol)


def flax_state_arrays(module: Any) -> dict[str, np.ndarray]:
    import jax
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module)):
        value = var.get_value()
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out["/".join(map(str, path))] = np.array(value)
    return out


@needs_jax
@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "bool-mask"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_flax_jit_matches_eager(name: str, with_mask: bool) -> None:
    """Eager == ``nnx.jit`` == ``jax.jit`` over ``nnx.split``/``nnx.merge``, bit for bit,
    outputs and attention weights (eval mode, so that dropout is off)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = flax_module(name)
    model.eval()
    x = jnp.asarray(inputs())
    mask = jnp.asarray(bool_mask()) if with_mask else None

    eager = model(x, mask, return_weights=True)
    under_nnx_jit = nnx.jit(lambda m, x, mask: m(x, mask, return_weights=True))(model, x, mask)
    graphdef, state = nnx.split(model)
    under_jax_jit = jax.jit(
        lambda state, x, mask: nnx.merge(graphdef, state)(x, mask, return_weights=True)
    )(state, x, mask)

    assert eager[0].shape[:2] == (BATCH, SEQ) and np.isfinite(np.asarray(eager[0])).all()
    assert_equal_tree(eager, under_nnx_jit)
    assert_equal_tree(eager, under_jax_jit)
    if with_mask:  # the mask was applied: masked weights are exactly zero, row 0 of batch 1 all zero
        weights = np.asarray(eager[1])
        assert (weights[~np.broadcast_to(bool_mask(), weights.shape)] == 0).all()
        assert (weights[1, :, 0] == 0).all()


@needs_jax
@pytest.mark.parametrize("how", ["nnx.jit", "jax.jit"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_flax_jit_traces_once_per_shape(name: str, how: str) -> None:
    """Three calls with new values of one shape trace once; a new shape traces again; the
    first shape again is a cache hit."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = flax_module(name)
    model.eval()
    traces = 0

    if how == "nnx.jit":
        @nnx.jit
        def nnx_forward(m: Any, x: Any) -> Any:
            nonlocal traces
            traces += 1
            return m(x)

        def call(x: Any) -> Any:
            return nnx_forward(model, x)
    else:
        graphdef, state = nnx.split(model)

        @jax.jit
        def jax_forward(state: Any, x: Any) -> Any:
            nonlocal traces
            traces += 1
            return nnx.merge(graphdef, state)(x)

        def call(x: Any) -> Any:
            return jax_forward(state, x)

    outs = [np.asarray(call(jnp.asarray(inputs(seed)))) for seed in range(3)]
    assert traces == 1
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
    call(jnp.asarray(inputs(3, (BATCH, SEQ - 1, D_IN))))
    assert traces == 2
    call(jnp.asarray(inputs(4)))
    assert traces == 2


@needs_jax
def test_flax_jit_shape_errors_at_trace_time() -> None:
    """Under ``nnx.jit`` shapes are static, so bad input raises the eager ValueError (same
    text) while tracing, and the module's state is left as it was."""
    import jax.numpy as jnp
    from flax import nnx

    model = flax_module("MultiHeadAttention")  # training mode, dropout 0.5
    before = flax_state_arrays(model)
    forward = nnx.jit(lambda m, x: m(x))
    x = jnp.asarray(inputs(0, (BATCH, 7, D_IN)))
    with pytest.raises(ValueError) as eager:
        model(x)
    with pytest.raises(ValueError) as traced:
        forward(model, x)
    # str(): JAX attaches its traceback-filtering hint as a note, not to the message.
    assert str(traced.value) == str(eager.value) == "sequence length 7 exceeds context_length 6"
    after = flax_state_arrays(model)
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


# --------------------------------------------------------------------------- dropout

# One example: XLA's CPU compiler takes about half a second more per leading slice of a
# random draw (measured: bernoulli of (2, 2, 5, 5) compiles in ~3 s, of (1, 2, 5, 5) in
# ~1.7 s, of (1, 1, 5, 5) in ~0.5 s), and each eager draw of a new shape and each jitted
# training step compiles one.
DROPOUT_SHAPE = (1, SEQ, D_IN)


@needs_jax
@pytest.mark.parametrize("name", DROPOUT_VARIANTS)
def test_flax_dropout_eval_is_deterministic(name: str) -> None:
    import jax.numpy as jnp

    model = flax_module(name)
    x = jnp.asarray(inputs(shape=DROPOUT_SHAPE))
    model.eval()
    counts = rng_counts(model)
    a, b = model(x), model(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert rng_counts(model) == counts  # nothing drawn in eval mode
    model.train()
    np.testing.assert_array_equal(np.asarray(model(x, deterministic=True)), np.asarray(a))
    assert rng_counts(model) == counts


@needs_jax
@pytest.mark.parametrize("name", DROPOUT_VARIANTS)
def test_flax_dropout_train_draws_and_advances(name: str) -> None:
    """Training mode: two calls differ, each dropout stream advances once per call, and
    each weight is either dropped (0) or its eval value scaled by 1/(1-rate)."""
    import jax.numpy as jnp

    model = flax_module(name)
    x = jnp.asarray(inputs(shape=DROPOUT_SHAPE))
    model.eval()
    _, w_eval = model(x, return_weights=True)
    model.train()
    counts = rng_counts(model)
    assert counts, "a dropout variant has a dropout stream"
    out1, w1 = model(x, return_weights=True)
    out2, w2 = model(x, return_weights=True)
    assert not np.array_equal(np.asarray(out1), np.asarray(out2))
    assert rng_counts(model) == {p: c + 2 for p, c in counts.items()}
    w_eval, w1 = np.asarray(w_eval), np.asarray(w1)
    dropped = w1 == 0
    np.testing.assert_allclose(w1[~dropped], w_eval[~dropped] / (1 - RATE), rtol=1e-6)
    live = w_eval > 0
    assert (dropped & live).any() and (~dropped & live).any()  # rate 0.5: some of each


@needs_jax
@pytest.mark.parametrize("name", DROPOUT_VARIANTS)
def test_flax_dropout_call_flag_overrides_mode(name: str) -> None:
    import jax.numpy as jnp

    model = flax_module(name)
    x = jnp.asarray(inputs(shape=DROPOUT_SHAPE))
    model.eval()
    reference = np.asarray(model(x))
    # eval mode, deterministic=False at the call: dropout on, the module's stream advances
    counts = rng_counts(model)
    dropped = np.asarray(model(x, deterministic=False))
    assert not np.array_equal(dropped, reference)
    assert rng_counts(model) == {p: c + 1 for p, c in counts.items()}
    # training mode, deterministic=True at the call: dropout off, nothing drawn
    model.train()
    counts = rng_counts(model)
    np.testing.assert_array_equal(np.asarray(model(x, deterministic=True)), reference)
    assert rng_counts(model) == counts


@needs_jax
@pytest.mark.parametrize("name", DROPOUT_VARIANTS)
def test_flax_dropout_call_rngs(name: str) -> None:
    """``rngs=`` at the call takes precedence over the module's stream (which it leaves
    alone): the same key twice gives the same dropout, another key another dropout."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = flax_module(name)
    model.train()
    x = jnp.asarray(inputs(shape=DROPOUT_SHAPE))
    counts = rng_counts(model)
    a = np.asarray(model(x, rngs=nnx.Rngs(dropout=3)))
    b = np.asarray(model(x, rngs=nnx.Rngs(dropout=3)))
    c = np.asarray(model(x, rngs=nnx.Rngs(dropout=4)))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    k1 = np.asarray(model(x, rngs=jax.random.key(5)))
    k2 = np.asarray(model(x, rngs=jax.random.key(5)))
    np.testing.assert_array_equal(k1, k2)
    assert not np.array_equal(k1, a)
    assert rng_counts(model) == counts  # the module's own stream was not used


@needs_jax
@pytest.mark.parametrize("name", DROPOUT_VARIANTS)
def test_flax_dropout_under_jit(name: str) -> None:
    """Training-mode dropout under ``nnx.jit`` draws from the module's stream, advances it
    (no retrace), and gives exactly the eager result for the same stream state; so does
    ``jax.jit`` over split/merge when the new state is returned."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = flax_module(name)
    model.train()
    eager_twin = nnx.clone(model)
    functional_twin = nnx.clone(model)
    x = jnp.asarray(inputs(shape=DROPOUT_SHAPE))
    counts = rng_counts(model)
    traces = 0

    @nnx.jit
    def forward(m: Any, x: Any) -> Any:
        nonlocal traces
        traces += 1
        return m(x)

    jitted = [np.asarray(forward(model, x)) for _ in range(3)]
    assert traces == 1
    assert not np.array_equal(jitted[0], jitted[1]) and not np.array_equal(jitted[1], jitted[2])
    assert rng_counts(model) == {p: c + 3 for p, c in counts.items()}

    eager = [np.asarray(eager_twin(x)) for _ in range(3)]
    for e, j in zip(eager, jitted, strict=True):
        assert_jit_equal(e, j)

    graphdef, state = nnx.split(functional_twin)

    @jax.jit
    def step(state: Any, x: Any) -> Any:
        m = nnx.merge(graphdef, state)
        return m(x), nnx.state(m)

    for j in jitted:
        out, state = step(state, x)
        np.testing.assert_array_equal(np.asarray(out), j)


# --------------------------------------------------------------------------- linen bridge


@needs_jax
def test_flax_to_linen_bridge() -> None:
    """``nnx.bridge.to_linen`` wraps MultiHeadAttention inside a linen model (Dense ->
    attention -> Dense): init + apply work, the output has the right shape, apply is
    deterministic and jit-able, and it equals the NNX module run on the parameters taken
    out of the linen variables (with the linen Dense layers applied around it)."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn
    from flax import nnx

    import jax_attention

    d_model, num_heads, d_final = 8, 2, 4

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            h = nn.Dense(d_model, name="dense_in")(x)
            h = nnx.bridge.to_linen(
                jax_attention.MultiHeadAttention, d_model, d_model, CONTEXT, 0.0, num_heads,
                name="attn",
            )(h)
            return nn.Dense(d_final, name="dense_out")(h)

    x = jnp.asarray(inputs())
    net = Net()
    # Dropout rate 0.0: the module takes no "dropout" stream, so a params key alone inits it.
    variables = net.init(jax.random.key(0), x)
    y = net.apply(variables, x)
    assert y.shape == (BATCH, SEQ, d_final)
    assert np.isfinite(np.asarray(y)).all()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(net.apply(variables, x)))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(net.apply)(variables, x)))

    params = nn.meta.unbox(variables)["params"]
    # The same NNX class, built with other weights, then loaded from the linen variables.
    attn = jax_attention.MultiHeadAttention(d_model, d_model, CONTEXT, 0.0, num_heads, rngs=nnx.Rngs(42))
    h = nn.Dense(d_model).apply({"params": params["dense_in"]}, x)

    def run_nnx() -> np.ndarray:
        return np.asarray(nn.Dense(d_final).apply({"params": params["dense_out"]}, attn(h)))

    assert not np.array_equal(run_nnx(), np.asarray(y))  # different weights, different output
    flat = nnx.to_flat_state(nnx.state(attn, nnx.Param))
    linen_leaves = jax.tree_util.tree_leaves_with_path(params["attn"])
    assert len(flat) == len(linen_leaves) == 5  # q/k/v kernels (no qkv_bias), out_proj kernel + bias
    for path, var in flat:
        value = params["attn"]
        for key in path:
            value = value[key]
        assert value.shape == var.get_value().shape
        var.set_value(value)
    np.testing.assert_array_equal(run_nnx(), np.asarray(y))


# =========================================================================== PyTorch


def torch_module(name: str) -> Any:
    import torch

    import torch_attention

    torch.manual_seed(0)
    return getattr(torch_attention, name)(*VARIANTS[name])


def _torch_calls(name: str) -> list[tuple[bool, dict[str, Any]]]:
    """(training, call kwargs) pairs: eval with and without a mask, and for the dropout
    variants training mode with an explicit keep-mask (a random draw could not match)."""
    import torch

    mask = torch.from_numpy(bool_mask())
    calls: list[tuple[bool, dict[str, Any]]] = [(False, {}), (False, {"mask": mask})]
    if name in DROPOUT_VARIANTS:
        heads = VARIANTS[name][4] if "MultiHead" in name else 1
        keep = torch.from_numpy(np.random.default_rng(2).random((BATCH, heads, SEQ, SEQ)) < 1 - RATE)
        calls.append((True, {"mask": mask, "dropout_mask": keep}))
    return calls


def _check_compiled(name: str, backend: str) -> None:
    import torch

    torch._dynamo.reset()
    model = torch_module(name)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: no graph breaks
    x = torch.from_numpy(inputs())
    for training, kwargs in _torch_calls(name):
        model.train(training)
        with torch.no_grad():
            eager = model(x, return_weights=True, **kwargs)
            out = compiled(x, return_weights=True, **kwargs)
        for e, c in zip(eager, out, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)
        if "mask" in kwargs:  # the mask reached the compiled graph
            weights = out[1]
            assert (weights[~kwargs["mask"].expand_as(weights)] == 0).all()


@needs_torch
@pytest.mark.parametrize("name", list(VARIANTS))
def test_torch_compile_matches_eager(name: str) -> None:
    """``torch.compile(fullgraph=True)`` gives the eager outputs and weights (1e-6).

    Backend ``aot_eager``, not the default ``inductor``: on this CPU inductor's C++ codegen
    and gcc take ~25 s for the first variant and ~60 s for all seven, cold, which would
    make this file slow.  ``aot_eager`` still runs the parts that see our Python code --
    Dynamo's capture (``fullgraph=True`` fails on any graph break) and AOTAutograd's
    functionalisation -- and ``test_torch_compile_inductor`` below runs inductor once.
    """
    _check_compiled(name, "aot_eager")


@needs_torch
@pytest.mark.slow
# Importing inductor imports torch.utils.mkldnn, which warns about its own use of the
# deprecated torch.jit.script_method; torch's internals, not this library.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_inductor() -> None:
    """The default backend (inductor, generated C++) on the multi-head module."""
    _check_compiled("MultiHeadAttention", "inductor")


@needs_torch
def test_torch_compile_compiles_once_per_shape() -> None:
    """Three calls with new values of one shape compile one graph; a new shape another."""
    import torch

    torch._dynamo.reset()
    model = torch_module("MultiHeadAttention").eval()
    graphs = 0

    def counting_backend(gm: Any, example_inputs: Any) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    compiled = torch.compile(model, backend=counting_backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        outs = [compiled(torch.from_numpy(inputs(seed))) for seed in range(3)]
        assert graphs == 1
        assert not torch.equal(outs[0], outs[1])
        compiled(torch.from_numpy(inputs(3, (BATCH, SEQ - 1, D_IN))))
        assert graphs == 2
