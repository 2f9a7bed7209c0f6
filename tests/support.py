"""What the tests share: whether each framework is installed, markers that skip a test
cleanly where one is missing, the tutorials' six input embeddings, seeded inputs, and the
constructor errors of both twins."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
from typing import Any

import numpy as np
import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("flax") is not None

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")
needs_jax = pytest.mark.skipif(not HAS_JAX, reason="JAX / Flax are not installed")
needs_both = pytest.mark.skipif(not (HAS_TORCH and HAS_JAX), reason="needs both PyTorch and JAX")

TUTORIAL_INPUTS = [
    [0.43, 0.15, 0.89],  # Your     (x^1)
    [0.55, 0.87, 0.66],  # journey  (x^2)
    [0.57, 0.85, 0.64],  # starts   (x^3)
    [0.22, 0.58, 0.33],  # with     (x^4)
    [0.77, 0.25, 0.10],  # one      (x^5)
    [0.05, 0.80, 0.55],  # step     (x^6)
]


def random_x(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Standard normal float32 inputs of ``shape``, from ``seed``."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@functools.cache
def small_mha_pair(seed: int, **options: Any) -> tuple[Any, Any]:
    """A PyTorch ``MultiHeadAttention`` (eval, d_in 16, 4 heads, qkv biases; by default half
    of each head turning, theta 10000) drawn from ``seed``, and its Flax twin by
    ``to_flax`` (the same weights); one pair per seed and options, shared by a file's tests."""
    import torch

    import torch_attention
    from attention_spec.rope import RopeConfig
    from parity_tests import to_flax

    options = {"rope": RopeConfig(theta=10000.0, partial_rotary_factor=0.5), **options}
    torch.manual_seed(seed)
    module = torch_attention.MultiHeadAttention(16, 16, None, 0.0, 4, True, **options).eval()
    return module, to_flax(module)


def decode_in_steps(module: Any, x: np.ndarray, prompt: int, max_len: int) -> np.ndarray:
    """A module's outputs for ``x`` (B, T, d_in) decoded through a fresh cache of
    ``max_len``: the first ``prompt`` tokens at once, then one token at a time; the outputs
    concatenated along T, as NumPy.  A Flax module's steps run under ``nnx.jit`` (one
    compile for the prompt, one for every step)."""
    step: Any
    if HAS_TORCH and isinstance(module, importlib.import_module("torch").nn.Module):
        import torch

        def step(chunk: np.ndarray, cache: Any) -> tuple[Any, Any]:
            out, cache = module(torch.from_numpy(chunk), cache=cache)
            return out.detach().numpy(), cache
    else:
        import jax.numpy as jnp
        from flax import nnx

        jitted = nnx.jit(lambda m, chunk, c: m(chunk, cache=c))

        def step(chunk: np.ndarray, cache: Any) -> tuple[Any, Any]:
            out, cache = jitted(module, jnp.asarray(chunk), cache)
            return np.asarray(out), cache

    cache = module.init_cache(x.shape[0], max_len)
    out, cache = step(x[:, :prompt], cache)
    outs = [out]
    for t in range(prompt, x.shape[1]):
        out, cache = step(x[:, t:t + 1], cache)
        outs.append(out)
    return np.concatenate(outs, 1)


def mha_oracle(module: Any, x: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """The float64 oracle's output of a PyTorch ``MultiHeadAttention`` on ``x``, with its
    weights as they are."""
    from parity_tests import reference

    params = {k: v.detach().double().numpy() for k, v in module.state_dict().items()}
    return reference.forward("MultiHeadAttention", module.config, params, x.astype(np.float64),
                             positions=positions)[0]


def assert_input_gradient_matches_finite_differences(module64: Any, x: np.ndarray, oracle: Any, *,
                                                     positions: np.ndarray | None = None, seed: int = 9) -> None:
    """d sum(out * cot) / dx of a float64 PyTorch module against central differences
    (h = 1e-6) of ``oracle(module64, x)`` (its float64 oracle), ``cot`` drawn from ``seed``."""
    import torch

    xt = torch.from_numpy(x).requires_grad_(True)
    out = module64(xt) if positions is None else module64(xt, positions=torch.from_numpy(positions))
    cot = np.random.default_rng(seed).standard_normal(tuple(out.shape))
    (out * torch.from_numpy(cot)).sum().backward()
    assert xt.grad is not None
    h = 1e-6
    numeric = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        numeric[idx] = ((oracle(module64, up) - oracle(module64, down)) * cot).sum() / (2 * h)
    np.testing.assert_allclose(xt.grad.numpy(), numeric, rtol=1e-6, atol=1e-7)


def assert_paths_and_twin(torch_m: Any, flax_m: Any, x: np.ndarray, positions: np.ndarray, want: np.ndarray,
                           paths: Any) -> None:
    """Each twin's output at ``positions`` on every one of ``paths`` against ``want`` (the
    float64 oracle, float32's oracle tolerance); then output and gradients (input and every
    parameter) twin against twin on ``auto`` (``check_parity``)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from parity_tests import check_parity
    from parity_tests.tolerances import ORACLE

    forward = nnx.jit(lambda m, x, p, path: m(x, positions=p, implementation=path), static_argnames="path")
    tol = ORACLE["float32"]
    for path in paths:
        got_t = torch_m(torch.from_numpy(x), positions=torch.from_numpy(positions), implementation=path)
        got_f = forward(flax_m, jnp.asarray(x), jnp.asarray(positions), path=path)
        np.testing.assert_allclose(got_t.detach().numpy(), want, rtol=tol.rtol, atol=tol.atol, err_msg=path)
        np.testing.assert_allclose(np.asarray(got_f), want, rtol=tol.rtol, atol=tol.atol, err_msg=path)
    report = check_parity(
        torch_m, flax_m, x, implementation="auto",
        torch_call=lambda m, *a, **k: m(*a, positions=torch.from_numpy(positions), **k),
        flax_call=lambda m, *a, **k: m(*a, positions=jnp.asarray(positions), **k))
    assert report.ok, report


def constructor_errors(options: dict[str, Any], variant: str = "MultiHeadAttention") -> list[tuple[type, str]]:
    """The exception of the registry's ``make_config`` and of each twin's constructor for
    ``options``, as (type, text): a bad option must give the same three."""
    from flax import nnx

    import jax_attention
    import torch_attention
    from attention_spec.registry import make_config

    found = []
    for build in (lambda: make_config(variant, options),
                  lambda: getattr(torch_attention, variant)(**options),
                  lambda: getattr(jax_attention, variant)(**options, rngs=nnx.Rngs(0))):
        with pytest.raises((TypeError, ValueError)) as info:
            build()
        found.append((info.type, str(info.value)))
    return found


# --------------------------------------------------------------------------- tiers of cases
#
# A test over several option axes takes its cases from ``tiered``, not from stacked
# ``parametrize`` decorators (a full product): the default run (plain ``pytest``, CI)
# runs the cases that show every feasible pair of values together; the rest of the
# product is marked ``exhaustive`` and runs only with ``pytest --exhaustive``; the quick
# tier (``pytest -m "not slow"``) runs one case of each test function (conftest.py).


def _value_of(entry: Any) -> tuple[Any, tuple[Any, ...], str | None]:
    """(value, marks, id) of an axis entry: a plain value or a one-value ``pytest.param``."""
    if isinstance(entry, type(pytest.param(None))):
        (value,) = entry.values
        return value, tuple(entry.marks), entry.id
    return entry, (), None


def _id_of(name: str, value: Any, given: str | None, index: int) -> str:
    if given is not None:
        return given
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return f"{name}{index}"


def tiered(argnames: str, *axes: Any, valid: Any = None, strength: int = 2) -> list[Any]:
    """``pytest.param`` rows for ``@pytest.mark.parametrize(argnames, tiered(...))`` over
    the product of ``axes`` (one sequence of values per name; a value may be a one-value
    ``pytest.param`` carrying marks and an id), constrained by ``valid(row)`` (a dict of
    name -> value of a partial row: False if no case may hold those values together).

    Rows of a covering of every single value: no mark (the quick tier). Further rows of a
    pairwise covering grown from them (``strength=2``), or of a second covering of every
    single value, its axes read backwards (``strength=1``: for two axes, where pairwise is
    the whole product), or none (``strength=0``: one covering is enough by default, where
    another test runs every pair): ``slow``. Every other row of the product: ``slow`` and
    ``exhaustive``. (Of the unmarked rows, the quick tier runs the first: conftest.py runs
    each test function once there.) Ids join the values' ids with "-" in the order of
    ``argnames``."""
    from parity_tests.cases import covering

    names = [n.strip() for n in argnames.split(",")]
    if len(names) != len(axes):
        raise ValueError(f"{len(names)} names ({argnames}) for {len(axes)} axes")
    entries = [[_value_of(e) for e in axis] for axis in axes]
    # covering() works on indices, so that unhashable values (arrays, dicts) can be axes
    index_axes = [tuple(range(len(axis))) for axis in entries]

    def index_valid(partial: dict[int, int]) -> bool:
        return valid is None or bool(valid({names[a]: entries[a][i][0] for a, i in partial.items()}))

    if strength not in (0, 1, 2):
        raise ValueError(f"strength must be 0, 1 or 2; got {strength!r}")
    once = covering(index_axes, index_valid, strength=1)
    if strength == 2:
        pairs = covering(index_axes, index_valid, strength=2, start=tuple(once))
    elif strength == 1:
        pairs = covering([axis[::-1] for axis in index_axes], index_valid, strength=1)
    else:
        pairs = []
    tier = {**{row: 2 for row in itertools.product(*index_axes) if index_valid(dict(enumerate(row)))},
            **{row: 1 for row in pairs}, **{row: 0 for row in once}}
    params = []
    for row in itertools.product(*index_axes):  # the product's order, so ids read as before
        if row not in tier:
            continue
        picked = [entries[a][i] for a, i in enumerate(row)]
        marks = [m for _, ms, _ in picked for m in ms]
        if tier[row] >= 1:
            marks.append(pytest.mark.slow)
        if tier[row] == 2:
            marks.append(pytest.mark.exhaustive)
        ident = "-".join(_id_of(names[a], v, given, i) for a, (i, (v, _, given)) in enumerate(zip(row, picked, strict=True)))
        params.append(pytest.param(*(v for v, _, _ in picked), marks=marks, id=ident))
    return params


def quick_only(values: Any, *keep: int) -> list[Any]:
    """``values`` as parameters of one axis, all but those at the indices ``keep`` (the
    first, by default) marked ``slow``: the case that the quick tier runs."""
    keep = keep or (0,)
    params = []
    for i, entry in enumerate(values):
        value, marks, given = _value_of(entry)
        extra = () if i in keep else (pytest.mark.slow,)
        params.append(pytest.param(value, marks=(*marks, *extra), id=given))
    return params


# --------------------------------------------------------------------------- compiled programs shared by tests

_PROGRAMS: dict[tuple[Any, ...], Any] = {}


def options_key(options: dict[str, Any]) -> tuple[Any, ...]:
    """Call options as part of a cache key: an array by its shape, dtype and bytes."""
    def static(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return value.shape, value.dtype.str, value.tobytes()
        return value if isinstance(value, (int, float, str, type(None))) else tuple(static(v) for v in value)

    return tuple(sorted((name, static(value)) for name, value in options.items()))


def shared_program(key: tuple[Any, ...], build: Any) -> Any:
    """The program cached under ``key`` in this process, ``build()`` on first use: one
    compiled function for every test that makes the same call on other data (op by op,
    or a new jit per test, each call compiled afresh)."""
    if key not in _PROGRAMS:
        _PROGRAMS[key] = build()
    return _PROGRAMS[key]


# --------------------------------------------------------------------------- whole-model proofs
# (tests/harness/test_family_proofs_2026.py, test_hybrid_proofs.py, test_sparse_proofs.py)


def lm_ids(seq: int, vocab: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    """Token ids (batch, seq), int64, uniform over ``vocab``, from ``seed``."""
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int64)


def left_padded(seq: int, pads: int, batch: int = 2) -> np.ndarray:
    """Hugging Face's attention mask (batch, seq), 1 = token: the last row left-padded by
    ``pads`` (0s first), the others whole."""
    mask = np.ones((batch, seq), np.int64)
    mask[-1, :pads] = 0
    return mask


def hf_logits(m: Any, ids: Any) -> Any:
    """A ``transformers`` causal LM's logits: ``locate_divergence``'s ``torch_call``."""
    return m(input_ids=ids).logits


def flax_logits(m: Any, ids: Any) -> Any:
    """A Flax port's logits (its ``"logits"``): ``locate_divergence``'s ``flax_call``."""
    return m(ids)["logits"]


def ported(hf: Any, flax: Any) -> tuple[Any, Any, list[Any]]:
    """(hf, flax, the weight map): ``infer_param_map``'s rules, the weights copied by them."""
    from parity_tests import copy_params, infer_param_map

    rules = infer_param_map(hf, flax)
    copy_params(hf, flax, rules)
    return hf, flax, rules


def assert_named_at(report: Any, torch_name: str, flax_path: tuple[Any, ...], direction: str = "forward") -> None:
    """A ``DivergenceReport``'s first divergence is ``direction`` at ``torch_name`` /
    ``flax_path``."""
    first = report.first
    assert first is not None and (first.torch_name, first.direction) == (torch_name, direction), str(report)
    assert first.flax_path == flax_path, str(report)


def proven(port: tuple[Any, Any, list[Any]], ids: np.ndarray, mask: np.ndarray, children: set[str],
           decode: Any = None, locate: bool = True) -> Any:
    """A whole-model proof in one call: ``check_causal_lm_parity`` on ``ids`` and the
    (left-padding) ``mask``: logits and every parameter's gradient at the real rows, two
    AdamW steps, three tokens decoded greedily with the port's caches (``decode``; None:
    ``parity_tests.causal_lm.greedy``); then ``locate_divergence`` on the clean port,
    forward, with no ``module_map``: nothing diverges, no boundary mismatch, ``children``
    compared (``locate=False``: not run, for a model whose modules return more than ours).
    Returns the ``CausalLMReport``."""
    from parity_tests import check_causal_lm_parity, locate_divergence
    from parity_tests.causal_lm import greedy

    hf, flax, rules = port
    report = check_causal_lm_parity(hf, flax, ids, mask, param_map=rules, steps=2, decode_steps=3,
                                    flax_decode=greedy if decode is None else decode)
    assert report.ok and report.divergence is None, report.message()
    pads = int(mask.size - mask.sum())
    assert report.logits.rows_left_out == pads and len(report.training.steps) == 2 and report.tokens_agree
    grads = [f for f in report.logits.findings if f.name.startswith("grad ") and not f.name.startswith("grad input[")]
    assert {f.name.removeprefix("grad ") for f in grads} == {n for n, _ in hf.named_parameters()}
    assert [f.name for f in report.decoding] == [f"decode step {s} logits" for s in range(3)]
    if not locate:
        return report
    clean = locate_divergence(hf, flax, ids, torch_call=hf_logits, flax_call=flax_logits, backward=False)
    assert clean.ok and not clean.boundaries, str(clean)
    assert children <= {p.torch_name for p in clean.pairs if p.output.ok}, str(clean)
    return report
