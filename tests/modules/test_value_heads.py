"""Value heads of their own width (``v_head_dim``) and a value scale (``v_scale``) on
``MultiHeadAttention``, both twins (MiMo-V2-Flash's ``v_head_dim`` and
``attention_value_scale``): W_value gives ``num_kv_heads * v_head_dim`` features times
``v_scale``, out_proj takes ``num_heads * v_head_dim``.  Each path (reference, fused,
blockwise, flex through a score mod) against the float64 oracle, the Flax twin against the
PyTorch one with its input gradient, cached decoding in both twins, and the refusals one
text in the registry and both twins."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support import constructor_errors, decode_in_steps, mha_oracle, needs_both, small_mha_pair

OPTIONS = {"num_kv_heads": 2, "v_head_dim": 6, "v_scale": 0.7, "out_bias": False}


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    return small_mha_pair(7, **OPTIONS)


def _x(t: int = 12) -> np.ndarray:
    return np.random.default_rng(3).standard_normal((2, t, 16)).astype(np.float32)


@needs_both
def test_the_widths_are_the_value_heads(pair: Any) -> None:
    torch_module, flax_module = pair
    shapes = {k: tuple(v.shape) for k, v in torch_module.state_dict().items()}
    assert shapes["W_value.weight"] == (12, 16) and shapes["out_proj.weight"] == (16, 24)
    assert shapes["W_key.weight"] == (8, 16)
    assert flax_module.spec.cache_widths() == (2, 4, 6)


@needs_both
@pytest.mark.parametrize("implementation", ["reference", "fused", "blockwise", "flex"])
def test_every_path_is_the_oracle_in_both_twins(pair: Any, implementation: str) -> None:
    import jax.numpy as jnp
    import torch

    from attention_spec.mods import alibi
    from parity_tests import to_flax
    from torch_attention import MultiHeadAttention

    torch_module, _ = pair
    options = dict(torch_module.spec.options())
    if implementation == "flex":  # a score mod that stands for no option: the flex path
        options["score_mod"] = alibi(np.array([0.5, 0.25, 0.125, 0.0625], np.float32))
    else:
        options["implementation"] = implementation
    module = MultiHeadAttention(**options).eval()
    module.load_state_dict(torch_module.state_dict())
    x = _x()
    want = mha_oracle(module, x, positions=np.arange(12)[None])
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    twin = np.asarray(to_flax(module)(jnp.asarray(x)))
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale <= 1e-5 and np.abs(twin - want).max() / scale <= 1e-5


@needs_both
def test_the_twins_agree_backward(pair: Any) -> None:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    torch_module, flax_module = pair
    x = _x()
    r = np.random.default_rng(5).standard_normal((2, 12, 16)).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_(True)
    (torch_module(xt) * torch.from_numpy(r)).sum().backward()
    graph, state = nnx.split(flax_module)
    dx = jax.grad(lambda xi: (nnx.merge(graph, state)(xi) * jnp.asarray(r)).sum())(jnp.asarray(x))
    want = xt.grad.numpy()
    assert np.abs(np.asarray(dx) - want).max() / np.abs(want).max() <= 1e-5


@needs_both
def test_cached_decoding_gives_the_whole_call_in_both_twins(pair: Any) -> None:
    import jax.numpy as jnp
    import torch

    torch_module, flax_module = pair
    x = _x()
    with torch.no_grad():
        whole = torch_module(torch.from_numpy(x)).numpy()
        stepped = decode_in_steps(torch_module, x, 8, 16)
    flax_stepped = decode_in_steps(flax_module, x, 8, 16)
    np.testing.assert_allclose(np.asarray(flax_module(jnp.asarray(x))), whole, rtol=0, atol=1e-5)
    np.testing.assert_allclose(stepped, whole, rtol=0, atol=1e-5)
    np.testing.assert_allclose(flax_stepped, whole, rtol=0, atol=1e-5)


@needs_both
@pytest.mark.parametrize(("options", "text"), [
    ({"v_head_dim": 0}, "v_head_dim must be >= 1; got 0"),
    ({"v_head_dim": 6, "output_gate": True}, "v_head_dim=6 gives the values heads of their own width: output_gate "
                                             "must be False; got output_gate=True"),
    ({"v_head_dim": 6, "out_proj": False}, "out_proj must be True; got out_proj=False"),
    ({"v_head_dim": 6, "values_from_keys": True}, "values_from_keys must be False"),
    ({"v_scale": 0.0}, "v_scale must be None or a finite number other than 0"),
    ({"v_scale": True}, "v_scale must be None or a finite number other than 0"),
])
def test_refusals_are_one_text_in_the_registry_and_both_twins(options: dict[str, Any], text: str) -> None:
    found = constructor_errors({"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 4,
                                **options})
    assert len(set(found)) == 1 and text in found[0][1], found
