"""Whole-model proofs of the two hybrid families, each in one call: a Qwen3.5 text model
(``Qwen3_5ForCausalLM``: a ``linear_attention`` layer, the gated delta rule, beside a
``full_attention`` layer: softmax attention with an output gate, per-head qk-norms of
``1 + w`` and partial rope, a quarter of each head turned) and a Kimi Linear
(``KimiLinearForCausalLM``: a KDA layer, channel-wise gates, beside an MLA layer, latent
attention without rope), both built tiny (width 32, 2 layers) with every weight random.
The Flax side follows ``tests/harness/test_family_proofs.py``: modules named as Hugging
Face's, every attention layer, linear or softmax, ``to_flax(from_hf(layer))``, the MLPs and
norms written plainly here; ``check_causal_lm_parity`` proves logits and every parameter's
gradient at the real rows of a left-padded batch of 512, AdamW steps and greedy decoding
with one cache per layer (``parity_tests.causal_lm.greedy``: a linear layer's
``DeltaCache``, the conv's last inputs and the rule's state, beside a softmax layer's KV
cache); ``locate_divergence`` finds the clean port clean with no ``module_map`` and names
a bug planted in the linear layer.

Left padding as ``transformers`` handles it: its linear layers get the 2-d padding mask
(``create_recurrent_attention_mask``) and zero the padded tokens' inputs
(``apply_mask_to_padding_states``) before the projections, so the conv and the state see
zeros there, and a one-token decoding step gets no mask; ours take the same 2-d mask
(``padding_mask=``), the prompt's when it is decoded, none for a step."""

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
from parity_tests.causal_lm import PaddedEmbed, randomise  # noqa: E402
from torch_attention.interop import from_hf  # noqa: E402

VOCAB, WIDTH, LONG, PADS = 96, 32, 512, 37
_ZEROS = nnx.initializers.zeros_init()  # the weights are copied in: no random draw to compile per shape
COMMON = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              use_cache=False, tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"])


def _nudged(port: tuple[Any, Any, list[Any]], path: tuple[Any, ...]) -> Any:
    """``locate_divergence`` with one element of the kernel at ``path`` (under ``model``)
    nudged by 1e-3 (then restored)."""
    hf, flax, _ = port
    module = flax.model
    for step in path:
        module = module.layers[step] if isinstance(step, int) else getattr(module, step)
    kernel = module.kernel
    saved = kernel[...]
    kernel[...] = saved.at[3, 5].add(1e-3)
    try:
        return locate_divergence(hf, flax, lm_ids(LONG, VOCAB), torch_call=hf_logits, flax_call=flax_logits)
    finally:
        kernel[...] = saved


# --------------------------------------------------------------------------- what both families share


def _randomised(hf: Any, norm_mean: float = 1.0) -> None:
    """Every weight drawn anew (``randomise``), matrices of std 0.1, the embedding's rows
    of std 0.3: the residual stream near unit scale from the first layer on.  At
    ``randomise``'s default (std ``32 ** -0.5``, the embedding too) the first residual is
    small beside the mixer's output, the RMSNorm after it triples float32 rounding, and
    ``transformers``' own float32 logits missed its float64 ones by 3x the elementwise
    tolerance (1e-5) at a logit of 0.03; here by 0.2x (ours: 0.2x of theirs, 0.2x of the
    float64)."""
    randomise(hf, 0, std=0.1, norm_mean=norm_mean)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(3.0)


class _SiLU(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x)


class _MLP(nnx.Module):
    """``Qwen3_5MLP`` / ``KimiLinearMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, width: int, inner: int, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(width, inner, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.up_proj = nnx.Linear(width, inner, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.down_proj = nnx.Linear(inner, width, use_bias=False, kernel_init=_ZEROS, rngs=rngs)
        self.act_fn = _SiLU()

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Norm(nnx.Module):
    """An RMSNorm in float32: ``x * (mean(x^2) + eps) ** -0.5 * (offset + scale)``;
    Qwen3.5's ``Qwen3_5RMSNorm`` has offset 1 (its weight starts at 0), Kimi's offset 0."""

    def __init__(self, width: int, eps: float, offset: float) -> None:
        self.scale, self.eps, self.offset = nnx.Param(jnp.full((width,), 1.0 - offset, jnp.float32)), eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        weight = self.scale[...].reshape((1,) * (y.ndim - 1) + (-1,))  # ranks explicit
        return (y * (self.offset + weight)).astype(x.dtype)


class _Layer(nnx.Module):
    """A hybrid decoder layer named as Hugging Face's: ``x + mixer(input_layernorm(x))``,
    then ``x + mlp(post_attention_layernorm(x))``, the mixer ``to_flax(from_hf(...))`` of
    Hugging Face's, a linear-attention layer (``linear``) or softmax attention.  Called on
    a whole sequence with the 4-d mask for softmax, the 2-d padding mask for linear
    attention (``transformers``' ``create_recurrent_attention_mask``); or, ``step``, on new
    tokens with the layer's cache (``init_cache``: a ``DeltaCache`` or a KV cache)."""

    mixer_name = "self_attn"

    def __init__(self, hf_layer: Any, mixer_name: str, linear: bool, eps: float, offset: float, inner: int,
                 rngs: nnx.Rngs) -> None:
        width = hf_layer.hidden_size
        self.mixer_name, self.linear = mixer_name, linear
        self.input_layernorm = _Norm(width, eps, offset)
        setattr(self, mixer_name, to_flax(from_hf(getattr(hf_layer, mixer_name))))
        self.post_attention_layernorm = _Norm(width, eps, offset)
        self.mlp = _MLP(width, inner, rngs)

    @property
    def mixer(self) -> Any:
        return getattr(self, self.mixer_name)

    def _at(self, positions: jax.Array) -> dict[str, jax.Array]:
        return {} if self.mixer.spec.rope is None else {"positions": positions}

    def _forward(self, x: jax.Array, attend: Any) -> jax.Array:
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x: jax.Array, mask: Any, padding: Any, positions: jax.Array) -> jax.Array:
        if self.linear:
            return self._forward(x, lambda h: self.mixer(h, padding))
        # the weights too, as Hugging Face's eager layers return them: one structure to compare
        return self._forward(x, lambda h: self.mixer(h, mask, return_weights=True, **self._at(positions))[0])

    def init_cache(self, batch: int, max_len: int) -> Any:
        return self.mixer.init_cache(batch) if self.linear else self.mixer.init_cache(batch, max_len)

    def step(self, x: jax.Array, mask: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """The layer on new tokens with its cache: ``(x, cache) -> (x, new cache)``.  The
        prompt (the one call of more than one token) fills the cache from slot 0: its
        padding mask is the key mask's first T slots; a one-token step has none, as
        ``transformers`` gives a decoding step none."""
        box: list[Any] = []

        def attend(h: jax.Array) -> jax.Array:
            if self.linear:
                padding = mask[:, 0, 0, :h.shape[1]] if h.shape[1] > 1 else None
                out, new = self.mixer(h, padding, cache=cache)
            else:
                out, new = self.mixer(h, mask, cache=cache, **self._at(positions))
            box.append(new)
            return out

        return self._forward(x, attend), box[0]


class _Inner(nnx.Module):
    def __init__(self, embed: Any, layers: list[Any], norm: Any) -> None:
        self.embed_tokens, self.layers, self.norm = embed, nnx.List(layers), norm


class _HybridForCausalLM(nnx.Module):
    """``model`` (``embed_tokens``, ``layers``, ``norm``) and ``lm_head``, named as Hugging
    Face's; ``attention_mask`` (B, T), 1 = token: the 4-d key mask for softmax layers, the
    2-d padding mask for linear ones (None where every token is real, as
    ``create_recurrent_attention_mask`` gives)."""

    def __init__(self, hf: Any, mixers: list[tuple[str, bool]], offset: float, inner: list[int]) -> None:
        c, rngs = hf.config, nnx.Rngs(0)
        layers = [_Layer(layer, name, linear, c.rms_norm_eps, offset, width, rngs)
                  for layer, (name, linear), width in zip(hf.model.layers, mixers, inner, strict=True)]
        self.model = _Inner(PaddedEmbed(c.vocab_size, c.hidden_size, c.pad_token_id, rngs), layers,
                            _Norm(c.hidden_size, c.rms_norm_eps, offset))
        self.lm_head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, kernel_init=_ZEROS, rngs=rngs)

    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> dict[str, jax.Array]:
        padding = None if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
        mask = None if padding is None else padding[:, None, None, :]
        x, positions = self.model.embed_tokens(ids), jnp.arange(ids.shape[1])[None]  # Hugging Face's: 0 .. T-1
        for layer in self.model.layers:
            x = layer(x, mask, padding, positions)
        return {"logits": self.lm_head(self.model.norm(x))}


# --------------------------------------------------------------------------- Qwen3.5


def _qwen3_5_config() -> Any:
    import transformers

    config = transformers.Qwen3_5TextConfig(
        **COMMON, head_dim=16, linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4,
        linear_value_head_dim=8, linear_conv_kernel_dim=4)  # rope: theta 1e4, a quarter of each head (2 pairs)
    config._attn_implementation = "eager"
    return config


def _qwen3_5_hf() -> Any:
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(_qwen3_5_config()).float().eval()
    _randomised(hf, norm_mean=0.0)  # its RMSNorms scale by 1 + w: w near 0
    with torch.no_grad():  # but the gated norm's weight is a plain one: near 1
        for layer in hf.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.norm.weight.add_(1.0)
    return hf


def _qwen3_5_port(hf: Any) -> Any:
    mixers = [("linear_attn", True) if t == "linear_attention" else ("self_attn", False)
              for t in hf.config.layer_types]
    return _HybridForCausalLM(hf, mixers, 1.0, [layer.mlp.intermediate_size for layer in hf.model.layers])


@pytest.fixture(scope="module")
def qwen3_5() -> tuple[Any, Any, list[Any]]:
    hf = _qwen3_5_hf()
    return ported(hf, _qwen3_5_port(hf))


def test_a_whole_qwen3_5_port_with_a_gated_delta_layer_is_proven_in_one_call(
        qwen3_5: tuple[Any, Any, list[Any]]) -> None:
    """``from_hf`` reads layer 0 as our ``GatedDeltaNet`` (2 key heads of 8, 4 value heads
    of 8, a conv of 4) and layer 1 as softmax attention with an output gate, qk-norms of
    ``1 + w`` over each head and rope on 4 of its 16 channels; every weight paired by name
    and shape (``in_proj_qkv`` split into three).  A left-padded batch."""
    from jax_attention import GatedDeltaNet

    _, flax, rules = qwen3_5
    linear, full = flax.model.layers[0].linear_attn, flax.model.layers[1].self_attn
    assert isinstance(linear, GatedDeltaNet)
    g = linear.geometry
    assert (g.qk_heads, g.key_dim, g.heads, g.value_dim, g.kernel) == (2, 8, 4, 8, 4)
    assert full.spec.output_gate and full.spec.qk_norm == "rms" and full.spec.qk_norm_offset == 1.0
    assert full.spec.rope.partial_rotary_factor == 0.25 and len(full.spec.rope.inv_freq) == 2
    mapped = {r.torch_names[0] for r in rules}
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in mapped
    proven(qwen3_5, lm_ids(LONG, VOCAB), left_padded(LONG, PADS),
           {"model.layers.0.linear_attn", "model.layers.0.linear_attn.in_proj_z",
            "model.layers.0.linear_attn.out_proj", "model.layers.1.self_attn",
            "model.layers.1.self_attn.o_proj", "model.layers.0.mlp"})


def test_a_qwen3_5_nudged_gate_in_the_linear_layer_is_named_at_that_projection(
        qwen3_5: tuple[Any, Any, list[Any]]) -> None:
    """One element of the linear layer's ``W_gate`` (Hugging Face's ``in_proj_z``) nudged
    by 1e-3: named at ``in_proj_z``."""
    assert_named_at(_nudged(qwen3_5, (0, "linear_attn", "W_gate")), "model.layers.0.linear_attn.in_proj_z",
              ("model", "layers", 0, "linear_attn", "W_gate"))


# --------------------------------------------------------------------------- Kimi Linear


def _kimi_hf() -> Any:
    import transformers

    config = transformers.KimiLinearConfig(
        **{**COMMON, "num_key_value_heads": 4}, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        mlp_layer_types=["dense", "dense"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(config).float().eval()
    _randomised(hf)  # its norms scale by w: w near 1
    return hf


def _kimi_port(hf: Any) -> Any:
    mixers = [("self_attn", t == "linear_attention") for t in hf.config.layer_types]
    return _HybridForCausalLM(hf, mixers, 0.0, [layer.mlp.intermediate_size for layer in hf.model.layers])


@pytest.fixture(scope="module")
def kimi() -> tuple[Any, Any, list[Any]]:
    hf = _kimi_hf()
    return ported(hf, _kimi_port(hf))


def test_a_whole_kimi_linear_port_with_a_kda_layer_beside_latent_attention_is_proven_in_one_call(
        kimi: tuple[Any, Any, list[Any]]) -> None:
    """``from_hf`` reads layer 0 as our ``KimiDeltaAttention`` (4 heads of 8, a decay per
    key channel through a rank-8 bottleneck, the output norm gated by a sigmoid) and layer
    1 as ``MultiHeadLatentAttention`` (a latent of 16, nope keys of 8 and a shared key part
    of 4 that Kimi does not rotate: no rope, no ``positions=``); the forget gate's
    ``A_log`` (1, 1, 4, 1) paired with ours (4,).  A left-padded batch."""
    from jax_attention import KimiDeltaAttention, MultiHeadLatentAttention

    _, flax, rules = kimi
    linear, latent = flax.model.layers[0].self_attn, flax.model.layers[1].self_attn
    assert isinstance(linear, KimiDeltaAttention) and isinstance(latent, MultiHeadLatentAttention)
    g = linear.geometry
    assert (g.heads, g.key_dim, g.value_dim, g.kernel) == (4, 8, 8, 4)
    assert latent.spec.rope is None and latent.spec.latent.kv_lora_rank == 16
    mapped = {r.torch_names[0]: r.flax_paths[0] for r in rules}
    assert mapped["model.layers.0.self_attn.forget_gate.A_log"] == ("model", "layers", 0, "self_attn", "A_log")
    proven(kimi, lm_ids(LONG, VOCAB), left_padded(LONG, PADS),
           {"model.layers.0.self_attn", "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.forget_gate.f_b_proj", "model.layers.0.self_attn.o_proj",
            "model.layers.1.self_attn", "model.layers.1.self_attn.kv_b_proj", "model.layers.1.mlp"})


def test_a_kimi_nudged_query_in_the_kda_layer_is_named_at_that_projection(kimi: tuple[Any, Any, list[Any]]) -> None:
    """One element of the KDA layer's ``W_query`` nudged by 1e-3: named at ``q_proj``."""
    assert_named_at(_nudged(kimi, (0, "self_attn", "W_query")), "model.layers.0.self_attn.q_proj",
              ("model", "layers", 0, "self_attn", "W_query"))


# --------------------------------------------------------------------------- the quick tier's stand-in


def test_the_qwen3_5_linear_layer_written_here_agrees_with_transformers_on_a_left_padded_prompt_and_steps() -> None:
    """The part written here, beside Hugging Face's ``Qwen3_5DecoderLayer`` of linear
    attention alone (no whole model): the layer on a batch of 2 x 12, its second row
    left-padded by 5 (Hugging Face's 2-d mask zeroing those inputs), called as ``greedy``
    calls it: a prompt of 9 (its padding mask the key mask's first 9 slots),
    then 3 one-token steps with the ``DeltaCache`` and no mask; the real rows agree with
    Hugging Face's whole-sequence output (the quick tier's stand-in for the whole-model
    proofs)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    hf_layer = Qwen3_5DecoderLayer(_qwen3_5_config(), 0).float().eval()
    randomise(hf_layer, 0, std=0.1, norm_mean=0.0)
    with torch.no_grad():
        hf_layer.linear_attn.norm.weight.add_(1.0)
    ours = _Layer(hf_layer, "linear_attn", True, 1e-6, 1.0, 64, nnx.Rngs(0))
    copy_params(hf_layer, ours, infer_param_map(hf_layer, ours))
    x = np.random.default_rng(3).standard_normal((2, 12, WIDTH)).astype(np.float32)
    padding = np.ones((2, 12), bool)
    padding[1, :5] = False
    with torch.no_grad():
        want = hf_layer(torch.from_numpy(x), None, attention_mask=torch.from_numpy(padding.astype(np.int64))).numpy()
        unmasked = hf_layer(torch.from_numpy(x), None).numpy()
    assert np.abs(unmasked[1, 5:] - want[1, 5:]).max() > 1e-3  # the pads reach the real tokens unless masked
    step = nnx.jit(_Layer.step)  # two programs (9 tokens, chunked; 1, recurrent), not one per operation
    keys, cache, parts = jnp.asarray(padding)[:, None, None, :], ours.init_cache(2, 12), []
    for start, stop in ((0, 9), (9, 10), (10, 11), (11, 12)):
        out, cache = step(ours, jnp.asarray(x[:, start:stop]), keys, jnp.arange(start, stop)[None], cache)
        parts.append(np.asarray(out))
    got = np.concatenate(parts, axis=1)
    np.testing.assert_allclose(got[padding], want[padding], rtol=1e-5, atol=1e-5)
