"""Every path against the reference, on CPU, for every variant: ``implementation=
"fused"`` (F.scaled_dot_product_attention / jax.nn.dot_product_attention), ``"blockwise"``
and ``"auto"`` give the reference numbers forward and backward, with causal masks, padding
as lengths, dense masks and fully masked rows; and an explicit path that cannot honour an
option says which."""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.cases import VARIANTS, make_mask
from parity_tests.tolerances import GRAD_PARITY, PARITY
from tests.support import needs_jax, needs_torch, quick_only, tiered

FRAMEWORKS = [pytest.param("torch", marks=needs_torch, id="torch"), pytest.param("jax", marks=needs_jax, id="jax")]
PATHS = ("fused", "blockwise")  # "auto" is one of these; see test_auto_*
MASKS = ("none", "lengths", "random", "fully-masked")
SEQ = 150  # > 128: the blockwise path really runs in two blocks


def inputs(spec, heads, mask_kind, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, SEQ, 16)) * spec.input_scale).astype(np.float32)
    lengths = None
    mask = None
    if mask_kind == "lengths":
        lengths = np.array([SEQ, 37], dtype=np.int32)
    elif mask_kind != "none":
        mask = make_mask(mask_kind, 2, heads, SEQ, rng)
    return x, mask, lengths


def run(fw, spec, config, x, mask, lengths, paths):
    """{path: (output, grad x, grads of parameters) of sum(out * c)} in one framework, a
    module built for each path, or {path: the ValueError} where its module refuses the call."""
    if fw == "torch":
        import torch

        import torch_attention

        def one(implementation):
            torch.manual_seed(0)
            module = getattr(torch_attention, spec.cls)(**{**config, "implementation": implementation}).eval()
            xt = torch.tensor(x, requires_grad=True)
            kw = {}
            if mask is not None:
                kw["mask"] = torch.from_numpy(mask)
            if lengths is not None:
                kw["kv_lengths"] = torch.from_numpy(lengths)
            out = module(xt, **kw)
            c = np.random.default_rng(9).uniform(0.5, 1.5, tuple(out.shape)).astype(np.float32)
            (out * torch.from_numpy(c)).sum().backward()
            grads = [p.grad.numpy() for p in module.parameters()]
            return out.detach().numpy(), xt.grad.numpy(), grads

        results = {}
        for implementation in paths:
            try:
                results[implementation] = one(implementation)
            except ValueError as err:
                results[implementation] = err
        return results
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention

    kw = {}
    if mask is not None:
        kw["mask"] = jnp.asarray(mask)
    if lengths is not None:
        kw["kv_lengths"] = jnp.asarray(lengths)
    splits, refused = {}, {}
    for implementation in paths:
        try:
            module = getattr(jax_attention, spec.cls)(**{**config, "implementation": implementation},
                                                      rngs=nnx.Rngs(0))
        except ValueError as err:
            refused[implementation] = err
            continue
        module.eval()
        splits[implementation] = nnx.split(module, nnx.Param, ...)

    def loss(graphdef, rest):
        def value(params, x):
            out = nnx.merge(graphdef, params, rest)(x, **kw)
            c = jax.random.uniform(jax.random.key(9), out.shape, minval=0.5, maxval=1.5)
            return jnp.sum(out * c), out

        return jax.value_and_grad(value, argnums=(0, 1), has_aux=True)

    # Every path's module in one program: XLA compiles one program a third cheaper than
    # three.  A module that refuses the call raises while it is traced: that path is left out.
    @jax.jit
    def all_paths(params, x):
        results = {}
        for implementation, (graphdef, _, rest) in splits.items():
            try:
                results[implementation] = loss(graphdef, rest)(params[implementation], x)
            except ValueError as err:
                refused[implementation] = err
        return results

    ran = all_paths({path: split[1] for path, split in splits.items()}, jnp.asarray(x))
    results = dict(refused)
    for implementation, ((_, out), (gp, gx)) in ran.items():
        grads = [np.asarray(v[...]) for _, v in nnx.to_flat_state(gp)]
        results[implementation] = (np.asarray(out), np.asarray(gx), grads)
    return results


def assert_close(got, expected, tol):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    bound = tol.atol + tol.rtol * (np.abs(expected).max() if tol.normwise else np.abs(expected))
    assert np.isfinite(got).all()
    assert (np.abs(got - expected) <= bound).all(), float(np.abs(got - expected).max())


# The variants that run in JAX by default: one for each option that reaches the paths'
# attention itself (a refusal by design, the mask strategy, a window, grouped heads,
# sinks: the CPU kernel's and the blockwise path's own code).  The others differ in their
# projections, norms and positions, which the matrix runs on every path in both twins;
# they run in PyTorch, where a case costs a tenth of JAX's (three paths compiled).
JAX_BY_DEFAULT = {"simplified-sum", "causal-renorm", "mha-window", "mha-headdim-gqa", "mha-sinks-gqa"}

# One mask kind per variant, in rotation, so each kind meets every path with several
# variants, and one framework per variant (the matrix runs every variant in both twins),
# without compiling 4 x 21 x 3 JAX programs; the other framework and a second kind per
# variant with --exhaustive.
COMBOS = [
    pytest.param(variant_id, MASKS[(i + j) % len(MASKS)], fw.id, id=f"{variant_id}-{MASKS[(i + j) % len(MASKS)]}-{fw.id}",
                 marks=(*fw.marks, *(() if j == 0 and (fw.id == "jax") == (variant_id in JAX_BY_DEFAULT)
                                     else (pytest.mark.slow, pytest.mark.exhaustive))))
    for i, variant_id in enumerate(VARIANTS)
    for j in (0, 2)
    for fw in FRAMEWORKS
]


@pytest.mark.parametrize("variant_id,mask_kind,fw", COMBOS)
def test_paths_match_reference(fw, variant_id, mask_kind):
    spec = VARIANTS[variant_id]
    heads = 2 if spec.multihead else 1
    config = spec.config(heads)
    if "context_length" in config:
        config["context_length"] = SEQ
    x, mask, lengths = inputs(spec, heads, mask_kind)
    ran = run(fw, spec, config, x, mask, lengths, ("reference", *PATHS))
    for path in ("reference", *PATHS):  # only a refusal by design is an answer
        if isinstance(ran[path], ValueError) and (path == "reference" or spec.refusal(path) is None):
            raise ran[path]
    ref = ran["reference"]
    dead = None if mask is None else ~np.broadcast_to(mask, (2, heads, SEQ, SEQ)).any(-1)
    for path in PATHS:
        refused = spec.refusal(path)  # by design, naming it: e.g. normalization='sum', sinks on fused
        if isinstance(ran[path], ValueError):
            assert f"implementation={path!r} cannot honour {refused.split('=')[0]}" in str(ran[path]), ran[path]
            continue
        if refused is not None:
            assert spec.may_honour("torch" if fw == "torch" else "flax"), (path, refused)
            # the JAX twin's CPU kernel takes sinks: checked as any path
        out, gx, grads = ran[path]
        assert_close(out, ref[0], PARITY["float32"])
        assert_close(gx, ref[1], GRAD_PARITY["float32"])
        for g, r in zip(grads, ref[2], strict=True):
            assert_close(g, r, GRAD_PARITY["float32"])
        if dead is not None and dead.all(axis=1).any():
            rows = dead.all(axis=1)  # (B, T): every head of the row sees nothing
            if spec.cls in ("MultiHeadAttention", "MultiHeadLatentAttention"):
                # the heads give zeros, the output projection its bias: every such row the same
                assert (out[rows] == out[rows][:1]).all()
            else:
                assert (out[rows] == 0).all()


def functional_call(fw, implementation, **options):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)).astype(np.float32) for _ in range(3))
    if fw == "torch":
        import torch

        from torch_attention import functional

        conv = {k_: torch.from_numpy(v_) if isinstance(v_, np.ndarray) else v_ for k_, v_ in options.items()}
        return functional.dot_product_attention(
            *(torch.from_numpy(a) for a in (q, k, v)), implementation=implementation, **conv)
    import jax.numpy as jnp

    from jax_attention import functional

    conv = {k_: jnp.asarray(v_) if isinstance(v_, np.ndarray) else v_ for k_, v_ in options.items()}
    if "training" in conv:
        conv["deterministic"] = not conv.pop("training")
    return functional.dot_product_attention(
        *(jnp.asarray(a) for a in (q, k, v)), implementation=implementation, **conv)


KEEP = np.ones((2, 2, 5, 5), dtype=bool)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("path", ["fused", "blockwise"])
@pytest.mark.parametrize(
    "options,named",
    [
        ({"return_weights": True}, "return_weights=True"),
        ({"normalization": "sum"}, "normalization='sum'"),
        ({"dropout_rate": 0.1, "training": True, "dropout_mask": KEEP}, "an explicit dropout_mask"),
    ],
    ids=["weights", "sum", "dropout-mask"],
)
def test_explicit_path_names_what_it_cannot_honour(fw, path, options, named):
    with pytest.raises(ValueError, match=f"implementation='{path}' cannot honour .*{named.replace('(', '[(]')}"):
        functional_call(fw, path, **options)
    functional_call(fw, "auto", **options)  # auto falls back to the reference path


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_random_dropout_on_the_fused_path(fw):
    """PyTorch's SDPA draws dropout itself; jax.nn.dot_product_attention cannot."""
    if fw == "torch":
        out = functional_call(fw, "fused", dropout_rate=0.5, training=True)
        assert out.shape == (2, 2, 5, 4)
    else:
        with pytest.raises(ValueError, match="cannot honour dropout in training mode"):
            functional_call(fw, "fused", dropout_rate=0.5, training=True, rng=_key())
    with pytest.raises(ValueError, match="implementation='blockwise' cannot honour dropout in training mode"):
        functional_call(fw, "blockwise", dropout_rate=0.5, training=True, **({"rng": _key()} if fw == "jax" else {}))


def _key():
    import jax

    return jax.random.key(0)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_auto_takes_the_fast_path(fw):
    """auto is SDPA in PyTorch; in JAX the fused path on a GPU or TPU (the backend JAX
    computes on here) and, on CPU, the explicit math for these 5 query rows (at most
    ``FEW_QUERY_ROWS``, as a decode step has), else the blockwise path (below)."""
    rng = np.random.default_rng(0)
    mask = rng.random((2, 2, 5, 5)) < 0.5
    auto = functional_call(fw, "auto", mask=mask, causal=True)
    if fw == "torch":
        fast = "fused"
    else:
        import jax

        fast = "reference" if jax.default_backend() == "cpu" else "fused"
    assert np.array_equal(np.asarray(auto), np.asarray(functional_call(fw, fast, mask=mask, causal=True)))


def test_auto_on_cpu_by_query_rows():
    """JAX on CPU: a call of at most ``FEW_QUERY_ROWS`` query rows runs on the CPU kernel's
    forward for few rows (``"cpu-decode"``) where ``auto`` takes the kernel, else the
    explicit math, and ``route`` says why (here with a mask, which the kernel does not
    take); one more row takes the fast path (the kernel's blocks of rows, or blockwise)."""
    import jax
    import jax.numpy as jnp

    from jax_attention import _cpu_fused
    from jax_attention.functional import FEW_QUERY_ROWS, route

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's rule")
    k = jnp.ones((2, 4, 300, 8), jnp.float32)
    for rows in (1, FEW_QUERY_ROWS):
        q = jnp.ones((2, 4, rows, 8), jnp.float32)
        chosen = route(q, k, k, causal=True)
        if _cpu_fused.cpu_kernel_supports(q, implementation="auto", few_rows=True):
            assert (chosen.path, chosen.kernel) == ("fused", "cpu-decode"), chosen.explain()
        else:
            assert chosen.path == "reference", chosen.explain()
        assert route(q, k, k, causal=True, implementation="fused").kernel in ("cpu-decode", "xla")
        masked = route(q, k, k, mask=jnp.ones((300,), bool), causal=True)
        assert masked.path == "reference", masked.explain()
        assert any(f"{rows} query rows (at most {FEW_QUERY_ROWS}" in reason for reason in masked.reasons), masked
    q = jnp.ones((2, 4, FEW_QUERY_ROWS + 1, 8), jnp.float32)
    assert route(q, k, k, causal=True).kernel in ("cpu-kernel", "blockwise")
    assert route(q[:, :, :1], k, k, implementation="blockwise").path == "blockwise"  # asked for: taken


def test_auto_resolution_rules():
    from attention_spec import resolve_implementation

    common = {"return_weights": False, "normalization": "softmax", "dropout_active": False,
              "dropout_mask_given": False, "fused_draws_dropout": False}
    cpu_jax, fast = ("blockwise",), ("fused", "blockwise")
    assert resolve_implementation("auto", preference=cpu_jax, **common) == "blockwise"
    assert resolve_implementation("auto", preference=fast, **common) == "fused"
    assert resolve_implementation("auto", preference=fast, **{**common, "dropout_active": True}) == "reference"
    assert resolve_implementation(
        "auto", preference=fast, **{**common, "dropout_active": True, "fused_draws_dropout": True}) == "fused"
    assert resolve_implementation("auto", preference=fast, fused_blockers=("x",), **common) == "blockwise"
    assert resolve_implementation("auto", preference=cpu_jax, **{**common, "return_weights": True}) == "reference"
    assert resolve_implementation("reference", preference=fast, **{**common, "return_weights": True}) == "reference"
    with pytest.raises(ValueError, match="implementation='fused' cannot honour x; use"):
        resolve_implementation("fused", preference=fast, fused_blockers=("x",), **common)


@needs_jax
@pytest.mark.parametrize("causal", quick_only([False, True]))
def test_tpu_splash_kernel_matches_reference(causal):
    """The TPU fused path (Pallas splash attention), run in the Pallas interpreter on CPU:
    forward and gradients against the reference math."""
    import jax
    import jax.numpy as jnp

    from jax_attention import functional

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 2, 256, 128)), jnp.float32) for _ in range(3))
    assert functional.splash_supports(q, k, v)
    assert not functional.splash_supports(q[..., :100, :], k, v)

    def splash(q, k, v):
        return functional.splash_attention(q, k, v, causal=causal, scale=0.1, interpret=True)

    def reference(q, k, v):
        return functional.dot_product_attention(q, k, v, causal=causal, scale=0.1, implementation="reference")

    def output_and_grads(attend):
        """The output and the gradients of sum(out * cot) in one program (eagerly, and
        the forward apart from them, it took twice the time)."""
        def both(q, k, v, cot):
            out, pullback = jax.vjp(attend, q, k, v)
            return out, pullback(cot)

        return jax.jit(both)

    cot = jnp.asarray(rng.uniform(0.5, 1.5, (2, 2, 256, 128)), jnp.float32)
    # The interpreter's products take the backend's default precision (TF32 on a GPU),
    # forward and backward: float32 asked for throughout.
    with jax.default_matmul_precision("float32"):
        out, grads = output_and_grads(splash)(q, k, v, cot)
    want, expected = output_and_grads(reference)(q, k, v, cot)
    assert_close(out, want, PARITY["float32"])
    for g, e in zip(grads, expected, strict=True):
        assert_close(g, e, GRAD_PARITY["float32"])


@pytest.mark.parametrize("path,dtype,fw", tiered("path,dtype,fw", ["fused", "blockwise"], ["bfloat16", "float16"],
                                                 FRAMEWORKS))
def test_paths_match_reference_in_half_precision(fw, dtype, path):
    """Half-precision inputs: every path keeps its softmax in float32 and agrees with the
    reference within the dtype's tolerance, masks and fully masked rows included."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, SEQ, 8)).astype(np.float32) for _ in range(3))
    mask = make_mask("fully-masked", 2, 2, SEQ, rng)
    if fw == "torch":
        import torch

        from torch_attention import functional

        args = [torch.from_numpy(a).to(getattr(torch, dtype)) for a in (q, k, v)]
        kw = {"mask": torch.from_numpy(mask), "causal": True}
        ref = functional.dot_product_attention(*args, implementation="reference", **kw)
        got = functional.dot_product_attention(*args, implementation=path, **kw)
        ref, got = ref.float().numpy(), got.float().numpy()
    else:
        import jax.numpy as jnp

        from jax_attention import functional

        args = [jnp.asarray(a).astype(dtype) for a in (q, k, v)]
        kw = {"mask": jnp.asarray(mask), "causal": True}
        ref = np.asarray(functional.dot_product_attention(*args, implementation="reference", **kw), np.float32)
        got = np.asarray(functional.dot_product_attention(*args, implementation=path, **kw), np.float32)
    assert_close(got, ref, PARITY[dtype])
    dead = ~mask.any(-1)
    assert (got[dead] == 0).all()
