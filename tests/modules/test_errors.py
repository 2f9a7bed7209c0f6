"""Bad input, in both frameworks, from one table of cases.

Every case says how to build a module (or which adapter to call) and how to call it,
the exception type it must raise and a regex its message must match.  Each case runs in
PyTorch and in Flax NNX (``test_error[...]``), and, when both are installed, in both at
once to prove that the two texts are identical (``test_same_text[...]``).

DESIGN.md: bad input raises before any work is done and without changing the module's
state.  So for every failing call the test also snapshots the module (parameters, the
train/eval flags, and the random state: torch's global generator, the Flax module's
``RngKey``/``RngCount`` variables and any ``nnx.Rngs`` handed to a constructor) before
and after, and requires them equal.  The forward cases use modules in training mode with
dropout > 0 wherever the variant has dropout, so that an error raised after the dropout
draw would show up as an advanced random stream.  "Before any work" is checked directly
too: during a failing forward call no module may start projecting (``_project``) and the
attention math (``functional.attention_weights``) may not start, except where the error
is a property of the scores themselves (``normalization='sum'`` with a zero row sum).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both, needs_jax, needs_torch

CLASSES = (
    "SimplifiedAttention", "SelfAttention_v1", "SelfAttention_v2", "CausalAttention", "Head",
    "MultiHeadAttentionWrapper", "MultiHeadAttention",
)


# --------------------------------------------------------------------------- framework adapter


class Framework:
    """The few framework-specific operations a case needs, behind one interface."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "torch":
            import torch_attention

            self.lib = torch_attention
        else:
            import jax_attention

            self.lib = jax_attention
        self.constructor_rngs: Any = None  # the nnx.Rngs every Flax constructor gets
        if name == "flax":
            from flax import nnx

            self.constructor_rngs = nnx.Rngs(0)

    def array(self, value: Any, dtype: Any = np.float32) -> Any:
        a = np.array(value, dtype=dtype)
        if self.name == "torch":
            import torch

            return torch.from_numpy(a)
        import jax.numpy as jnp

        return jnp.asarray(a)

    def randn(self, *shape: int) -> Any:
        return self.array(np.random.default_rng(0).standard_normal(shape))

    def module(self, cls: str, *args: Any, train: bool = True, **kwargs: Any) -> Any:
        """``lib.cls(*args, **kwargs)`` (plus ``rngs`` in Flax), in training mode by default."""
        if self.name == "flax":
            kwargs["rngs"] = self.constructor_rngs
        m = getattr(self.lib, cls)(*args, **kwargs)
        if train:
            m.train()
        else:
            m.eval()
        return m

    # -- state snapshots: everything a failed call must leave unchanged

    def snapshot(self, module: Any) -> dict[str, Any]:
        if self.name == "torch":
            import torch

            snap: dict[str, Any] = {"rng": torch.get_rng_state().numpy().copy()}
            if module is not None:
                snap.update({f"param {k}": v.detach().numpy().copy() for k, v in module.state_dict().items()})
                snap.update({f"training {k or '.'}": m.training for k, m in module.named_modules()})
            return snap
        from flax import nnx

        snap = {}
        if module is not None:
            snap["graphdef"] = nnx.graphdef(module)  # static attributes, e.g. deterministic
            snap.update({f"state {_path(p)}": _np(v) for p, v in nnx.to_flat_state(nnx.state(module))})
        if self.constructor_rngs is not None:
            rngs_state = nnx.state(self.constructor_rngs)
            snap.update({f"rngs {_path(p)}": _np(v) for p, v in nnx.to_flat_state(rngs_state)})
        return snap


@contextlib.contextmanager
def record_work(fw: Framework) -> Iterator[list[str]]:
    """Yields a list that records every ``_project`` call of any attention class and every
    ``attention_weights`` call of the reference path (the math after all of ``functional``'s checks)."""
    work: list[str] = []

    def counting(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            work.append(label)
            return fn(*args, **kwargs)

        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        # ``_project`` may live in a base class (it does today): patch every class in each
        # variant's MRO that defines it, once, so that no projection escapes the count.
        patched: set[type] = set()
        for name in CLASSES:
            for klass in getattr(fw.lib, name).__mro__:
                if "_project" in vars(klass) and klass not in patched:
                    patched.add(klass)
                    mp.setattr(klass, "_project", counting(vars(klass)["_project"], f"{klass.__name__}._project"))
        assert patched, "no class defines _project: record_work would record nothing"
        reference = importlib.import_module(f"{fw.lib.__name__}._reference")  # the reference path's math
        mp.setattr(reference, "attention_weights", counting(reference.attention_weights, "attention_weights"))
        yield work


def _path(p: Any) -> str:
    return "/".join(map(str, p))


def _np(variable: Any) -> Any:
    import jax

    value = variable.get_value() if hasattr(variable, "get_value") else variable
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.array(value)


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any], where: str) -> None:
    assert before.keys() == after.keys(), f"{where}: the module's state changed structure"
    for key in before:
        b, a = before[key], after[key]
        if isinstance(b, np.ndarray):
            assert b.dtype == a.dtype and np.array_equal(b, a), f"{where}: {key} changed by a failed call"
        else:
            assert b == a, f"{where}: {key} changed by a failed call"


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class ErrorCase:
    """``build(fw)`` makes the module (or raises, for a constructor case with no ``call``);
    ``call(fw, module)`` then raises.  ``exc`` is the exact type; ``match`` a regex that
    the message must contain (``re.search``)."""

    id: str
    exc: type[Exception]
    match: str
    build: Callable[[Framework], Any]
    call: Callable[[Framework, Any], Any] | None = None
    # False only where the error depends on computed values (the scores), not on shapes,
    # dtypes or options: those checks cannot run before the work that computes them.
    before_work: bool = True


def mha(fw: Framework, **kw: Any) -> Any:
    # d_in 8, d_out 8, context_length 6, dropout 0.5, 2 heads of 4; training mode.
    return fw.module("MultiHeadAttention", 8, 8, 6, 0.5, 2, True, **kw)


def mha_wrapper(fw: Framework, **kw: Any) -> Any:
    return fw.module("MultiHeadAttentionWrapper", 8, 4, 6, 0.5, 2, True, **kw)


def causal(fw: Framework, **kw: Any) -> Any:
    return fw.module("CausalAttention", 8, 4, 6, 0.5, True, **kw)


def head(fw: Framework, **kw: Any) -> Any:
    return fw.module("Head", 8, 4, 6, 0.5, **kw)


ORTHOGONAL_X = [[1.0, 0.0], [-1.0, 0.0]]  # x @ x^T = [[1, -1], [-1, 1]]: row 0 sums to exactly 0

CASES = [
    # ---- input rank, width, length, dtype
    ErrorCase(
        "rank-1d", ValueError,
        re.escape("x must have shape (batch, seq, d_in) or (seq, d_in); got a 1-d array of shape (8,)"),
        mha, lambda fw, m: m(fw.randn(8)),
    ),
    ErrorCase(
        "rank-4d", ValueError,
        re.escape("got a 4-d array of shape (1, 2, 5, 8)"),
        mha_wrapper, lambda fw, m: m(fw.randn(1, 2, 5, 8)),
    ),
    ErrorCase(
        "rank-4d-simplified", ValueError,
        re.escape("got a 4-d array of shape (1, 2, 5, 8)"),
        lambda fw: fw.module("SimplifiedAttention"), lambda fw, m: m(fw.randn(1, 2, 5, 8)),
    ),
    ErrorCase(
        "last-dim-not-d_in", ValueError,
        re.escape("x has last dimension 7 but the module expects d_in=8"),
        mha, lambda fw, m: m(fw.randn(2, 5, 7)),
    ),
    ErrorCase(
        "last-dim-not-d_in-wrapper", ValueError,
        re.escape("x has last dimension 9 but the module expects d_in=8"),
        mha_wrapper, lambda fw, m: m(fw.randn(5, 9)),
    ),
    ErrorCase(
        "last-dim-not-d_in-sa1", ValueError,
        re.escape("x has last dimension 3 but the module expects d_in=8"),
        lambda fw: fw.module("SelfAttention_v1", 8, 4), lambda fw, m: m(fw.randn(2, 5, 3)),
    ),
    ErrorCase(
        "seq-exceeds-context", ValueError,
        re.escape("sequence length 7 exceeds context_length 6"),
        head, lambda fw, m: m(fw.randn(2, 7, 8)),
    ),
    ErrorCase(
        "seq-exceeds-context-unbatched-mha", ValueError,
        re.escape("sequence length 9 exceeds context_length 6"),
        mha, lambda fw, m: m(fw.randn(9, 8)),
    ),
    ErrorCase(
        "empty-sequence", ValueError,
        re.escape("x has an empty sequence: shape (2, 0, 8)"),
        causal, lambda fw, m: m(fw.randn(2, 0, 8)),
    ),
    ErrorCase(
        "int-input", TypeError,
        re.escape("x must be a floating-point array; got dtype int32"),
        mha, lambda fw, m: m(fw.array(np.ones((2, 5, 8)), np.int32)),
    ),
    ErrorCase(
        "bool-input-sa2", TypeError,
        re.escape("x must be a floating-point array; got dtype bool"),
        lambda fw: fw.module("SelfAttention_v2", 8, 4), lambda fw, m: m(fw.array(np.ones((5, 8)), bool)),
    ),
    # ---- constructor arguments
    ErrorCase(
        "d_out-not-divisible-by-heads", ValueError,
        re.escape("d_out must be divisible by num_heads; got d_out=6, num_heads=4"),
        lambda fw: fw.module("MultiHeadAttention", 8, 6, 6, 0.0, 4),
    ),
    ErrorCase(
        "num_heads-0-mha", ValueError, re.escape("num_heads must be >= 1; got 0"),
        lambda fw: fw.module("MultiHeadAttention", 8, 8, 6, 0.0, 0),
    ),
    ErrorCase(
        "num_heads-0-wrapper", ValueError, re.escape("num_heads must be >= 1; got 0"),
        lambda fw: fw.module("MultiHeadAttentionWrapper", 8, 4, 6, 0.0, 0),
    ),
    ErrorCase(
        "num_heads-negative-wrapper", ValueError, re.escape("num_heads must be >= 1; got -2"),
        lambda fw: fw.module("MultiHeadAttentionWrapper", 8, 4, 6, 0.0, -2),
    ),
    ErrorCase(
        "dropout-negative", ValueError, re.escape("dropout must be in [0, 1); got -0.1"),
        lambda fw: fw.module("CausalAttention", 8, 4, 6, -0.1),
    ),
    ErrorCase(
        "dropout-one", ValueError, re.escape("dropout must be in [0, 1); got 1.0"),
        lambda fw: fw.module("MultiHeadAttention", 8, 8, 6, 1.0, 2),
    ),
    ErrorCase(
        "dropout-one-head", ValueError, re.escape("dropout must be in [0, 1); got 1.0"),
        lambda fw: fw.module("Head", 8, 4, 6, 1.0),
    ),
    ErrorCase(
        "d_in-float", TypeError, re.escape("d_in must be an int; got float 8.0"),
        lambda fw: fw.module("SelfAttention_v2", 8.0, 4),
    ),
    ErrorCase(
        "context_length-0", ValueError, re.escape("context_length must be >= 1; got 0"),
        lambda fw: fw.module("Head", 8, 4, 0),
    ),
    ErrorCase(
        "dropout-string", TypeError, re.escape("dropout must be a float in [0, 1); got str '0.1'"),
        lambda fw: fw.module("MultiHeadAttentionWrapper", 8, 4, 6, "0.1", 2),
    ),
    ErrorCase(
        "causal-not-bool", TypeError, re.escape("causal must be a bool; got int 1"),
        lambda fw: fw.module("SelfAttention_v1", 8, 4, causal=1),
    ),
    ErrorCase(
        "mask_strategy-unknown", ValueError,
        re.escape("mask_strategy must be one of 'fill', 'renormalize'; got 'bogus'"),
        lambda fw: fw.module("CausalAttention", 8, 4, 6, 0.0, mask_strategy="bogus"),
    ),
    ErrorCase(
        "mask_strategy-unknown-simplified", ValueError,
        re.escape("mask_strategy must be one of 'fill', 'renormalize'; got 'Fill'"),
        lambda fw: fw.module("SimplifiedAttention", mask_strategy="Fill"),
    ),
    ErrorCase(
        "normalization-unknown", ValueError,
        re.escape("normalization must be one of 'softmax', 'sum'; got 'l1'"),
        lambda fw: fw.module("SimplifiedAttention", normalization="l1"),
    ),
    ErrorCase(
        "scale-zero", ValueError,
        re.escape("scale must be None or a positive finite number; got 0"),
        lambda fw: fw.module("SelfAttention_v2", 8, 4, scale=0),
    ),
    ErrorCase(
        "scale-negative", ValueError,
        re.escape("scale must be None or a positive finite number; got -0.5"),
        lambda fw: fw.module("MultiHeadAttention", 8, 8, 6, 0.0, 2, scale=-0.5),
    ),
    ErrorCase(
        "scale-inf", ValueError,
        re.escape("scale must be None or a positive finite number; got inf"),
        lambda fw: fw.module("SelfAttention_v1", 8, 4, scale=float("inf")),
    ),
    # OLMo's clip_qkv and Qwen3-Next's output gate (tests/modules/test_gate_and_clip.py)
    ErrorCase(
        "clip_qkv-zero", ValueError,
        re.escape("clip_qkv must be None or a positive finite number; got 0"),
        lambda fw: mha(fw, clip_qkv=0),
    ),
    ErrorCase(
        "clip_qkv-negative", ValueError,
        re.escape("clip_qkv must be None or a positive finite number; got -1.5"),
        lambda fw: mha(fw, clip_qkv=-1.5),
    ),
    ErrorCase(
        "clip_qkv-nan", ValueError,
        re.escape("clip_qkv must be None or a positive finite number; got nan"),
        lambda fw: mha(fw, clip_qkv=float("nan")),
    ),
    ErrorCase(
        "clip_qkv-string", TypeError, re.escape("clip_qkv must be None or a float; got str '8'"),
        lambda fw: mha(fw, clip_qkv="8"),
    ),
    ErrorCase(
        "clip_qkv-bool", TypeError, re.escape("clip_qkv must be None or a float; got bool True"),
        lambda fw: mha(fw, clip_qkv=True),
    ),
    ErrorCase(
        "output_gate-not-bool", TypeError, re.escape("output_gate must be a bool; got int 1"),
        lambda fw: mha(fw, output_gate=1),
    ),
    # ---- HunYuan's qk-norm after rope, Laguna's gate, BitNet's out_norm (tests/modules/test_norm_placement_and_gates.py)
    ErrorCase(
        "qk_norm_position-unknown", ValueError,
        re.escape("qk_norm_position must be one of 'before_rope', 'after_rope'; got 'after'"),
        lambda fw: mha(fw, qk_norm="rms", qk_norm_position="after"),
    ),
    ErrorCase(
        "qk_norm_position-without-qk_norm", ValueError,
        re.escape("qk_norm_position='after_rope' needs qk_norm ('rms' or 'layer')"),
        lambda fw: mha(fw, qk_norm_position="after_rope"),
    ),
    ErrorCase(
        "output_gate_activation-unknown", ValueError,
        re.escape("output_gate_activation must be one of 'sigmoid', 'softplus'; got 'relu'"),
        lambda fw: mha(fw, output_gate=True, output_gate_activation="relu"),
    ),
    ErrorCase(
        "output_gate_activation-without-gate", ValueError,
        re.escape("output_gate_activation='softplus' needs output_gate=True"),
        lambda fw: mha(fw, output_gate_activation="softplus"),
    ),
    ErrorCase(
        "output_gate_per_head-not-bool", TypeError, re.escape("output_gate_per_head must be a bool; got int 1"),
        lambda fw: mha(fw, output_gate=True, output_gate_per_head=1),
    ),
    ErrorCase(
        "output_gate_per_head-without-gate", ValueError,
        re.escape("output_gate_per_head=True needs output_gate=True"),
        lambda fw: mha(fw, output_gate_per_head=True),
    ),
    ErrorCase(
        "output_gate_bias-without-gate", ValueError, re.escape("output_gate_bias=True needs output_gate=True"),
        lambda fw: mha(fw, output_gate_bias=True),
    ),
    ErrorCase(
        "output_gate_bias-not-bool", TypeError, re.escape("output_gate_bias must be a bool; got str 'yes'"),
        lambda fw: mha(fw, output_gate=True, output_gate_bias="yes"),
    ),
    ErrorCase(
        "query_scale_kind-unknown", ValueError,
        re.escape("query_scale_kind must be one of 'log', 'power'; got 'exp'"),
        lambda fw: mha(fw, query_scale=(0.1, 2048, 1), query_scale_kind="exp"),
    ),
    ErrorCase(
        "query_scale_kind-without-query_scale", ValueError,
        re.escape("query_scale_kind='power' needs query_scale (a QueryScale(beta, floor, offset))"),
        lambda fw: mha(fw, query_scale_kind="power"),
    ),
    ErrorCase(
        "out_norm-unknown", ValueError, re.escape("out_norm must be one of 'rms'; got 'layer'"),
        lambda fw: mha(fw, out_norm="layer"),
    ),
    # ---- 2026's projection mechanisms (tests/modules/test_projection_mechanisms.py)
    ErrorCase(
        "qk_norm_weight-not-bool", TypeError, re.escape("qk_norm_weight must be a bool; got int 0"),
        lambda fw: mha(fw, qk_norm="rms", qk_norm_weight=0),
    ),
    ErrorCase(
        "qk_norm_weight-false-layer", ValueError,
        re.escape("qk_norm_weight=False (a weightless RMS norm) needs qk_norm='rms'; got qk_norm='layer'"),
        lambda fw: mha(fw, qk_norm="layer", qk_norm_weight=False),
    ),
    ErrorCase(
        "qk_norm_weight-false-offset", ValueError,
        re.escape("qk_norm_offset=1.0 scales by offset + weight: it needs qk_norm_weight=True"),
        lambda fw: mha(fw, qk_norm="rms", qk_norm_weight=False, qk_norm_offset=1.0),
    ),
    ErrorCase(
        "v_norm-unknown", ValueError, re.escape("v_norm must be one of 'rms'; got 'layer'"),
        lambda fw: mha(fw, v_norm="layer"),
    ),
    ErrorCase(
        "values_from_keys-not-bool", TypeError, re.escape("values_from_keys must be a bool; got str 'yes'"),
        lambda fw: mha(fw, values_from_keys="yes"),
    ),
    ErrorCase(
        "values_from_keys-vdim", ValueError,
        re.escape("values_from_keys=True takes the values from W_key's output: vdim must be None; got vdim=6"),
        lambda fw: mha(fw, values_from_keys=True, vdim=6),
    ),
    ErrorCase(
        "values_from_keys-context-pair", ValueError,
        re.escape("values_from_keys=True takes the values from the keys: context must be one array, not a "
                  "(key_input, value_input) pair"),
        lambda fw: mha(fw, values_from_keys=True),
        lambda fw, m: m(fw.randn(2, 5, 8), context=(fw.randn(2, 4, 8), fw.randn(2, 4, 8))),
    ),
    ErrorCase(
        "query_scale-not-a-record", TypeError,
        re.escape("query_scale must be None or a QueryScale(beta, floor, offset); got float 0.5"),
        lambda fw: mha(fw, query_scale=0.5),
    ),
    ErrorCase(
        "query_scale-floor-zero", ValueError, re.escape("query_scale's floor must be an int >= 1; got 0"),
        lambda fw: mha(fw, query_scale=(0.1, 0, 1)),
    ),
    ErrorCase(
        "query_scale-beta-inf", ValueError, re.escape("query_scale's beta must be a finite number; got inf"),
        lambda fw: mha(fw, query_scale=(float("inf"), 8192)),
    ),
    ErrorCase(
        "query_scale-offset-float", ValueError, re.escape("query_scale's offset must be an int; got 0.5"),
        lambda fw: mha(fw, query_scale=(0.1, 8192, 0.5)),
    ),
    ErrorCase(
        "query_scale-context", ValueError,
        re.escape("query_scale= scales the queries of self-attention by their positions: a call with context= "
                  "(cross-attention) is not taken"),
        lambda fw: mha(fw, query_scale=(0.1, 4, 1)),
        lambda fw, m: m(fw.randn(2, 5, 8), context=fw.randn(2, 4, 8)),
    ),
    # Gemma 4's KV shared across layers (kv_shared: another layer's keys and values as kv=)
    ErrorCase(
        "kv_shared-not-bool", TypeError, re.escape("kv_shared must be a bool; got int 1"),
        lambda fw: mha(fw, kv_shared=1),
    ),
    ErrorCase(
        "kv_shared-kdim", ValueError,
        re.escape("kv_shared=True takes another layer's keys and values (kv=): kdim must be None; got kdim=6"),
        lambda fw: mha(fw, kv_shared=True, kdim=6),
    ),
    ErrorCase(
        "kv_shared-values_from_keys", ValueError,
        re.escape("kv_shared=True takes another layer's keys and values (kv=): values_from_keys must be False; "
                  "got values_from_keys=True"),
        lambda fw: mha(fw, kv_shared=True, values_from_keys=True),
    ),
    ErrorCase(
        "kv_shared-v_norm", ValueError,
        re.escape("kv_shared=True takes another layer's keys and values (kv=): v_norm must be None; "
                  "got v_norm='rms'"),
        lambda fw: mha(fw, kv_shared=True, v_norm="rms"),
    ),
    ErrorCase(
        "kv_shared-call-without-kv", ValueError,
        re.escape("a module built with kv_shared=True computes no keys or values: its call needs kv="),
        lambda fw: mha(fw, kv_shared=True), lambda fw, m: m(fw.randn(2, 5, 8)),
    ),
    ErrorCase(
        "kv_shared-return_kv", ValueError,
        re.escape("return_kv=True returns the keys and values the call computes; a module built with "
                  "kv_shared=True computes none (its kv= are another layer's)"),
        lambda fw: mha(fw, kv_shared=True),
        lambda fw, m: m(fw.randn(2, 5, 8), kv=(fw.randn(2, 2, 5, 4), fw.randn(2, 2, 5, 4)), return_kv=True),
    ),
    ErrorCase(
        "kv_shared-context", ValueError,
        re.escape("kv= is another layer's self-attention keys and values: context must be None"),
        lambda fw: mha(fw, kv_shared=True),
        lambda fw, m: m(fw.randn(2, 5, 8), context=fw.randn(2, 5, 8),
                        kv=(fw.randn(2, 2, 5, 4), fw.randn(2, 2, 5, 4))),
    ),
    ErrorCase(
        "kv_shared-kv-one-array", TypeError,
        re.escape("kv must be a (keys, values) pair, as a return_kv=True call returns it, or the storing "
                  "layer's KVCache; got one array"),
        lambda fw: mha(fw, kv_shared=True), lambda fw, m: m(fw.randn(2, 5, 8), kv=fw.randn(2, 2, 5, 4)),
    ),
    ErrorCase(
        "kv_shared-kv-shape", ValueError,
        re.escape("kv does not fit this module: keys (2, 2, 4, 4), values (2, 2, 4, 4); expected keys and "
                  "values of shape (2, 2, 5, 4)"),
        lambda fw: mha(fw, kv_shared=True),
        lambda fw, m: m(fw.randn(2, 5, 8), kv=(fw.randn(2, 2, 4, 4), fw.randn(2, 2, 4, 4))),
    ),
    ErrorCase(
        "kv-without-kv_shared", ValueError,
        re.escape("kv= takes another layer's keys and values, for a MultiHeadAttention built with "
                  "kv_shared=True; this MultiHeadAttention computes its own"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), kv=(fw.randn(2, 2, 5, 4), fw.randn(2, 2, 5, 4))),
    ),
    ErrorCase(
        "return_kv-not-bool", TypeError, re.escape("return_kv must be a bool; got int 1"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), return_kv=1),
    ),
    # ---- masks
    ErrorCase(
        "mask-does-not-broadcast-heads", ValueError,
        re.escape("mask of shape (3, 5, 5) does not broadcast to (batch, heads, q_len, kv_len) = (2, 2, 5, 5)"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), fw.array(np.ones((3, 5, 5)), bool)),
    ),
    ErrorCase(
        "mask-does-not-broadcast-kv_len", ValueError,
        re.escape("mask of shape (5, 4) does not broadcast to (batch, heads, q_len, kv_len) = (2, 1, 5, 5)"),
        causal, lambda fw, m: m(fw.randn(2, 5, 8), fw.array(np.ones((5, 4)), bool)),
    ),
    ErrorCase(
        "mask-does-not-broadcast-unbatched", ValueError,
        re.escape("mask of shape (2, 1, 5, 5) does not broadcast to (heads, q_len, kv_len) = (2, 5, 5)"),
        mha_wrapper, lambda fw, m: m(fw.randn(5, 8), fw.array(np.ones((2, 1, 5, 5)), bool)),
    ),
    ErrorCase(
        "mask-float", TypeError,
        re.escape("mask must be a bool array (True = may attend); got dtype float32"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), fw.array(np.ones((5, 5)))),
    ),
    ErrorCase(
        "mask-float-simplified", TypeError,
        re.escape("mask must be a bool array (True = may attend); got dtype float32"),
        lambda fw: fw.module("SimplifiedAttention"),
        lambda fw, m: m(fw.randn(2, 5, 8), fw.array(np.ones((5, 5)))),
    ),
    # ---- dropout masks
    ErrorCase(
        "dropout_mask-in-eval-mode", ValueError,
        re.escape(
            "dropout_mask was given, but dropout is off: the module is in eval mode "
            "(deterministic); dropout applies in training mode only"
        ),
        lambda fw: causal(fw, train=False),
        lambda fw, m: m(fw.randn(2, 5, 8), dropout_mask=fw.array(np.ones((5, 5)), bool)),
    ),
    ErrorCase(
        "dropout_mask-in-eval-mode-mha", ValueError,
        re.escape("dropout_mask was given, but dropout is off"),
        lambda fw: mha(fw, train=False),
        lambda fw, m: m(fw.randn(2, 5, 8), dropout_mask=fw.array(np.ones((2, 2, 5, 5)), bool)),
    ),
    ErrorCase(
        "dropout_mask-wrong-shape", ValueError,
        re.escape(
            "dropout_mask of shape (2, 1, 5, 4) does not broadcast to the attention weights' "
            "shape (2, 1, 5, 5)"
        ),
        causal, lambda fw, m: m(fw.randn(2, 5, 8), dropout_mask=fw.array(np.ones((2, 1, 5, 4)), bool)),
    ),
    ErrorCase(
        "dropout_mask-wrong-heads-wrapper", ValueError,
        re.escape(
            "dropout_mask of shape (3, 5, 5) does not broadcast to the attention weights' "
            "shape (2, 2, 5, 5)"
        ),
        mha_wrapper, lambda fw, m: m(fw.randn(2, 5, 8), dropout_mask=fw.array(np.ones((3, 5, 5)), bool)),
    ),
    ErrorCase(
        "dropout_mask-float", TypeError,
        re.escape("dropout_mask must be a bool array (True = keep); got dtype float32"),
        head, lambda fw, m: m(fw.randn(2, 5, 8), dropout_mask=fw.array(np.ones((5, 5)))),
    ),
    # ---- normalization="sum" with a row that sums to zero
    ErrorCase(
        "sum-normalization-zero-row", ValueError,
        re.escape(
            "normalization='sum' divides each row of scores by its sum, and a row sums to zero; "
            "use normalization='softmax'"
        ),
        lambda fw: fw.module("SimplifiedAttention", normalization="sum"),
        lambda fw, m: m(fw.array(ORTHOGONAL_X)),
        before_work=False,
    ),
    ErrorCase(
        "sum-normalization-zero-row-batched", ValueError,
        re.escape("a row sums to zero"),
        lambda fw: fw.module("SimplifiedAttention", normalization="sum"),
        lambda fw, m: m(fw.array([[[1.0, 2.0], [3.0, 1.0]], ORTHOGONAL_X])),
        before_work=False,
    ),
    # ---- cross-attention, grouped heads, KV cache, windows, packed sequences
    ErrorCase(
        "context-batch-differs", ValueError,
        re.escape("context key input and x must have the same batch size; got 3 and 2"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), context=fw.randn(3, 4, 8)),
    ),
    ErrorCase(
        "context-width-not-kdim", ValueError,
        re.escape("context key input must have width 5 (its last dimension); got shape (2, 4, 6)"),
        lambda fw: mha(fw, kdim=5, vdim=7),
        lambda fw, m: m(fw.randn(2, 5, 8), context=(fw.randn(2, 4, 6), fw.randn(2, 4, 7))),
    ),
    ErrorCase(
        "context-width-not-vdim", ValueError,
        re.escape("context value input must have width 7 (its last dimension); got shape (2, 4, 5)"),
        lambda fw: mha(fw, kdim=5, vdim=7),
        lambda fw, m: m(fw.randn(2, 5, 8), context=(fw.randn(2, 4, 5), fw.randn(2, 4, 5))),
    ),
    ErrorCase(
        "context-pair-lengths-differ", ValueError,
        re.escape("context key and value inputs must have the same length; got (2, 4, 8) and (2, 3, 8)"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), context=(fw.randn(2, 4, 8), fw.randn(2, 3, 8))),
    ),
    ErrorCase(
        "num_kv_heads-does-not-divide", ValueError,
        re.escape("num_heads must be a multiple of num_kv_heads; got num_heads=4, num_kv_heads=3"),
        lambda fw: fw.module("MultiHeadAttention", 8, 8, 6, 0.0, 4, num_kv_heads=3),
    ),
    ErrorCase(
        "kdim-not-positive", ValueError, re.escape("kdim must be >= 1; got 0"),
        lambda fw: mha(fw, kdim=0),
    ),
    ErrorCase(
        "cache-not-from-init_cache", TypeError,
        re.escape("cache must come from module.init_cache(batch_size, max_len); got something else"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), cache={"key": fw.randn(2, 2, 6, 4)}),
    ),
    ErrorCase(
        "cache-past-max_len", ValueError,
        re.escape(
            "the KV cache holds 0 of max_len=4 positions and cannot take 5 more; init_cache with a larger max_len"
        ),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), cache=m.init_cache(2, 4)),
    ),
    ErrorCase(
        "cache-batch-differs", ValueError,
        re.escape("the cache does not fit this call: key (3, 2, 6, 4)"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), cache=m.init_cache(3, 6)),
    ),
    ErrorCase(
        "cache-with-context", ValueError,
        re.escape("a cache is for self-attention decoding; context must be None"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), context=fw.randn(2, 4, 8), cache=m.init_cache(2, 6)),
    ),
    ErrorCase(
        "cache-on-wrapper", TypeError,
        re.escape("MultiHeadAttentionWrapper has no KV cache"),
        mha_wrapper, lambda fw, m: m.init_cache(2, 6),
    ),
    # ---- KV-cache and call checks
    ErrorCase(
        "cache-dtype-not-floating", TypeError,
        re.escape("a KV cache must hold floating-point keys and values; got dtype int32"),
        mha, lambda fw, m: m.init_cache(2, 6, dtype=fw.array(0, np.int32).dtype),
    ),
    ErrorCase(
        "cache-max_len-past-context_length", ValueError,
        re.escape("a KV cache of max_len=7 does not fit context_length 6: the module attends over at most "
                  "context_length positions"),
        mha, lambda fw, m: m.init_cache(2, 7),
    ),
    ErrorCase(
        "cache-batch-0", ValueError,
        re.escape("a call with a cache needs at least one example (init_cache takes batch_size >= 1); "
                  "got x of shape (0, 5, 8)"),
        mha, lambda fw, m: m(fw.randn(0, 5, 8), cache=m.init_cache(2, 6)),
    ),
    ErrorCase(
        "cache-path-cannot-honour", ValueError,
        re.escape("implementation='blockwise' cannot honour return_weights=True"),
        mha, lambda fw, m: m(fw.randn(2, 1, 8), cache=m.init_cache(2, 6), implementation="blockwise",
                             return_weights=True),
    ),
    ErrorCase(
        "context-dtype-differs", TypeError,
        re.escape("context key input has dtype float16 but the module computes in float32; "
                  "cast context key input first"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), context=fw.array(np.zeros((2, 4, 8)), np.float16)),
    ),
    ErrorCase(
        "window-not-a-pair", TypeError,
        re.escape("window must be None or a pair (left, right) of ints >= 0 or None; got 3"),
        lambda fw: mha(fw, window=3),
    ),
    ErrorCase(
        "window-negative", ValueError, re.escape("window left must be >= 0 or None; got -1"),
        lambda fw: causal(fw, window=(-1, 0)),
    ),
    ErrorCase(
        "alignment-unknown", ValueError,
        re.escape("alignment must be one of 'top_left', 'bottom_right'; got 'center'"),
        lambda fw: head(fw, alignment="center"),
    ),
    ErrorCase(
        "segment_ids-wrong-shape", ValueError,
        re.escape("segment_ids must have shape (batch, length) = (2, 5); got shape (2, 4)"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), segment_ids=fw.array(np.zeros((2, 4)), np.int32)),
    ),
    ErrorCase(
        "segment_ids-float", TypeError,
        re.escape("segment_ids must hold integers (one segment id per token); got dtype float32"),
        causal, lambda fw, m: m(fw.randn(2, 5, 8), segment_ids=fw.array(np.zeros((2, 5)))),
    ),
    ErrorCase(
        "kv_segment_ids-missing-for-cross", ValueError,
        re.escape("segment_ids for queries of length 5 and keys of length 4 need kv_segment_ids for the keys"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), context=fw.randn(2, 4, 8),
                             segment_ids=fw.array(np.zeros((2, 5)), np.int32)),
    ),
    ErrorCase(
        "bias-wrong-shape-cross", ValueError,
        re.escape("(2, 2, 5, 4)"),
        mha, lambda fw, m: m(fw.randn(2, 5, 8), context=fw.randn(2, 4, 8), bias=fw.randn(2, 2, 5, 5)),
    ),
    # ---- mask adapters
    ErrorCase(
        "from_blocked_mask-float", TypeError,
        re.escape("blocked mask must be a bool array (True = blocked); got dtype float32"),
        lambda fw: None, lambda fw, m: fw.lib.from_blocked_mask(fw.array([[0.0, 1.0], [0.0, 0.0]])),
    ),
    ErrorCase(
        "from_additive_mask-bias", ValueError,
        re.escape(
            "additive mask holds values other than 0 and blocked (-inf or <= -1e4) (a bias); "
            "it cannot be converted to a bool mask without losing them"
        ),
        lambda fw: None, lambda fw, m: fw.lib.from_additive_mask(fw.array([[0.0, -np.inf], [0.5, 0.0]])),
    ),
    ErrorCase(
        "from_additive_mask-bool", TypeError,
        re.escape("additive mask must be a floating-point array; got dtype bool"),
        lambda fw: None, lambda fw, m: fw.lib.from_additive_mask(fw.array([[True, False]], bool)),
    ),
]

CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS), "case ids must be unique"


def run_case(fw_name: str, case: ErrorCase) -> Exception:
    """Runs one case in one framework; returns the exception after checking its type,
    its message, that no state changed and (unless exempt) that no work was done."""
    fw = Framework(fw_name)
    where = f"{fw_name} {case.id}"
    if case.call is None:  # a constructor case: nothing built, no random numbers drawn
        before = fw.snapshot(None)
        with pytest.raises(case.exc) as info:
            case.build(fw)
        after = fw.snapshot(None)
    else:
        module = case.build(fw)
        before = fw.snapshot(module)
        with record_work(fw) as work, pytest.raises(case.exc) as info:
            case.call(fw, module)
        after = fw.snapshot(module)
        if case.before_work:
            assert not work, f"{where}: raised only after work started: {work}"
        else:
            assert work, f"{where}: before_work=False but the error came before any work"
    error = info.value
    assert type(error) is case.exc, f"{where}: raised {type(error).__name__}, expected {case.exc.__name__}"
    assert re.search(case.match, str(error)), f"{where}: message {str(error)!r} does not match {case.match!r}"
    assert_same_snapshot(before, after, where)
    return error


FRAMEWORK_PARAMS = [
    pytest.param("torch", marks=needs_torch, id="torch"),
    pytest.param("flax", marks=needs_jax, id="flax"),
]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("fw_name", FRAMEWORK_PARAMS)
def test_error(fw_name: str, case: ErrorCase) -> None:
    run_case(fw_name, case)


@needs_both
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_same_text(case: ErrorCase) -> None:
    torch_error = run_case("torch", case)
    flax_error = run_case("flax", case)
    assert type(torch_error) is type(flax_error)
    assert str(torch_error) == str(flax_error)


# --------------------------------------------------------------------------- the checks' guard


@pytest.mark.parametrize("fw_name", FRAMEWORK_PARAMS)
def test_valid_calls_pass_and_snapshot_sees_changes(fw_name: str) -> None:
    """The table's modules accept good input (so each case fails for the reason it names),
    and the snapshot notices a real state change (so ``assert_same_snapshot`` can fail)."""
    fw = Framework(fw_name)
    x = fw.randn(2, 5, 8)
    for build in (mha, mha_wrapper, causal, head):
        module = build(fw)
        with record_work(fw) as work:
            out = module(x, fw.array(np.ones((5, 5)), bool), dropout_mask=fw.array(np.ones((5, 5)), bool))
        assert tuple(out.shape)[:2] == (2, 5)
        assert "attention_weights" in work and any(w.endswith("._project") for w in work)
    fw.module("SimplifiedAttention", normalization="sum")(fw.array([[1.0, 2.0], [3.0, 1.0]]))
    module = mha(fw)
    before = fw.snapshot(module)
    module(x)  # training mode, dropout 0.5: draws from the random stream
    with pytest.raises(AssertionError, match="changed by a failed call"):
        assert_same_snapshot(before, fw.snapshot(module), "guard")


@needs_jax
def test_flax_call_rngs_untouched_by_failed_call() -> None:
    """A Flax call given its own ``rngs=`` does not draw from them when the input is bad."""
    from flax import nnx

    fw = Framework("flax")
    module = mha(fw)
    call_rngs = nnx.Rngs(dropout=7)
    before = {_path(p): _np(v) for p, v in nnx.to_flat_state(nnx.state(call_rngs))}
    with pytest.raises(ValueError, match="exceeds context_length"):
        module(fw.randn(2, 7, 8), rngs=call_rngs)
    after = {_path(p): _np(v) for p, v in nnx.to_flat_state(nnx.state(call_rngs))}
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    module(fw.randn(2, 5, 8), rngs=call_rngs)  # a good call does draw: the check above can fail
    drawn = {_path(p): _np(v) for p, v in nnx.to_flat_state(nnx.state(call_rngs))}
    assert any(not np.array_equal(before[k], drawn[k]) for k in before)



@needs_jax
def test_flax_deterministic_call_flag_rejects_dropout_mask() -> None:
    """In Flax the call's ``deterministic=True`` turns dropout off as ``.eval()`` does, so a
    ``dropout_mask`` with it is the eval-mode error, raised before any state changes."""
    fw = Framework("flax")
    module = mha(fw)  # training mode
    before = fw.snapshot(module)
    with pytest.raises(ValueError, match=re.escape("dropout_mask was given, but dropout is off")):
        module(fw.randn(2, 5, 8), dropout_mask=fw.array(np.ones((5, 5)), bool), deterministic=True)
    assert_same_snapshot(before, fw.snapshot(module), "flax deterministic=True")
    module(fw.randn(2, 5, 8), dropout_mask=fw.array(np.ones((5, 5)), bool), deterministic=False)
