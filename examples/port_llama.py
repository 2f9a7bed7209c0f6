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
from parity_tests.causal_lm import generate_positions
from torch_attention.interop import from_hf

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

class PaddedEmbed(nnx.Module):
    """An embedding with PyTorch's ``padding_idx``: the padding token's row gets no
    gradient (``nn.Embedding`` zeroes it), so no optimiser moves it.  Forward, it is
    ``nnx.Embed``; without the frozen row only the gradients tell (the first draft of this
    example used ``nnx.Embed``, and the gradient check caught it at that row)."""

    def __init__(self, num: int, features: int, padding_idx: int, rngs: nnx.Rngs) -> None:
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (num, features), jnp.float32))
        self.padding_idx = padding_idx

    def __call__(self, ids: jax.Array) -> jax.Array:  # (B, T) -> (B, T, C)
        table = self.embedding[...]  # (V, C)
        frozen = (jnp.arange(table.shape[0]) == self.padding_idx)[:, None]
        return jnp.take(jnp.where(frozen, jax.lax.stop_gradient(table), table), ids, axis=0)


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

    def __init__(self, hf_layer: Any, eps: float, rngs: nnx.Rngs) -> None:
        width, inner = hf_layer.mlp.gate_proj.in_features, hf_layer.mlp.gate_proj.out_features
        self.input_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.self_attn = to_flax(from_hf(hf_layer.self_attn))
        self.post_attention_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.mlp = MLP(width, inner, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None, positions: jax.Array) -> jax.Array:  # (B, T, C)
        # the attention weights too, as Hugging Face's eager layer returns them: the outputs of
        # the two layers then have one structure, and locate_divergence compares both
        attended, _ = self.self_attn(self.input_layernorm(x), mask, positions=positions, return_weights=True)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def step(self, x: jax.Array, mask: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """The layer on new tokens with its KV cache: ``(x, cache) -> (x, new cache)``."""
        attended, cache = self.self_attn(self.input_layernorm(x), mask, positions=positions, cache=cache)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Model(nnx.Module):
    def __init__(self, hf: Any, rngs: nnx.Rngs) -> None:
        config = hf.config
        self.embed_tokens = PaddedEmbed(config.vocab_size, config.hidden_size, config.pad_token_id, rngs)
        self.layers = nnx.List([DecoderLayer(layer, config.rms_norm_eps, rngs) for layer in hf.model.layers])
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
    """Llama with its language-model head, in Flax NNX, named as Hugging Face's."""

    def __init__(self, hf: Any, rngs: nnx.Rngs) -> None:
        self.model = Model(hf, rngs)
        self.lm_head = nnx.Linear(hf.config.hidden_size, hf.config.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> dict[str, jax.Array]:
        """ids (B, T) -> {"logits": (B, T, V)}, named as Hugging Face's output;
        ``attention_mask`` as Hugging Face's (B, T), 1 = token, 0 = padding."""
        mask = None if attention_mask is None else attention_mask[:, None, None, :].astype(bool)  # (B, 1, 1, T)
        return {"logits": self.lm_head(self.model(ids, mask)["last_hidden_state"])}


def greedy(model: LlamaForCausalLM, ids: jax.Array, attention_mask: jax.Array, steps: int) -> jax.Array:
    """Greedy decoding of ``steps`` tokens with one KV cache per attention layer, as
    ``generate`` decodes a left-padded batch: the prompt, then one token at a time, each
    call's key mask as long as the cache (``max_len``; the prompt's pads False) and its
    positions counting real tokens only.  Returns the logits each step chose from, (steps,
    B, V): the prompt's last position's, then each new token's."""
    batch, prompt = ids.shape
    max_len = prompt + steps
    inner = model.model
    caches = [layer.self_attn.init_cache(batch, max_len) for layer in inner.layers]
    real = jnp.asarray(attention_mask).astype(bool)
    keys = jnp.concatenate([real, jnp.ones((batch, steps), bool)], axis=1)[:, None, None, :]  # (B, 1, 1, max_len)
    tokens, positions = jnp.asarray(ids), jnp.asarray(generate_positions(attention_mask))
    chosen = []
    for _ in range(steps):
        x = inner.embed_tokens(tokens)
        for i, layer in enumerate(inner.layers):
            x, caches[i] = layer.step(x, keys, positions, caches[i])
        logits = model.lm_head(inner.norm(x))[:, -1]
        chosen.append(logits)
        tokens, positions = jnp.argmax(logits, -1)[:, None], positions[:, -1:] + 1
    return jnp.stack(chosen)


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
