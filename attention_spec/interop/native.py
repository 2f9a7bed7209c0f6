"""What a native attention module and ours can express of each other: the allow-lists
that the twins' native importers and exporters decide by.

``torch_attention.interop`` converts to and from ``torch.nn.MultiheadAttention``;
``jax_attention.interop`` to and from ``flax.nnx.MultiHeadAttention`` and Linen's
``MultiHeadDotProductAttention``.  Each conversion declares an allow-list: for every
option that it carries, a check of the value (``ANY``: every value carries; else None
when the value is expressible, or the line that says why not).  Every other option must
hold its default, or the conversion is refused naming it, with this module's one text
(``not_expressible``) in both twins.  The options come from the thing converted, never
from a list of what is forbidden: our module's ``spec`` (``AttentionConfig.options()``,
every constructor keyword, with the registry's defaults) or the native module's
constructor (``native_options``).  So an option added later on either side is refused
until a converter declares that it carries it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from attention_spec.registry import REQUIRED, AttentionConfig

__all__ = ["ACTS_THROUGH", "ANY", "Check", "native_options", "not_expressible", "refusals", "spec_refusals"]

# A check of one allow-list entry: the subject (our spec, or the native module) -> None
# when its value converts, else one line naming the option, the value and why.
Check = Callable[[Any], "str | None"]


def ANY(subject: Any) -> None:  # noqa: N802  (a constant of the allow-lists: every value carries)
    """Every value carries (or none changes the computation)."""
    return None


# Our options that act only through another: while every one named here is off (None or
# False) the option changes nothing, so any value of it converts.  (qk-norm's scope,
# epsilon and offset without qk-norm; the alignment of a causal mask, window or chunk without
# any of them.)
ACTS_THROUGH: dict[str, tuple[str, ...]] = {
    "qk_norm_scope": ("qk_norm",),
    "qk_norm_eps": ("qk_norm",),
    "qk_norm_offset": ("qk_norm",),
    "alignment": ("causal", "window", "chunk"),
}


def _show(value: Any) -> str:
    """``repr``, but a function by its name (its address would differ from run to run) and
    a dataclass (a ``RopeConfig``) by the fields it sets, not all twenty."""
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        return f"<function {value.__qualname__}>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        set_ = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
                if f.default is dataclasses.MISSING or not _same(getattr(value, f.name), f.default)]
        return f"{type(value).__name__}({', '.join(set_)})"
    return repr(value)


def not_expressible(name: str, value: Any, default: Any, target: str) -> str:
    """The line, the same in both twins, for an option that ``target`` cannot express."""
    if default is REQUIRED:
        return f"{name}={_show(value)} ({target} cannot express it)"
    return f"{name}={_show(value)} ({target} cannot express it; only {name}={_show(default)} converts)"


def _same(value: Any, default: Any) -> bool:
    try:
        return value is default or bool(value == default)
    except Exception:  # an array-like value whose == is not a bool: not the default
        return False


def refusals(
    options: Mapping[str, Any],
    defaults: Mapping[str, Any],
    allowed: Mapping[str | tuple[str, ...], Check],
    subject: Any,
    target: str,
    *,
    inert: Callable[[str], bool] = lambda name: False,
) -> list[str]:
    """Every option of ``options`` ({name: value}) that ``target`` cannot express, one
    line each: first the allow-list's (``allowed``: {option or tuple of options: check},
    each check run on ``subject`` in the list's order where ``options`` has its
    option), then every option it does not name whose value is not its default
    (``defaults``; REQUIRED or absent: none) and that is not ``inert`` there, in the order
    of ``options``.  Empty: it converts."""
    named: set[str] = set()
    problems = []
    for key, check in allowed.items():
        names = (key,) if isinstance(key, str) else key
        named.update(names)
        if any(n in options for n in names) and (line := check(subject)):
            problems.append(line)
    for name, value in options.items():
        default = defaults.get(name, REQUIRED)
        if name in named or inert(name) or (default is not REQUIRED and _same(value, default)):
            continue
        problems.append(not_expressible(name, value, default, target))
    return problems


def spec_refusals(spec: AttentionConfig, allowed: Mapping[str | tuple[str, ...], Check], target: str) -> list[str]:
    """``refusals`` of our module's options (``spec.options()``, the registry's defaults):
    what an exporter to ``target`` cannot carry.  An option of ``ACTS_THROUGH`` whose
    owners are all off changes nothing and is not refused."""
    options = spec.options()
    named = {n for key in allowed for n in ((key,) if isinstance(key, str) else key)}
    if not named <= set(options):  # a misspelt entry would never run its check
        raise ValueError(f"the allow-list for {target} names options that {spec.variant} does not have: "
                         f"{sorted(named - set(options))}")

    def inert(name: str) -> bool:
        owners = ACTS_THROUGH.get(name)
        return owners is not None and all(options.get(owner) in (None, False) for owner in owners)

    return refusals(options, spec.declaration.defaults, allowed, spec, target, inert=inert)


def native_options(module: Any, signature_of: Any, skip: Iterable[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """({name: value}, {name: default}) of a native module's constructor options: the
    parameters of ``signature_of`` (its class, whose ``__init__`` is read) that the module
    keeps as attributes of the same name.  One it does not keep (an initialiser, the
    rngs it drew from) has shaped the weights, which are copied, not the computation; it
    is left out, as are those in ``skip``."""
    values: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    missing = object()
    for name, param in inspect.signature(signature_of.__init__).parameters.items():
        if name == "self" or name in skip or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = getattr(module, name, missing)
        if value is missing:
            continue
        values[name] = value
        defaults[name] = REQUIRED if param.default is param.empty else param.default
    return values, defaults
