"""Host inputs to the public functions (issue 40, item 3): rope ``positions`` and a
``dropout_mask`` given as a Python list or a NumPy array rather than a framework array.

- PyTorch's ``apply_rope``, ``parallel.ring_attention`` and ``dot_product_attention``
  take them (they raised ``AttributeError``): the result equals, bit for bit, the same
  call with a tensor, and the JAX twin's for the same list or NumPy array within float32
  parity (the JAX twin took NumPy arrays already; now lists too for ``dropout_mask``).
- A bad host input (strings, floats, ragged lists) is refused by name, with one text in
  both twins: each checks the NumPy array as given (``attention_spec.arrays.host_array``)
  before converting it, so a float64 list is "float64" in both, not float32 in JAX.

The PyTorch ring runs in this process over a one-rank gloo group (no exchange), the JAX
ring over a one-device mesh: what is under test is the entry point, not the ring.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_spec.rope import RopeConfig
from parity_tests.tolerances import PARITY
from tests.support import needs_both, needs_jax, needs_torch, random_x

B, H, T, D = 2, 2, 6, 8
ROPE = RopeConfig(theta=10000.0)
POSITIONS = np.array([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]], np.int64)  # per-example offsets
# dropout keeps roughly half; the seed fixes which
KEEP = np.random.default_rng(1).random((B, H, T, T)) < 0.5
RATE = 0.5


def _host(kind: str, array: np.ndarray) -> Any:
    return array.tolist() if kind == "list" else array


def _close(actual: Any, expected: Any) -> None:
    tol = PARITY["float32"]
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol.rtol, atol=tol.atol)


@pytest.fixture
def torch_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group for PyTorch's ring (the default group), torn down after."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _jax_ring(q: Any, **options: Any) -> Any:
    import jax
    from jax.sharding import Mesh

    from jax_attention.parallel import ring_attention

    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    return ring_attention(q, q, q, mesh=mesh, axis_name="seq", **options)


# --------------------------------------------------------------------------- accepted


@needs_torch
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_torch_apply_rope_takes_host_positions_as_a_tensor(kind: str) -> None:
    import torch

    from torch_attention.functional import apply_rope

    x = torch.from_numpy(random_x((B, H, T, D)))
    expected = apply_rope(x, torch.from_numpy(POSITIONS), ROPE)
    assert torch.equal(apply_rope(x, _host(kind, POSITIONS), ROPE), expected)


@needs_both
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_apply_rope_twins_agree_on_host_positions(kind: str) -> None:
    import jax.numpy as jnp
    import torch

    from jax_attention.functional import apply_rope as jax_rope
    from torch_attention.functional import apply_rope as torch_rope

    x = random_x((B, H, T, D))
    _close(torch_rope(torch.from_numpy(x), _host(kind, POSITIONS), ROPE),
           jax_rope(jnp.asarray(x), _host(kind, POSITIONS), ROPE))


@needs_torch
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_torch_ring_takes_host_positions_as_a_tensor(kind: str, torch_group: None) -> None:
    import torch

    from torch_attention.parallel import ring_attention

    q = torch.from_numpy(random_x((B, H, T, D)))
    expected = ring_attention(q, q, q, causal=True, rope=ROPE, positions=torch.from_numpy(POSITIONS))
    got = ring_attention(q, q, q, causal=True, rope=ROPE, positions=_host(kind, POSITIONS))
    assert torch.equal(got, expected)


@needs_both
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_rings_agree_on_host_positions(kind: str, torch_group: None) -> None:
    import jax.numpy as jnp
    import torch

    from torch_attention.parallel import ring_attention

    x = random_x((B, H, T, D))
    ours = ring_attention(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x), causal=True, rope=ROPE,
                          positions=_host(kind, POSITIONS))
    _close(ours, _jax_ring(jnp.asarray(x), causal=True, rope=ROPE, positions=_host(kind, POSITIONS)))


@needs_torch
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_torch_dropout_mask_from_the_host_equals_a_tensor(kind: str) -> None:
    import torch

    from torch_attention.functional import dot_product_attention

    q, k, v = (torch.from_numpy(random_x((B, H, T, D), seed)) for seed in range(3))
    expected = dot_product_attention(q, k, v, dropout_rate=RATE, training=True, dropout_mask=torch.from_numpy(KEEP))
    got = dot_product_attention(q, k, v, dropout_rate=RATE, training=True, dropout_mask=_host(kind, KEEP))
    assert torch.equal(got, expected)


@needs_both
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_dropout_mask_from_the_host_twins_agree(kind: str) -> None:
    import jax.numpy as jnp
    import torch

    from jax_attention.functional import dot_product_attention as jax_attention
    from torch_attention.functional import dot_product_attention as torch_attention

    qkv = [random_x((B, H, T, D), seed) for seed in range(3)]
    ours = torch_attention(*map(torch.from_numpy, qkv), dropout_rate=RATE, training=True,
                           dropout_mask=_host(kind, KEEP))
    theirs = jax_attention(*map(jnp.asarray, qkv), dropout_rate=RATE, deterministic=False,
                           dropout_mask=_host(kind, KEEP))
    _close(ours, theirs)
    # the mask did act: the kept weights scaled by 2, the rest 0, as the float64 sum says
    w = np.einsum("bhtd,bhsd->bhts", qkv[0].astype(np.float64), qkv[1].astype(np.float64)) / np.sqrt(D)
    w = np.exp(w - w.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True) * KEEP / (1 - RATE)
    _close(ours, w @ qkv[2].astype(np.float64))


# --------------------------------------------------------------------------- refused

RAGGED = "rope positions must be an array, or nested lists of one length per level; NumPy makes no array of this list"
# (name, positions, error, text): one text, both twins, apply_rope and the rings alike
BAD_POSITIONS: list[tuple[str, Any, type[Exception], str]] = [
    ("strings", [["a"] * T] * B, TypeError, "rope positions must be integers; got dtype <U1"),
    ("float64-numpy", POSITIONS.astype(np.float64), TypeError, "rope positions must be integers; got dtype float64"),
    ("float-list", POSITIONS.astype(float).tolist(), TypeError, "rope positions must be integers; got dtype float64"),
    ("bools", np.ones((B, T), bool), TypeError, "rope positions must be integers; got dtype bool"),
    ("ragged", [[0, 1, 2], [0, 1]], TypeError, RAGGED),
    ("wrong-shape", list(range(T)), ValueError,
     f"rope positions must have shape (batch, seq) = ({B}, {T}) (or (1, {T})); got shape ({T},)"),
]
BAD_IDS = [case[0] for case in BAD_POSITIONS]


def _raises(call: Callable[[], Any], error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(text)}$"):
        call()


@needs_torch
@pytest.mark.parametrize(("name", "positions", "error", "text"), BAD_POSITIONS, ids=BAD_IDS)
def test_torch_refuses_bad_host_positions(name: str, positions: Any, error: type[Exception], text: str,
                                          torch_group: None) -> None:
    import torch

    from torch_attention.functional import apply_rope
    from torch_attention.parallel import ring_attention

    q = torch.zeros(B, H, T, D)
    _raises(lambda: apply_rope(q, positions, ROPE), error, text)
    _raises(lambda: ring_attention(q, q, q, rope=ROPE, positions=positions), error, text)


@needs_jax
@pytest.mark.parametrize(("name", "positions", "error", "text"), BAD_POSITIONS, ids=BAD_IDS)
def test_jax_refuses_bad_host_positions(name: str, positions: Any, error: type[Exception], text: str) -> None:
    import jax.numpy as jnp

    from jax_attention.functional import apply_rope

    q = jnp.zeros((B, H, T, D))
    _raises(lambda: apply_rope(q, positions, ROPE), error, text)
    _raises(lambda: _jax_ring(q, rope=ROPE, positions=positions), error, text)


# (name, dropout_mask, error, text): one text, both twins
BAD_DROPOUT_MASKS: list[tuple[str, Any, type[Exception], str]] = [
    ("float64-numpy", KEEP.astype(np.float64), TypeError,
     "dropout_mask must be a bool array (True = keep); got dtype float64"),
    ("int-list", KEEP.astype(int).tolist(), TypeError,
     "dropout_mask must be a bool array (True = keep); got dtype int64"),
    ("ragged", [[True, False], [True]], TypeError,
     "dropout_mask must be an array, or nested lists of one length per level; NumPy makes no array of this list"),
]


@needs_torch
@pytest.mark.parametrize(("name", "mask", "error", "text"), BAD_DROPOUT_MASKS, ids=[c[0] for c in BAD_DROPOUT_MASKS])
def test_torch_refuses_bad_host_dropout_masks(name: str, mask: Any, error: type[Exception], text: str) -> None:
    import torch

    from torch_attention.functional import dot_product_attention

    q = torch.zeros(B, H, T, D)
    _raises(lambda: dot_product_attention(q, q, q, dropout_rate=RATE, training=True, dropout_mask=mask), error, text)


@needs_jax
@pytest.mark.parametrize(("name", "mask", "error", "text"), BAD_DROPOUT_MASKS, ids=[c[0] for c in BAD_DROPOUT_MASKS])
def test_jax_refuses_bad_host_dropout_masks(name: str, mask: Any, error: type[Exception], text: str) -> None:
    import jax.numpy as jnp

    from jax_attention.functional import dot_product_attention

    q = jnp.zeros((B, H, T, D))
    _raises(lambda: dot_product_attention(q, q, q, dropout_rate=RATE, deterministic=False, dropout_mask=mask),
            error, text)


# --------------------------------------------------------------------------- a module's positions=

MODULE = {"d_in": 16, "d_out": 16, "context_length": None, "dropout": 0.0, "num_heads": 2, "rope": ROPE}


@needs_both
@pytest.mark.parametrize(("name", "positions", "error", "text"), BAD_POSITIONS[:-1], ids=BAD_IDS[:-1])
def test_module_positions_from_the_host_get_one_text(name: str, positions: Any, error: type[Exception],
                                                     text: str) -> None:
    """A module call's ``positions=`` is checked as given too (the JAX twin converted
    first: float32 for a float64 list, and its own texts for strings and ragged lists)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import jax_attention
    import torch_attention

    x = random_x((B, T, 16))
    _raises(lambda: torch_attention.MultiHeadAttention(**MODULE)(torch.from_numpy(x), positions=positions),
            error, text)
    _raises(lambda: jax_attention.MultiHeadAttention(**MODULE, rngs=nnx.Rngs(0))(jnp.asarray(x), positions=positions),
            error, text)


@needs_both
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_module_positions_from_the_host_equal_a_tensor_and_the_twin(kind: str) -> None:
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import jax_attention
    from parity_tests import to_torch

    x = random_x((B, T, 16))
    flax_module = jax_attention.MultiHeadAttention(**MODULE, rngs=nnx.Rngs(0))
    torch_module = to_torch(flax_module)
    ours = torch_module(torch.from_numpy(x), positions=_host(kind, POSITIONS))
    assert torch.equal(ours, torch_module(torch.from_numpy(x), positions=torch.from_numpy(POSITIONS)))
    _close(ours.detach(), flax_module(jnp.asarray(x), positions=_host(kind, POSITIONS)))
