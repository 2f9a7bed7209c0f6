"""One call that proves a causal language model's port: ``check_causal_lm_parity``.

Given a PyTorch causal LM (a ``transformers`` ``*ForCausalLM``, or any model called as
one) and its Flax NNX port, it runs the proofs the harness has, in the order a port is
debugged, and on failure says where:

1. logits at the real rows of a (left-)padded batch, and the gradient of every parameter
   (``check_parity`` with ``rows=`` from the attention mask);
2. ``steps`` AdamW steps side by side on next-token cross-entropy over the real rows
   (``check_training_parity``);
3. greedy decoding of ``decode_steps`` tokens: the Flax side by the caller's step function
   (its caches, one per layer), the PyTorch side by recomputing the whole sequence each
   step with the positions ``generate`` gives (real tokens counted, pads not); the logits
   of each step compared, and the tokens chosen;
4. when any of them fails, ``locate_divergence`` on the unpadded ids names the module.

The weight map is ``infer_param_map``'s unless one is given.

What every whole-model port otherwise writes again, here once:

- ``randomise(model, seed, std)``: every PyTorch parameter drawn anew (Hugging Face's
  init leaves biases at 0 and norms at 1, where a bias or a norm mapped to the wrong place
  goes unseen);
- ``PaddedEmbed``: a Flax NNX embedding with PyTorch's ``padding_idx`` (the padding row
  gets no gradient through the lookup), an optional scale applied inside it (Gemma's
  ``*ScaledWordEmbedding``) and ``attend`` for a tied head;
- ``greedy(model, ids, attention_mask, steps)``: greedy decoding of a port named as
  Hugging Face's, one KV cache per attention layer, as ``generate`` decodes a left-padded
  batch: ``check_causal_lm_parity``'s ``flax_decode``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_spec.interop.numpy_arrays import as_numpy
from parity_tests.divergence import (
    DivergenceReport,
    SelectionFinding,
    compare_choices,
    locate_divergence,
    same_choices,
)
from parity_tests.harness import Finding, ParityReport, check_parity, compare, full_precision
from parity_tests.tolerances import PARITY
from parity_tests.training import TrainingReport, check_training_parity

# and PaddedEmbed, built when first imported (``__getattr__``: this module imports no framework)
__all__ = ["CausalLMReport", "check_causal_lm_parity", "generate_positions", "greedy", "next_token_losses",
           "randomise"]

# AdamW on both sides.  eps 1e-6, not torch's 1e-8: among a whole model's thousands of
# gradient elements some sit near 1e-8, where a rounding difference of 1e-10 between the
# frameworks moves Adam's step by 1% of lr (examples/_proof.py measured it on GPT-2).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-6, 0.1


@dataclass
class CausalLMReport:
    """Each proof's report (None: not run), the decoding's per-step findings and whether
    the tokens chosen agree, and, on failure, where the port parts (``divergence``)."""

    logits: ParityReport
    training: TrainingReport | None = None
    decoding: list[Finding] = field(default_factory=list)
    tokens_agree: bool | None = None
    divergence: DivergenceReport | None = None
    selections: list[SelectionFinding] = field(default_factory=list)  # sparse attention's choices of keys

    @property
    def ok(self) -> bool:
        return (self.logits.ok and (self.training is None or self.training.ok)
                and all(f.ok for f in self.decoding) and self.tokens_agree is not False
                and all(s.ok for s in self.selections))

    @property
    def same_selection(self) -> bool:
        """Whether the logits and gradients were compared with the Flax model on the
        PyTorch model's choice of keys (some sparse layer's choices differ)."""
        return any(s.differs for s in self.selections)

    def message(self) -> str:
        lines = []
        if self.selections:
            differ = [s for s in self.selections if s.differs]
            lines.append(f"choices of keys: {len(self.selections)} sparse layer calls, {len(differ)} differ"
                         + (" (logits and gradients compared with the Flax model on PyTorch's choice)"
                            if differ else ""))
            lines += [s.text() for s in differ]
        lines.append(f"logits and gradients: {self.logits.message()}")
        if self.training is not None:
            lines.append(f"training: {self.training.message()}")
        if self.decoding:
            worst = max(self.decoding, key=lambda f: f.tolerance_used)
            verdict = "agree" if all(f.ok for f in self.decoding) else "differ"
            tokens = "the same tokens" if self.tokens_agree else "other tokens"
            lines.append(f"decoding: {len(self.decoding)} steps with caches {verdict}, {tokens} chosen; "
                         f"worst {worst.describe()}")
        if self.divergence is not None:
            lines.append(f"where: {str(self.divergence).splitlines()[0]}")
            lines += [f"boundary mismatch (searched past): {b.torch_name or '(root)'}: {b.why}"
                      for b in self.divergence.boundaries]
        return "\n".join(lines)


def generate_positions(attention_mask: Any) -> np.ndarray:
    """The positions ``transformers``' ``generate`` gives a left-padded batch: each real
    token its index among its row's real tokens, a pad 1 (no query attends to it)."""
    mask = np.asarray(as_numpy(attention_mask)).astype(np.int64)
    return np.where(mask != 0, np.cumsum(mask, axis=-1) - 1, 1)


def randomise(model: Any, seed: int = 0, std: float | None = None, *, norm_mean: float = 1.0) -> None:
    """Every parameter of a PyTorch model drawn anew, in place: matrices and embeddings
    N(0, std^2) (``std`` None: ``hidden_size ** -0.5`` from ``model.config``), norm
    weights ``norm_mean`` + N(0, 0.1^2) (a parameter whose name holds ``norm`` or whose
    module's starts with ``ln_``; Gemma's ``1 + w`` norms want ``norm_mean=0.0``), every
    other vector N(0, 0.1^2).  Hugging Face's own init leaves biases at zero and norms at
    one, where a bias mapped to the wrong place, or a norm weight read as a bias, would go
    unseen.  ``std = width ** -0.5`` keeps every layer near unit scale (softmaxes neither
    flat nor one-hot): at std 0.2 a two-layer Llama's logits reached 5, and float32
    rounding (2.8e-6 of that scale) broke the elementwise tolerance at a logit of 0.12.
    Raises ValueError without ``std`` where the model has no ``config.hidden_size``."""
    import torch

    if std is None:
        width = getattr(getattr(model, "config", None), "hidden_size", None)
        if not isinstance(width, int):
            raise ValueError("randomise needs std= for a model without config.hidden_size")
        std = width ** -0.5
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            parts = name.split(".")
            if p.ndim >= 2:
                p.copy_(std * noise)
            elif "norm" in name or (len(parts) > 1 and parts[-2].startswith("ln_")):
                p.copy_(norm_mean + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


@functools.cache
def _padded_embed_class() -> type:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class PaddedEmbed(nnx.Module):
        """A Flax NNX embedding as PyTorch's ``nn.Embedding(num, features, padding_idx)``:
        the padding token's row gets no gradient through the lookup (``nn.Embedding``
        zeroes it, so no optimiser moves it); forward it is ``nnx.Embed``.  A port with a
        plain ``nnx.Embed`` agrees forward and fails the gradient check at that row alone.

        ``scale``: the lookup times this number (in the table's dtype), inside the module,
        where Hugging Face's scaled embeddings scale (Gemma's ``*ScaledWordEmbedding``,
        ``sqrt(hidden_size)``): ``locate_divergence`` pairs the modules by name and
        compares what each returns.  ``attend(x)``: ``x @ table.T``, a tied head (its
        gradient reaches every row, the padding row too, as the transpose's does in
        PyTorch).  ``padding_idx`` None: no row frozen.  The parameter is ``embedding``,
        (num, features), float32 unless ``param_dtype``."""

        def __init__(self, num: int, features: int, padding_idx: int | None = None, rngs: Any = None, *,
                     scale: float | None = None, param_dtype: Any = None) -> None:
            rngs = nnx.Rngs(0) if rngs is None else rngs
            dtype = jnp.float32 if param_dtype is None else param_dtype
            self.embedding = nnx.Param(jax.random.normal(rngs.params(), (num, features), dtype))
            self.padding_idx = -1 if padding_idx is None else padding_idx
            self.scale = scale

        def __call__(self, ids: Any) -> Any:  # (B, T) -> (B, T, C)
            table = self.embedding[...]
            frozen = (jnp.arange(table.shape[0]) == self.padding_idx)[:, None]
            out = jnp.take(jnp.where(frozen, jax.lax.stop_gradient(table), table), ids, axis=0)
            return out if self.scale is None else out * jnp.asarray(self.scale, table.dtype)

        def attend(self, x: Any) -> Any:  # (..., C) -> (..., num)
            return x @ self.embedding[...].T

    PaddedEmbed.__module__ = __name__
    return PaddedEmbed


def __getattr__(name: str) -> Any:
    """``PaddedEmbed``, built when first asked for (this module imports no framework)."""
    if name == "PaddedEmbed":
        return _padded_embed_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _lm_head(model: Any, hidden: Any) -> Any:
    lm_head = getattr(model, "lm_head", None)
    return model.model.embed_tokens.attend(hidden) if lm_head is None else lm_head(hidden)


def _layer_step(layer: Any, x: Any, keys: Any, positions: Any, cache: Any) -> tuple[Any, Any]:
    """One layer on new tokens with its cache."""
    return layer.step(x, keys, positions, cache)


def _model_step(model: Any, tokens: Any, keys: Any, positions: Any, caches: list[Any], head: Any
                ) -> tuple[Any, list[Any]]:
    """Every layer on new tokens with its cache: (the last position's logits, the caches)."""
    inner = model.model
    x = inner.embed_tokens(tokens)
    updated = []
    for layer, cache in zip(inner.layers, caches, strict=True):
        x, cache = layer.step(x, keys, positions, cache)
        updated.append(cache)
    return head(model, inner.norm(x))[:, -1], updated


@functools.cache
def _compiled(per_layer: bool) -> Any:
    from flax import nnx

    return nnx.jit(_layer_step) if per_layer else nnx.jit(_model_step, static_argnames=("head",))


def _alike(layers: Any) -> bool:
    """Whether some layers are built alike (one graph definition): then one program per
    layer kind and shape compiles faster than one for the whole model (measured: a
    Qwen3-MoE's two alike layers 5-8 s against 12-14 s; a SmolLM3's RoPE and NoPE layers
    the other way round)."""
    from flax import nnx

    try:
        return len({nnx.graphdef(layer) for layer in layers}) < len(layers)
    except TypeError:  # a graph definition that does not hash
        return False


def _init_cache(layer: Any, batch: int, max_len: int) -> Any:
    """A layer's empty cache: its own ``init_cache(batch, max_len)`` where it has one (a
    hybrid model's layers: a linear-attention layer's cache is its conv and recurrent
    state, no KV cache), else its ``self_attn``'s."""
    own = getattr(layer, "init_cache", None)
    return own(batch, max_len) if callable(own) else layer.self_attn.init_cache(batch, max_len)


def greedy(model: Any, ids: Any, attention_mask: Any, steps: int, *,
           head: Callable[[Any, Any], Any] | None = None) -> Any:
    """Greedy decoding of ``steps`` tokens with one KV cache per attention layer, as
    ``generate`` decodes a left-padded batch: the prompt, then one token at a time, each
    call's key mask as long as the cache (``prompt + steps``; the prompt's pads False:
    ``kv_lengths`` describes right padding, not left) and its positions counting real
    tokens only (``generate_positions``).  Returns the logits each step chose from,
    (steps, B, V): the prompt's last position's, then each new token's.  It is
    ``check_causal_lm_parity``'s ``flax_decode``.

    The port is named as Hugging Face's ``*ForCausalLM``: ``model.model.embed_tokens(ids)``,
    ``model.model.layers`` (each with ``self_attn.init_cache(batch, max_len)``, or an
    ``init_cache(batch, max_len)`` of its own: a hybrid model's linear-attention layer
    caches no keys, and ``step(x, mask, positions, cache) -> (x, cache)``, the layer on new
    tokens with its cache), ``model.model.norm``, then ``head(model, hidden) -> logits`` (default:
    ``model.lm_head(hidden)``, or ``model.model.embed_tokens.attend(hidden)`` where the
    port has no ``lm_head``: a tied head; a function defined once, not a new lambda per
    call, or each call compiles again).  The steps run under ``nnx.jit``: one program per
    shape (the prompt's, a new token's) for the whole model, or, where layers are built
    alike, one per kind of layer and shape, which they share (eagerly, a 512-token prompt
    through two layers took seconds more).  Raises ValueError for steps < 1."""
    import jax.numpy as jnp

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int; got {steps!r}")
    head = _lm_head if head is None else head
    inner = model.model
    per_layer = _alike(list(inner.layers))
    batch, prompt = np.shape(ids)
    caches = [_init_cache(layer, batch, prompt + steps) for layer in inner.layers]
    real = jnp.asarray(as_numpy(attention_mask)).astype(bool)
    keys = jnp.concatenate([real, jnp.ones((batch, steps), bool)], axis=1)[:, None, None, :]  # (B, 1, 1, max_len)
    tokens, positions = jnp.asarray(as_numpy(ids)), jnp.asarray(generate_positions(attention_mask))
    chosen = []
    for _ in range(steps):
        if per_layer:
            x = inner.embed_tokens(tokens)
            for i, layer in enumerate(inner.layers):
                x, caches[i] = _compiled(True)(layer, x, keys, positions, caches[i])
            logits = head(model, inner.norm(x))[:, -1]
        else:
            logits, caches = _compiled(False)(model, tokens, keys, positions, caches, head=head)
        chosen.append(logits)
        tokens, positions = jnp.argmax(logits, -1)[:, None], positions[:, -1:] + 1
    return jnp.stack(chosen)


def _torch_logits(model: Any, ids: Any, attention_mask: Any = None) -> Any:
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    return model(input_ids=ids, **kwargs).logits


def _flax_logits(model: Any, ids: Any, attention_mask: Any = None) -> Any:
    out = model(ids) if attention_mask is None else model(ids, attention_mask)
    return out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)


def _torch_greedy(model: Any, ids: np.ndarray, attention_mask: np.ndarray, steps: int) -> np.ndarray:
    """The reference: the whole sequence recomputed at every step, at ``generate``'s
    positions, the greedy token appended; the logits each step chose from (steps, B, V)."""
    import torch

    tokens, mask = torch.from_numpy(ids), torch.from_numpy(attention_mask.astype(np.int64))
    chosen = []
    with torch.no_grad():
        for _ in range(steps):
            positions = torch.from_numpy(generate_positions(mask.numpy()))
            logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits[:, -1]
            chosen.append(logits.float().numpy())
            token = logits.argmax(-1, keepdim=True)
            tokens, mask = torch.cat([tokens, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return np.stack(chosen)


def next_token_losses() -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    """Next-token cross-entropy, mean over the kept rows, in both frameworks: ``(logits
    (..., vocab), target ids (...) as float) -> scalar``."""
    import optax
    import torch

    def torch_loss(logits: Any, target: Any) -> Any:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).long())

    def flax_loss(logits: Any, target: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1).astype("int32")).mean()

    return torch_loss, flax_loss


def check_causal_lm_parity(
    torch_model: Any,
    flax_model: Any,
    ids: Any,
    attention_mask: Any = None,
    *,
    param_map: Any = None,
    torch_call: Callable[..., Any] | None = None,
    flax_call: Callable[..., Any] | None = None,
    steps: int = 10,
    optimizer: Any = "adamw",
    decode_steps: int = 0,
    flax_decode: Callable[..., Any] | None = None,
    torch_decode: Callable[..., Any] | None = None,
    locate: bool = True,
) -> CausalLMReport:
    """Proves a causal LM port in one call (see the module docstring).

    Args:
      ids: token ids (B, T), integers.  attention_mask: Hugging Face's (B, T), 1 = token,
        0 = padding (left padding for decoding); None = every token real.
      param_map: the weight map (``Rule``s or the mapping form); None: ``infer_param_map``.
      torch_call, flax_call: ``(model, ids, attention_mask or None) -> logits (B, T, V)``;
        default: ``model(input_ids=, attention_mask=).logits`` and ``model(ids,
        attention_mask)`` (its ``"logits"`` or ``.logits`` where it returns more).
      steps: AdamW steps on next-token cross-entropy (0: none); optimizer as
        ``check_training_parity`` takes it (``"adamw"``: lr 1e-3, eps 1e-6, decay 0.1).
      decode_steps: greedy tokens to decode (0: none), with ``flax_decode(model, ids,
        attention_mask, decode_steps) -> logits (decode_steps, B, V)``, the logits each
        step chose from (the prompt's last position's first), decoding with the port's
        caches; ``torch_decode`` likewise (default: the sequence recomputed each step at
        ``generate``'s positions).
      locate: on failure, run ``locate_divergence`` on the ids without padding.

    Sparse attention (DSA): every sparse layer's choice of keys is compared first
    (``compare_choices``, on ``ids`` and the mask: which layer, how many queries chose
    other keys, ties within the scores' rounding told from divergences, in ``selections``
    and the message); where any differ, the logits and every gradient are compared with the
    Flax model on the PyTorch model's choice (``same_choices``), so a tie changes no number
    compared, and a choice beyond the rounding fails the report.  The training steps and the
    decoding run each side on its own choice (the weights, and the tokens, change the
    choice): a tie there shows as their failure, beside the choices reported.

    Returns a ``CausalLMReport`` (raises nothing when the proofs fail).  Raises ValueError
    for ``decode_steps`` without ``flax_decode``, an attention mask of another shape than
    the ids, and what the harness calls raise.
    """
    from parity_tests.param_map import infer_param_map

    np_ids = np.asarray(as_numpy(ids))
    if np_ids.ndim != 2 or not np.issubdtype(np_ids.dtype, np.integer):
        raise ValueError(f"ids must be integer token ids (batch, seq); got dtype {np_ids.dtype}, shape {np_ids.shape}")
    mask = None if attention_mask is None else np.asarray(as_numpy(attention_mask)).astype(np.int64)
    if mask is not None and mask.shape != np_ids.shape:
        raise ValueError(f"attention_mask must have the ids' shape {np_ids.shape}; got {mask.shape}")
    if decode_steps and flax_decode is None:
        raise ValueError("decode_steps needs flax_decode=: (model, ids, attention_mask, steps) -> the logits of "
                         "each step (steps, B, V), decoding with the port's caches")
    rules = infer_param_map(torch_model, flax_model) if param_map is None else param_map
    t_call = torch_call or _torch_logits
    f_call = flax_call or _flax_logits
    real = None if mask is None else mask.astype(bool)
    inputs = [np_ids] if mask is None else [np_ids, mask]
    # sparse attention: each layer's choice of keys compared apart from the numbers; where
    # some differ (a tie within the scores' rounding goes either way), the logits and
    # gradients are compared with the Flax model on the PyTorch model's choice
    findings, choices = compare_choices(torch_model, flax_model, *inputs, torch_call=t_call, flax_call=f_call)
    if not any(s.differs for s in findings):
        choices = []
    with same_choices(flax_model, choices):
        logits = check_parity(torch_model, flax_model, *inputs, param_map=rules, rows=real,
                              torch_call=t_call, flax_call=f_call)
    report = CausalLMReport(logits, selections=findings)
    if steps:
        x, y = np_ids[:, :-1].astype(np.float32), np_ids[:, 1:].astype(np.float32)  # ids exact below 2**24
        kept = None if real is None else real[:, :-1]

        def torch_step(m: Any, x: Any, mask: Any = None) -> Any:
            return t_call(m, x.long(), None if mask is None else mask.long())

        def flax_step(m: Any, x: Any, mask: Any = None) -> Any:
            return f_call(m, x.astype("int32"), None if mask is None else mask.astype("int32"))

        report.training = check_training_parity(
            torch_model, flax_model, [(x, y)], loss=next_token_losses(), optimizer=optimizer, steps=steps, lr=LR, betas=BETAS,
            eps=EPS, weight_decay=WEIGHT_DECAY, mask=kept, rows=kept, param_map=rules,
            torch_call=torch_step, flax_call=flax_step)
    if decode_steps:
        full = np.ones_like(np_ids) if mask is None else mask
        with full_precision():
            want = (torch_decode or _torch_greedy)(torch_model, np_ids, full, decode_steps)
            got = flax_decode(flax_model, np_ids, full, decode_steps)  # type: ignore[misc]
        want, got = np.asarray(as_numpy(want)), np.asarray(as_numpy(got))
        dtype = str(got.dtype) if str(got.dtype) in PARITY else "float32"
        report.decoding = [compare(f"decode step {s} logits", want[s], got[s], PARITY[dtype])
                           for s in range(decode_steps)]
        report.tokens_agree = bool(np.array_equal(want.argmax(-1), got.argmax(-1)))
    if not report.ok and locate:
        report.divergence = locate_divergence(torch_model, flax_model, np_ids,
                                              torch_call=lambda m, x: t_call(m, x, None),
                                              flax_call=lambda m, x: f_call(m, x, None))
    return report

