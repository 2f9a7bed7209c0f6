"""Keys and values shared across layers (Gemma 4's ``num_kv_shared_layers``), both twins.

``MultiHeadAttention(..., kv_shared=True)`` holds ``W_query`` (and ``q_norm``) and
``out_proj`` alone; its call takes another layer's keys and values: ``kv=(k, v)`` as that
layer's call with ``return_kv=True`` returns them, or, in cached decoding, ``kv=cache``,
the storing layer's cache after its call on the same tokens (read, never written).

Here: numbers by hand, the float64 oracle, twin against twin with gradients (they reach
the storing layer's weights through the shared keys and values), cached decoding against
the whole sequence (Flax jitted), the call checks (one text in both twins, before any
work), the exporters' refusals by name, and transformers' own Gemma 4 text model built
tiny with its last two layers reusing, every attention replaced by ours, past 400.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import numpy as np
import pytest

from parity_tests.tolerances import GRAD_PARITY, ORACLE, PARITY
from tests.support import needs_both, needs_torch

# Positions past 400, where rope's errors show (two examples, apart).
FAR = 401 + np.arange(6)[None] + 9 * np.arange(2)[:, None]
STORE: dict[str, Any] = {"qk_norm": "rms", "v_norm": "rms", "num_kv_heads": 2}
# The reusing layer: its own window (its mask is its own).
REUSE: dict[str, Any] = {"qk_norm": "rms", "num_kv_heads": 2, "kv_shared": True, "window": (3, 0)}


def _x(batch: int = 2, seq: int = 6, width: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, seq, width)).astype(np.float32)


@functools.cache
def _pairs() -> tuple[Any, Any, Any, Any]:
    """A storing and a reusing torch MultiHeadAttention (d_in 16, 4 heads of 4, 2 key/value
    heads, rope on half of each head; eval) and their Flax twins."""
    import torch

    import torch_attention
    from attention_spec.rope import RopeConfig
    from parity_tests import to_flax

    rope = RopeConfig(theta=10000.0, partial_rotary_factor=0.5)
    torch.manual_seed(7)
    store = torch_attention.MultiHeadAttention(16, 16, None, 0.0, 4, True, **STORE, rope=rope).eval()
    reuse = torch_attention.MultiHeadAttention(16, 16, None, 0.0, 4, True, **REUSE, rope=rope).eval()
    with torch.no_grad():  # q_norm's weight away from ones
        reuse.q_norm.weight.uniform_(0.5, 1.5)
        store.q_norm.weight.uniform_(0.5, 1.5)
        store.k_norm.weight.uniform_(0.5, 1.5)
    return store, reuse, to_flax(store), to_flax(reuse)


def _params(module: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().double().numpy() for k, v in module.state_dict().items()}


# --------------------------------------------------------------------------- by hand


@needs_torch
def test_by_hand_and_what_it_holds() -> None:
    """No W_key, W_value or k_norm; the output by hand (float64, no rope): q = x Wq^T + b,
    RMS-normed per head times q_norm's weight, attending causally over the given k and v
    (2 key/value heads for 4 query heads) at 1/sqrt(4), mixed by out_proj.  The storing
    layer's return_kv gives what its own attention read."""
    import torch

    import torch_attention

    torch.manual_seed(3)
    kw = {"d_in": 8, "d_out": 8, "context_length": None, "dropout": 0.0, "num_heads": 4, "qkv_bias": True,
          "num_kv_heads": 2, "qk_norm": "rms"}
    store = torch_attention.MultiHeadAttention(**kw).double()
    reuse = torch_attention.MultiHeadAttention(**kw, kv_shared=True).double()
    assert sorted(n for n, _ in reuse.named_parameters()) == [
        "W_query.bias", "W_query.weight", "out_proj.bias", "out_proj.weight", "q_norm.weight"]
    assert reuse.W_key is None and reuse.W_value is None and not hasattr(reuse, "k_norm")
    x = torch.from_numpy(_x(2, 5, 8, seed=1)).double()
    out, (k, v) = store(x, return_kv=True)
    torch.testing.assert_close(out, store(x), rtol=0, atol=0)
    assert k.shape == v.shape == (2, 2, 5, 2)
    with torch.no_grad():
        reuse.q_norm.weight.uniform_(0.5, 1.5)
    got = reuse(x, kv=(k, v))

    q = (x @ reuse.W_query.weight.T + reuse.W_query.bias).view(2, 5, 4, 2)
    q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + 1e-6) * reuse.q_norm.weight
    q = q.transpose(1, 2)  # (B, H, T, D)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(2)
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    heads = (torch.softmax(s, -1) @ vv).transpose(1, 2).reshape(2, 5, 8)
    want = heads @ reuse.out_proj.weight.T + reuse.out_proj.bias
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # unbatched: x (T, d_in), kv (Hkv, T, D) as the unbatched storing call returns them
    out0, (k0, v0) = store(x[0], return_kv=True)
    assert k0.shape == (2, 5, 2)
    torch.testing.assert_close(reuse(x[0], kv=(k0, v0)), want[0], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- oracle and twins


@needs_both
def test_both_twins_against_the_oracle_past_400() -> None:
    """The storing layer's oracle returns its keys and values, the reusing layer's oracle
    attends over them with its own window, rotating its queries alone at
    positions past 400: each twin's pair of calls (PyTorch on every path) within the
    float32 oracle tolerance, the weights too."""
    import jax.numpy as jnp
    import torch

    from parity_tests import reference

    store, reuse, fstore, freuse = _pairs()
    x, tol = _x(seed=2), ORACLE["float32"]
    _, _, kv = reference.forward("MultiHeadAttention", store.config, _params(store), x.astype(np.float64),
                                 positions=FAR, return_kv=True)
    want, want_w = reference.forward("MultiHeadAttention", reuse.config, _params(reuse), x.astype(np.float64),
                                     positions=FAR, kv=kv)
    for path in ("reference", "fused", "blockwise", "auto"):
        _, (k, v) = store(torch.from_numpy(x), positions=torch.from_numpy(FAR), return_kv=True, implementation=path)
        np.testing.assert_allclose(k.detach().numpy(), kv[0], rtol=tol.rtol, atol=tol.atol)
        got = reuse(torch.from_numpy(x), positions=torch.from_numpy(FAR), kv=(k, v), implementation=path)
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=tol.rtol, atol=tol.atol, err_msg=path)
    got, weights = _flax_pair()(fstore, freuse, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=tol.rtol, atol=tol.atol)


@functools.cache
def _flax_pair() -> Any:
    """The Flax pair's call, jitted (one compilation, not one per eager operation): the
    storing layer's keys and values into the reusing layer, its output and weights, at FAR."""
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def run(store: Any, reuse: Any, x: Any) -> Any:
        _, kv = store(x, positions=jnp.asarray(FAR), return_kv=True)
        return reuse(x, positions=jnp.asarray(FAR), kv=kv, return_weights=True)

    return run


def _flax_grads(fstore: Any, freuse: Any, x: np.ndarray, g1: np.ndarray, g2: np.ndarray) -> dict[str, np.ndarray]:
    """The gradients of sum(store(x) * g1) + sum(reuse(x, kv) * g2), x's and both modules'
    parameters', named and laid out as the PyTorch twin's."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_attention.interop import torch_state_dict

    def loss(store: Any, reuse: Any, x: Any) -> Any:
        out, kv = store(x, positions=jnp.asarray(FAR), return_kv=True)
        return jnp.sum(out * g1) + jnp.sum(reuse(x, positions=jnp.asarray(FAR), kv=kv) * g2)

    gs, gr, gx = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2)))(fstore, freuse, jnp.asarray(x))
    grads = {"x": np.asarray(gx)}
    for name, module, g in (("store", fstore, gs), ("reuse", freuse, gr)):
        graph, state = nnx.split(module)
        clone = nnx.merge(graph, jax.tree.map(lambda a: a, state))
        nnx.update(clone, g)
        grads |= {f"{name}.{k}": v for k, v in torch_state_dict(clone).items()}
    return grads


@needs_both
def test_twin_against_twin_with_gradients() -> None:
    """Outputs and the gradients of x and of every parameter of both layers, PyTorch
    against Flax; the reusing layer's output alone sends gradients into the storing
    layer's W_key, W_value and k_norm through the shared keys and values."""
    import jax.numpy as jnp
    import torch

    store, reuse, fstore, freuse = _pairs()
    x = _x(seed=3)
    rng = np.random.default_rng(4)
    g1, g2 = (rng.standard_normal((2, 6, 16)).astype(np.float32) for _ in range(2))
    xt = torch.from_numpy(x).requires_grad_(True)
    pos = torch.from_numpy(FAR)
    out, kv = store(xt, positions=pos, return_kv=True)
    got = reuse(xt, positions=pos, kv=kv)
    tol, gtol = PARITY["float32"], GRAD_PARITY["float32"]
    np.testing.assert_allclose(np.asarray(_flax_pair()(fstore, freuse, jnp.asarray(x))[0]),
                               got.detach().numpy(), rtol=tol.rtol, atol=tol.atol)
    # the reusing layer's output alone reaches the storing layer's key and value weights
    reached = torch.autograd.grad(got.sum(), [store.W_key.weight, store.W_value.weight, store.k_norm.weight],
                                  retain_graph=True)
    assert all(float(g.abs().max()) > 0 for g in reached)
    store.zero_grad()
    reuse.zero_grad()
    ((out * torch.from_numpy(g1)).sum() + (got * torch.from_numpy(g2)).sum()).backward()
    want = {"x": xt.grad.numpy()} | {f"store.{n}": p.grad.numpy() for n, p in store.named_parameters()} | {
        f"reuse.{n}": p.grad.numpy() for n, p in reuse.named_parameters()}
    flax = _flax_grads(fstore, freuse, x, g1, g2)
    assert sorted(flax) == sorted(want)
    for name, g in want.items():
        np.testing.assert_allclose(flax[name], g, rtol=gtol.rtol, atol=gtol.atol, err_msg=name)


# --------------------------------------------------------------------------- cached decoding


@needs_both
def test_cached_decoding_equals_the_whole_sequence() -> None:
    """A prompt of 3 then one token at a time, the reusing layer reading the storing
    layer's cache after each of its calls (and writing none): both layers' outputs equal
    the whole sequence's, PyTorch eager and Flax jitted; PyTorch again with a padded
    prompt (2 and 3 valid tokens: the fills differ, the queries sit at each example's)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    store, reuse, fstore, freuse = _pairs()
    x, tol = _x(2, 7, seed=5), PARITY["float32"]
    whole_s, kv = store(torch.from_numpy(x), return_kv=True)
    whole = reuse(torch.from_numpy(x), kv=kv).detach().numpy()

    def steps(call: Any, cache: Any, chunks: list[tuple[int, int]]) -> tuple[list[Any], list[Any]]:
        outs, reused = [], []
        for a, b in chunks:
            out, cache, got = call(x[:, a:b], cache)
            outs.append(np.asarray(out))
            reused.append(np.asarray(got))
        return outs, reused

    chunks = [(0, 3), *((t, t + 1) for t in range(3, 7))]

    def torch_step(chunk: np.ndarray, cache: Any) -> Any:
        before = cache.key.clone()
        out, cache = store(torch.from_numpy(chunk), cache=cache)
        got = reuse(torch.from_numpy(chunk), kv=cache)
        assert torch.equal(before[:, :, :int(cache.lengths[0]) - chunk.shape[1]],
                           cache.key[:, :, :int(cache.lengths[0]) - chunk.shape[1]])
        return out.detach(), cache, got.detach()

    outs, reused = steps(torch_step, store.init_cache(2, 8), chunks)
    np.testing.assert_allclose(np.concatenate(outs, 1), whole_s.detach().numpy(), rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(np.concatenate(reused, 1), whole, rtol=tol.rtol, atol=tol.atol)

    @nnx.jit
    def flax_step(store: Any, reuse: Any, chunk: Any, cache: Any) -> Any:
        out, cache = store(chunk, cache=cache)
        return out, cache, reuse(chunk, kv=cache)

    outs, reused = steps(lambda c, cache: flax_step(fstore, freuse, jnp.asarray(c), cache), fstore.init_cache(2, 8),
                         chunks)
    np.testing.assert_allclose(np.concatenate(reused, 1), whole, rtol=tol.rtol, atol=tol.atol)

    # a padded prompt: example 0 has 2 valid tokens, example 1 has 3; then one token each
    cache = store.init_cache(2, 8)
    lengths = torch.tensor([2, 3])
    prompt = torch.from_numpy(x[:, :3])
    _, cache = store(prompt, cache=cache, kv_lengths=lengths)
    first = reuse(prompt, kv=cache, kv_lengths=lengths).detach().numpy()
    token = torch.from_numpy(np.stack([x[0, 2:3], x[1, 3:4]]))
    _, cache = store(token, cache=cache)
    nxt = reuse(token, kv=cache).detach().numpy()
    for b, n in ((0, 2), (1, 3)):
        seq = torch.from_numpy(np.concatenate([x[b, :n], token[b].numpy()])[None])
        _, kv_b = store(seq, return_kv=True)
        want = reuse(seq, kv=kv_b).detach().numpy()[0]
        np.testing.assert_allclose(first[b, :n], want[:n], rtol=tol.rtol, atol=tol.atol)
        np.testing.assert_allclose(nxt[b, 0], want[n], rtol=tol.rtol, atol=tol.atol)


# --------------------------------------------------------------------------- checks


def _causal(lib: Any) -> Any:
    if lib.__name__ == "jax_attention":
        from flax import nnx

        return lib.CausalAttention(16, 16, 8, 0.0, rngs=nnx.Rngs(0))
    return lib.CausalAttention(16, 16, 8, 0.0)


@needs_both
def test_call_checks_one_text_in_both_twins_before_any_work() -> None:
    """Each refused call raises the same type and text in both twins, before any work:
    the storing layer's cache keeps its fill and keys."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention

    store, reuse, fstore, freuse = _pairs()
    x = _x(seed=6)
    tx, fx = torch.from_numpy(x), jnp.asarray(x)
    _, tkv = store(tx, return_kv=True)
    tcache = store.init_cache(2, 8)
    _, tcache = store(tx[:, :2], cache=tcache)
    kept = tcache.key.clone(), tcache.lengths.clone()
    # the Flax twin's, as the PyTorch twin's calls gave them (the checks read shapes and fills)
    fkv = tuple(jnp.asarray(t.detach().numpy()) for t in tkv)
    fcache = fstore.init_cache(2, 8)._replace(lengths=jnp.asarray(tcache.lengths.numpy(), jnp.int32))

    def both(t_call: Any, f_call: Any, error: type[Exception], text: str) -> None:
        with pytest.raises(error, match=re.escape(text)) as t_info:
            t_call(torch_attention, tx, tkv, tcache, store, reuse)
        with pytest.raises(error) as f_info:
            f_call(jax_attention, fx, fkv, fcache, fstore, freuse)
        assert str(f_info.value) == str(t_info.value)

    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda lib, x, kv, c, s, r: r(x), ValueError, "kv_shared=True computes no keys or values"),
        (lambda lib, x, kv, c, s, r: s(x, kv=kv), ValueError, "this MultiHeadAttention computes its own"),
        (lambda lib, x, kv, c, s, r: r(x, kv=(kv[0][:, :1], kv[1][:, :1])), ValueError,
         "kv does not fit this module: keys (2, 1, 6, 4)"),
        (lambda lib, x, kv, c, s, r: r(x, kv=(kv[0][..., :2], kv[1][..., :2])), ValueError,
         "expected keys and values of shape (2, 2, 6, 4)"),
        (lambda lib, x, kv, c, s, r: r(x[:, :4], kv=kv), ValueError, "the length of x"),
        (lambda lib, x, kv, c, s, r: r(x, kv=(kv[0].astype("float16") if hasattr(kv[0], "astype")
                                              else kv[0].half(), kv[1])), ValueError,
         "kv must be in the module's compute dtype float32; got keys float16"),
        (lambda lib, x, kv, c, s, r: r(x, kv=kv[0]), TypeError, "kv must be a (keys, values) pair"),
        (lambda lib, x, kv, c, s, r: r(x, kv=kv, return_kv=True), ValueError, "computes none"),
        (lambda lib, x, kv, c, s, r: r(x, kv=kv, context=x), ValueError, "context must be None"),
        (lambda lib, x, kv, c, s, r: r(x[:, :1], cache=c), ValueError, "writes no cache"),
        (lambda lib, x, kv, c, s, r: r.init_cache(2, 8), TypeError, "it has no init_cache"),
        (lambda lib, x, kv, c, s, r: s(x[:, :1], cache=c, return_kv=True), ValueError,
         "return_kv=True with a cache"),
        (lambda lib, x, kv, c, s, r: s(x, return_kv=1), TypeError, "return_kv must be a bool"),
        (lambda lib, x, kv, c, s, r: r(x[:, :3], kv=c), ValueError, "got fills [2, 2], tokens [3, 3]"),
        (lambda lib, x, kv, c, s, r: _causal(lib)(x, return_kv=True), ValueError,
         "CausalAttention has no return_kv"),
        (lambda lib, x, kv, c, s, r: _causal(lib)(x, kv=kv), ValueError, "this CausalAttention computes its own"),
    ]
    for call, error, text in cases:
        both(call, call, error, text)
    assert torch.equal(tcache.key, kept[0]) and torch.equal(tcache.lengths, kept[1])
    for options, text in (({"values_from_keys": True}, "values_from_keys must be False"),
                          ({"v_norm": "rms"}, "v_norm must be None"), ({"kdim": 8}, "kdim must be None")):
        for lib in (torch_attention, jax_attention):
            with pytest.raises(ValueError, match=re.escape(text)):
                lib.MultiHeadAttention(16, 16, None, 0.0, 4, kv_shared=True, **options,
                                       **({"rngs": nnx.Rngs(0)} if lib is jax_attention else {}))
    with pytest.raises(TypeError, match="kv_shared must be a bool"):
        torch_attention.MultiHeadAttention(16, 16, None, 0.0, 4, kv_shared=1)


@needs_both
def test_exporters_refuse_it_by_name() -> None:
    """nn.MultiheadAttention, nnx.MultiHeadAttention and Linen's module take no other
    layer's keys: each exporter names kv_shared."""
    from jax_attention.interop import to_linen_multihead, to_nnx_multihead
    from torch_attention.interop import to_nn_multihead

    _, reuse, _, freuse = _pairs()
    for export, module in ((to_nn_multihead, reuse), (to_nnx_multihead, freuse), (to_linen_multihead, freuse)):
        with pytest.raises(ValueError, match="kv_shared=True"):
            export(module)


# --------------------------------------------------------------------------- transformers' Gemma 4


class _Ours:
    """A Gemma 4 decoder layer's ``self_attn`` replaced by ours (``from_hf``): a "store"
    layer's call returns its keys and values into ``shared`` under its layer type, a
    "reuse" layer's (``kv_shared=True``) takes them; rope at the layer's position ids."""

    def __new__(cls, hf: Any, shared: dict[str, Any]) -> Any:
        import torch

        from torch_attention.interop import from_hf

        class Wrapper(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ours = from_hf(hf)
                self.mode = "reuse" if hf.is_kv_shared_layer else "store" if hf.store_full_length_kv else None
                self.layer_type = hf.layer_type

            def forward(self, hidden_states: Any, position_embeddings: Any, attention_mask: Any,
                        shared_kv_states: Any = None, cache: Any = None, position_ids: Any = None,
                        **kwargs: Any) -> Any:
                if self.mode == "reuse":
                    out = self.ours(hidden_states, positions=position_ids, kv=shared[self.layer_type])
                elif self.mode == "store":
                    out, shared[self.layer_type] = self.ours(hidden_states, positions=position_ids, return_kv=True)
                else:
                    out = self.ours(hidden_states, positions=position_ids)
                return out, None

        return Wrapper()


@needs_torch
def test_gemma4_text_model_with_shared_layers_past_400() -> None:
    """transformers' Gemma 4 text model built tiny: 4 layers (sliding, full, sliding,
    full), the last two reusing the keys and values of the first two ("store"); every
    attention replaced by ours from ``from_hf`` (the reusing layers as kv_shared modules:
    W_query, q_norm, out_proj), wired as ``_Ours`` says; the logits at positions past 400
    within 1e-5 of the largest.  ``to_hf`` writes a reusing layer back one to one."""
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM, Gemma4TextAttention

    from torch_attention.interop import to_hf

    config = Gemma4TextConfig(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4, global_head_dim=8,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=4, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, vocab_size=32, hidden_size_per_layer_input=0,
        sliding_window=16, intermediate_size=32, attn_implementation="eager")
    assert config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    torch.manual_seed(9)
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms' weights away from their init
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 32, (2, 410), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # (a slice, not 0: transformers 5.24 slices the reusing layers' inputs to an int
        # logits_to_keep, and fails doing so without per-layer inputs)
        want = model(ids, logits_to_keep=slice(None)).logits
    shared: dict[str, Any] = {}
    layers = model.model.layers
    hf_reuse = layers[2].self_attn
    for layer in layers:
        layer.self_attn = _Ours(layer.self_attn, shared)
    assert layers[2].self_attn.ours.spec.kv_shared and layers[3].self_attn.ours.spec.kv_shared
    assert sorted(n for n, _ in layers[3].self_attn.ours.named_parameters()) == [
        "W_query.weight", "out_proj.weight", "q_norm.weight"]
    with torch.no_grad():
        got = model(ids, logits_to_keep=slice(None)).logits
    far = slice(401, None)
    error = float((got[:, far] - want[:, far]).abs().max() / want[:, far].abs().max())
    assert error <= 1e-5, error
    again = to_hf(layers[2].self_attn.ours, Gemma4TextAttention(config, layer_idx=2))
    assert all(torch.equal(a, b) for a, b in zip(hf_reuse.state_dict().values(), again.state_dict().values(),
                                                 strict=True))
