"""The declared weight map between the twins' linear-attention layers (``GatedDeltaNet``,
``KimiDeltaAttention``: ``torch_attention/delta_net.py``, ``jax_attention/delta_net.py``),
which are not registry variants (they hold no softmax attention config): their
constructor keywords read from either twin (``delta_config``) and their rules
(``delta_rules``), as ``attention_spec.interop.conversion.module_rules`` gives them.

Every ``nn.Linear`` weight (out, in) <-> an ``nnx.Linear`` kernel (in, out), transposed;
``conv_weight`` (C, K), ``A_log``, ``dt_bias`` and ``norm_weight`` the same array on both
sides.  Shapes are declared from the config, so a state of another geometry is refused by
name before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_spec.delta import DEFAULT_CHUNK, check_delta_net_options
from attention_spec.interop.specs import Rule, linear_rules

__all__ = ["DELTA_LAYERS", "delta_config", "delta_rules", "is_delta_layer"]

DELTA_LAYERS = ("GatedDeltaNet", "KimiDeltaAttention")


def is_delta_layer(module: Any) -> bool:
    """Whether ``module`` is one of the twins' linear-attention layers (either framework)."""
    return type(module).__name__ in DELTA_LAYERS and hasattr(module, "geometry")


def delta_config(module: Any) -> dict[str, Any]:
    """The constructor keywords of a linear-attention layer of either twin (no dtype)."""
    g = module.geometry
    keys: dict[str, Any] = ({"num_heads": g.heads, "head_dim": g.key_dim}
                            if type(module).__name__ == "KimiDeltaAttention" else
                            {"num_key_heads": g.qk_heads, "key_head_dim": g.key_dim, "num_value_heads": g.heads,
                             "value_head_dim": g.value_dim})
    return {"d_in": g.d_in, **keys, "conv_kernel_size": g.kernel, "chunk_size": module.chunk_size,
            "norm_eps": module.norm_eps}


def delta_rules(name: str, config: Mapping[str, Any]) -> list[Rule]:
    """The rules of layer ``name`` ("GatedDeltaNet" or "KimiDeltaAttention") for
    ``config`` (its constructor keywords), in the layer's creation order."""
    if name not in DELTA_LAYERS:
        raise ValueError(f"{name} is not a linear-attention layer ({', '.join(DELTA_LAYERS)})")
    c = dict(config)
    kimi = name == "KimiDeltaAttention"
    if kimi:
        c.setdefault("num_key_heads", c.get("num_heads"))
        c.setdefault("num_value_heads", c.get("num_heads"))
        c.setdefault("key_head_dim", c.get("head_dim"))
        c.setdefault("value_head_dim", c.get("head_dim"))
    g = check_delta_net_options(c["d_in"], c["num_key_heads"], c["key_head_dim"], c["num_value_heads"],
                                c["value_head_dim"], c.get("conv_kernel_size", 4), c.get("chunk_size", DEFAULT_CHUNK),
                                c.get("norm_eps", 1e-6))
    qk, v = g.qk_heads * g.key_dim, g.heads * g.value_dim

    def linear(n: str, out: int, fan_in: int) -> list[Rule]:
        return linear_rules(n, (n,), bias=False, shape=(out, fan_in))

    def same(n: str, shape: tuple[int, ...]) -> Rule:
        return Rule(n, (n,), (), (shape,))

    rules = [*linear("W_query", qk, g.d_in), *linear("W_key", qk, g.d_in), *linear("W_value", v, g.d_in),
             same("conv_weight", (g.conv_channels, g.kernel)), *linear("W_beta", g.heads, g.d_in),
             same("norm_weight", (g.value_dim,)), *linear("out_proj", g.d_in, v)]
    if kimi:
        d = g.key_dim
        rules += [*linear("W_decay_down", d, g.d_in), *linear("W_decay_up", g.heads * d, d),
                  same("A_log", (g.heads,)), same("dt_bias", (g.heads * d,)),
                  *linear("W_gate_down", d, g.d_in), *linear("W_gate_up", g.heads * d, d)]
    else:
        rules += [*linear("W_gate", v, g.d_in), *linear("W_decay", g.heads, g.d_in), same("A_log", (g.heads,)),
                  same("dt_bias", (g.heads,))]
    return rules
