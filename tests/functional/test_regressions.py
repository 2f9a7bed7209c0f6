"""One regression test per defect once found in the numerics and input handling of
attention (float16 overflow, bfloat16 rounding, huge logits, NaN at padded keys, mask,
bias and ``kv_lengths`` forms), in both frameworks and, where the defect concerns the
functional cores, on every path of ``dot_product_attention``.  Each test asserts against
float64 numbers computed here with NumPy (independently of the code under test) or
against exact numbers."""

from __future__ import annotations

import re

import numpy as np
import pytest

from parity_tests.tolerances import ORACLE
from tests.support import needs_jax, needs_torch

FRAMEWORKS = [pytest.param("torch", marks=needs_torch), pytest.param("jax", marks=needs_jax)]
PATHS = ("reference", "fused", "blockwise", "auto")


# --------------------------------------------------------------------------- helpers


def lib(fw):
    if fw == "torch":
        import torch_attention

        return torch_attention
    import jax_attention

    return jax_attention


def to_fw(fw, a, dtype=None):
    """NumPy -> framework array; ``dtype`` a name ("float16", "bfloat16", ...)."""
    if a is None:
        return None
    if fw == "torch":
        import torch

        t = torch.from_numpy(np.array(a, copy=True))  # ascontiguousarray makes 0-d 1-d
        return t.to(getattr(torch, dtype)) if dtype else t
    import jax.numpy as jnp

    return jnp.asarray(a, dtype=getattr(jnp, dtype) if dtype else None)


def to_np(x):
    if hasattr(x, "detach"):
        import torch

        x = x.detach()
        return (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x).numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def attend(fw, q, k, v, *, dtype="float32", jit=False, **options):
    """``dot_product_attention`` of NumPy inputs in ``dtype``; the output as float64."""
    args = [to_fw(fw, t, dtype) for t in (q, k, v)]
    options = {name: to_fw(fw, val) if isinstance(val, np.ndarray) else val for name, val in options.items()}
    if fw == "torch":
        return to_np(lib(fw).dot_product_attention(*args, **options))
    import jax

    fn = lambda q, k, v: lib(fw).dot_product_attention(q, k, v, **options)  # noqa: E731
    return to_np((jax.jit(fn) if jit else fn)(*args))


def oracle(q, k, v, *, scale=None, mask=None, causal=False):
    """float64 attention by the formula; rows with nothing to attend to give 0."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ np.swapaxes(k, -1, -2)
    allowed = np.ones(scores.shape, bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & np.tril(np.ones(scores.shape[-2:], bool))
    scores = np.where(allowed, scores, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    e = np.where(allowed, np.exp(scores - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    weights = e / np.where(total == 0, 1.0, total)
    v_used = np.where(allowed.any(-2)[..., None], v, 0.0)  # a fully hidden key mixes nothing
    return weights @ v_used


def rounded(a, dtype):
    """``a`` as the framework sees it in ``dtype`` (bfloat16 / float16 rounding), float64."""
    import torch

    return torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, dtype)).double().numpy()


def assert_close(got, expected, tol, *, relative_to_max=False):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(got).all(), got
    scale = np.abs(expected).max() if relative_to_max else np.abs(expected)
    err = np.abs(got - expected)
    assert (err <= tol.atol + tol.rtol * scale).all(), float(err.max())


def x64_enabled(fw):
    if fw == "torch":
        return True
    import jax

    return bool(jax.config.jax_enable_x64)


# --------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_float16_overflowing_logit_is_not_a_zero_row(fw, path, masked):
    """q = 300, k = -300 (logits -360000: beyond float16) still weigh the one value 2."""
    q = np.full((1, 1, 2, 4), 300.0, np.float32)
    k = np.full((1, 1, 3, 4), -300.0, np.float32)
    v = np.full((1, 1, 3, 4), 2.0, np.float32)
    mask = np.array([True, True, False]) if masked else None
    out = attend(fw, q, k, v, dtype="float16", scale=0.5, mask=mask, implementation=path)
    np.testing.assert_array_equal(out, np.full((1, 1, 2, 4), 2.0))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bfloat16_head_dim_64_within_oracle_tolerance(fw, path):
    rng = np.random.default_rng(0)
    q, k, v = (rounded(rng.standard_normal((1, 2, 16, 64)) * 3, "bfloat16") for _ in range(3))
    out = attend(fw, q, k, v, dtype="bfloat16", causal=True, implementation=path)
    expected = oracle(q, k, v, causal=True)
    assert_close(out, expected, ORACLE["bfloat16"])
    if fw == "jax" and path in ("fused", "auto") and _takes_cudnn(q, k, v):
        return  # cuDNN rounds the weights to bfloat16 before mixing, as FlashAttention does: ORACLE is its bound
    # Computed in float32 and rounded once to bfloat16: within its unit roundoff (2**-8,
    # a property of the format, not a measured tolerance) plus float32 noise.
    assert (np.abs(out - expected) <= 2.0**-8 * np.abs(expected) + 1e-5 * np.abs(expected).max()).all()


def _takes_cudnn(*arrays):
    """Whether JAX's fused path runs cuDNN on these bfloat16 inputs (on an NVIDIA GPU only)."""
    import jax.numpy as jnp

    from jax_attention import functional

    return functional.cudnn_supports(*(jnp.asarray(a, jnp.bfloat16) for a in arrays))


# --------------------------------------------------------------------------- renormalize


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_renormalize_is_stable_and_equals_fill_on_every_path(fw, path):
    """A hidden key 110 above the visible ones: renormalize must not underflow to 0."""
    q = np.ones((1, 1, 1, 1), np.float32)
    k = np.array([0.0, 1.0, 110.0], np.float32).reshape(1, 1, 3, 1)
    v = np.array([1.0, 3.0, 50.0], np.float32).reshape(1, 1, 3, 1)
    mask = np.array([True, True, False])
    expected = (1.0 + 3.0 * np.e) / (1.0 + np.e)
    for strategy in ("renormalize", "fill"):
        out = attend(fw, q, k, v, scale=1.0, mask=mask, mask_strategy=strategy, implementation=path)
        np.testing.assert_allclose(out.ravel(), [expected], rtol=1e-6)
    if path == "reference":  # the output does not depend on asking for the weights
        args = [to_fw(fw, t) for t in (q, k, v)]
        out, weights = lib(fw).dot_product_attention(
            *args, scale=1.0, mask=to_fw(fw, mask), mask_strategy="renormalize", return_weights=True,
        )
        np.testing.assert_allclose(to_np(out).ravel(), [expected], rtol=1e-6)
        np.testing.assert_allclose(to_np(weights).ravel(), [1 / (1 + np.e), np.e / (1 + np.e), 0.0], rtol=1e-6)


# --------------------------------------------------------------------------- float64


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_float64_stays_float64_or_fused_refuses(fw, path):
    if not x64_enabled(fw):
        pytest.skip("float64 in JAX needs JAX_ENABLE_X64=1")
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 7, 4)) for _ in range(3))
    if path == "fused":
        with pytest.raises(ValueError, match=re.escape(
            "implementation='fused' cannot honour float64 inputs (the fused kernel does not "
            "guarantee float64 accuracy)"
        )):
            attend(fw, q, k, v, dtype="float64", causal=True, implementation=path)
        return
    out = attend(fw, q, k, v, dtype="float64", causal=True, implementation=path)
    np.testing.assert_allclose(out, oracle(q, k, v, causal=True), rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------- huge logits


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_huge_logits_keep_the_row_max_subtraction_exact(fw, path, jit):
    if fw == "torch" and jit:
        pytest.skip("no jit in PyTorch")
    rng = np.random.default_rng(2)
    q, k, v = (np.float32(rng.standard_normal((2, 2, 5, 3)) * 1e5) for _ in range(3))
    out = attend(fw, q, k, v, jit=jit, implementation=path)
    expected = oracle(q, k, v)
    assert np.isfinite(out).all()
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()


# --------------------------------------------------------------------------- padded keys


def _padded_problem():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)).astype(np.float32) for _ in range(3))
    lengths = np.array([5, 2], np.int32)
    k = np.concatenate([k, rng.standard_normal((2, 2, 1, 3)).astype(np.float32)], axis=2)  # S = 5
    v = np.concatenate([v, rng.standard_normal((2, 2, 1, 3)).astype(np.float32)], axis=2)
    valid = np.arange(5)[None, :] < lengths[:, None]  # (B, S)
    v_clean, k_clean = v.copy(), k.copy()
    v[1, :, 2:] = np.nan  # padding: garbage that must never be read
    k[1, :, 2:] = np.inf
    return q, k, v, k_clean, v_clean, lengths, valid


@pytest.mark.parametrize("kind", ["kv_lengths", "padding-mask"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_nan_at_padded_keys_reaches_no_output_and_no_gradient(fw, path, kind):
    q, k, v, k_clean, v_clean, lengths, valid = _padded_problem()
    mask = valid[:, None, None, :]
    options = {"kv_lengths": lengths} if kind == "kv_lengths" else {"mask": mask}
    expected = oracle(q, k_clean, v_clean, mask=mask)
    out = attend(fw, q, k, v, implementation=path, **options)
    assert_close(out, expected, ORACLE["float32"])
    # d sum(out) / d v: 0 at padded keys, finite everywhere
    if fw == "torch":
        import torch

        vt = torch.tensor(v, requires_grad=True)
        kw = {n: torch.from_numpy(a) for n, a in options.items()}
        lib(fw).dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), vt, implementation=path, **kw
        ).sum().backward()
        grad = vt.grad.numpy()
    else:
        import jax
        import jax.numpy as jnp

        kw = {n: jnp.asarray(a) for n, a in options.items()}
        grad = np.asarray(jax.jit(jax.grad(lambda vv: lib(fw).dot_product_attention(
            jnp.asarray(q), jnp.asarray(k), vv, implementation=path, **kw).sum()))(jnp.asarray(v)))
    assert np.isfinite(grad).all()
    assert (grad[1, :, 2:] == 0).all()
    # each valid key's value gradient is the total weight it gets: sum over queries
    weights_total = oracle(q, k_clean, np.eye(5)[None, None].repeat(2, 0).repeat(2, 1), mask=mask).sum(-2)
    np.testing.assert_allclose(grad[0], np.repeat(weights_total[0][..., None], 3, -1), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the three, against the oracle

THREE = ("huge-logit", "nan-past-lengths", "nan-at-masked-keys", "fully-masked-rows", "all-three")


def _three_problem(kind):
    """(q, k, v, options, magnitude) for one of ``THREE``: inputs x 1e5 (logits of about
    1e10); NaN and Inf stored at keys past ``kv_lengths``, or at keys that the mask
    hides from every query; rows with nothing to attend to (a masked row, an example of
    length 0); or all three at once.  ``options`` are NumPy."""
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, 4, 6, 8)).astype(np.float32) for _ in range(3))
    magnitude = 1e5 if kind in ("huge-logit", "all-three") else 1.0
    q, k, v = q * np.float32(magnitude), k * np.float32(magnitude), v * np.float32(magnitude)
    options = {}
    if kind in ("nan-past-lengths", "all-three"):
        lengths = np.array([4, 0] if kind == "all-three" else [6, 3], np.int32)
        options["kv_lengths"] = lengths
        for b, length in enumerate(lengths):
            k[b, :, length:], v[b, :, length:] = np.inf, np.nan
    if kind in ("nan-at-masked-keys", "fully-masked-rows", "all-three"):
        mask = rng.random((2, 1, 6, 6)) > 0.3
        if kind != "fully-masked-rows":  # key 1 hidden from every query holds garbage
            mask[..., 1] = False
            k[:, :, 1], v[:, :, 1] = np.nan, -np.inf
        if kind != "nan-at-masked-keys":
            mask[0, :, 2] = False  # query 2 of example 0 sees nothing
        options["mask"] = mask
    return q, k, v, options, magnitude


def _three_oracle(q, k, v, options):
    from parity_tests.reference import attention as reference

    q, k, v = (np.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (q, k, v))
    mask = options.get("mask", np.ones((1, 1, 1, q.shape[-2]), bool))
    mask = np.broadcast_to(mask, (q.shape[0], 1, q.shape[-2], k.shape[-2]))
    if "kv_lengths" in options:
        mask = mask & (np.arange(k.shape[-2]) < options["kv_lengths"][:, None])[:, None, None, :]
    return reference(q, k, v, scale=1 / np.sqrt(q.shape[-1]), mask=mask)[0]


@pytest.mark.parametrize("kind", THREE)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_huge_logits_nan_padding_and_fully_masked_rows_match_the_oracle(fw, path, kind):
    """The three numerical regressions, alone and together, on every path: finite outputs
    within float32's oracle tolerance of the float64 oracle (relative to the values' size
    for inputs x 1e5), zeros for a row with nothing to attend to, and a value gradient
    that is finite everywhere and 0 at every key that holds garbage."""
    q, k, v, options, magnitude = _three_problem(kind)
    expected = _three_oracle(q, k, v, options)
    tol = ORACLE["float32"]
    if fw == "torch":
        import torch

        vt = torch.tensor(v, requires_grad=True)
        out_t = lib(fw).dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), vt, implementation=path,
                                              **{n: torch.from_numpy(a) for n, a in options.items()})
        (out_t * (1.0 / magnitude)).sum().backward()
        out, grad = to_np(out_t), vt.grad.numpy()
    else:
        import jax
        import jax.numpy as jnp

        kw = {n: jnp.asarray(a) for n, a in options.items()}

        def run(vv):
            return lib(fw).dot_product_attention(jnp.asarray(q), jnp.asarray(k), vv, implementation=path, **kw)

        out_j, vjp = jax.vjp(run, jnp.asarray(v))
        out, grad = to_np(out_j), np.asarray(vjp(jnp.full(out_j.shape, 1.0 / magnitude, out_j.dtype))[0])
    assert_close(out, expected, tol, relative_to_max=magnitude != 1.0)
    if "mask" in options:
        rows = ~_three_oracle_rows(options)  # (B, T): rows with nothing to attend to
        assert (out[rows.nonzero()[0], :, rows.nonzero()[1]] == 0).all()
    assert np.isfinite(grad).all()
    garbage = ~np.isfinite(k) | ~np.isfinite(v)
    assert (grad[garbage] == 0).all()


def _three_oracle_rows(options):
    """(B, T) bool: the rows with something to attend to (mask and lengths)."""
    seen = np.broadcast_to(options["mask"], (2, 1, 6, 6))[:, 0]
    if "kv_lengths" in options:
        seen = seen & (np.arange(6) < options["kv_lengths"][:, None])[:, None, :]
    return seen.any(-1)


# --------------------------------------------------------------------------- low-rank masks


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_0d_and_1d_masks_work_on_every_path(fw, path, rank):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 2, 3, 4)).astype(np.float32) for _ in range(3))
    mask = np.array(True) if rank == 0 else np.array([True, False, True])
    out = attend(fw, q, k, v, mask=mask, causal=True, implementation=path)
    assert_close(out, oracle(q, k, v, mask=mask, causal=True), ORACLE["float32"])


# --------------------------------------------------------------------------- float16 under jit


@needs_jax
@pytest.mark.parametrize("path", PATHS)
def test_jax_float16_runs_under_jit_as_eagerly(path):
    rng = np.random.default_rng(5)
    q, k, v = (rounded(rng.standard_normal((1, 2, 6, 8)), "float16") for _ in range(3))
    eager = attend("jax", q, k, v, dtype="float16", causal=True, implementation=path)
    jitted = attend("jax", q, k, v, dtype="float16", causal=True, implementation=path, jit=True)
    np.testing.assert_array_equal(jitted, eager)
    assert_close(jitted, oracle(q, k, v, causal=True), ORACLE["float16"])


# --------------------------------------------------------------------------- kv_lengths


@pytest.mark.parametrize("form", ["int", "list", "numpy", "array-0d"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_kv_lengths_as_int_list_or_array(fw, path, form):
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 2, 3, 4)).astype(np.float32) for _ in range(3))
    lengths = {"int": 2, "list": [2, 2], "numpy": np.array([2, 2]),
               "array-0d": to_fw(fw, np.array(2, np.int32))}[form]
    out = attend(fw, q, k, v, kv_lengths=lengths, implementation=path)
    assert_close(out, oracle(q, k, v, mask=np.arange(3) < 2), ORACLE["float32"])


KV_LENGTH_ERRORS = [
    (2.5, TypeError, "kv_lengths must hold integers (valid keys per example); got dtype float64"),
    ([True, False], TypeError, "kv_lengths must hold integers (valid keys per example); got dtype bool"),
    ([1, 2, 3], ValueError, "kv_lengths must be an int or have shape (batch,) = (2,); got shape (3,)"),
    ([-1, 2], ValueError, "kv_lengths must lie in [0, kv_len] = [0, 3]; got values from -1 to 2"),
    ([1, 4], ValueError, "kv_lengths must lie in [0, kv_len] = [0, 3]; got values from 1 to 4"),
]


@pytest.mark.parametrize("lengths,error,message", KV_LENGTH_ERRORS, ids=lambda p: str(p)[:20])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bad_kv_lengths_raise_one_text(fw, lengths, error, message):
    q = np.zeros((2, 1, 3, 4), np.float32)
    with pytest.raises(error, match=re.escape(message)):
        attend(fw, q, q, q, kv_lengths=lengths)
    with pytest.raises(error, match=re.escape(message)):
        lib(fw).functional.canonical_kv_lengths(lengths, 2, 3)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_kv_lengths_need_a_batch_dimension(fw):
    q = np.zeros((1, 3, 4), np.float32)
    with pytest.raises(ValueError, match=re.escape(
        "kv_lengths needs q, k and v of shape (batch, heads, len, dim); got q of shape (1, 3, 4)"
    )):
        attend(fw, q, q, q, kv_lengths=2)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_padding_mask_rejects_fractional_lengths(fw):
    with pytest.raises(TypeError, match=re.escape("lengths must be an integer array; got dtype float32")):
        lib(fw).padding_mask(to_fw(fw, np.array([1.5, 2.0], np.float32)), 3)
    np.testing.assert_array_equal(
        np.asarray(lib(fw).padding_mask(to_fw(fw, np.array([1, 3])), 3)).reshape(2, 3),
        [[True, False, False], [True, True, True]],
    )


# --------------------------------------------------------------------------- additive masks


ADDITIVE = np.array([0.0, -np.inf, -1e9, -1e4], np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_additive_mask_encodings_are_blocked_eagerly_and_under_jit(fw, jit, dtype):
    if fw == "torch" and jit:
        pytest.skip("no jit in PyTorch")
    values = ADDITIVE if dtype != "float16" else ADDITIVE[[0, 1, 3]]  # -1e9 is -inf in float16
    if fw == "torch":
        import torch

        additive = torch.from_numpy(values).to(getattr(torch, dtype))
        lowest = torch.full((1,), torch.finfo(additive.dtype).min, dtype=additive.dtype)
        additive = torch.cat([additive, lowest])
        convert = lib(fw).from_additive_mask
    else:
        import jax
        import jax.numpy as jnp

        additive = jnp.asarray(values, getattr(jnp, dtype))
        additive = jnp.concatenate([additive, jnp.full((1,), jnp.finfo(additive.dtype).min, additive.dtype)])
        convert = jax.jit(lib(fw).from_additive_mask) if jit else lib(fw).from_additive_mask
    got = np.asarray(convert(additive))
    np.testing.assert_array_equal(got, [True] + [False] * (len(got) - 1))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_additive_bias_raises_eagerly_and_under_jit(fw, jit):
    if fw == "torch" and jit:
        pytest.skip("no jit in PyTorch")
    from attention_spec import ADDITIVE_BIAS_MESSAGE

    additive = to_fw(fw, np.array([0.0, -0.5, -np.inf], np.float32))
    convert = lib(fw).from_additive_mask
    if jit:
        import jax

        convert = jax.jit(convert)
    # under jit the ValueError is raised by a callback and arrives wrapped in JAX's
    # runtime error; its text is the same
    with pytest.raises(Exception, match=re.escape(ADDITIVE_BIAS_MESSAGE)) as info:
        np.asarray(convert(additive))
    if not jit:
        assert info.type is ValueError


# --------------------------------------------------------------------------- value width


@pytest.mark.parametrize("widths", [(5, 3), (4, 7)], ids=["narrower-v", "wider-v"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_value_width_different_from_key_width(fw, path, widths):
    d, dv = widths
    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((2, 2, 4, d)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, 2, 4, dv)).astype(np.float32)
    mask = rng.random((2, 1, 4, 4)) < 0.7
    out = attend(fw, q, k, v, mask=mask, implementation=path)
    assert out.shape == (2, 2, 4, dv)
    assert_close(out, oracle(q, k, v, mask=mask), ORACLE["float32"])


# --------------------------------------------------------------------------- mask helpers


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_mask_helpers_raise_one_error_for_bad_shapes(fw):
    with pytest.raises(ValueError, match=re.escape("q_len must be >= 0; got -1")):
        lib(fw).causal_mask(-1)
    with pytest.raises(TypeError, match=re.escape("kv_len must be an int; got float 2.5")):
        lib(fw).causal_mask(2, 2.5)
    a, b = to_fw(fw, np.ones((2, 3), bool)), to_fw(fw, np.ones((4, 1, 2), bool))
    with pytest.raises(ValueError, match=re.escape("masks of shapes (2, 3), (4, 1, 2) do not broadcast together")):
        lib(fw).combine_masks(a, b)
    with pytest.raises(TypeError, match=re.escape("mask must be a bool array (True = may attend); got dtype float32")):
        lib(fw).combine_masks(a, to_fw(fw, np.ones((2, 3), np.float32)))


# --------------------------------------------------------------------------- dropout mask


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_dropout_mask_with_rate_zero_raises(fw, path):
    q = np.zeros((1, 1, 3, 4), np.float32)
    keep = np.ones((3, 3), bool)
    training = {"training": True} if fw == "torch" else {"deterministic": False}
    with pytest.raises(ValueError, match=re.escape(
        "dropout_mask was given, but dropout is off: the dropout rate is 0.0"
    )):
        attend(fw, q, q, q, dropout_rate=0.0, dropout_mask=keep, implementation=path, **training)
