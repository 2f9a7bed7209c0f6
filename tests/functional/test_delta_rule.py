"""The gated delta rule and KDA (``gated_delta_rule`` in both twins' ``functional``): two
tokens worked by hand; each twin's chunked and recurrent forms against the float64 loop
oracle (``parity_tests.reference_delta``), at lengths that are and are not multiples of
the chunk, grouped value heads, a decay per head or per key channel, an initial state, the
L2 norm, both layouts, float64, bfloat16; gradients of q, k, v, g, beta and the initial
state against central differences of the oracle and twin against twin; against
transformers' own functions (Qwen3-Next's gated delta rule, Kimi Linear's KDA), forward
and backward; bad input refused with one text in both twins."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np
import pytest

from parity_tests.reference_delta import gated_delta_rule as oracle
from parity_tests.tolerances import DELTA_GRAD_ORACLE, DELTA_ORACLE, DELTA_TWINS
from tests.support import needs_both

pytestmark = needs_both


class Setting(NamedTuple):
    """One call: sizes (B, Hk, H, T, Dk, Dv), the chunk, and the options."""

    name: str
    sizes: tuple[int, int, int, int, int, int]
    chunk: int
    per_channel: bool
    initial: bool
    l2norm: bool
    layout: str
    dtype: str


# Pairwise over: the decay's kind, grouped value heads, T a multiple of the chunk or not
# (or shorter), an initial state, the L2 norm, the layout, the dtype.
SETTINGS = [
    Setting("heads-divides", (2, 2, 2, 8, 4, 3), 4, False, False, False, "bhsd", "float32"),
    Setting("kda-grouped-ragged", (1, 1, 2, 7, 4, 3), 4, True, True, True, "bshd", "float32"),
    Setting("grouped-shorter", (2, 1, 2, 5, 3, 2), 8, False, True, True, "bhsd", "bfloat16"),
    Setting("kda-float64", (1, 2, 2, 9, 3, 2), 3, True, True, False, "bhsd", "float64"),
]


def _inputs(setting: Setting, seed: int = 0) -> dict[str, np.ndarray]:
    """float64 draws, heads first: unit-norm keys (as the layers make them), decays in
    (-1, 0), beta in (0, 1)."""
    batch, qk_heads, heads, length, key_dim, value_dim = setting.sizes
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((batch, qk_heads, length, key_dim))
    arrays = {
        "q": rng.standard_normal((batch, qk_heads, length, key_dim)),
        "k": k if setting.l2norm else k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.standard_normal((batch, heads, length, value_dim)),
        "g": -rng.uniform(0.05, 1.0, (batch, heads, length) + ((key_dim,) if setting.per_channel else ())),
        "beta": rng.uniform(0.05, 1.0, (batch, heads, length)),
    }
    if setting.initial:
        arrays["initial_state"] = rng.standard_normal((batch, heads, key_dim, value_dim))
    return arrays


@functools.cache
def _jitted(**options: Any) -> Any:
    """JAX's ``gated_delta_rule`` with these static options, jitted (one program, where
    eager JAX compiles each primitive), shared by the tests."""
    import jax

    from jax_attention.functional import gated_delta_rule

    return jax.jit(functools.partial(gated_delta_rule, **options))


@functools.cache
def _jitted_grad(**options: Any) -> Any:
    """The gradient of sum(out * c1) + sum(state * c2) over every input, jitted."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import gated_delta_rule

    def loss(values: dict[str, Any], cot: tuple[Any, Any]) -> Any:
        values = dict(values)
        positional = [values.pop(n) for n in NAMES[:5]]
        out, state = gated_delta_rule(*positional, **values, **options)
        return jnp.sum(out * cot[0]) + jnp.sum(state * cot[1])

    return jax.jit(jax.grad(loss))


def _as_layout(name: str, x: np.ndarray, layout: str) -> np.ndarray:
    return np.swapaxes(x, 1, 2) if layout == "bshd" and name != "initial_state" else x


def _rounded(arrays: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The inputs as the dtype holds them (the oracle reads the same values)."""
    import ml_dtypes

    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return {n: x.astype(kind).astype(np.float64) if n != "initial_state" else x.astype(np.float32).astype(np.float64)
            for n, x in arrays.items()}


def _run(twin: str, setting: Setting, arrays: dict[str, np.ndarray], form: str) -> tuple[np.ndarray, np.ndarray]:
    """A twin's (out, final state) as float64, heads first."""
    given = {n: _as_layout(n, x, setting.layout) for n, x in arrays.items()}
    options = {"form": form, "chunk_size": setting.chunk, "qk_l2norm": setting.l2norm, "layout": setting.layout}
    if twin == "jax":
        import jax
        import jax.numpy as jnp
        import ml_dtypes

        kind = ml_dtypes.bfloat16 if setting.dtype == "bfloat16" else np.dtype(setting.dtype)
        with jax.enable_x64(setting.dtype == "float64"):
            tensors = {n: jnp.asarray(x.astype(np.float32 if n == "initial_state" and setting.dtype != "float64"
                                                else kind)) for n, x in given.items()}
            out, state = _jitted(**options)(tensors.pop("q"), tensors.pop("k"), tensors.pop("v"), tensors.pop("g"),
                                            tensors.pop("beta"), **tensors)
            out, state = np.asarray(out.astype(jnp.float32 if setting.dtype != "float64" else out.dtype)), np.asarray(state)
    else:
        import torch

        from torch_attention.functional import gated_delta_rule

        kind = getattr(torch, setting.dtype)
        tensors = {n: torch.tensor(x).to(torch.float32 if n == "initial_state" and setting.dtype != "float64" else kind)
                   for n, x in given.items()}
        out, state = gated_delta_rule(tensors.pop("q"), tensors.pop("k"), tensors.pop("v"), tensors.pop("g"),
                                      tensors.pop("beta"), **tensors, **options)
        out, state = out.double().numpy(), state.double().numpy()
    return _as_layout("out", out.astype(np.float64), setting.layout), state.astype(np.float64)


def _error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


# --------------------------------------------------------------------------- by hand


def test_two_tokens_worked_by_hand() -> None:
    """B = H = 1, Dk = 2, Dv = 1, scale 1, a zero state.  Token 1 (q = k = e1, v = 2,
    beta 1, no decay): the delta is 2, S = [[2], [0]], o = 2.  Token 2 (q = e2,
    k = (0.6, 0.8), v = 1, beta 0.5, decay 0.5): S = [[1], [0]] predicts 0.6 for k, the
    delta is 0.5 * (1 - 0.6) = 0.2, S = [[1.12], [0.16]], o = 0.16."""
    import jax.numpy as jnp
    import torch

    from jax_attention.functional import gated_delta_rule as jax_rule
    from torch_attention.functional import gated_delta_rule as torch_rule

    q = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    k = np.array([[[[1.0, 0.0], [0.6, 0.8]]]])
    v = np.array([[[[2.0], [1.0]]]])
    g = np.log(np.array([[[1.0, 0.5]]]))
    beta = np.array([[[1.0, 0.5]]])
    want_out, want_state = np.array([[[[2.0], [0.16]]]]), np.array([[[[1.12], [0.16]]]])
    out, state = oracle(q, k, v, g, beta, scale=1.0)
    np.testing.assert_allclose(out, want_out, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(state, want_state, rtol=1e-15, atol=1e-15)
    for form in ("chunked", "recurrent"):
        for rule, wrap in ((jax_rule, lambda x: jnp.asarray(x, jnp.float32)),
                           (torch_rule, lambda x: torch.tensor(x, dtype=torch.float32))):
            out, state = rule(*map(wrap, (q, k, v, g, beta)), scale=1.0, form=form, chunk_size=2)
            np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(np.asarray(state), want_state, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("twin", ["jax", "torch"])
@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_each_form_against_the_oracle_and_each_other(twin: str, setting: Setting) -> None:
    """Out and the final state of both forms within the dtype's tolerance of the float64
    oracle (on the inputs as the dtype rounds them), and the two forms within it of each
    other."""
    arrays = _rounded(_inputs(setting), setting.dtype)
    want_out, want_state = oracle(**arrays, qk_l2norm=setting.l2norm)
    tol = DELTA_ORACLE[setting.dtype]
    results = {form: _run(twin, setting, arrays, form) for form in ("chunked", "recurrent")}
    for form, (out, state) in results.items():
        assert _error(out, want_out) <= tol, (form, _error(out, want_out))
        assert _error(state, want_state) <= DELTA_ORACLE[max(setting.dtype, "float32", key=_width)], form
    assert _error(results["chunked"][0], results["recurrent"][0]) <= 2 * tol


def _width(dtype: str) -> int:
    return {"bfloat16": 0, "float32": 1, "float64": 2}[dtype]


def test_the_twins_agree() -> None:
    """The same call in both twins, float32, each form: out and state within the parity
    tolerance (measured 1e-7)."""
    setting = SETTINGS[1]
    arrays = _rounded(_inputs(setting, seed=3), "float32")
    for form in ("chunked", "recurrent"):
        (jo, js), (to, ts) = _run("jax", setting, arrays, form), _run("torch", setting, arrays, form)
        assert _error(jo, to) <= DELTA_TWINS and _error(js, ts) <= DELTA_TWINS, form


# --------------------------------------------------------------------------- gradients

GRAD_SETTINGS = [Setting("scalar", (1, 1, 2, 5, 3, 2), 2, False, True, True, "bhsd", "float64"),
                 Setting("kda", (1, 1, 1, 5, 3, 2), 2, True, True, False, "bhsd", "float64")]
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _loss_oracle(arrays: dict[str, np.ndarray], cot: tuple[np.ndarray, np.ndarray], l2norm: bool) -> float:
    out, state = oracle(**arrays, qk_l2norm=l2norm)
    return float(np.sum(out * cot[0]) + np.sum(state * cot[1]))


def _grads(twin: str, setting: Setting, arrays: dict[str, np.ndarray], cot: tuple[np.ndarray, np.ndarray],
           form: str, dtype: str) -> dict[str, np.ndarray]:
    options = {"form": form, "chunk_size": setting.chunk, "qk_l2norm": setting.l2norm}
    if twin == "jax":
        import jax
        import jax.numpy as jnp

        with jax.enable_x64(dtype == "float64"):
            got = _jitted_grad(**options)({n: jnp.asarray(x.astype(dtype)) for n, x in arrays.items()},
                                          tuple(jnp.asarray(c.astype(dtype)) for c in cot))
            return {n: np.asarray(x, np.float64) for n, x in got.items()}
    import torch

    from torch_attention.functional import gated_delta_rule

    tensors = {n: torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True) for n, x in arrays.items()}
    given = dict(tensors)
    positional = [given.pop(n) for n in NAMES[:5]]
    out, state = gated_delta_rule(*positional, **given, **options)
    (torch.sum(out * torch.tensor(cot[0]).to(out)) + torch.sum(state * torch.tensor(cot[1]).to(state))).backward()
    return {n: t.grad.double().numpy() for n, t in tensors.items()}


@pytest.fixture(scope="module")
def grad_problems() -> list[tuple[Setting, dict[str, np.ndarray], tuple[np.ndarray, np.ndarray], list[dict[str, Any]]]]:
    """Each gradient setting's inputs, cotangents and three random directions over every
    input, with the oracle's central differences along them (eps 1e-6)."""
    problems = []
    for setting in GRAD_SETTINGS:
        arrays = _inputs(setting, seed=5)
        rng = np.random.default_rng(7)
        out, state = oracle(**arrays, qk_l2norm=setting.l2norm)
        cot = (rng.standard_normal(out.shape), rng.standard_normal(state.shape))
        directions = []
        for _ in range(3):
            u = {n: rng.standard_normal(x.shape) for n, x in arrays.items()}
            plus = _loss_oracle({n: x + 1e-6 * u[n] for n, x in arrays.items()}, cot, setting.l2norm)
            minus = _loss_oracle({n: x - 1e-6 * u[n] for n, x in arrays.items()}, cot, setting.l2norm)
            directions.append({"u": u, "fd": (plus - minus) / 2e-6})
        problems.append((setting, arrays, cot, directions))
    return problems


@pytest.mark.parametrize("twin", ["jax", "torch"])
def test_gradients_match_central_differences_of_the_oracle(twin: str, grad_problems: Any) -> None:
    """float64 autograd of sum(out * c1) + sum(state * c2), both forms, along three random
    directions over q, k, v, g, beta and the initial state, against the oracle's central
    differences (float32 gradients: against transformers', below)."""
    for setting, arrays, cot, directions in grad_problems:
        for form in ("chunked", "recurrent"):
            grads = _grads(twin, setting, arrays, cot, form, "float64")
            for direction in directions:
                ad = sum(float(np.sum(grads[n] * direction["u"][n])) for n in arrays)
                magnitude = sum(float(np.sum(np.abs(grads[n] * direction["u"][n]))) for n in arrays)
                error = abs(ad - direction["fd"]) / (magnitude + abs(direction["fd"]))
                assert error <= DELTA_GRAD_ORACLE, (setting.name, form, error)


# --------------------------------------------------------------------------- transformers


def _hf_inputs(per_channel: bool) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(11)
    batch, length, qk_heads, heads, key_dim, value_dim = 2, 11, 1, 2, 4, 3
    shapes = {"q": (batch, length, qk_heads, key_dim), "k": (batch, length, qk_heads, key_dim),
              "v": (batch, length, heads, value_dim)}
    made = {n: torch.tensor(rng.standard_normal(s), dtype=torch.float32, requires_grad=True) for n, s in shapes.items()}
    g = -rng.uniform(0.05, 1.0, (batch, length, heads) + ((key_dim,) if per_channel else ()))
    made["g"] = torch.tensor(g, dtype=torch.float32, requires_grad=True)
    made["beta"] = torch.tensor(rng.uniform(0.05, 1.0, (batch, length, heads)), dtype=torch.float32, requires_grad=True)
    made["initial_state"] = torch.tensor(rng.standard_normal((batch, heads, key_dim, value_dim)), dtype=torch.float32,
                                         requires_grad=True)
    return made


@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_transformers_functions_forward_and_backward(family: str) -> None:
    """transformers' chunked and recurrent functions (Qwen3-Next's gated delta rule; Kimi
    Linear's KDA: a decay per key channel, one head per value head) with the L2 norm, a
    ragged length (11, chunks of 4) and an initial state: checked against the oracle
    first, then each twin's same form against them, out, state and every input's
    gradient."""
    import warnings

    import jax.numpy as jnp
    import torch

    from torch_attention.functional import gated_delta_rule as torch_rule

    if family == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        theirs = {"chunked": m.torch_chunk_gated_delta_rule, "recurrent": m.torch_recurrent_gated_delta_rule}
    else:
        from transformers.models.kimi_linear import modeling_kimi_linear as m

        theirs = {"chunked": m.chunk_kimi_delta_attention, "recurrent": m.recurrent_kimi_delta_attention}
    per_channel = family == "kimi_linear"
    made = _hf_inputs(per_channel)
    if per_channel:  # KDA: as many query/key heads as value heads
        made["q"], made["k"] = (made[n].detach().repeat_interleave(2, dim=2).requires_grad_() for n in ("q", "k"))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    first = {n: made[n].detach().double().numpy() for n in names}
    want, want_state = oracle(*(np.swapaxes(first[n], 1, 2) for n in names[:5]),
                              initial_state=first["initial_state"], qk_l2norm=True)
    rng = np.random.default_rng(2)
    cot = rng.standard_normal(want.shape)
    for form, function in theirs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "falling back to its reference PyTorch implementation"
            kwargs = {"chunk_size": 4} if form == "chunked" else {}
            out, state = function(*(made[n] for n in names[:5]), initial_state=made["initial_state"],
                                  output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
        assert _error(out.detach().double().numpy(), np.swapaxes(want, 1, 2)) <= DELTA_ORACLE["float32"], form
        assert _error(state.detach().double().numpy(), want_state) <= DELTA_ORACLE["float32"], form
        grads = torch.autograd.grad((out * torch.tensor(np.swapaxes(cot, 1, 2)).float()).sum() + state.sum(),
                                    [made[n] for n in names])
        theirs_grads = {n: gr.double().numpy() for n, gr in zip(names, grads, strict=True)}
        ours = {n: made[n].detach().clone().requires_grad_() for n in names}
        o, s = torch_rule(*(ours[n] for n in names[:5]), initial_state=ours["initial_state"], form=form,
                          chunk_size=4, qk_l2norm=True, layout="bshd")
        ((o * torch.tensor(np.swapaxes(cot, 1, 2)).float()).sum() + s.sum()).backward()
        assert _error(o.detach().double().numpy(), out.detach().double().numpy()) <= DELTA_TWINS, form
        assert _error(s.detach().double().numpy(), state.detach().double().numpy()) <= DELTA_TWINS, form
        for n in names:
            assert _error(ours[n].grad.double().numpy(), theirs_grads[n]) <= DELTA_TWINS, (form, n)

        options = {"form": form, "chunk_size": 4, "qk_l2norm": True, "layout": "bshd"}
        values = {n: jnp.asarray(first[n], jnp.float32) for n in names}
        jo, _ = _jitted(**options)(*(values[n] for n in names[:5]), initial_state=values["initial_state"])
        assert _error(np.asarray(jo, np.float64), out.detach().double().numpy()) <= DELTA_TWINS, form
        jax_grads = _jitted_grad(**options)(values, (jnp.asarray(np.swapaxes(cot, 1, 2), jnp.float32),
                                                     jnp.ones(want_state.shape, jnp.float32)))
        for n in names:
            assert _error(np.asarray(jax_grads[n], np.float64), theirs_grads[n]) <= DELTA_TWINS, (form, n)


# --------------------------------------------------------------------------- errors

BAD = [
    ("a rank-3 q", {"q": (2, 5, 4)}, ValueError, "gated_delta_rule takes q, k and v of rank 4"),
    ("k another shape", {"k": (1, 2, 5, 3)}, ValueError, "q and k must have the same shape (B, Hk, T, Dk)"),
    ("value heads not a multiple", {"v": (1, 3, 5, 2), "g": (1, 3, 5), "beta": (1, 3, 5)}, ValueError,
     "v's heads must be a multiple of q and k's"),
    ("g another shape", {"g": (1, 2, 4)}, ValueError, "g must be (B, H, T) (a decay per head and token) or (B, H, T, Dk)"),
    ("beta per channel", {"beta": (1, 2, 5, 4)}, ValueError, "beta must be (B, H, T), H v's heads"),
    ("a state of another shape", {"initial_state": (1, 2, 2, 4)}, ValueError,
     "initial_state must be (B, H, Dk, Dv) = (1, 2, 4, 2); got (1, 2, 2, 4)"),
    ("an unknown form", {"form": "fused"}, ValueError, "form must be one of 'chunked', 'recurrent'; got 'fused'"),
    ("chunk 0", {"chunk_size": 0}, ValueError, "chunk_size must be >= 1; got 0"),
    ("a negative scale", {"scale": -1.0}, ValueError, "scale must be None or a positive finite number"),
    ("an int beta", {"beta_dtype": "int32"}, TypeError, "q, k, v, g and beta must share one floating-point dtype"),
]


@pytest.mark.parametrize(("case", "change", "error", "text"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_one_text_in_both_twins(case: str, change: dict[str, Any], error: type,
                                                          text: str) -> None:
    import jax.numpy as jnp
    import torch

    from jax_attention.functional import gated_delta_rule as jax_rule
    from torch_attention.functional import gated_delta_rule as torch_rule

    shapes = {"q": (1, 2, 5, 4), "k": (1, 2, 5, 4), "v": (1, 2, 5, 2), "g": (1, 2, 5), "beta": (1, 2, 5)}
    options = {n: change[n] for n in ("form", "chunk_size", "scale") if n in change}
    shapes.update({n: s for n, s in change.items() if n in shapes or n == "initial_state"})
    texts = []
    for rule, make in ((jax_rule, lambda s, d: jnp.zeros(s, d)), (torch_rule, lambda s, d: torch.zeros(s, dtype=getattr(torch, d)))):
        arrays = {n: make(s, change.get("beta_dtype", "float32") if n == "beta" else "float32") for n, s in shapes.items()}
        positional = [arrays.pop(n) for n in ("q", "k", "v", "g", "beta")]
        with pytest.raises(error) as raised:
            rule(*positional, **arrays, **options)
        texts.append(str(raised.value))
    assert texts[0] == texts[1] and text in texts[0], texts


def test_jit_compiles_once_for_a_shape() -> None:
    """Under ``jax.jit`` the chunked form is one scan: two calls of one shape compile
    once, and the result equals the eager call's bit for bit."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import gated_delta_rule

    setting = SETTINGS[0]
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in _inputs(setting).items()}
    traced = []

    @jax.jit
    def run(q: Any, k: Any, v: Any, g: Any, beta: Any) -> Any:
        traced.append(1)
        return gated_delta_rule(q, k, v, g, beta, chunk_size=setting.chunk)

    first, again = run(**arrays), run(**{n: x + 0 for n, x in arrays.items()})
    eager = gated_delta_rule(**arrays, chunk_size=setting.chunk)
    assert len(traced) == 1 and math.isfinite(float(jnp.sum(first[0])))
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(again[0]))
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(eager[0]))
