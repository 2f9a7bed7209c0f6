"""Whole-model proofs of two 2026 families, each in one call: a Llama 4 text model
(``Llama4ForCausalLM``: a chunked RoPE layer with a weightless L2 qk-norm beside a NoPE
layer with attention temperature tuning, every layer a top-1 sigmoid-routed mixture of
experts plus a shared expert, an untied head) and a Gemma 4 text model
(``Gemma4ForCausalLM``: a sliding layer of head width 8 beside a full layer of width 16
whose keys are its values (``attention_k_eq_v``) and whose rope is proportional (a
quarter of the pairs rotate), q-, k- and v-norms, sandwich norms, a scaled embedding tied
to the head, the final logits soft-capped), both built tiny (width 32, 2 layers) with
every weight random.  The Flax side follows ``tests/harness/test_family_proofs.py``:
modules named as Hugging Face's, the attention ``to_flax(from_hf(layer))`` per layer,
the MoE written plainly here; ``check_causal_lm_parity`` proves logits and every
parameter's gradient at 512 positions, AdamW steps and greedy decoding with one KV cache
per layer (``parity_tests.causal_lm.greedy``); ``locate_divergence`` finds the clean
port clean with no ``module_map`` and names a bug planted in one layer.

Both are proven on a left-padded batch of 512.  ``transformers`` counts a left-padded
row's Llama 4 chunks from its first real token (``chunked_overlay``: ``(kv_idx -
left_padding) // C``), whatever positions rotate it; ours counts them at ``positions=``
(``attention_spec.geometry.chunk_origin``: from each row's position 0), so the Llama 4
port gives its chunked layer the positions ``generate`` gives (real tokens counted from
0, ``generate_positions``), where Hugging Face's forward rotates at slots 0 .. T - 1:
the same rotation of each query against each key, up to rounding (measured: the model's
logits move by 4.2e-6 of 4.5 between the two in transformers itself).
``test_llama4_chunks_under_left_padding_are_counted_from_each_rows_first_token`` shows
the layer alone.  Llama 4's temperature tuning scales at the slot (``arange +
past_seen_tokens``, pads counted) in both, the NoPE layer taking no ``positions=``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support import (
    assert_named_at,
    flax_logits,
    hf_logits,
    left_padded,
    lm_ids,
    needs_both,
    ported,
    proven,
)

pytestmark = needs_both
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from parity_tests import copy_params, infer_param_map, locate_divergence, to_flax  # noqa: E402
from parity_tests.causal_lm import PaddedEmbed, greedy, randomise  # noqa: E402
from torch_attention.interop import from_hf  # noqa: E402

VOCAB, WIDTH, LONG, PADS, CHUNK = 96, 32, 512, 37, 16
_ZEROS = nnx.initializers.zeros_init()  # the weights are copied in: no random draw to compile per shape
COMMON = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              use_cache=False)


def _nudged_query(port: tuple[Any, Any, list[Any]], layer: int) -> Any:
    """``locate_divergence`` with one element of layer ``layer``'s ``W_query`` kernel
    nudged by 1e-3 (then restored)."""
    hf, flax, _ = port
    kernel = flax.model.layers[layer].self_attn.W_query.kernel
    saved = kernel[...]
    kernel[...] = saved.at[3, 5].add(1e-3)
    try:
        return locate_divergence(hf, flax, lm_ids(LONG, VOCAB), torch_call=hf_logits, flax_call=flax_logits)
    finally:
        kernel[...] = saved


class _Cached(nnx.Module):
    """What both families' decoder layers share: ``_forward(x, attend)`` with the
    attention ``to_flax(from_hf(...))`` at ``positions=`` where it rotates (a NoPE layer
    takes none: its temperature tuning counts slots, as Hugging Face's does); called on a
    whole sequence, or, ``step``, on new tokens with a KV cache (``greedy``)."""

    self_attn: Any

    def _at(self, positions: jax.Array) -> dict[str, jax.Array]:
        return {} if self.self_attn.spec.rope is None else {"positions": positions}

    def _forward(self, x: jax.Array, attend: Any) -> jax.Array:
        raise NotImplementedError

    def __call__(self, x: jax.Array, mask: Any, positions: jax.Array) -> jax.Array:
        # the weights too, as Hugging Face's eager layers return them: one structure to compare
        return self._forward(x, lambda h: self.self_attn(h, mask, return_weights=True, **self._at(positions))[0])

    def step(self, x: jax.Array, mask: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """The layer on new tokens with its KV cache: ``(x, cache) -> (x, new cache)``."""
        box: list[Any] = []

        def attend(h: jax.Array) -> jax.Array:
            out, new = self.self_attn(h, mask, cache=cache, **self._at(positions))
            box.append(new)
            return out

        return self._forward(x, attend), box[0]


class _CausalLM(nnx.Module):
    """``model`` (``embed_tokens``, ``layers``, ``norm``) and the head, named as Hugging
    Face's; ``attention_mask`` (B, T), 1 = token."""

    model: Any

    def head(self, hidden: jax.Array) -> jax.Array:
        raise NotImplementedError

    def positions(self, ids: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
        return jnp.arange(ids.shape[1])[None]  # Hugging Face's: 0 .. T-1

    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> dict[str, jax.Array]:
        mask = None if attention_mask is None else jnp.asarray(attention_mask)[:, None, None, :].astype(bool)
        x, positions = self.model.embed_tokens(ids), self.positions(ids, attention_mask)
        for layer in self.model.layers:
            x = layer(x, mask, positions)
        return {"logits": self.head(self.model.norm(x))}


class _Inner(nnx.Module):
    def __init__(self, embed: Any, layers: list[Any], norm: Any) -> None:
        self.embed_tokens, self.layers, self.norm = embed, nnx.List(layers), norm


# --------------------------------------------------------------------------- Llama 4


class _SiLU(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x)


class _L4MLP(nnx.Module):
    """``Llama4TextMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (the shared expert)."""

    def __init__(self, width: int, inner: int, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(width, inner, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.up_proj = nnx.Linear(width, inner, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.down_proj = nnx.Linear(inner, width, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.activation_fn = _SiLU()

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.activation_fn(self.gate_proj(x)) * self.up_proj(x))


class _L4Router(nnx.Module):
    """``Llama4Router``: logits ``x @ weight.T`` (E, C) as Hugging Face stores it; each
    token's top-k logits through a sigmoid, every other expert's score 0 (Hugging Face's
    ``-inf`` scattered, then the sigmoid); returns ``(scores, logits)`` (N, E) each."""

    def __init__(self, experts: int, width: int, top_k: int) -> None:
        self.weight = nnx.Param(jnp.zeros((experts, width), jnp.float32))
        self.top_k = top_k

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:  # (N, C)
        logits = x @ self.weight[...].T
        _, index = jax.lax.top_k(logits, self.top_k)
        chosen = jnp.sum(jax.nn.one_hot(index, logits.shape[-1], dtype=jnp.int32), axis=1) > 0
        return jnp.where(chosen, jax.nn.sigmoid(logits.astype(jnp.float32)), 0.0).astype(logits.dtype), logits


class _L4Experts(nnx.Module):
    """``Llama4TextExperts``: the input (E * N, C) in expert blocks, each block times its
    expert's ``gate_up_proj`` (E, C, 2 I), ``up * silu(gate)``, times ``down_proj`` (E, I, C)."""

    def __init__(self, experts: int, width: int, inner: int) -> None:
        self.gate_up_proj = nnx.Param(jnp.zeros((experts, width, 2 * inner), jnp.float32))
        self.down_proj = nnx.Param(jnp.zeros((experts, inner, width), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        experts, width = self.gate_up_proj.shape[0], x.shape[-1]
        gate, up = jnp.split(jnp.einsum("enc,eco->eno", x.reshape(experts, -1, width), self.gate_up_proj[...]), 2, -1)
        return jnp.einsum("eni,eic->enc", up * jax.nn.silu(gate), self.down_proj[...]).reshape(-1, width)


class _L4Moe(nnx.Module):
    """``Llama4TextMoe``: every expert on every token scaled by its score (0 where not
    routed), summed, plus the shared expert; returns ``(out (N, C), router logits)``."""

    def __init__(self, hf_moe: Any, rngs: nnx.Rngs) -> None:
        experts = hf_moe.experts
        self.router = _L4Router(hf_moe.num_experts, hf_moe.hidden_dim, hf_moe.top_k)
        self.experts = _L4Experts(experts.num_experts, experts.hidden_size, experts.expert_dim)
        self.shared_expert = _L4MLP(hf_moe.hidden_dim, hf_moe.shared_expert.gate_proj.out_features, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        flat = x.reshape(-1, x.shape[-1])
        scores, logits = self.router(flat)
        routed = self.experts(jnp.tile(flat, (scores.shape[1], 1)) * scores.T.reshape(-1, 1))
        return self.shared_expert(flat) + routed.reshape(scores.shape[1], *flat.shape).sum(0), logits


class _L4Layer(_Cached):
    """``Llama4TextDecoderLayer``: ``x + self_attn(input_layernorm(x))``, then
    ``x + feed_forward(post_attention_layernorm(x))``."""

    def __init__(self, hf_layer: Any, eps: float, rngs: nnx.Rngs) -> None:
        width = hf_layer.hidden_size
        self.input_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.self_attn = to_flax(from_hf(hf_layer.self_attn))
        self.post_attention_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.feed_forward = _L4Moe(hf_layer.feed_forward, rngs)

    def _forward(self, x: jax.Array, attend: Any) -> jax.Array:
        x = x + attend(self.input_layernorm(x))
        return x + self.feed_forward(self.post_attention_layernorm(x))[0].reshape(x.shape)


class _Llama4ForCausalLM(_CausalLM):
    def __init__(self, hf: Any) -> None:
        c, rngs = hf.config, nnx.Rngs(0)
        self.model = _Inner(PaddedEmbed(c.vocab_size, c.hidden_size, c.pad_token_id, rngs),
                            [_L4Layer(layer, c.rms_norm_eps, rngs) for layer in hf.model.layers],
                            nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs))
        self.lm_head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, kernel_init=_ZEROS, rngs=rngs)

    def head(self, hidden: jax.Array) -> jax.Array:
        return self.lm_head(hidden)

    def positions(self, ids: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
        """``generate``'s positions (``generate_positions``): the chunks are counted at them,
        from each row's first real token, as Hugging Face's mask counts them."""
        if attention_mask is None:
            return super().positions(ids, attention_mask)
        real = jnp.asarray(attention_mask).astype(jnp.int32)
        return jnp.where(real != 0, jnp.cumsum(real, axis=-1) - 1, 1)


def _llama4_config() -> Any:
    import transformers

    config = transformers.Llama4TextConfig(
        **COMMON, intermediate_size=16, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1,
        moe_layers=[0, 1], attention_chunk_size=CHUNK, no_rope_layers=[1, 0], use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=32, attn_scale=0.1)  # layer 0 rotates in chunks, layer 1 is NoPE
    config._attn_implementation = "eager"
    return config


def _llama4_hf() -> Any:
    import transformers

    config = _llama4_config()
    torch.manual_seed(0)
    hf = transformers.Llama4ForCausalLM(config).float().eval()
    randomise(hf, 0)
    return hf


@pytest.fixture(scope="module")
def llama4() -> tuple[Any, Any, list[Any]]:
    hf = _llama4_hf()
    return ported(hf, _Llama4ForCausalLM(hf))


def test_a_whole_llama4_port_with_chunks_and_a_nope_layer_is_proven_in_one_call(
        llama4: tuple[Any, Any, list[Any]]) -> None:
    """``from_hf`` reads layer 0 as chunked (16) with a weightless qk-norm and rope, layer 1
    as NoPE with temperature tuning (``QueryScale(0.1, 32, 1)``: the scale is 1 + 0.1 *
    log(17) at slot 511); the router's and the experts' weights are paired by name and
    shape.  The batch's second row left-padded by 37, no multiple of the chunk (16): its
    chunks counted from its first real token, as Hugging Face's (see the module's
    docstring)."""
    _, flax, rules = llama4
    first, second = (layer.self_attn.spec for layer in flax.model.layers)
    assert (first.chunk, first.qk_norm, first.qk_norm_weight, first.rope is None) == (CHUNK, "rms", False, False)
    assert (second.chunk, second.rope, tuple(second.query_scale)) == (None, None, (0.1, 32, 1))
    mapped = {r.torch_names[0]: r.flax_paths[0] for r in rules}
    assert mapped["model.layers.1.feed_forward.experts.gate_up_proj"][-2:] == ("experts", "gate_up_proj")
    proven(llama4, lm_ids(LONG, VOCAB), left_padded(LONG, PADS),
           {"model.layers.1.feed_forward.router", "model.layers.1.feed_forward.experts",
            "model.layers.0.feed_forward.shared_expert", "model.layers.0.self_attn.o_proj",
            "model.layers.1.self_attn"})


def test_a_llama4_nudged_query_in_the_chunked_layer_is_named_at_that_projection(
        llama4: tuple[Any, Any, list[Any]]) -> None:
    """One element of layer 0's ``W_query`` nudged by 1e-3: named at ``q_proj``."""
    assert_named_at(_nudged_query(llama4, 0), "model.layers.0.self_attn.q_proj",
              ("model", "layers", 0, "self_attn", "W_query"))


def test_llama4_chunks_under_left_padding_are_counted_from_each_rows_first_token(
        llama4: tuple[Any, Any, list[Any]]) -> None:
    """The chunked layer alone on the left-padded batch of 512 (the second row padded by
    37, no multiple of 16), at ``generate``'s positions: both rows agree with
    ``transformers``' layer under its chunked mask (its rope at slots 0..511) at every real
    row, past 400 included: the padded row's first chunk is its tokens 0 .. 15 (slots 37
    .. 52) in both.  At positions counting slots (0..511 for both rows) its chunks would
    start at slot 0: from slot 48 on (the first boundary after 37) every row differs."""
    from transformers.masking_utils import create_chunked_causal_mask

    from parity_tests.causal_lm import generate_positions

    hf, flax, _ = llama4
    x, mask = np.random.default_rng(1).standard_normal((2, LONG, WIDTH)).astype(np.float32), left_padded(LONG, PADS)
    t_x, slots = torch.from_numpy(x), torch.arange(LONG)[None]
    with torch.no_grad():
        hf_mask = create_chunked_causal_mask(config=hf.config, inputs_embeds=t_x, attention_mask=torch.from_numpy(mask),
                                             cache=None, position_ids=slots)
        want = hf.model.layers[0].self_attn(t_x, hf.model.rotary_emb(t_x, slots), hf_mask)[0].numpy()
    layer, keys = flax.model.layers[0].self_attn, jnp.asarray(mask)[:, None, None, :].astype(bool)
    got = np.asarray(layer(jnp.asarray(x), keys, positions=jnp.asarray(generate_positions(mask))))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1, PADS:], want[1, PADS:], rtol=1e-5, atol=1e-5)
    at_slots = np.asarray(layer(jnp.asarray(x), keys, positions=jnp.arange(LONG)[None]))
    parting = -(-PADS // CHUNK) * CHUNK  # 48
    np.testing.assert_allclose(at_slots[1, PADS:parting], want[1, PADS:parting], rtol=1e-5, atol=1e-5)
    assert np.abs(at_slots[1, parting:] - want[1, parting:]).max(axis=-1).min() > 1e-3


# --------------------------------------------------------------------------- Gemma 4


class _G4Norm(nnx.Module):
    """``Gemma4RMSNorm``: in float32, ``x * (mean(x^2) + eps) ** -0.5 * weight`` (a plain
    weight, not Gemma 3's ``1 + w``)."""

    def __init__(self, width: int, eps: float) -> None:
        self.scale, self.eps = nnx.Param(jnp.ones((width,), jnp.float32)), eps

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].reshape((1,) * (y.ndim - 1) + (-1,))).astype(x.dtype)  # ranks explicit


class _GeluTanh(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=True)


class _G4MLP(nnx.Module):
    def __init__(self, width: int, inner: int, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(width, inner, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.up_proj = nnx.Linear(width, inner, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.down_proj = nnx.Linear(inner, width, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.act_fn = _GeluTanh()

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _G4Layer(_Cached):
    """``Gemma4TextDecoderLayer`` without per-layer inputs or a MoE block: norms before and
    after the attention and the MLP; ``layer_scalar`` (a buffer, 1 here) times the output."""

    def __init__(self, hf_layer: Any, c: Any, rngs: nnx.Rngs) -> None:
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, _G4Norm(c.hidden_size, c.rms_norm_eps))
        self.self_attn = to_flax(from_hf(hf_layer.self_attn))  # its window or not, head width, rope, k = v
        self.mlp = _G4MLP(c.hidden_size, hf_layer.mlp.intermediate_size, rngs)
        self.layer_scalar = float(hf_layer.layer_scalar.item())

    def _forward(self, x: jax.Array, attend: Any) -> jax.Array:
        x = x + self.post_attention_layernorm(attend(self.input_layernorm(x)))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * jnp.asarray(self.layer_scalar, x.dtype)


class _Gemma4ForCausalLM(_CausalLM):
    """The head tied to the scaled embedding (``attend``), the logits soft-capped:
    ``cap * tanh(logits / cap)``."""

    def __init__(self, hf: Any) -> None:
        c, rngs = hf.config, nnx.Rngs(0)
        self.model = _Inner(PaddedEmbed(c.vocab_size, c.hidden_size, c.pad_token_id, rngs, scale=c.hidden_size ** 0.5),
                            [_G4Layer(layer, c, rngs) for layer in hf.model.layers], _G4Norm(c.hidden_size, c.rms_norm_eps))
        self.softcap = c.final_logit_softcapping

    def head(self, hidden: jax.Array) -> jax.Array:
        logits = self.model.embed_tokens.attend(hidden)
        return logits if self.softcap is None else jnp.tanh(logits / self.softcap) * self.softcap


def _gemma4_head(model: Any, hidden: jax.Array) -> jax.Array:
    return model.head(hidden)


def _gemma4_greedy(model: Any, ids: Any, attention_mask: Any, steps: int) -> Any:
    return greedy(model, ids, attention_mask, steps, head=_gemma4_head)


def _gemma4_hf() -> Any:
    import transformers

    config = transformers.Gemma4TextConfig(
        **COMMON, intermediate_size=64, global_head_dim=16, hidden_size_per_layer_input=0, vocab_size_per_layer_input=64,
        num_kv_shared_layers=0, attention_k_eq_v=True, sliding_window=CHUNK, final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(config).float().eval()
    randomise(hf, 0)
    return hf


@pytest.fixture(scope="module")
def gemma4() -> tuple[Any, Any, list[Any]]:
    hf = _gemma4_hf()
    return ported(hf, _Gemma4ForCausalLM(hf))


def test_a_whole_gemma4_port_with_sliding_and_full_layers_of_two_widths_is_proven_in_one_call(
        gemma4: tuple[Any, Any, list[Any]]) -> None:
    """``from_hf`` reads the sliding layer (window 16: ``(15, 0)``, head width 8, rope theta
    1e4, a ``W_value``) and the full one (head width 16, keys as values: no ``W_value``,
    proportional rope: 2 of 8 frequencies nonzero); scale 1, q-, k- and v-norms in both; the
    head tied (no rule for ``lm_head``), its logits soft-capped at 4.  A left-padded batch."""
    hf, flax, rules = gemma4
    sliding, full = (layer.self_attn for layer in flax.model.layers)
    assert (sliding.spec.window, sliding.spec.head_dim, full.spec.head_dim) == ((CHUNK - 1, 0), 8, 16)
    assert sliding.W_value is not None and full.W_value is None and full.spec.values_from_keys
    assert sum(f != 0 for f in full.spec.rope.inv_freq) == 2 and full.spec.v_norm == "rms"
    assert not any(r.torch_names[0].startswith("lm_head") for r in rules)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    proven(gemma4, lm_ids(LONG, VOCAB), left_padded(LONG, PADS),
           {"model.layers.1.self_attn", "model.layers.1.self_attn.k_proj", "model.layers.0.mlp",
            "model.layers.1.post_feedforward_layernorm"}, _gemma4_greedy)


def test_a_gemma4_nudged_query_in_the_full_layer_is_named_at_that_projection(
        gemma4: tuple[Any, Any, list[Any]]) -> None:
    """One element of the full layer's (width 16) ``W_query`` nudged by 1e-3: named at
    ``q_proj``."""
    assert_named_at(_nudged_query(gemma4, 1), "model.layers.1.self_attn.q_proj",
              ("model", "layers", 1, "self_attn", "W_query"))


# --------------------------------------------------------------------------- the quick tier's stand-in


def test_the_llama4_moe_written_here_agrees_with_transformers_at_40_tokens() -> None:
    """The part written here, beside Hugging Face's ``Llama4TextMoe`` alone (no whole
    model, no attention): top-1 sigmoid routing, every expert on every token scaled by its
    score, a shared expert; its output and its router logits, on 2 x 40 tokens (the quick
    tier's stand-in for the whole-model proofs)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    moe = Llama4TextMoe(_llama4_config()).float().eval()
    randomise(moe, 0, std=WIDTH ** -0.5)
    ours = _L4Moe(moe, nnx.Rngs(0))
    rules = infer_param_map(moe, ours)
    assert {r.torch_names[0] for r in rules} == {n for n, _ in moe.named_parameters()}
    copy_params(moe, ours, rules)
    x = np.random.default_rng(2).standard_normal((2, 40, WIDTH)).astype(np.float32)
    with torch.no_grad():
        want = moe(torch.from_numpy(x))
    got = ours(jnp.asarray(x))
    assert int((np.asarray(got[1]).argmax(-1)[:, None] == np.arange(4)).sum(0).min()) > 0  # every expert routed to
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-5, atol=1e-5)
