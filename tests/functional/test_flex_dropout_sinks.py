"""What our ``flex_attention`` has that PyTorch's lacks (issue 56, item 3): dropout on the
weights (pytorch issue #141784) and attention sinks, in both twins, forward and backward.

Against the float64 loop oracle (``reference.flex_attention`` with ``sinks``, ``keep`` and
``rate``): out and lse, and the gradients of q, k, v and sinks by central differences
(directional, and each sink's own); twin against twin; a drawn keep-mask read back
through an identity ``v`` (each output row is then that row's weights), so that the
oracle checks the forward's survivors and the backward's use of the same keep-mask; the
call that stands for named options handing sinks and a keep-mask to
``dot_product_attention``; a module's flex row honouring them; one error text per bad
input, raised before any work.

Tiny shapes (B 2, Hq 4 over Hkv 2, L = S = 8, blocks of 4), an ALiBi score mod, and a
mask mod of one's own that leaves a whole query block (rows 0-3) and row 5 without keys;
JAX's compilations are what costs: one jitted function per kind of dropout, gradients
in float64 only (float32 forward), one module call.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest

from attention_spec import mods
from attention_spec.positions import alibi_slopes
from parity_tests import reference
from parity_tests.tolerances import FLEX_GRAD_ORACLE, FLEX_ORACLE, GRAD_ORACLE, ORACLE, PARITY
from tests.support import needs_both

pytestmark = needs_both

B, H, HKV, L, E, EV = 2, 4, 2, 8, 4, 8  # EV = L: an identity v reads the weights back
BLOCK, RATE, SCALE = 4, 0.25, 0.5
SLOPES = np.asarray(alibi_slopes(H), np.float64)
SCORE_MOD = mods.alibi(SLOPES)
DEAD_ROWS = [0, 1, 2, 3, 5]
EPS = 1e-5  # where the oracle's differences erred least (sinks: 5e-11-9e-11; 1e-6: 6e-10-4e-9)


def _mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Causal, with query block 0 (rows 0-3, no key block at all) and row 5 blocked."""
    return (kv_idx <= q_idx) & (q_idx >= 4) & (q_idx != 5)


def _draw() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(56)
    return {
        "q": rng.standard_normal((B, H, L, E)), "k": rng.standard_normal((B, HKV, L, E)),
        "v": rng.standard_normal((B, HKV, L, EV)),
        "sinks": np.array([0.5, -1.0, 2.5, 0.0]),  # one sink outweighing its row's keys
        "keep": rng.random((B, H, L, L)) >= RATE, "co": rng.uniform(0.5, 1.5, (B, H, L, EV)),
        "cl": rng.uniform(0.5, 1.5, (B, H, L)),
    }


DATA = _draw()
IDENTITY_V = np.broadcast_to(np.eye(L), (B, HKV, L, EV)).copy()


def _oracle(q: Any, k: Any, v: Any, sinks: Any, keep: Any) -> tuple[np.ndarray, np.ndarray]:
    return reference.flex_attention(q, k, v, score_mod=SCORE_MOD, mask_mod=_mask_mod, scale=SCALE, sinks=sinks,
                                    keep=keep, rate=RATE)


def _oracle_loss(arrays: list[np.ndarray], keep: np.ndarray) -> float:
    out, lse = _oracle(*arrays, keep)
    return math.fsum((out * DATA["co"]).ravel()) + math.fsum((lse * DATA["cl"]).ravel())


def _torch(arrays: list[np.ndarray], dtype: str, **dropout: Any) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(out, lse, grads of q, k, v, sinks) of the PyTorch twin's public flex_attention."""
    import torch

    import torch_attention.functional as tf

    bm = tf.create_block_mask(_mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    ts = [torch.tensor(a, dtype=getattr(torch, dtype), requires_grad=True) for a in arrays]
    out, lse = tf.flex_attention(*ts[:3], SCORE_MOD, bm, SCALE, enable_gqa=True, return_lse=True, sinks=ts[3],
                                 dropout_rate=RATE, training=True, **dropout)
    loss = (out * torch.tensor(DATA["co"], dtype=out.dtype)).sum() + (lse * torch.tensor(DATA["cl"])).sum()
    loss.backward()
    return out.detach().numpy(), lse.detach().numpy(), [t.grad.numpy() for t in ts]


@functools.cache
def _jax_fn(kind: str, grad: bool = True) -> Any:
    """The jitted value and gradients (q, k, v, sinks) of the JAX twin's public
    flex_attention (``grad`` False: the value alone), its last operand the keep-mask
    (``kind="keep"``) or the rng key."""
    import jax
    import jax.numpy as jnp

    import jax_attention.functional as jf

    bm = jf.create_block_mask(_mask_mod, None, None, L, L, BLOCK_SIZE=BLOCK)

    def loss(q: Any, k: Any, v: Any, sinks: Any, extra: Any) -> Any:
        dropout = {"dropout_mask": extra} if kind == "keep" else {"rng": extra}
        out, lse = jf.flex_attention(q, k, v, SCORE_MOD, bm, SCALE, enable_gqa=True, return_lse=True, sinks=sinks,
                                     dropout_rate=RATE, deterministic=False, **dropout)
        return jnp.sum(out * DATA["co"].astype(out.dtype)) + jnp.sum(lse * DATA["cl"].astype(lse.dtype)), (out, lse)

    if not grad:
        return jax.jit(lambda *a: (loss(*a), ()))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _jax(arrays: list[np.ndarray], dtype: str, kind: str, extra: Any, grad: bool = True) -> tuple[
        np.ndarray, np.ndarray, list[np.ndarray]]:
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(dtype == "float64"):
        (_, (out, lse)), grads = _jax_fn(kind, grad)(*(jnp.asarray(a, getattr(jnp, dtype)) for a in arrays),
                                                     jnp.asarray(extra) if kind == "keep" else extra)
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


def _close(got: np.ndarray, want: np.ndarray, tol: Any, what: str) -> None:
    scale = np.abs(want).max() if tol.normwise else np.abs(want)
    error = np.abs(got - want)
    assert np.all(error <= tol.atol + tol.rtol * scale), f"{what}: max error {error.max():.2e}"


def _check_gradients(grads: list[np.ndarray], arrays: list[np.ndarray], keep: np.ndarray, what: str) -> None:
    """float64 gradients (q, k, v, sinks) against the oracle's central differences: two
    random directions through all four, then each sink alone."""
    rng = np.random.default_rng(len(what))
    directions = [[rng.standard_normal(a.shape) for a in arrays] for _ in range(2)]
    directions += [[np.zeros_like(a) for a in arrays[:3]] + [np.eye(H)[h]] for h in range(H)]
    for us in directions:
        fd = (_oracle_loss([a + EPS * u for a, u in zip(arrays, us, strict=True)], keep)
              - _oracle_loss([a - EPS * u for a, u in zip(arrays, us, strict=True)], keep)) / (2 * EPS)
        ad = math.fsum(float((g * u).sum()) for g, u in zip(grads, us, strict=True))
        magnitude = math.fsum(float(np.abs(g * u).sum()) for g, u in zip(grads, us, strict=True))
        error = abs(ad - fd) / (magnitude + abs(fd))
        assert error <= FLEX_GRAD_ORACLE, f"{what}: <grad, u> = {ad!r}, difference {fd!r} ({error:.2e})"


ARRAYS = [DATA["q"], DATA["k"], DATA["v"], DATA["sinks"]]


@pytest.fixture(scope="module")
def float64_runs() -> dict[str, tuple[np.ndarray, np.ndarray, list[np.ndarray]]]:
    import torch

    return {"torch": _torch(ARRAYS, "float64", dropout_mask=torch.tensor(DATA["keep"])),
            "jax": _jax(ARRAYS, "float64", "keep", DATA["keep"])}


def test_keep_mask_and_sinks_against_the_oracle_in_float64(float64_runs: Any) -> None:
    """An explicit keep-mask and sinks with a score mod and a block mask: out and lse equal
    the oracle's, a row without keys has zeros and lse = its sink, and the gradients of
    q, k, v and sinks equal the oracle's central differences, in both twins, and each
    other's."""
    want_out, want_lse = _oracle(*ARRAYS, DATA["keep"])
    assert np.all(want_out[:, :, DEAD_ROWS] == 0)
    assert np.array_equal(want_lse[:, :, DEAD_ROWS], np.broadcast_to(DATA["sinks"][:, None], (B, H, 5)))
    for side, (out, lse, grads) in float64_runs.items():
        _close(out, want_out, PARITY["float64"], f"{side} out")
        _close(lse, want_lse, PARITY["float64"], f"{side} lse")
        assert np.all(out[:, :, DEAD_ROWS] == 0)
        _check_gradients(grads, ARRAYS, DATA["keep"], side)
    for got, want, name in zip(float64_runs["torch"][2], float64_runs["jax"][2], "q k v sinks".split(), strict=True):
        _close(got, want, PARITY["float64"], f"twin against twin, d{name}")


def test_a_sink_of_minus_inf_is_no_sink() -> None:
    """A head whose sink is -inf is a head without one (its rows without keys: zeros, lse
    -inf), with finite gradients and none for that sink, in both twins (the compiled JAX
    function of the first test, new values)."""
    import torch

    arrays = [*ARRAYS[:3], np.array([0.5, -np.inf, 2.5, 0.0])]
    want_out, want_lse = _oracle(*arrays, DATA["keep"])
    assert np.all(want_lse[:, 1, DEAD_ROWS] == -np.inf)
    for side, (out, lse, grads) in (("torch", _torch(arrays, "float64", dropout_mask=torch.tensor(DATA["keep"]))),
                                    ("jax", _jax(arrays, "float64", "keep", DATA["keep"]))):
        _close(out, want_out, PARITY["float64"], f"{side} out")
        assert np.array_equal(np.isfinite(lse), np.isfinite(want_lse)), side
        _close(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], PARITY["float64"], f"{side} lse")
        assert all(np.isfinite(g).all() for g in grads) and grads[3][1] == 0, side


def test_float32_against_the_oracle_and_twin_against_twin(float64_runs: Any) -> None:
    """float32 inputs (sinks cast to the compute dtype): out and lse within the flex
    oracle's tolerance and the twins within parity of each other; the PyTorch twin's
    gradients within the gradient oracle's of the float64 ones (the JAX twin's float32
    backward is its float64 one, traced again: not compiled once more here)."""
    import torch

    want_out, want_lse = _oracle(*ARRAYS, DATA["keep"])
    arrays = [a.astype(np.float32) for a in ARRAYS]
    runs = {"torch": _torch(arrays, "float32", dropout_mask=torch.tensor(DATA["keep"])),
            "jax": _jax(arrays, "float32", "keep", DATA["keep"], grad=False)}
    for side, (out, lse, _) in runs.items():
        assert out.dtype == np.float32 and lse.dtype == np.float32
        _close(out, want_out, FLEX_ORACLE["float32"], f"{side} out")
        _close(lse, want_lse, FLEX_ORACLE["float32"], f"{side} lse")
    for got, want, name in zip(runs["torch"][2], float64_runs["torch"][2], "q k v sinks".split(), strict=True):
        _close(got, want, GRAD_ORACLE["float32"], f"torch d{name}")
    _close(runs["torch"][0], runs["jax"][0], PARITY["float32"], "twin against twin, out")
    _close(runs["torch"][1], runs["jax"][1], PARITY["float32"], "twin against twin, lse")


def test_the_torch_chunks_and_checkpointed_blocks_and_the_jax_loops_give_the_same(float64_runs: Any,
                                                                                  monkeypatch: Any) -> None:
    """The PyTorch twin's keys a chunk at a time (``KEY_CHUNK`` 2 here: the online softmax
    over several chunks, the sink seen first, each chunk's slice of the keep-mask), its
    other path (a score mod over a tensor that needs its gradient: each query block a
    checkpoint, dropout and sinks by ``_softmax`` and ``dropout_weights``) and the JAX
    twin's loops (past ``UNROLLED_BLOCKS`` query blocks) give the numbers and gradients of
    the main paths."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention._flex as jflex
    import torch_attention._flex as tflex

    monkeypatch.setattr(tflex, "KEY_CHUNK", 2)
    chunked = _torch(ARRAYS, "float64", dropout_mask=torch.tensor(DATA["keep"]))
    for got, want, what in zip((chunked[0], chunked[1], *chunked[2]), (float64_runs["torch"][0],
                               float64_runs["torch"][1], *float64_runs["torch"][2]), "out lse dq dk dv dsinks".split(),
                               strict=True):
        _close(got, want, PARITY["float64"], f"chunked {what}")
    ts = [torch.tensor(a, requires_grad=True) for a in ARRAYS]
    slopes = torch.tensor(SLOPES, requires_grad=True)
    bm = tflex.create_block_mask(_mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = tflex.flex_attention(*ts[:3], mods.alibi(slopes), bm, SCALE, True, True, sinks=ts[3],
                                    dropout_rate=RATE, training=True, dropout_mask=torch.tensor(DATA["keep"]))
    ((out * torch.tensor(DATA["co"])).sum() + (lse * torch.tensor(DATA["cl"])).sum()).backward()
    assert float(slopes.grad.abs().max()) > 1e-3  # the checkpointed path ran
    want_out, want_lse, want_grads = float64_runs["torch"]
    _close(out.detach().numpy(), want_out, PARITY["float64"], "checkpointed out")
    _close(lse.detach().numpy(), want_lse, PARITY["float64"], "checkpointed lse")
    for t, want in zip(ts, want_grads, strict=True):
        _close(t.grad.numpy(), want, PARITY["float64"], "checkpointed gradient")
    monkeypatch.setattr(jflex, "UNROLLED_BLOCKS", 1)  # both query blocks in one loop
    monkeypatch.setattr(jflex, "LOOPS", 1)
    looped_runs: list[int] = []
    original = jflex._looped
    monkeypatch.setattr(jflex, "_looped", lambda *a: (looped_runs.append(1), original(*a))[1])
    with jax.enable_x64(True):
        jbm = jflex.create_block_mask(_mask_mod, None, None, L, L, BLOCK_SIZE=BLOCK)
        looped, looped_lse = jflex.flex_attention(
            *(jnp.asarray(a) for a in ARRAYS[:3]), SCORE_MOD, jbm, SCALE, True, True, sinks=jnp.asarray(ARRAYS[3]),
            dropout_rate=RATE, deterministic=False, dropout_mask=jnp.asarray(DATA["keep"]))
        _close(np.asarray(looped), float64_runs["jax"][0], PARITY["float64"], "looped out")
        _close(np.asarray(looped_lse), float64_runs["jax"][1], PARITY["float64"], "looped lse")
    assert looped_runs


def _read_back(out: np.ndarray) -> np.ndarray:
    """The keep-mask of a call with the identity v: each output row is its weights, a
    dropped one exactly 0 (every visible key's softmax weight is far from 0 here)."""
    return out != 0


@pytest.mark.parametrize("side", ["torch", "jax"])
def test_drawn_dropout_is_one_keep_mask_for_forward_and_backward(side: str, monkeypatch: Any) -> None:
    """Dropout drawn from a generator (PyTorch) or an rng key (JAX), read back through an
    identity v: about ``RATE`` of the visible weights dropped, the survivors the oracle's
    weights / (1 - RATE) with that keep-mask, rows without keys zeros, the gradients the
    oracle's central differences with that keep-mask (so the backward used the forward's
    keep-mask), the same seed drawing the same and another seed another.  The PyTorch
    twin's keys come 3 at a time here (``KEY_CHUNK``): each chunk draws its own part."""
    import jax
    import torch

    import torch_attention._flex as tflex

    monkeypatch.setattr(tflex, "KEY_CHUNK", 3)

    arrays = [DATA["q"], DATA["k"], IDENTITY_V, DATA["sinks"]]

    def run(seed: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        if side == "torch":
            return _torch(arrays, "float64", generator=torch.Generator().manual_seed(seed))
        return _jax(arrays, "float64", "drawn", jax.random.key(seed))

    out, lse, grads = run(7)
    keep = _read_back(out)
    visible = _oracle(*arrays, None)[0] > 0
    dropped = 1.0 - keep[visible].mean()
    assert abs(dropped - RATE) < 0.1, dropped  # 3 standard deviations of 160 draws
    want_out, want_lse = _oracle(*arrays, keep)
    _close(out, want_out, PARITY["float64"], f"{side} out")
    _close(lse, want_lse, PARITY["float64"], f"{side} lse")
    assert np.all(out[:, :, DEAD_ROWS] == 0)
    _check_gradients(grads, arrays, keep, f"{side} drawn")
    assert np.array_equal(run(7)[0], out)
    assert not np.array_equal(_read_back(run(8)[0]), keep)


def test_named_options_hand_sinks_and_the_keep_mask_to_dot_product_attention() -> None:
    """Mods that stand for named options (causal, a soft cap) with sinks and a keep-mask:
    that call of ``dot_product_attention``, the sinks and keep-mask passed on (the same
    numbers to the bit, and the oracle's); dropout drawn stays on the flex path (it
    draws its own keep-mask), as does ``return_lse``."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    q, k, v, sinks, keep = (DATA[n] for n in ("q", "k", "v", "sinks", "keep"))
    k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    want, _ = reference.flex_attention(q, k, v, score_mod=mods.softcap(2.0), mask_mod=mods.causal, scale=SCALE,
                                       sinks=sinks, keep=keep, rate=RATE)
    tbm = tf.create_block_mask(mods.causal, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)
    tq, tk, tv, ts = (torch.tensor(a) for a in (q, k, v, sinks))
    given = {"sinks": ts, "dropout_rate": RATE, "training": True, "dropout_mask": torch.tensor(keep)}
    route = tf.flex_route(tq, tk, tv, mods.softcap(2.0), tbm, SCALE, **given)
    assert route.reasons[0] == ("flex: the mods stand for causal=True, softcap=2.0, sinks=<array>, "
                                "dropout_rate=0.25, dropout_mask=<array>, training=True"), route.reasons
    out = tf.flex_attention(tq, tk, tv, mods.softcap(2.0), tbm, SCALE, **given)
    named = tf.dot_product_attention(tq, tk, tv, causal=True, softcap=2.0, scale=SCALE, sinks=ts, dropout_rate=RATE,
                                     training=True, dropout_mask=torch.tensor(keep))
    assert torch.equal(out, named)
    _close(out.numpy(), want, PARITY["float64"], "torch named")
    drawn = tf.flex_route(tq, tk, tv, mods.softcap(2.0), tbm, SCALE, sinks=ts, dropout_rate=RATE, training=True)
    assert drawn.path == "flex" and "dropout drawn" in drawn.reasons[0]
    # the JAX twin's route (its options as its keywords: deterministic=False); its run is
    # dot_product_attention's, under test elsewhere (one compilation less here)
    jbm = jf.create_block_mask(mods.causal, None, None, L, L, BLOCK_SIZE=BLOCK)
    jq, jk, jv, js = (jnp.asarray(a, jnp.float32) for a in (q, k, v, sinks))
    jgiven = {"sinks": js, "dropout_rate": RATE, "deterministic": False, "dropout_mask": jnp.asarray(keep)}
    assert jf.flex_route(jq, jk, jv, mods.softcap(2.0), jbm, SCALE, **jgiven).reasons[0] == route.reasons[0]
    jdrawn = jf.flex_route(jq, jk, jv, mods.softcap(2.0), jbm, SCALE, sinks=js, dropout_rate=RATE,
                           deterministic=False, rng=jax.random.key(0))
    assert jdrawn.reasons == drawn.reasons


def _bad(f: Any, mk: Any, **extra: Any) -> Any:
    q, k = mk(DATA["q"]), mk(DATA["k"])
    return f.flex_attention(q, k, k, SCORE_MOD, None, None, True, **extra)


# id -> (the PyTorch twin's keywords, the JAX twin's (mk makes an array), the error, the
# text; two texts where the twins' argument is named differently, as in their signatures).
def _bad_cases() -> dict[str, tuple[Any, Any, type, tuple[str, ...]]]:
    keep_shape = (B, H, L, L + 1)
    train = {"dropout_rate": RATE, "training": True}
    jtrain = {"dropout_rate": RATE, "deterministic": False}
    return {
        "sinks-shape": (lambda mk: {"sinks": mk(np.zeros(3))}, lambda mk: {"sinks": mk(np.zeros(3))}, ValueError,
                        ("flex_attention: sinks must have shape (4,), one logit per query head; got (3,)",)),
        "sinks-dtype": (lambda mk: {"sinks": mk(np.zeros(4, np.int32))},
                        lambda mk: {"sinks": mk(np.zeros(4, np.int32))}, TypeError,
                        ("flex_attention: sinks must be a floating-point array; got dtype int32",)),
        "keep-shape": (lambda mk: {**train, "dropout_mask": mk(np.ones(keep_shape, bool))},
                       lambda mk: {**jtrain, "dropout_mask": mk(np.ones(keep_shape, bool))}, ValueError,
                       ("flex_attention: dropout_mask of shape (2, 4, 8, 9) does not broadcast to the attention "
                        "weights' shape (2, 4, 8, 8)",)),
        "keep-dtype": (lambda mk: {**train, "dropout_mask": mk(np.ones((L, L), np.float32))},
                       lambda mk: {**jtrain, "dropout_mask": mk(np.ones((L, L), np.float32))}, TypeError,
                       ("flex_attention: dropout_mask must be a bool array (True = keep); got dtype float32",)),
        "keep-in-eval": (lambda mk: {"dropout_rate": RATE, "dropout_mask": mk(np.ones((L, L), bool))},
                         lambda mk: {"dropout_rate": RATE, "dropout_mask": mk(np.ones((L, L), bool))}, ValueError,
                         ("flex_attention: dropout_mask was given, but dropout is off: the module is in eval mode "
                          "(deterministic); dropout applies in training mode only",)),
        "rate": (lambda mk: {"dropout_rate": 1.0, "training": True},
                 lambda mk: {"dropout_rate": 1.0, "deterministic": False}, ValueError,
                 ("flex_attention: dropout must be in [0, 1); got 1.0",)),
        "mode": (lambda mk: {"training": 1}, lambda mk: {"deterministic": 1}, TypeError,
                 ("flex_attention: training must be a bool; got int 1",
                  "flex_attention: deterministic must be a bool; got int 1")),
        "stream-type": (lambda mk: {**train, "generator": 3}, lambda mk: {**jtrain, "rng": 3}, TypeError,
                        ("flex_attention: generator must be a torch.Generator or None; got int",
                         "flex_attention: rng must be a JAX random key or None; got int")),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_one_text_in_both_twins_before_any_work(case: str, monkeypatch: Any) -> None:
    """Sinks of the wrong shape or dtype, a keep-mask of the wrong shape or dtype or with
    dropout off, a bad rate, flag or stream: the same error and text in both twins
    (``attention_spec.flex.check_flex_extras``), raised before the block plan is read."""
    import jax.numpy as jnp
    import torch

    import jax_attention._flex as jflex
    import jax_attention.functional as jf
    import torch_attention._flex as tflex
    import torch_attention.functional as tf

    torch_kw, jax_kw, error, texts = _bad_cases()[case]
    for module in (jflex, tflex):
        monkeypatch.setattr(module, "_plan", lambda *a: pytest.fail("work began before the checks"))
    with pytest.raises(error) as torch_error:
        _bad(tf, torch.tensor, **torch_kw(torch.tensor))
    with pytest.raises(error) as jax_error:
        _bad(jf, jnp.asarray, **jax_kw(jnp.asarray))
    assert (str(torch_error.value), str(jax_error.value)) == (texts[0], texts[-1])


def test_dropout_without_a_stream() -> None:
    """Dropout drawn in training mode: the JAX twin, which has no global stream, refuses a
    call without an rng key (the text names what it needs); the PyTorch twin draws from
    torch's global generator, as ``nn.Dropout`` does."""
    import jax.numpy as jnp
    import torch

    import jax_attention.functional as jf
    import torch_attention.functional as tf

    with pytest.raises(ValueError, match=r"^flex_attention: dropout in training mode needs an rng key \(or a "
                                         r"dropout_mask\)$"):
        _bad(jf, jnp.asarray, dropout_rate=RATE, deterministic=False)
    torch.manual_seed(0)
    out = _bad(tf, torch.tensor, dropout_rate=RATE, training=True)
    assert torch.isfinite(out).all()


def test_a_modules_flex_row_honours_sinks_and_a_keep_mask(monkeypatch: Any) -> None:
    """``MultiHeadAttention(score_mod=alibi, sinks=True)`` in training with an explicit
    dropout mask: the flex row under "auto" in both twins (sinks and keep-mask honoured,
    equal to the reference math); dropout drawn without a mask is refused there by name
    (``mod_blockers``, both twins' row) and left to the reference math, which draws it
    (the PyTorch twin's call here: one JAX module call, its compilation the cost)."""
    import jax.numpy as jnp
    import torch

    import jax_attention._flex as jflex
    import torch_attention
    import torch_attention._flex as tflex
    from attention_spec.flex import mod_blockers
    from attention_spec.options import call_options
    from parity_tests.harness import to_flax

    torch.manual_seed(0)
    pt = torch_attention.MultiHeadAttention(16, 16, 32, RATE, H, num_kv_heads=HKV, causal=True,
                                            score_mod=mods.alibi(SLOPES.astype(np.float32)), sinks=True)
    with torch.no_grad():
        pt.sinks.copy_(torch.tensor(DATA["sinks"], dtype=torch.float32))
    fx = to_flax(pt)
    seen: list[str] = []
    for name, module in (("torch", tflex), ("flax", jflex)):
        monkeypatch.setattr(module, "run_call", functools.partial(
            lambda *a, _f, _n, **kw: seen.append(_n) or _f(*a, **kw), _f=module.run_call, _n=name))
    x = np.random.default_rng(1).standard_normal((B, L, 16)).astype(np.float32)
    keep = DATA["keep"]
    pt.train()
    flex_pt = pt(torch.tensor(x), dropout_mask=torch.tensor(keep)).detach().numpy()
    ref_pt = pt(torch.tensor(x), dropout_mask=torch.tensor(keep), implementation="reference").detach().numpy()
    flex_fx = np.asarray(fx(jnp.asarray(x), dropout_mask=jnp.asarray(keep), deterministic=False))
    assert seen == ["torch", "flax"]
    _close(flex_pt, ref_pt, ORACLE["float32"], "torch flex row against the reference math")
    _close(flex_fx, ref_pt, ORACLE["float32"], "flax flex row against the torch reference math")
    seen.clear()
    pt(torch.tensor(x))  # drawn: the reference math
    assert seen == []
    drawn = call_options(dropout_rate=RATE, training=True)._replace(score_mod=mods.alibi(SLOPES))
    assert mod_blockers(drawn, rank=4, sinks_given=True, dropout_mask_given=False) == ["dropout in training mode"]
    assert mod_blockers(drawn, rank=4, sinks_given=True, dropout_mask_given=True) == []
