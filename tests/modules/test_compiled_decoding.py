"""Compiled decoding in Flax: a jitted step has no host callback (the max_len check is
an overflow record in the cache, see test_cache_and_call_checks.py), attends over the
filled part of the cache (buckets of 128, 256, ... up to max_len), and updates a donated
cache in place.  Every path decodes what the full causal forward computes, against the
float64 oracle, with a cache far longer than its fill and fills that cross buckets.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import ORACLE, PARITY
from tests.support import needs_both, needs_jax, quick_only, tiered

PATHS = ("reference", "fused", "blockwise", "auto")


def _pair(d_in: int, heads: int, kv_heads: int, seed: int = 0) -> tuple[Any, Any]:
    """A causal torch MultiHeadAttention (eval) and its Flax twin with the same weights."""
    import torch

    import torch_attention
    from parity_tests import to_flax

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadAttention(d_in, d_in, None, 0.0, heads, True, num_kv_heads=kv_heads).eval()
    return module, to_flax(module)


def _oracle(module: Any, x: np.ndarray, rows: Any = None) -> np.ndarray:
    """The float64 oracle's output; of the query ``rows`` alone (indices) when given, the
    others masked out (zeros): its loops cost a Python step per key of each query it
    computes, and a query that its mask leaves no key costs none."""
    from parity_tests import reference

    params = {k: v.detach().double().numpy() for k, v in module.state_dict().items()}
    mask = None
    if rows is not None:
        mask = np.zeros((1, 1, x.shape[1], 1), bool)
        mask[:, :, rows] = True
    return reference.forward("MultiHeadAttention", module.config, params, x.astype(np.float64), mask)[0]


def _decoding_input() -> np.ndarray:
    """test_decoding_equals_the_oracle_and_the_full_forward's x: 2 examples of 140 tokens."""
    return np.random.default_rng(1).standard_normal((2, 140, 16)).astype(np.float32)


@functools.cache
def _decoding_oracle(heads: tuple[int, int]) -> np.ndarray:
    """The oracle's output for that test's module of ``heads`` (its weights from seed 0)
    and x: computed once for the cases that share them, not once a case."""
    torch_m, _ = _pair(16, *heads)
    return _oracle(torch_m, _decoding_input())


def _close(got: np.ndarray, want: np.ndarray, tol: Any) -> None:
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)


def _step(flax_m: Any, implementation: str) -> Any:
    """The fastest jitted step: the module split once, a pure step, the cache donated."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(flax_m)
    step = jax.jit(lambda state, x, cache: nnx.merge(graphdef, state)(x, cache=cache, implementation=implementation),
                   donate_argnums=2)
    return lambda x, cache: step(state, x, cache)


def _decode(flax_m: Any, x: np.ndarray, prompt: int, max_len: int, implementation: str,
            chunks: tuple[int, ...] = ()) -> tuple[np.ndarray, Any]:
    """The prompt eagerly, then ``chunks`` (token counts) and single tokens, jitted."""
    import jax.numpy as jnp

    step = _step(flax_m, implementation)
    xs = jnp.asarray(x)
    out, cache = flax_m(xs[:, :prompt], cache=flax_m.init_cache(x.shape[0], max_len), implementation=implementation)
    outs, t = [np.asarray(out)], prompt
    for n in (*chunks, *([1] * (x.shape[1] - prompt - sum(chunks)))):
        out, cache = step(xs[:, t : t + n], cache)
        outs.append(np.asarray(out))
        t += n
    return np.concatenate(outs, 1), cache


@needs_both
# pairwise over (path, heads, by example): every path grouped and not, batched and not
@pytest.mark.parametrize("implementation,heads,by_example", tiered(
    "implementation,heads,by_example", PATHS,
    [pytest.param((4, 2), id="grouped"), pytest.param((2, 2), id="mha")],
    [pytest.param(False, id="batched"), pytest.param(True, id="by-example")]))
def test_decoding_equals_the_oracle_and_the_full_forward(implementation: str, heads: tuple[int, int],
                                                         by_example: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of 124, a chunk of 3 and 13 single tokens, jitted and donated, with a
    cache of max_len 512 (buckets 128, 256, 512): the fill crosses 128 under jit.
    ``by_example``: every bucket counts as long, so one-token steps attend example by
    example (``_DECODE_BYTES``), as a large batch with a long fill does."""
    from jax_attention import _cache

    if by_example:
        monkeypatch.setattr(_cache, "_DECODE_BYTES", 0)
    _, flax_m = _pair(16, *heads)
    x = _decoding_input()
    # (a cache of 512, not 1000: a bucket less to compile in each of the two steps)
    got, cache = _decode(flax_m, x, 124, 512, implementation, chunks=(3,))
    assert np.asarray(cache.lengths).tolist() == [140, 140] and np.asarray(cache.overflow).tolist() == [0, 0]
    _close(got, _decoding_oracle(heads), ORACLE["float32"])
    _close(got, np.asarray(flax_m(x, implementation=implementation)), PARITY["float32"])


@needs_both
@pytest.mark.slow
def test_decoding_past_2048_runs_the_tiled_blockwise_kernel() -> None:
    """Fills past 2048 of a cache of 4200 attend over 4096 positions, where the blockwise
    path walks key tiles in loops ("blockwise-tiled"): the decoded tokens and rows of the
    prompt against the oracle, every row against the PyTorch twin's full forward."""
    import jax.numpy as jnp
    import torch

    import jax_attention

    torch_m, flax_m = _pair(8, 2, 1)
    x = np.random.default_rng(2).standard_normal((1, 2102, 8)).astype(np.float32)
    q, k = jnp.zeros((1, 1, 2, 4)), jnp.zeros((1, 1, 4096, 4))
    assert jax_attention.functional.route(q, k, k, kv_lengths=[2101], implementation="blockwise").kernel == (
        "blockwise-tiled")
    got, _ = _decode(flax_m, x, 2100, 4200, "blockwise")
    # The oracle's Python loops over every row took 35 s: it checks the two decoded
    # tokens and the prompt's every 64th row, those about 2048 and its last (rows in
    # every query tile and key tile of the loops), under a second; the twin every row.
    rows = [*range(0, 2100, 64), 2047, 2048, 2099, 2100, 2101]
    _close(got[:, rows], _oracle(torch_m, x, rows)[:, rows], ORACLE["float32"])
    with torch.no_grad():
        _close(got, torch_m(torch.from_numpy(x)).numpy(), PARITY["float32"])


@needs_jax
def test_a_jitted_step_has_no_host_callback_and_attends_by_buckets() -> None:
    """On a path that reads every key it is given (here the explicit math), a step
    attends over the smallest bucket of positions that holds the fill: one switch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    m = jax_attention.MultiHeadAttention(16, 16, None, 0.0, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    cache = m.init_cache(2, 1000)
    for tokens in (1, 3):
        jaxpr = str(jax.make_jaxpr(lambda s, x, c: nnx.merge(graphdef, s)(x, cache=c, implementation="reference"))(
            state, jnp.zeros((2, tokens, 16)), cache))
        assert "callback" not in jaxpr
        assert jaxpr.count("cond[") == 1  # one switch over the buckets 128, 256, 512, 1000
    assert jax_attention._cache.fill_buckets(1000) == (128, 256, 512, 1000)
    assert jax_attention._cache.fill_buckets(128) == (128,)


@needs_jax
def test_a_step_on_the_cpu_kernel_reads_the_cache_as_it_lies() -> None:
    """On CPU, a one-token step (its query heads folded into rows) runs on the kernel's
    forward for few rows, which reads no key past a length: no buckets (no switch), and
    no operation in the compiled step makes a cache-sized array but the write into the
    cache itself (no copy, no zeroing past the fill), so a step costs what the filled
    part costs, whatever max_len."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention
    from jax_attention import _cpu_fused

    q = jnp.zeros((2, 2, 2, 8), jnp.float32)
    if not _cpu_fused.cpu_kernel_supports(q, implementation="auto", few_rows=True) or not _cpu_fused.confirm(
            "auto", few_rows=True):
        pytest.skip("auto runs the CPU kernel only on XLA's CPU backend, where it is built and tuned for the CPU")
    m = jax_attention.MultiHeadAttention(16, 16, None, 0.0, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    cache = m.init_cache(2, 1000)

    def step(s: Any, x: Any, c: Any) -> Any:
        return nnx.merge(graphdef, s)(x, cache=c)

    assert "cond[" not in str(jax.make_jaxpr(step)(state, jnp.zeros((2, 1, 16)), cache))
    text = jax.jit(step, donate_argnums=2).lower(state, jnp.zeros((2, 1, 16)), cache).compile().as_text()
    assert "twin_attention_decode_fwd" in text
    sized = [line for line in text.splitlines() if "f32[2,2,1000,4]" in line.split("=", 1)[-1].split("(", 1)[0]
             and not any(op in line for op in ("parameter(", "get-tuple-element(", "tuple(", "scatter", "fusion("))]
    assert not sized, sized
    fusions = [line for line in text.splitlines() if "= f32[2,2,1000,4]" in line and "fusion(" in line]
    assert all("scatter" in line or "dynamic-update-slice" in line for line in fusions), fusions


@needs_jax
@pytest.mark.parametrize("implementation", quick_only(PATHS, 3))
def test_a_donated_cache_is_updated_in_place(implementation: str) -> None:
    """The compiled step aliases every field of a donated cache to the cache it returns
    (input_output_alias) and copies none of them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    m = jax_attention.MultiHeadAttention(64, 64, None, 0.0, 8, num_kv_heads=2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    cache = m.init_cache(4, 1024)
    step = jax.jit(lambda s, x, c: nnx.merge(graphdef, s)(x, cache=c, implementation=implementation),
                   donate_argnums=2)
    compiled = step.lower(state, jnp.zeros((4, 1, 64)), cache).compile()
    memory: Any = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= sum(t.nbytes for t in jax.tree.leaves(cache))
    text = str(compiled.as_text())
    header = text[text.index("input_output_alias={"):text.index("entry_computation_layout")]
    assert header.count("may-alias") + header.count("must-alias") == len(cache)
    entry = text[text.index("\nENTRY"):]
    assert not [line for line in entry.splitlines() if " copy(" in line and "[4,2,1024,8]" in line]


@needs_jax
def test_latent_attention_records_an_overflow_under_jit_too() -> None:
    """The latent cache takes the same guarded write: a jitted step past max_len writes
    nothing and records it; the next eager call raises the eager text."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention
    from attention_spec.rope import RopeConfig

    m = jax_attention.MultiHeadLatentAttention(
        d_in=16, num_heads=4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=7,
        q_lora_rank=None, rope=RopeConfig(theta=10000.0), rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 16)).astype(np.float32))
    step = nnx.jit(lambda m, x, cache: m(x, cache=cache))
    _, cache = step(m, x[:, :3], m.init_cache(2, 4))
    eager = pytest.raises(ValueError, match="cannot take 2 more")
    with eager as before:
        m(x[:, 3:5], cache=cache)
    out, failed = jax.block_until_ready(step(m, x[:, 3:5], cache))
    assert np.isnan(np.asarray(out)).all() and np.asarray(failed.overflow).tolist() == [3, 2]
    np.testing.assert_array_equal(np.asarray(failed.key), np.asarray(cache.key))
    with pytest.raises(ValueError) as after:
        m(x[:, 3:4], cache=failed)
    assert str(after.value) == str(before.value)
