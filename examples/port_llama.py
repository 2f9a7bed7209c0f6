"""A tiny ``transformers`` Llama (``LlamaForCausalLM``, random init) ported to Flax NNX and
proven: logits and every parameter's gradient at 512 positions with left padding, ten
AdamW steps, and ``locate_divergence`` module by module.

The Flax model is built from Flax's own ``Embed``, ``RMSNorm`` and ``Linear`` and, per
decoder layer, this library's attention: ``to_flax(from_hf(layer.self_attn))``, the Flax
twin of the ``MultiHeadAttention`` that ``from_hf`` reads from the Hugging Face layer
(grouped key/value heads, rope with the rotary embedding's own frequencies, causal).  Its
modules are named as Hugging Face's (``model.layers.0.self_attn`` is
``("model", "layers", 0, "self_attn")``), so that ``locate_divergence`` pairs them by name.
Llama does not tie its output head to the embedding: ``lm_head`` is a ``Linear``.

Run ``python -m examples.port_llama``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from examples._proof import (
    Port,
    left_padding,
    locate,
    prove_logits_and_grads,
    prove_training,
    randomise,
    summary,
    tokens,
)
from parity_tests import copy_params, infer_param_map, to_flax
from parity_tests.causal_lm import PaddedEmbed, greedy
from torch_attention.interop import from_hf

__all__ = ["DecoderLayer", "LlamaForCausalLM", "MLP", "Model", "PaddedEmbed", "greedy", "hf_model", "make_port",
           "port"]

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, INNER, LAYERS, POSITIONS = 96, 64, 4, 2, 16, 128, 2, 1024
BATCH, SEQ, PADS = 2, 512, (0, 37)  # the second row left-padded by 37


def hf_model(seed: int = 0) -> Any:
    """The tiny Llama: 2 layers, width 64, 4 query heads over 2 key/value heads of 16,
    1024 positions, float32, eager attention, every weight random (``randomise``), in
    eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=INNER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=POSITIONS, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    randomise(model, seed, std=WIDTH ** -0.5)
    return model


# --------------------------------------------------------------------------- the Flax port

class SiLU(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x)


class MLP(nnx.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, width: int, inner: int, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, inner, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(inner, width, use_bias=False, rngs=rngs)
        self.act_fn = SiLU()

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm layer: ``x + self_attn(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, hf_layer: Any, eps: float, rngs: nnx.Rngs, mlp: Callable[[Any, nnx.Rngs], Any] | None = None
                 ) -> None:
        width = hf_layer.input_layernorm.weight.shape[0]
        self.input_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.self_attn = to_flax(from_hf(hf_layer.self_attn))
        self.post_attention_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.mlp = (MLP(width, hf_layer.mlp.gate_proj.out_features, rngs) if mlp is None
                    else mlp(hf_layer, rngs))

    def __call__(self, x: jax.Array, mask: jax.Array | None, positions: jax.Array) -> jax.Array:  # (B, T, C)
        # the attention weights too, as Hugging Face's eager layer returns them: the outputs of
        # the two layers then have one structure, and locate_divergence compares both
        attended, _ = self.self_attn(self.input_layernorm(x), mask, return_weights=True, **self._at(positions))
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(self, x: jax.Array, mask: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """The layer on new tokens with its KV cache: ``(x, cache) -> (x, new cache)``."""
        attended, cache = self.self_attn(self.input_layernorm(x), mask, cache=cache, **self._at(positions))
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), cache

    def _at(self, positions: jax.Array) -> dict[str, jax.Array]:
        """The positions for a layer that rotates; none for a NoPE layer (SmolLM3's every
        fourth), which takes none (``from_hf`` gave it ``rope=None``)."""
        return {} if self.self_attn.spec.rope is None else {"positions": positions}


class Model(nnx.Module):
    def __init__(self, hf: Any, rngs: nnx.Rngs, mlp: Callable[[Any, nnx.Rngs], Any] | None = None) -> None:
        config = hf.config
        self.embed_tokens = PaddedEmbed(config.vocab_size, config.hidden_size, config.pad_token_id, rngs)
        self.layers = nnx.List([DecoderLayer(layer, config.rms_norm_eps, rngs, mlp) for layer in hf.model.layers])
        self.norm = nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, rngs=rngs)

    def __call__(self, ids: jax.Array, mask: jax.Array | None) -> dict[str, jax.Array]:
        """{"last_hidden_state": (B, T, C)}, as Hugging Face's ``LlamaModel`` names it.
        Positions 0..T-1 for every row, padded or not, as Hugging Face gives them."""
        _, seq = ids.shape
        positions = jnp.arange(seq)[None]  # (1, T)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, mask, positions)
        return {"last_hidden_state": self.norm(x)}


class LlamaForCausalLM(nnx.Module):
    """Llama with its language-model head, in Flax NNX, named as Hugging Face's.  The
    same skeleton ports any family whose decoder layer is Llama's (pre-norm RMSNorms around
    the attention and the MLP): Qwen3, DeepSeek-V3's dense layers, SmolLM3 (its NoPE
    layers: ``from_hf`` finds which layers rotate).  ``mlp(hf_layer, rngs)`` builds each
    layer's MLP where it is not Llama's (a mixture of experts); a Hugging Face model whose
    head is tied to its embedding gets no ``lm_head`` here either (the embedding's
    ``attend``)."""

    def __init__(self, hf: Any, rngs: nnx.Rngs, mlp: Callable[[Any, nnx.Rngs], Any] | None = None) -> None:
        self.model = Model(hf, rngs, mlp)
        if hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:  # untied
            self.lm_head = nnx.Linear(hf.config.hidden_size, hf.config.vocab_size, use_bias=False, rngs=rngs)

    def head(self, hidden: jax.Array) -> jax.Array:  # (B, T, C) -> (B, T, V)
        lm_head = getattr(self, "lm_head", None)
        return self.model.embed_tokens.attend(hidden) if lm_head is None else lm_head(hidden)

    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> dict[str, jax.Array]:
        """ids (B, T) -> {"logits": (B, T, V)}, named as Hugging Face's output;
        ``attention_mask`` as Hugging Face's (B, T), 1 = token, 0 = padding."""
        mask = None if attention_mask is None else attention_mask[:, None, None, :].astype(bool)  # (B, 1, 1, T)
        return {"logits": self.head(self.model(ids, mask)["last_hidden_state"])}


def port(hf: Any) -> LlamaForCausalLM:
    """The Flax NNX port of a ``LlamaForCausalLM``, every weight copied through the map
    ``infer_param_map`` derives from the two models (Hugging Face's projections to ours,
    ``nn.Linear`` weights transposed into kernels, norm weights as ``scale``), checked
    before anything is written."""
    model = LlamaForCausalLM(hf, nnx.Rngs(0))
    copy_params(hf, model, infer_param_map(hf, model), to="flax")
    return model


def torch_call(model: Any, ids: Any, attention_mask: Any = None) -> Any:
    return model(input_ids=ids, attention_mask=attention_mask).logits


def flax_call(model: LlamaForCausalLM, ids: Any, attention_mask: Any = None) -> Any:
    return model(ids, attention_mask)["logits"]


def make_port(seed: int = 0) -> Port:
    hf = hf_model(seed)
    flax = port(hf)
    return Port(hf, flax, infer_param_map(hf, flax), torch_call, flax_call)


def batches(n: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` batches (ids, next ids), each (BATCH, SEQ)."""
    out = []
    for k in range(n):
        ids = tokens(VOCAB, BATCH, SEQ + 1, seed + k)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def main() -> int:
    """Ports the model, proves it and prints a short report; 0 when every proof holds."""
    p = make_port()
    ids, mask = tokens(VOCAB, BATCH, SEQ, seed=0), left_padding(BATCH, SEQ, PADS)
    parity = prove_logits_and_grads(p, ids, mask)
    training = prove_training(p, batches(10), mask)
    divergence = locate(p, ids)
    print(summary("Llama (2 layers, width 64, grouped heads, rope, 512 positions, left padding)",
                  parity, training, divergence))
    return 0 if parity.ok and training.ok and divergence.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
