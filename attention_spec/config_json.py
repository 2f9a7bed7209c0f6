"""The JSON form of a module's configuration, both ways.

A module's ``config`` (either twin) is the dict of its constructor keywords; the values are
numbers, strings, bools and None, but for ``window`` (a tuple) and ``rope`` (a
``RopeConfig``), which ``json.dumps`` refuses.  ``config_to_json`` writes the dict as a
JSON object (``rope`` as the object of its fields that differ from the defaults,
``rope_to_mapping``; tuples as lists), and ``config_from_json`` reads it back: the same
dict, so ``type(module)(**config_from_json(config_to_json(module.config)))`` is a module
of the same configuration (PyTorch; the Flax twin adds ``rngs=``).  The text is what
``python -m parity_tests.convert --config`` takes.

    text = config_to_json(ours.config)        # '{"d_in": 32, ..., "rope": {"inv_freq": [...]}, ...}'
    again = MultiHeadAttention(**config_from_json(text))

Python's JSON keeps every float (``repr`` round-trips), so the rope's frequencies and the
scale come back bit for bit.  A config with a ``score_mod`` or ``mask_mod`` (functions,
and the arrays they capture) has no JSON form: refused, naming them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from attention_spec.registry import AttentionConfig
from attention_spec.rope import RopeConfig, rope_from_mapping, rope_to_mapping

_SCALARS = (bool, int, float, str, type(None))


def _json_value(name: str, value: Any) -> Any:
    if isinstance(value, RopeConfig):
        return rope_to_mapping(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
        return [_json_value(name, v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"config_to_json: {name}={value!r} has no JSON form (JSON has no inf or nan)")
    if isinstance(value, _SCALARS):
        return value
    if name in ("score_mod", "mask_mod"):
        raise ValueError(f"config_to_json: {name} is a function (with the arrays it captures), which has "
                         f"no JSON form; got {type(value).__name__}: build the module without it, or keep the "
                         "mod in code and pass it again when the module is rebuilt")
    raise TypeError(f"config_to_json: {name} has no JSON form; got {type(value).__name__} {value!r}")


def config_to_json(config: Mapping[str, Any] | AttentionConfig, **dumps: Any) -> str:
    """A module's ``config`` (the dict of its constructor keywords, or its ``spec``) as
    JSON text: a ``RopeConfig`` as the object of its fields (``rope_to_mapping``), tuples
    as lists.  ``dumps``: ``json.dumps``' keywords (``indent=2``, ``sort_keys=True``).
    Raises ValueError for a ``score_mod`` / ``mask_mod`` (functions) and for inf or nan,
    TypeError for any other value JSON cannot hold, naming the keyword."""
    options = config.options() if isinstance(config, AttentionConfig) else config
    if not isinstance(options, Mapping):
        raise TypeError(f"config_to_json takes a module's config (a dict); got {type(options).__name__}")
    return json.dumps({str(k): _json_value(str(k), v) for k, v in options.items()}, allow_nan=False, **dumps)


def config_from_json(text: str | bytes | Mapping[str, Any]) -> dict[str, Any]:
    """The constructor keywords of ``config_to_json``'s text (or of a JSON object already
    read): ``rope`` back to a ``RopeConfig`` (checked as when built; ValueError naming a
    field it has not), lists back to tuples (``window``).  Raises ValueError for text
    that is not a JSON object."""
    options = json.loads(text) if isinstance(text, (str, bytes, bytearray)) else text
    if not isinstance(options, Mapping):
        raise ValueError(f"config_from_json: a module's config is a JSON object of constructor keywords; "
                         f"got {type(options).__name__}")
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name == "rope" and isinstance(value, Mapping):
            value = rope_from_mapping(value)
        elif isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return out
