"""Porting a model that uses flex attention: a tiny PyTorch language model on
``torch.nn.attention.flex_attention`` (packed documents, causal within each, a sliding
window, a soft cap) ported to Flax NNX on ``jax_attention.functional.flex_attention``, the
mods written once (``attention_spec.mods``) and shared by both.

    python -m examples.port_flex

prints the largest difference of the logits (PyTorch's own flex, forward: it has no
backward on the CPU) and of every parameter's gradient (the PyTorch side on
``torch_attention.functional.flex_attention``, which has one) at 512 positions.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

VOCAB, WIDTH, HEADS, BATCH, SEQ, WINDOW, SOFTCAP = 97, 32, 4, 2, 512, 128, 20.0
DOCUMENTS = (200, 180, 132)  # each example packs three documents of these lengths


def document_ids(batch: int = BATCH) -> np.ndarray:
    """(B, SEQ) integers: the document of each position, the second example's order reversed."""
    one = np.concatenate([np.full(n, i) for i, n in enumerate(DOCUMENTS)])
    return np.stack([one if b % 2 == 0 else one[::-1].copy() for b in range(batch)])


def mods_for(ids: Any) -> tuple[Any, Any]:
    """(score_mod, mask_mod): a soft cap; causal within each document and a window."""
    from attention_spec import mods

    return mods.softcap(SOFTCAP), mods.and_masks(mods.causal, mods.sliding_window(WINDOW), mods.documents(ids))


def torch_model(seed: int = 0) -> Any:
    """The PyTorch model: embedding, one attention layer (q, k, v, o) on flex attention, a
    residual, the tied unembedding.  ``flex`` picks the flex attention it calls."""
    import torch
    from torch import nn

    class TinyFlexLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(WIDTH, WIDTH, bias=False)
                                                                   for _ in range(4))

        def forward(self, ids: Any, block_mask: Any, score_mod: Any, flex: Any) -> Any:
            x = self.embed(ids)
            b, t, _ = x.shape

            def heads(p: Any) -> Any:
                return p(x).reshape(b, t, HEADS, -1).transpose(1, 2)

            out = flex(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj), score_mod=score_mod,
                       block_mask=block_mask)
            x = x + self.o_proj(out.transpose(1, 2).reshape(b, t, WIDTH))
            return x @ self.embed.weight.T

    torch.manual_seed(seed)
    return TinyFlexLM()


def port(model: Any) -> Any:
    """The Flax NNX port, its weights copied from ``model`` (PyTorch's (out, in) kernels
    transposed to Flax's (in, out))."""
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention.functional as jf

    class TinyFlexLM(nnx.Module):
        def __init__(self, weights: dict[str, np.ndarray]) -> None:
            self.embed = nnx.Param(jnp.asarray(weights["embed.weight"]))
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(self, name, nnx.Param(jnp.asarray(weights[f"{name}.weight"].T)))

        def __call__(self, ids: Any, block_mask: Any, score_mod: Any) -> Any:
            x = self.embed[...][ids]
            b, t, _ = x.shape

            def heads(w: Any) -> Any:
                return (x @ w[...]).reshape(b, t, HEADS, -1).transpose(0, 2, 1, 3)

            out = jf.flex_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj), score_mod=score_mod,
                                    block_mask=block_mask)
            x = x + out.transpose(0, 2, 1, 3).reshape(b, t, WIDTH) @ self.o_proj[...]
            return x @ self.embed[...].T

    return TinyFlexLM({name: p.detach().numpy() for name, p in model.state_dict().items()})


def prove(seed: int = 0) -> dict[str, float]:
    """The largest differences, each over the largest entry of PyTorch's: ``logits``
    (PyTorch's own flex against the port) and ``grad <name>`` of the next token's mean
    cross-entropy, for every parameter (the PyTorch side on the PyTorch twin's flex, whose
    CPU backward PyTorch's own lacks).  The mods all stand for named options, so both
    twins' ``flex_attention`` run them as ``dot_product_attention`` (``flex_route``)."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    ids_np = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ))
    docs = document_ids()
    score_mod, mask_mod = mods_for(docs)
    model = torch_model(seed)
    flax_model = port(model)
    ids = torch.tensor(ids_np)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex: "use torch.compile" (its CPU kernel needs a compiler)
        theirs = model(ids, create_block_mask(mask_mod, BATCH, None, SEQ, SEQ, device="cpu"), score_mod,
                       flex_attention)
    jax_mask = jf.create_block_mask(mask_mod, BATCH, None, SEQ, SEQ)
    ours = flax_model(jnp.asarray(ids_np), jax_mask, score_mod)
    found = {"logits": float(np.abs(theirs.numpy() - np.asarray(ours)).max() / np.abs(theirs.numpy()).max())}
    torch_logits = model(ids, tf.create_block_mask(mask_mod, BATCH, None, SEQ, SEQ, device="cpu"), score_mod,
                         tf.flex_attention)
    targets = ids[:, 1:]
    torch.nn.functional.cross_entropy(torch_logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1)).backward()

    def loss(m: Any) -> Any:
        logits = m(jnp.asarray(ids_np), jax_mask, score_mod)[:, :-1]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(ids_np)[:, 1:, None], axis=-1)
        return -picked.mean()

    grads = nnx.grad(loss)(flax_model)
    for name, p in model.named_parameters():
        g = np.asarray(getattr(grads, name.split(".")[0])[...])
        g = g if name == "embed.weight" else g.T
        scale = max(float(np.abs(p.grad.numpy()).max()), 1e-12)
        found[f"grad {name}"] = float(np.abs(p.grad.numpy() - g).max()) / scale
    return found


def main() -> None:
    for name, diff in prove().items():
        print(f"{name:22s} {diff:.2e} (over its largest entry)")
    print(f"({BATCH} x {SEQ} tokens in documents of {DOCUMENTS}, window {WINDOW}, soft cap {SOFTCAP}; "
          f"head width {WIDTH // HEADS}, scale {1 / math.sqrt(WIDTH // HEADS):.3f})")


if __name__ == "__main__":
    main()
