"""``torch_attention.functional.route``: the path, kernel and reasons of a call, without
computing it.

Covered: ``"auto"`` on CPU takes SDPA (kernel ``"sdpa"``) in float32 and passes it by for
float64 and ``return_weights`` (the reason names the option; a Route with reasons explains
itself line by line); an explicit ``"fused"`` with ``softcap`` raises the call's
``ValueError``, same text, and so does every other refused call; dropout in training
keeps SDPA (it draws the dropout) and passes blockwise by where the fused path cannot run;
and over a grid of options the path that ``route`` names is the one the call runs
(counted by patching each path's entry point in ``functional``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.support import needs_torch

pytestmark = needs_torch


def _qkv(dtype: Any = None, shape: tuple[int, ...] = (2, 4, 5, 8)) -> tuple[Any, Any, Any]:
    import torch

    rng = np.random.default_rng(0)
    return tuple(torch.tensor(rng.standard_normal(shape), dtype=dtype or torch.float32) for _ in range(3))


def test_auto_on_cpu_float32_takes_sdpa() -> None:
    from attention_spec.routing import Route
    from torch_attention import functional

    route = functional.route(*_qkv())
    assert route == Route("fused", "sdpa", ())
    assert route.explain() == "fused (sdpa)"
    assert "route" in functional.__all__


def test_float64_passes_fused_by_and_says_why() -> None:
    import torch

    from torch_attention import functional

    route = functional.route(*_qkv(torch.float64))
    assert (route.path, route.kernel) == ("blockwise", "blockwise")
    assert len(route.reasons) == 1 and route.reasons[0].startswith("fused: ")
    assert "float64" in route.reasons[0]


def test_return_weights_goes_to_the_reference_and_names_the_option() -> None:
    from torch_attention import functional

    route = functional.route(*_qkv(), return_weights=True)
    assert (route.path, route.kernel) == ("reference", "reference")
    assert [r.split(":")[0] for r in route.reasons] == ["fused", "blockwise"]
    assert all("return_weights=True" in r for r in route.reasons)
    assert route.explain().splitlines()[1:] == [f"  not {r}" for r in route.reasons]


def test_explicit_paths_route_to_themselves() -> None:
    from torch_attention import functional

    for path, kernel in (("reference", "reference"), ("fused", "sdpa"), ("blockwise", "blockwise")):
        assert tuple(functional.route(*_qkv(), implementation=path)) == (path, kernel, ())


def _error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException:
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("options", [
    {"implementation": "fused", "softcap": 5.0},
    {"implementation": "blockwise", "return_weights": True},
    {"implementation": "fused", "normalization": "sum"},
    {"implementation": "cudnn"},
    {"softcap": -1.0},
    {"window": 3},
    {"dropout_rate": 0.5, "dropout_mask": "eval"},
    {"kv_lengths": [9, 1]},
    {"mask": "float"},
    {"q_offset": 1, "alignment": "bottom_right"},
], ids=lambda o: "-".join(map(str, o)))
def test_route_raises_what_the_call_raises(options: dict[str, Any]) -> None:
    import torch

    from torch_attention import functional

    q, k, v = _qkv()
    if options.get("dropout_mask") == "eval":  # a dropout mask while dropout is off
        options = {**options, "dropout_mask": torch.ones(2, 4, 5, 5, dtype=torch.bool)}
    if options.get("mask") == "float":
        options = {**options, "mask": torch.ones(5, 5)}
    expected = _error(functional.dot_product_attention, q, k, v, **options)
    got = _error(functional.route, q, k, v, **options)
    assert type(got) is type(expected) and str(got) == str(expected)


def test_softcap_with_explicit_fused_names_softcap() -> None:
    from torch_attention import functional

    error = _error(functional.route, *_qkv(), implementation="fused", softcap=5.0)
    assert "softcap" in str(error) and "implementation='fused'" in str(error)


def test_dropout_in_training() -> None:
    from torch_attention import functional

    q, k, v = _qkv()
    assert tuple(functional.route(q, k, v, dropout_rate=0.1, training=True)) == ("fused", "sdpa", ())
    assert functional.route(q, k, v, dropout_rate=0.1, training=False).path == "fused"
    route = functional.route(q, k, v, dropout_rate=0.1, training=True, softcap=5.0)
    assert route.path == "reference"
    assert [r.split(":")[0] for r in route.reasons] == ["fused", "blockwise"]
    assert "softcap" in route.reasons[0] and "dropout in training mode" in route.reasons[1]
    error = _error(functional.route, q, k, v, dropout_rate=0.1, training=True, implementation="blockwise")
    assert "dropout in training mode" in str(error)


def test_route_agrees_with_what_the_call_runs() -> None:
    import torch

    from torch_attention import _blockwise, _fused, _reference, functional

    ran: list[str] = []

    def counting(owner: Any, name: str, label: str) -> Callable[..., Any]:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ran.append(label)
            return real(*args, **kwargs)

        return wrapper

    grid = itertools.product(
        (torch.float32, torch.float64), ("auto", "reference", "fused", "blockwise"), (False, True),
        (None, 5.0), (False, True), (0.0, 0.2),
    )
    checked = 0
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, label in ((_fused, "_fused", "fused"), (_blockwise, "blockwise", "blockwise"),
                                   (_reference, "attention_weights", "reference")):
            mp.setattr(owner, name, counting(owner, name, label))
        for dtype, implementation, weights, softcap, causal, rate in grid:
            q, k, v = _qkv(dtype)
            options = {"implementation": implementation, "return_weights": weights, "softcap": softcap,
                       "causal": causal, "dropout_rate": rate, "training": True, "kv_lengths": [5, 3]}
            try:
                route = functional.route(q, k, v, **options)
            except ValueError as error:
                with pytest.raises(ValueError, match="cannot honour"):
                    functional.dot_product_attention(q, k, v, **options)
                assert "cannot honour" in str(error)
                continue
            ran.clear()
            functional.dot_product_attention(q, k, v, **options)
            assert ran == [route.path], (options, route)
            checked += 1
    assert checked >= 20
