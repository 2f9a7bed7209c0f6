"""Projections: ``functional.linear`` in both twins and, on CPU, the JAX twin's matrix-product
kernel (``jax_attention/csrc/gemm.h``) that its ``fused`` and ``auto`` paths run, forward
and both gradients.

The kernel is held to the rigorous bound of a float32 sum of K products,
|C - C64| <= K u (|A| |B|) with u = 2**-24, at shapes that cross its register tile (6 x 64),
its K blocks (256) and its K split for weight gradients; it must give the same bits call
after call.  ``linear`` is held to the float64 oracle on every path, and to the PyTorch
twin's ``F.linear`` with the same weights.  (The modules run it on every path of the
parity matrix: ``test_matrix``, ``test_parity_grid``.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from parity_tests.harness import compare
from parity_tests.tolerances import GRAD_ORACLE, GRAD_PARITY, ORACLE, PARITY, Tolerance
from tests.support import needs_jax, needs_torch

pytestmark = needs_jax


def _check(name: str, got: Any, want: Any, tol: Tolerance, labels: tuple[str, str]) -> None:
    finding = compare(name, got, want, tol, labels)
    assert finding.ok, finding.describe()

UNIT_ROUNDOFF = 2.0**-24

# (M, N, K): edges of the 6 x 64 tile, K blocks of 256, the big-M plan (B packed once) and
# the small-M plan of weight gradients (K split into partial sums), empty K.
SHAPES = [(1, 1, 1), (5, 7, 3), (6, 64, 256), (7, 65, 257), (130, 70, 513), (775, 129, 64),
          (64, 96, 3000), (300, 200, 5000), (3, 5, 0)]


def _kernel() -> Any:
    import jax

    from jax_attention import _cpu_kernel

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernel runs on XLA's CPU backend")
    assert _cpu_kernel.available(), _cpu_kernel.build_error()
    return _cpu_kernel


@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("trans_a", [False, True], ids=["a", "aT"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_the_kernel_within_the_float32_bound(shape: tuple[int, int, int], trans_a: bool, trans_b: bool) -> None:
    import jax
    import jax.numpy as jnp

    kernel = _kernel()
    m, n, k = shape
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    stored_a = np.ascontiguousarray(a.T) if trans_a else a
    stored_b = np.ascontiguousarray(b.T) if trans_b else b

    @jax.jit
    def product(x: Any, y: Any) -> Any:
        return kernel.matmul(x, y, trans_a=trans_a, trans_b=trans_b)

    got = np.asarray(product(jnp.asarray(stored_a), jnp.asarray(stored_b)), np.float64)
    want = a.astype(np.float64) @ b.astype(np.float64)
    bound = k * UNIT_ROUNDOFF * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
    assert got.shape == (m, n)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) - bound))
    again = np.asarray(product(jnp.asarray(stored_a), jnp.asarray(stored_b)), np.float64)
    np.testing.assert_array_equal(again, got)  # fixed order of the sums: the same bits every call


def test_the_kernel_reads_nothing_else() -> None:
    """Inf and NaN outside the operands' views reach no output: an operand sliced out of
    a larger array is passed as its own (XLA-made) buffer, and a row of zeros in A gives a
    row of exact zeros."""
    import jax.numpy as jnp

    kernel = _kernel()
    rng = np.random.default_rng(1)
    big = rng.standard_normal((70, 300)).astype(np.float32)
    big[:, 257:] = np.inf
    big[65:, :] = np.nan
    a = jnp.asarray(big)[:65, :257]
    b = jnp.asarray(rng.standard_normal((257, 70)).astype(np.float32))
    got = np.asarray(kernel.matmul(a.at[3].set(0.0), b))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[3], np.zeros(70, np.float32))


def _oracle(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, cot: np.ndarray) -> tuple[np.ndarray, ...]:
    """float64 y = x w + bias and the gradients of sum(y * cot)."""
    flat, flat_cot = x.reshape(-1, x.shape[-1]), cot.reshape(-1, cot.shape[-1])
    y = flat @ w + (0.0 if bias is None else bias)
    return (y.reshape(*x.shape[:-1], w.shape[1]), (flat_cot @ w.T).reshape(x.shape), flat.T @ flat_cot,
            flat_cot.sum(0))


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("path", ["auto", "fused", "blockwise", "reference"])
def test_linear_against_the_oracle(path: str, with_bias: bool) -> None:
    """Forward and the gradients for x, the kernel and the bias, on every path, at a
    shape whose product crosses the kernel's tiles and whose weight gradient splits K."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import linear

    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 700, 70)).astype(np.float32)
    w = (rng.standard_normal((70, 130)) / 8).astype(np.float32)
    bias = rng.standard_normal(130).astype(np.float32) if with_bias else None
    cot = rng.uniform(0.5, 1.5, (3, 700, 130)).astype(np.float32)

    operands = tuple(jnp.asarray(a) for a in (x, w) + (() if bias is None else (bias,)))

    def loss(*operands_: Any) -> Any:
        return jnp.sum(linear(*operands_, implementation=path, precision="highest") * cot)

    y = linear(*operands, implementation=path, precision="highest")
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(operands)))))(*operands)
    want = _oracle(x.astype(np.float64), w.astype(np.float64), None if bias is None else bias.astype(np.float64),
                   cot.astype(np.float64))
    assert y.dtype == jnp.float32
    labels = (path, "oracle")
    _check("y", np.asarray(y), want[0], ORACLE["float32"], labels)
    for name, got, expected in zip(("dx", "dkernel"), grads[:2], want[1:3], strict=True):
        _check(name, np.asarray(got), expected, GRAD_ORACLE["float32"], labels)
    if bias is not None:
        _check("dbias", np.asarray(grads[2]), want[3], GRAD_ORACLE["float32"], labels)


@pytest.mark.parametrize("path", ["blockwise", "reference"])
def test_forward_mode_on_xlas_dot(path: str) -> None:
    """On XLA's dot (``_xla_product``, its kernel viewed as (d_in, 1, d_out)) ``linear``
    stays differentiable forward (no ``custom_vjp``): ``jax.jvp`` in x, the kernel and
    the bias together gives dx W + x dW + db, held to the float64 oracle."""
    import jax
    import jax.numpy as jnp

    from jax_attention.functional import linear

    rng = np.random.default_rng(5)
    x, dx = (rng.standard_normal((2, 9, 70)).astype(np.float32) for _ in range(2))
    w, dw = ((rng.standard_normal((70, 30)) / 8).astype(np.float32) for _ in range(2))
    b, db = (rng.standard_normal(30).astype(np.float32) for _ in range(2))

    def f(x_: Any, w_: Any, b_: Any) -> Any:
        return linear(x_, w_, b_, implementation=path, precision="highest")

    y, dy = jax.jvp(f, tuple(map(jnp.asarray, (x, w, b))), tuple(map(jnp.asarray, (dx, dw, db))))
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    labels = (path, "oracle")
    _check("y", np.asarray(y), x64 @ w64 + b, ORACLE["float32"], labels)
    _check("dy", np.asarray(dy), dx.astype(np.float64) @ w64 + x64 @ dw.astype(np.float64) + db,
           ORACLE["float32"], labels)


def test_only_fused_and_auto_run_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU in float32, ``fused`` runs the kernel, and ``auto`` too where the kernel is
    tuned for the CPU (``test_cpu_kernel`` checks the builds) and x has more than
    ``FEW_ROWS`` rows (a decode step's few tokens stay on XLA's dot); ``reference`` and
    ``blockwise`` are XLA's dot and never ask for it; other dtypes stay on XLA."""
    import jax.numpy as jnp

    from jax_attention import functional
    from jax_attention._linear import FEW_ROWS

    kernel = _kernel()
    calls: list[tuple[bool, bool]] = []
    product = kernel.matmul

    def counted(a: Any, b: Any, *, trans_a: bool = False, trans_b: bool = False) -> Any:
        calls.append((trans_a, trans_b))
        return product(a, b, trans_a=trans_a, trans_b=trans_b)

    monkeypatch.setattr(kernel, "matmul", counted)
    x, w = jnp.ones((2, 20, 8), jnp.float32), jnp.ones((8, 3), jnp.float32)
    for path in ("reference", "blockwise"):
        functional.linear(x, w, implementation=path)
    functional.linear(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), implementation="auto")
    assert calls == []
    for path in ("fused", "auto"):
        functional.linear(x, w, implementation=path)
    assert calls == [(False, False)] * (1 if kernel.auto_declines() else 2)
    del calls[:]
    few = jnp.ones((2, FEW_ROWS // 2, 8), jnp.float32)  # FEW_ROWS rows in all
    functional.linear(few, w, implementation="auto")
    functional.linear(few, w, implementation="fused")
    assert calls == [(False, False)]  # fused only


def test_linear_promotes_as_flax_does() -> None:
    """The operands in ``dtype`` (None: their common type), as ``nnx.Linear`` computes."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_attention.functional import linear

    layer = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 8)), jnp.bfloat16)
    got = linear(x, layer.kernel[...], layer.bias[...], implementation="reference")
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(layer(x)))
    half = linear(x, layer.kernel[...], layer.bias[...], dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16


@needs_torch
@pytest.mark.parametrize("path", ["auto", "reference"])
def test_twins_agree(path: str) -> None:
    """The same weights (Flax's kernel is PyTorch's weight transposed): the same numbers
    forward and backward, within the twin tolerances."""
    import jax
    import jax.numpy as jnp
    import torch

    import torch_attention.functional as torch_functional
    from jax_attention.functional import linear

    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 33, 48)).astype(np.float32)
    w = (rng.standard_normal((48, 80)) / 7).astype(np.float32)
    bias = rng.standard_normal(80).astype(np.float32)
    cot = rng.standard_normal((4, 33, 80)).astype(np.float32)

    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, np.ascontiguousarray(w.T), bias))
    yt = torch_functional.linear(xt, wt, bt, implementation=path)
    (yt * torch.from_numpy(cot)).sum().backward()

    def loss(x_: Any, w_: Any, b_: Any) -> Any:
        return jnp.sum(linear(x_, w_, b_, implementation=path, precision="highest") * cot)

    yj = linear(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), implementation=path, precision="highest")
    gx, gw, gb = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias))
    labels = ("torch", "flax")
    _check("y", yt.detach().numpy(), np.asarray(yj), PARITY["float32"], labels)
    assert xt.grad is not None and wt.grad is not None and bt.grad is not None
    for name, want, got in (("dx", xt.grad, gx), ("dkernel", wt.grad.T, gw), ("dbias", bt.grad, gb)):
        _check(name, want.numpy(), np.asarray(got), GRAD_PARITY["float32"], labels)


BAD = [
    ("x-width", (2, 5, 7), (8, 3), (3,), r"linear: x must end in the weight's 8 input features; got shape \(2, 5, 7\)"),
    ("bias-shape", (2, 5, 8), (8, 3), (4,), r"linear: the bias must have shape \(3,\) \(the weight's output features\)"),
    ("scalar-x", (), (8, 3), None, r"linear: x must end in the weight's 8 input features; got shape \(\)"),
    ("weight-3d", (2, 5, 8), (8, 3, 1), None, r"linear: the weight must be a matrix; got shape \(8, 3, 1\)"),
]


@needs_torch
@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_bad_operands_same_text(bad: tuple[Any, ...]) -> None:
    """Wrong widths and shapes: the same ``ValueError`` text from both twins, before any
    work; an unknown ``implementation`` as every other call reports it."""
    import jax.numpy as jnp
    import torch

    import torch_attention.functional as torch_functional
    from jax_attention import functional as jax_functional

    _, x_shape, w_shape, b_shape, text = bad
    x = np.ones(x_shape, np.float32)
    w = np.ones(w_shape, np.float32)
    b = None if b_shape is None else np.ones(b_shape, np.float32)
    messages = []
    with pytest.raises(ValueError, match=text) as jax_error:
        jax_functional.linear(jnp.asarray(x), jnp.asarray(w), None if b is None else jnp.asarray(b))
    messages.append(str(jax_error.value))
    with pytest.raises(ValueError, match=text) as torch_error:
        # PyTorch's weight is the kernel transposed; a weight that is no matrix is passed as it is
        torch_w = np.ascontiguousarray(w.T) if w.ndim == 2 else w
        torch_functional.linear(torch.from_numpy(x), torch.from_numpy(torch_w), None if b is None else torch.from_numpy(b))
    messages.append(str(torch_error.value))
    assert messages[0] == messages[1]
    with pytest.raises(ValueError, match="implementation") as jax_error:
        jax_functional.linear(jnp.ones((2, 8)), jnp.ones((8, 3)), implementation="cudnn")
    with pytest.raises(ValueError, match="implementation") as torch_error:
        torch_functional.linear(torch.ones(2, 8), torch.ones(3, 8), implementation="cudnn")
    assert str(jax_error.value) == str(torch_error.value)


def test_the_shared_check_knows_both_layouts() -> None:
    """check_linear reads the weight's two features by its layout, and refuses a layout it
    does not know rather than guessing one."""
    from attention_spec.arrays import check_linear

    check_linear((2, 8), (8, 3), (3,), layout="in_out")
    check_linear((2, 8), (3, 8), (3,), layout="out_in")
    with pytest.raises(ValueError, match=r"x must end in the weight's 3 input features"):
        check_linear((2, 8), (8, 3), None, layout="out_in")
    with pytest.raises(ValueError, match=r"layout must be 'in_out' or 'out_in'; got 'in-out'"):
        check_linear((2, 8), (8, 3), None, layout="in-out")
