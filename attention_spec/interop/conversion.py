"""The declared weight map between the twins: our variants' rules, and the converters.

PyTorch names a parameter by a dotted path (``heads.0.W_query.weight``) and stores
``nn.Linear.weight`` as (out, in); Flax NNX names it by a path of keys
(``("heads", 0, "W_query", "kernel")``) and stores a kernel as (in, out).  One table per
variant (``LAYOUTS``, read from the registry) says which parameters exist and how each
moves; ``rules_for`` writes it, for a config, as the rules of the one weight map
(``attention_spec.interop.specs.Rule``, shapes declared); nothing is ever matched by
position.
Works on NumPy arrays, so either twin can convert a checkpoint without the other
framework installed.  The array helpers (``as_numpy``, ``flatten_paths``,
``check_complete``, ``check_float_arrays``) live in ``attention_spec.interop.numpy_arrays``
and are named here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_spec.interop.numpy_arrays import (
    Path,
    as_numpy,
    check_complete,
    check_float_arrays,
    flatten_paths,
)
from attention_spec.interop.specs import Rule, linear_rules, run_rules
from attention_spec.latent import indexer_layers
from attention_spec.registry import REGISTRY, AttentionConfig, make_config
from attention_spec.registry import VARIANTS as REGISTRY_VARIANTS
from attention_spec.registry import variant as _variant

__all__ = [
    "LAYOUTS",
    "ParamRule",
    "VARIANTS",
    "as_numpy",
    "check_complete",
    "check_float_arrays",
    "flatten_paths",
    "flax_shapes",
    "flax_to_torch",
    "module_rules",
    "rules_for",
    "torch_shapes",
    "torch_to_flax",
]

# kind of each parameter-holding child, per variant, read from the registry: "linear"
# (weight transposed, bias if any) or "matrix" (a raw (d_in, d_out) parameter used as
# x @ W, same layout in both frameworks).  The wrapper has none of its own: its layout is
# its head variant's once per head.
LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    name: tuple((p.name, p.layout) for p in decl.projections)
    for name, decl in REGISTRY.items()
    if decl.heads != "wrapper"
}


# Every variant of the library, in the registry's order.
VARIANTS: tuple[str, ...] = REGISTRY_VARIANTS


# A parameter's rule is the one weight map's ``Rule`` (one name, one path, its shape).
ParamRule = Rule


def rules_for(
    variant: str, config: Mapping[str, Any] | AttentionConfig, prefix: Path = ()
) -> list[Rule]:
    """The parameter rules of a variant with the given constructor config (a dict of
    constructor keywords, missing ones at their declared defaults, or an
    ``AttentionConfig``), in the registry's creation order.

    Raises ValueError for a variant that has no declared layout, TypeError/ValueError for
    a config that the variant's constructor would refuse.
    """
    decl = _variant(variant)
    if isinstance(config, AttentionConfig):
        spec = config
    else:
        spec = make_config(variant, config)
    if decl.heads == "wrapper":
        head = spec.head()
        return [
            rule
            for i in range(spec.num_heads)
            for rule in rules_for(head.variant, head, (*prefix, "heads", i))
        ]
    rules: list[Rule] = []
    for proj in spec.projections():
        path = (*prefix, proj.name)
        name = ".".join(map(str, path))
        # kdim / vdim widen the key / value inputs; grouped heads narrow their outputs
        fan_in, width = spec.fan_in(proj.role), spec.fan_out(proj.role)
        assert fan_in is not None and width is not None  # a variant with projections has both
        if proj.layout == "matrix":  # x @ W in both frameworks: the same (d_in, d_out) array
            rules.append(Rule(name, path, (), ((fan_in, width),)))
        else:
            rules += linear_rules(name, path, bias=proj.has_bias(spec), shape=(width, fan_in))
    for name, _, width in spec.qk_norms():  # weight <-> scale (and bias), the same (width,) array
        path = (*prefix, name)
        tail = (("weight", "scale"), ("bias", "bias")) if spec.qk_norm == "layer" else (("weight", "scale"),)
        rules += [Rule(".".join(map(str, (*path, t))), (*path, f), (), ((width,),)) for t, f in tail]
    for name, width in spec.out_norms():  # the merged heads' RMSNorm (out_norm): weight <-> scale
        path = (*prefix, name)
        rules.append(Rule(".".join(map(str, (*path, "weight"))), (*path, "scale"), (), ((width,),)))
    for name, width in spec.latent_norms():  # latent attention's RMSNorms: weight <-> scale
        path = (*prefix, name)
        rules.append(Rule(".".join(map(str, (*path, "weight"))), (*path, "scale"), (), ((width,),)))
    for name, kind, fan_in, width in indexer_layers(spec):  # sparse attention's indexer (DSA)
        path = (*prefix, "indexer", name)
        dotted = ".".join(map(str, path))
        if kind == "layer":  # its LayerNorm: weight <-> scale, bias <-> bias
            rules += [Rule(f"{dotted}.{t}", (*path, f), (), ((width,),)) for t, f in (("weight", "scale"), ("bias", "bias"))]
        else:
            rules += linear_rules(dotted, path, bias=False, shape=(width, fan_in))
    if spec.output_gate_bias:  # Beam's one gate bias per query head, the same (num_heads,) array
        rules.append(Rule(".".join(map(str, (*prefix, "gate_bias"))), (*prefix, "gate_bias"), (), ((spec.num_heads,),)))
    if spec.sinks:  # one logit per query head, the same (num_heads,) array
        rules.append(Rule(".".join(map(str, (*prefix, "sinks"))), (*prefix, "sinks"), (), ((spec.num_heads,),)))
    return rules


def module_rules(module: Any) -> list[Rule]:
    """Rules for one of our modules (either framework), from its ``spec``; the
    linear-attention layers' from their geometry (``attention_spec.interop.delta``)."""
    from attention_spec.interop.delta import delta_config, delta_rules, is_delta_layer

    if is_delta_layer(module):
        return delta_rules(type(module).__name__, delta_config(module))
    from attention_spec.interop.compressed import compressed_rules, is_compressed_layer

    if is_compressed_layer(module):  # DeepSeek-V4's attention: its declared map
        return compressed_rules(module.config)
    spec = getattr(module, "spec", None)
    if isinstance(spec, AttentionConfig):
        return rules_for(spec.variant, spec)
    return rules_for(type(module).__name__, module.config)


def torch_shapes(rules: list[Rule]) -> dict[str, tuple[int, ...]]:
    """{PyTorch name: declared shape} of a declared map."""
    return {n: s for r in rules for n, s in zip(r.torch_names, r.torch_shapes or (), strict=True)}


def flax_shapes(rules: list[Rule]) -> dict[Path, tuple[int, ...]]:
    """{Flax path: declared shape} of a declared map."""
    return {p: s for r in rules for p, s in zip(r.flax_paths, r.flax_shapes or (), strict=True)}


def torch_to_flax(arrays: Mapping[str, np.ndarray], rules: list[Rule]) -> dict[Path, np.ndarray]:
    """PyTorch-named arrays -> {flax path: array}, after checking names and shapes."""
    check_complete({k: np.shape(v) for k, v in arrays.items()}, torch_shapes(rules), "the PyTorch state_dict")
    return run_rules(arrays, rules, "to_flax")


def flax_to_torch(arrays: Mapping[Path, np.ndarray], rules: list[Rule]) -> dict[str, np.ndarray]:
    """{flax path: array} -> PyTorch-named arrays, after checking paths and shapes."""
    check_complete({k: np.shape(v) for k, v in arrays.items()}, flax_shapes(rules), "the Flax state")
    return run_rules(arrays, rules, "to_torch")
