"""A weight map between a PyTorch model and its Flax NNX port, derived rather than
written: ``infer_param_map(torch_model, flax_model)``.

Modules are paired by name: the PyTorch module ``model.layers.0.mlp.up_proj`` with the
Flax module at the path ``("model", "layers", 0, "mlp", "up_proj")`` (a path's keys as
text, joined by dots).  Each pair's own parameters are then mapped by what the modules
are, never by position:

- this library's attention modules (either twin's class on the PyTorch side) and the
  ``transformers`` attention layers that ``from_hf`` reads (``torch_attention._hf.hf_rules``),
  paired with our Flax module: by their declared maps, which also name the children
  (``q_proj`` -> ``W_query``, a packed ``c_attn`` split in three);
- ``nn.Linear`` -> a Flax module with a ``kernel`` (``nnx.Linear``): weight transposed,
  bias as it is; GPT-2's ``Conv1D`` (weight already (in, out)) likewise, untransposed;
- ``nn.Embedding`` -> a Flax module with an ``embedding`` (``nnx.Embed``);
- a norm (a class named ``*Norm*``: ``nn.LayerNorm``, ``nn.RMSNorm``, Hugging Face's
  ``LlamaRMSNorm`` ...) -> a Flax module with a ``scale`` (and ``bias``);
- any other module whose own parameters have the same names and shapes on both sides:
  as they are.

What cannot be paired is listed, both sides, in one ValueError, and nothing is returned
(so nothing is copied), as a map written by hand that does not match is refused by
``copy_params``.  A weight PyTorch ties to another (an output head that is the
embedding) is one parameter there: the Flax port must tie it too (``nnx.Embed.attend``),
or the error says which Flax parameter has no PyTorch weight of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_spec.interop.numpy_arrays import Path
from attention_spec.interop.specs import Rule, Transpose, path_text
from parity_tests.harness import _is_ours, flax_param_shapes, resolve_rules

__all__ = ["infer_param_map"]


def _dotted(path: Path) -> str:
    return ".".join(str(k) for k in path)


def _is_unit(module: Any) -> bool:
    """A module mapped as a whole by a declared map: one of ours, or a Hugging Face
    attention layer that ``from_hf`` reads (by mechanism, whatever its class:
    ``recognises_hf_layer``, as ``locate_divergence`` pairs them; SmolLM3's and
    Qwen3-MoE's layers are no proven class); our linear-attention layers and the
    transformers ones ``from_hf`` ports to them (``_hf_delta.layout``)."""
    from attention_spec.interop.delta import is_delta_layer
    from torch_attention import _hf_delta
    from torch_attention._hf import recognises_hf_layer, supported_hf_classes

    if _is_ours(module) or is_delta_layer(module) or type(module).__name__ in supported_hf_classes():
        return True
    if _hf_delta.layout(module) is not None:
        return True
    return "Attention" in type(module).__name__ and recognises_hf_layer(module)


def _unit_rules(module: Any) -> list[Rule]:
    from attention_spec.interop.conversion import module_rules
    from attention_spec.interop.delta import is_delta_layer
    from torch_attention._hf import hf_rules

    return module_rules(module) if _is_ours(module) or is_delta_layer(module) else hf_rules(module)


def _prefixed(rule: Rule, torch_prefix: str, flax_prefix: Path) -> Rule:
    names = [f"{torch_prefix}.{n}" if torch_prefix else n for n in rule.torch_names]
    paths = [(*flax_prefix, *p) for p in rule.flax_paths]
    return Rule(names if len(names) > 1 else names[0], paths if len(paths) > 1 else paths[0], rule.steps)


def _own_rules(module: Any, torch_name: str, own: Mapping[str, tuple[int, ...]], flax_path: Path,
               flax_own: Mapping[str, tuple[int, ...]]) -> list[Rule] | None:
    """Rules for one pair's own parameters (``own``: the PyTorch module's, by local name;
    ``flax_own``: the Flax module's), or None when nothing here says how they map."""
    from torch import nn

    prefix = f"{torch_name}." if torch_name else ""
    kind = type(module).__name__
    if isinstance(module, nn.Linear) and "kernel" in flax_own:  # weight (out, in) -> kernel (in, out)
        return [Rule(prefix + "weight", (*flax_path, "kernel"), (Transpose(),)),
                *([Rule(prefix + "bias", (*flax_path, "bias"), ())] if "bias" in own else [])]
    if kind == "Conv1D" and "kernel" in flax_own:  # transformers' GPT-2 projection: weight (in, out)
        return [Rule(prefix + t, (*flax_path, f), ()) for t, f in (("weight", "kernel"), ("bias", "bias")) if t in own]
    if isinstance(module, nn.Embedding) and "embedding" in flax_own:
        return [Rule(prefix + "weight", (*flax_path, "embedding"), ())]
    if "Norm" in kind and "scale" in flax_own:
        return [Rule(prefix + t, (*flax_path, f), ()) for t, f in (("weight", "scale"), ("bias", "bias")) if t in own]
    if set(own) == set(flax_own) and all(own[n] == flax_own[n] for n in own):
        return [Rule(prefix + n, (*flax_path, n), ()) for n in own]
    return None


def _renamed(rule: Rule, canonical: Mapping[str, str]) -> Rule:
    """``rule`` with each PyTorch name as ``named_parameters()`` gives it (a tied
    parameter's alias becomes the name it is known by)."""
    names = [canonical.get(n, n) for n in rule.torch_names]
    if names == list(rule.torch_names):
        return rule
    return Rule(names if len(names) > 1 else names[0], rule.flax_paths if len(rule.flax_paths) > 1 else
                rule.flax_paths[0], rule.steps)


def _other_name(alias: str, canonical: Mapping[str, str]) -> str:
    """Another name of the tensor ``alias`` names (the one it is known by, else an alias)."""
    name = canonical[alias]
    return name if name != alias else next(a for a, n in canonical.items() if n == name and a != alias)


def infer_param_map(torch_model: Any, flax_model: Any) -> list[Rule]:
    """The weight map between a PyTorch model and its Flax NNX port, from module types
    and names (see the module's docstring): a list of ``Rule``s that ``copy_params``,
    ``check_parity``, ``check_training_parity`` and the converter take as ``param_map``.

    Raises ValueError listing every PyTorch parameter and every Flax parameter that no
    pair accounts for (and why, where a pair was found but its parameters do not map),
    or a map that does not fit the shapes; TypeError when the models are not a PyTorch
    ``nn.Module`` and a Flax ``nnx.Module``.
    """
    from flax import nnx
    from torch import nn

    if not isinstance(torch_model, nn.Module) or not isinstance(flax_model, nnx.Module):
        raise TypeError("infer_param_map takes a PyTorch nn.Module and a Flax nnx.Module; got "
                        f"{type(torch_model).__name__} and {type(flax_model).__name__}")
    flax_params = flax_param_shapes(flax_model)
    flax_modules = {_dotted(tuple(p)): tuple(p) for p, _ in nnx.iter_modules(flax_model)}
    torch_params = dict(torch_model.named_parameters())
    # A tied tensor is one parameter with several names: named_parameters() gives it the
    # name of the module registered first (a head registered before its embedding names
    # the embedding's weight "head.weight"), the rules name it so; every other name of it
    # is an alias, and a module is mapped by all of its names.
    first_name = {id(p): name for name, p in torch_params.items()}
    canonical = {alias: first_name[id(p)] for alias, p in torch_model.named_parameters(remove_duplicate=False)}
    shared = {name for name in canonical.values() if sum(v == name for v in canonical.values()) > 1}
    rules: list[Rule] = []
    problems: list[str] = []
    covered: set[str] = set()
    units: list[str] = []  # names of modules mapped as a whole: their children are theirs
    for name, module in torch_model.named_modules():
        if any(name.startswith(u + ".") or u == "" for u in units):
            continue
        path = flax_modules.get(name)
        if path is None:
            continue
        if _is_unit(module):
            try:
                found = [_renamed(_prefixed(r, name, path), canonical) for r in _unit_rules(module)]
            except ValueError as err:
                problems.append(f"  {name}: {err}")
                continue
            units.append(name)
            rules += found
            covered.update(n for r in found for n in r.torch_names)
            continue
        prefix = f"{name}." if name else ""
        own = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False, remove_duplicate=False)}
        flax_own = {p[-1]: s for p, s in flax_params.items() if p[:-1] == path and isinstance(p[-1], str)}
        if not own or (not flax_own and all(canonical[prefix + n] in shared for n in own)):
            continue  # nothing of its own, or weights tied to ones mapped elsewhere, as the port ties them
        found = _own_rules(module, name, own, path, flax_own)
        if found is None:
            problems.append(f"  {name or '(root)'}: {type(module).__name__} with {sorted(own)} and the Flax "
                            f"{path_text(path) or '(root)'} with {sorted(flax_own)}: no rule pairs their parameters")
            continue
        twice = [prefix + n for n in own if canonical[prefix + n] in covered]
        if twice:  # a tied tensor that another module's Flax parameters already take
            problems += [f"  PyTorch ties {a!r} to {_other_name(a, canonical)!r}, but the Flax {path_text(path)} has "
                         f"parameters of its own ({', '.join(sorted(flax_own))}): tie them in the port too "
                         "(nnx.Embed.attend)" for a in twice]
            continue
        found = [_renamed(r, canonical) for r in found]
        rules += found
        covered.update(n for r in found for n in r.torch_names)
    mapped = {p for r in rules for p in r.flax_paths}
    problems += [f"  PyTorch parameter {n!r} is paired with nothing in the Flax model" for n in torch_params
                 if n not in covered]
    problems += [f"  Flax parameter {path_text(p)!r} is paired with nothing in the PyTorch model" for p in flax_params
                 if p not in mapped]
    if problems:
        raise ValueError("infer_param_map could not pair every parameter (nothing is mapped):\n" + "\n".join(problems))
    return resolve_rules(torch_model, flax_params, rules)
