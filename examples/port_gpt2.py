"""A tiny ``transformers`` GPT-2 (``GPT2LMHeadModel``, random init) ported to Flax NNX and
proven: logits and every parameter's gradient at 512 positions, ten AdamW steps, and
``locate_divergence`` module by module.

The Flax model is built from Flax's own ``Embed``, ``LayerNorm`` and ``Linear`` and, per
block, this library's attention: ``to_flax(from_hf(block.attn))``, the Flax twin of the
``MultiHeadAttention`` that ``from_hf`` reads from the Hugging Face layer (its packed
``c_attn`` split in thirds, its scale, causal).  Its modules are named as Hugging Face's
(``transformer.h.0.attn`` is ``("transformer", "h", 0, "attn")``), so that
``locate_divergence`` pairs them by name.  The output head is tied to ``wte`` as in
GPT-2: the Flax ``lm_head`` holds no weight and is given the embedding table.

Run ``python -m examples.port_gpt2``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from examples._proof import (
    ExactZero,
    Port,
    locate,
    prove_logits_and_grads,
    prove_training,
    randomise,
    summary,
    tokens,
)
from parity_tests import copy_params, infer_param_map, to_flax
from torch_attention.interop import from_hf

VOCAB, WIDTH, HEADS, LAYERS, POSITIONS = 96, 32, 4, 2, 512
BATCH, SEQ = 2, 512


def hf_model(seed: int = 0) -> Any:
    """The tiny GPT-2: 2 blocks, width 32, 4 heads, 512 positions, float32, eager
    attention, every weight random (``randomise``), in eval mode (no dropout)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                        bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).float().eval()
    randomise(model, seed, std=WIDTH ** -0.5)
    return model


# --------------------------------------------------------------------------- the Flax port

class NewGELU(nnx.Module):
    """GPT-2's ``gelu_new``: the tanh approximation of GELU."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=True)


class MLP(nnx.Module):
    """``c_fc`` -> gelu -> ``c_proj``; GPT-2's ``Conv1D`` weights are (in, out), as a kernel."""

    def __init__(self, width: int, inner: int, rngs: nnx.Rngs) -> None:
        self.c_fc = nnx.Linear(width, inner, rngs=rngs)
        self.act = NewGELU()
        self.c_proj = nnx.Linear(inner, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, hf_block: Any, eps: float, rngs: nnx.Rngs) -> None:
        width = hf_block.ln_1.weight.shape[0]
        self.ln_1 = nnx.LayerNorm(width, epsilon=eps, rngs=rngs)
        self.attn = to_flax(from_hf(hf_block.attn))
        self.ln_2 = nnx.LayerNorm(width, epsilon=eps, rngs=rngs)
        self.mlp = MLP(width, hf_block.mlp.c_fc.weight.shape[1], rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:  # (B, T, C)
        # the attention weights too, as Hugging Face's eager layer returns them: the outputs of
        # the two layers then have one structure, and locate_divergence compares both
        attended, _ = self.attn(self.ln_1(x), mask, return_weights=True)
        x = x + attended
        return x + self.mlp(self.ln_2(x))


class Transformer(nnx.Module):
    def __init__(self, hf: Any, rngs: nnx.Rngs) -> None:
        config = hf.config
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(config.n_positions, config.n_embd, rngs=rngs)
        self.h = nnx.List([Block(block, config.layer_norm_epsilon, rngs) for block in hf.transformer.h])
        self.ln_f = nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, rngs=rngs)

    def __call__(self, ids: jax.Array, mask: jax.Array | None) -> dict[str, jax.Array]:
        """{"last_hidden_state": (B, T, C)}, as Hugging Face's ``GPT2Model`` names it."""
        _, seq = ids.shape
        x = self.wte(ids) + self.wpe(jnp.arange(seq)[None])  # (B, T, C) + (1, T, C)
        for block in self.h:
            x = block(x, mask)
        return {"last_hidden_state": self.ln_f(x)}


class TiedHead(nnx.Module):
    """The output projection tied to the token embedding: ``x @ wte.T``."""

    def __call__(self, x: jax.Array, embedding: jax.Array) -> jax.Array:  # (B, T, C), (V, C) -> (B, T, V)
        return x @ embedding.T


class GPT2LMHead(nnx.Module):
    """GPT-2 with its language-model head, in Flax NNX, named as Hugging Face's."""

    def __init__(self, hf: Any, rngs: nnx.Rngs) -> None:
        self.transformer = Transformer(hf, rngs)
        self.lm_head = TiedHead()

    def __call__(self, ids: jax.Array, attention_mask: jax.Array | None = None) -> dict[str, jax.Array]:
        """ids (B, T) -> {"logits": (B, T, V)}, named as Hugging Face's output;
        ``attention_mask`` as Hugging Face's (B, T), 1 = token, 0 = padding."""
        mask = None if attention_mask is None else attention_mask[:, None, None, :].astype(bool)  # (B, 1, 1, T)
        hidden = self.transformer(ids, mask)["last_hidden_state"]
        return {"logits": self.lm_head(hidden, self.transformer.wte.embedding[...])}


def port(hf: Any) -> GPT2LMHead:
    """The Flax NNX port of a ``GPT2LMHeadModel``, every weight copied through the map
    ``infer_param_map`` derives from the two models (the packed ``c_attn`` split in three,
    Conv1D weights as they are, ``lm_head.weight`` the embedding's, one parameter that
    PyTorch lists once and the port ties too), checked before anything is written."""
    model = GPT2LMHead(hf, nnx.Rngs(0))
    copy_params(hf, model, infer_param_map(hf, model), to="flax")
    return model


def torch_call(model: Any, ids: Any, attention_mask: Any = None) -> Any:
    return model(input_ids=ids, attention_mask=attention_mask).logits


def flax_call(model: GPT2LMHead, ids: Any, attention_mask: Any = None) -> Any:
    return model(ids, attention_mask)["logits"]


def exact_zeros(hf: Any) -> list[ExactZero]:
    """Each block's key bias: the middle third of ``c_attn.bias``, ``W_key/bias`` here."""
    width = hf.config.n_embd
    return [ExactZero(f"transformer.h.{i}.attn.c_attn.bias", slice(width, 2 * width),
                      ("transformer", "h", i, "attn", "W_key", "bias")) for i in range(len(hf.transformer.h))]


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
    ids = tokens(VOCAB, BATCH, SEQ, seed=0)
    parity = prove_logits_and_grads(p, ids, None)
    training = prove_training(p, batches(10), None, exact_zeros(p.hf))
    divergence = locate(p, ids)
    print(summary("GPT-2 (2 blocks, width 32, 512 positions)", parity, training, divergence))
    return 0 if parity.ok and training.ok and divergence.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
