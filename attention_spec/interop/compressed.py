"""The declared weight map between the twins' ``CompressedAttention`` (DeepSeek-V4's
attention: ``torch_attention/compressed.py``, ``jax_attention/compressed.py``), which is
not a registry variant: its constructor keywords (``module.config``, the same in both
twins) and its rules (``compressed_rules``), as
``attention_spec.interop.conversion.module_rules`` gives them.

Every ``nn.Linear`` weight (out, in) <-> an ``nnx.Linear`` kernel (in, out), transposed; a
norm's ``weight`` <-> its ``scale``; ``sinks`` and ``position_bias`` the same array on
both sides.  Shapes are declared from the config, so a state of another geometry is
refused by name before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_spec.compressed import NAME, check_compressed_options
from attention_spec.interop.specs import Rule, linear_rules

__all__ = ["compressed_rules", "is_compressed_layer"]


def is_compressed_layer(module: Any) -> bool:
    """Whether ``module`` is either twin's ``CompressedAttention``."""
    return type(module).__name__ == NAME and hasattr(module, "geometry")


def compressed_rules(config: Mapping[str, Any]) -> list[Rule]:
    """The rules of a ``CompressedAttention`` built with ``config`` (its keywords), in
    its creation order."""
    c = dict(config)
    g = check_compressed_options(c["d_in"], c["num_heads"], c["head_dim"], c["q_lora_rank"], c["o_groups"],
                                 c["o_lora_rank"], c["window"], c["rope"], c.get("compression"),
                                 c.get("compress_rate"), c.get("index_heads"), c.get("index_head_dim"),
                                 c.get("index_topk"), c.get("norm_eps", 1e-6))

    def linear(name: str, out: int, fan_in: int) -> list[Rule]:
        return linear_rules(name, tuple(name.split(".")), bias=False, shape=(out, fan_in))

    def norm(name: str, width: int) -> Rule:
        return Rule(f"{name}.weight", (*name.split("."), "scale"), (), ((width,),))

    def same(name: str, shape: tuple[int, ...]) -> Rule:
        return Rule(name, tuple(name.split(".")), (), (shape,))

    width = g.num_heads * g.head_dim
    rules = [*linear("q_a_proj", g.q_lora_rank, g.d_in), norm("q_a_norm", g.q_lora_rank),
             *linear("q_b_proj", width, g.q_lora_rank), *linear("kv_proj", g.head_dim, g.d_in),
             norm("kv_norm", g.head_dim), *linear("o_a_proj", g.o_groups * g.o_lora_rank, width // g.o_groups),
             *linear("o_b_proj", g.d_in, g.o_groups * g.o_lora_rank), same("sinks", (g.num_heads,))]
    series = [("compressor", g.compressed_width, g.head_dim)] if g.compression is not None else []
    if g.compression == "csa":
        assert g.index_head_dim is not None and g.index_heads is not None
        series.append(("compressor.indexer", 2 * g.index_head_dim, g.index_head_dim))
    for prefix, w, entry in series:
        assert g.compress_rate is not None
        rules += [*linear(f"{prefix}.kv_proj", w, g.d_in), *linear(f"{prefix}.gate_proj", w, g.d_in),
                  same(f"{prefix}.position_bias", (g.compress_rate, w)), norm(f"{prefix}.kv_norm", entry)]
    if g.compression == "csa":
        assert g.index_head_dim is not None and g.index_heads is not None
        rules += [*linear("compressor.indexer.q_b_proj", g.index_heads * g.index_head_dim, g.q_lora_rank),
                  *linear("compressor.indexer.scorer.weights_proj", g.index_heads, g.d_in)]
    return rules
