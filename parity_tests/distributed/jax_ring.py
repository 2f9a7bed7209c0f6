"""JAX ring attention on 8 simulated CPU devices, run in a subprocess by
``test_distributed.py`` (``XLA_FLAGS`` must ask for the devices before jax is imported).

``python -m parity_tests.distributed.jax_ring parity OUT.json [TWINS_IN.npz TWINS_OUT.npz]``
  the ring on 2, 4 and 8 devices against single-device ``dot_product_attention``
  (reference path; rope cases on ``apply_rope``d q and k; sinks as a zero key whose score
  is a bias), forward and gradients (the sinks' too), per case in ``CASES``; the permutes counted
  in the jaxpr and the compiled HLO; the error texts; and, given the twins' inputs, the
  ring's outputs and gradients on 4 devices for ``twin_cases``.
``python -m parity_tests.distributed.jax_ring scale OUT.json``
  compiled per-device memory for 1, 2, 4 and 8 devices at a fixed S, and a forward at
  S = 65536 on 8 devices, checked on some rows against a float64 NumPy computation.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"  # the 8 devices are the host's, also where a GPU is present

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, cast  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from jax_attention.functional import apply_rope, dot_product_attention  # noqa: E402
from jax_attention.parallel import from_zigzag, ring_attention, to_zigzag  # noqa: E402
from parity_tests.distributed import (  # noqa: E402
    CASES,
    ROPE,
    SEQ,
    Case,
    case_inputs,
    case_positions,
    oracle_error,
    oracle_output,
    twin_cases,
)


def mesh_of(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("seq",))


def ring_fn(case: Case, n: int, inputs: dict[str, np.ndarray]) -> Any:
    """(q, k, v[, sinks]) in natural order -> the ring's output in natural order; rope
    cases at the case's positions (given ones laid out as q is)."""
    mesh = mesh_of(n)
    options: dict[str, Any] = {} if case.rope is None else {"rope": ROPE}
    if case.rope == "given":
        positions = jnp.asarray(inputs["positions"])
        options["positions"] = to_zigzag(positions, n, axis=-1) if case.layout == "zigzag" else positions

    def run(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
        if case.layout == "zigzag":
            q, k, v = (to_zigzag(t, n) for t in (q, k, v))
        out = ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=case.causal,
                             kv_lengths=case.lengths, layout=case.layout, sinks=sinks, **options)
        return from_zigzag(out, n) if case.layout == "zigzag" else out

    return run


def with_grads(f: Any, case: Case, inputs: dict[str, np.ndarray], *, one_program: bool = True) -> dict[str, np.ndarray]:
    """out and d(sum(out * d_out))/d(q, k, v[, sinks]).  ``one_program``: forward and
    backward compiled as one program (for the ring, shorter than the two that the vjp of
    a jitted function compiles); otherwise as those two (for the single-device
    reference, where the one program takes three times as long to compile)."""
    args = [jnp.asarray(inputs[n]) for n in ("q", "k", "v", "sinks") if n != "sinks" or case.sinks is not None]
    d_out = jnp.asarray(inputs["d_out"])
    if one_program:
        def run(args: list[jax.Array], d_out: jax.Array) -> Any:
            out, vjp = jax.vjp(f, *args)
            return out, vjp(d_out)

        out, grads = jax.jit(run)(args, d_out)
    else:
        out, vjp = jax.vjp(jax.jit(f), *args)
        grads = vjp(d_out)
    return {n: np.asarray(t) for n, t in zip(case.names, (out, *grads), strict=True)}


def reference(case: Case, inputs: dict[str, np.ndarray]) -> Any:
    """Single-device ``dot_product_attention`` (reference path) on the whole sequences, q
    and k turned by ``apply_rope`` first in rope cases.  Sinks: each head's sink is one
    more key, with zero key and value, after the sequence, that every query sees and
    whose score is the sink (a bias): the same softmax, its weight on nothing."""
    positions = jnp.asarray(case_positions(case, inputs))

    def run(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None = None) -> Any:
        if case.rope is not None:
            q, k = apply_rope(q, positions, ROPE), apply_rope(k, positions, ROPE)
        if sinks is None:
            return dot_product_attention(q, k, v, causal=case.causal, kv_lengths=case.lengths,
                                         implementation="reference")
        batch, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
        k, v = (jnp.concatenate([t, jnp.zeros((batch, kv_heads, 1, t.shape[-1]), t.dtype)], axis=2) for t in (k, v))
        allowed = np.ones((batch, 1, SEQ, case.kv_seq + 1), bool)
        if case.causal:
            allowed[..., : case.kv_seq] &= np.tril(np.ones((SEQ, case.kv_seq), bool))
        if case.lengths is not None:
            allowed[..., : case.kv_seq] &= np.arange(case.kv_seq) < np.asarray(case.lengths)[:, None, None, None]
        zeros = jnp.zeros((1, heads, SEQ, case.kv_seq), sinks.dtype)
        bias = jnp.concatenate([zeros, jnp.broadcast_to(sinks[None, :, None, None], (1, heads, SEQ, 1))], axis=-1)
        return dot_product_attention(q, k, v, mask=jnp.asarray(allowed), bias=bias,
                                     implementation="reference")
    return run


def permutes(case: Case, n: int, inputs: dict[str, np.ndarray]) -> dict[str, int]:
    """ppermute equations in the forward jaxpr; collective-permutes in the compiled
    forward, and in the compiled forward + backward."""
    q, k, v, d_out = (jnp.asarray(inputs[m]) for m in ("q", "k", "v", "d_out"))
    mesh = mesh_of(n)

    def forward(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=case.causal,
                              kv_lengths=case.lengths, layout=case.layout)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(forward(q, k, v) * d_out)

    jaxpr = str(jax.make_jaxpr(forward)(q, k, v))
    hlo = str(jax.jit(forward).lower(q, k, v).compile().as_text())
    grad_hlo = str(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text())
    return {
        "devices": n,
        "forward_jaxpr_ppermute": jaxpr.count("ppermute["),
        "forward_hlo_collective_permute": hlo.count("collective-permute("),
        "forward_backward_hlo_collective_permute": grad_hlo.count("collective-permute("),
    }


def error_texts() -> dict[str, str]:
    """The messages of the bad calls that ``torch_ring`` makes too (same keys)."""
    texts = {}
    x = jnp.zeros((1, 2, 12, 8), jnp.float32)
    calls = {
        "layout": lambda: ring_attention(x, x, x, mesh=mesh_of(4), axis_name="seq", layout="zig"),
        "zigzag_length": lambda: ring_attention(x, x, x, mesh=mesh_of(4), axis_name="seq", layout="zigzag"),
        "to_zigzag": lambda: to_zigzag(x, 4),
        "shapes": lambda: ring_attention(x[0], x[0], x[0], mesh=mesh_of(4), axis_name="seq"),  # no batch axis
        "heads": lambda: ring_attention(x, jnp.zeros((1, 3, 12, 8)), jnp.zeros((1, 3, 12, 8)), mesh=mesh_of(4),
                                        axis_name="seq"),
        "mesh_axis": lambda: ring_attention(x, x, x, mesh=mesh_of(4), axis_name="sequence"),
        "contiguous_length": lambda: ring_attention(x[:, :, :10], x[:, :, :10], x[:, :, :10],
                                                    mesh=mesh_of(4), axis_name="seq"),
        "sinks_shape": lambda: ring_attention(x, x, x, mesh=mesh_of(4), axis_name="seq", sinks=jnp.zeros(3)),
        "sinks_dtype": lambda: ring_attention(x, x, x, mesh=mesh_of(4), axis_name="seq",
                                              sinks=jnp.zeros(2, jnp.int32)),
        "rope_cross": lambda: ring_attention(x, jnp.zeros((1, 2, 20, 8)), jnp.zeros((1, 2, 20, 8)), mesh=mesh_of(4),
                                             axis_name="seq", rope=ROPE),
        "positions_without_rope": lambda: ring_attention(x, x, x, mesh=mesh_of(4), axis_name="seq",
                                                         positions=jnp.zeros((1, 12), jnp.int32)),
        "positions_dtype": lambda: ring_attention(x, x, x, mesh=mesh_of(4), axis_name="seq", rope=ROPE,
                                                  positions=jnp.zeros((1, 12))),
    }
    for name, call in calls.items():
        try:
            call()
        except (ValueError, TypeError) as error:
            texts[name] = f"{type(error).__name__}: {error}"
    return texts


def parity(out_path: str, twins_in: str | None, twins_out: str | None, only: set[str] | None = None) -> None:
    """The report of every case of ``CASES`` (of those whose ids are in ``only``)."""
    report: dict[str, Any] = {"cases": []}
    for case in (c for c in CASES if only is None or c.id in only):
        inputs = case_inputs(case)
        ring = with_grads(ring_fn(case, case.devices, inputs), case, inputs)
        ref = with_grads(reference(case, inputs), case, inputs, one_program=False)  # jitted, not op by op
        errors = {n: float(np.abs(ring[n] - ref[n]).max()) for n in ref}
        scales = {n: float(np.abs(ref[n]).max()) for n in ref}
        finite = all(bool(np.isfinite(t).all()) for t in ring.values())
        report["cases"].append({"id": case.id, "errors": errors, "scales": scales, "finite": finite,
                                "oracle": oracle_error(ring["out"], oracle_output(case, inputs))})
    causal_zigzag = next(c for c in CASES if c.devices == 4 and c.causal and c.layout == "zigzag")
    report["permutes"] = permutes(causal_zigzag, 4, case_inputs(causal_zigzag))
    report["errors"] = error_texts()
    if twins_in is not None and twins_out is not None:
        with np.load(twins_in) as stored:
            data = dict(stored)
        results = {}
        for case in twin_cases():
            inputs = {n: data[f"{case.id}/{n}"] for n in ("q", "k", "v", "d_out", "sinks", "positions")
                      if f"{case.id}/{n}" in data}
            for n, t in with_grads(ring_fn(case, case.devices, inputs), case, inputs).items():
                results[f"{case.id}/{n}"] = t
        np.savez(twins_out, **results)  # type: ignore[arg-type]
    with open(out_path, "w") as f:
        json.dump(report, f)


def scale(out_path: str) -> None:
    report: dict[str, Any] = {"memory": {}}
    seq, width = 8192, 16
    for n in (1, 2, 4, 8):
        mesh = mesh_of(n)
        spec = jax.ShapeDtypeStruct((1, 1, seq, width), jnp.float32,
                                    sharding=NamedSharding(mesh, PartitionSpec(None, None, "seq", None)))
        compiled = jax.jit(
            lambda q, k, v, mesh=mesh: ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=True,
                                                      layout="zigzag")
        ).lower(spec, spec, spec).compile()
        memory: Any = compiled.memory_analysis()
        report["memory"][str(n)] = {
            "temp": int(memory.temp_size_in_bytes),
            "arguments": int(memory.argument_size_in_bytes),
            "output": int(memory.output_size_in_bytes),
        }

    seq, n = 65536, 8
    mesh = mesh_of(n)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, seq, width)).astype(np.float32) for _ in range(3))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "seq", None))
    placed = [jax.device_put(to_zigzag(jnp.asarray(t), n), sharding) for t in (q, k, v)]
    forward = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=True,
                                                     layout="zigzag"))
    start = time.perf_counter()
    compiled = forward.lower(*placed).compile()
    compiled_at = time.perf_counter()
    out = np.asarray(from_zigzag(compiled(*placed), n))
    done = time.perf_counter()
    # Rows checked in float64: the first and last 32 queries and 32 in the middle.
    rows = np.r_[0:32, seq // 2 - 16 : seq // 2 + 16, seq - 32 : seq]
    q64, k64, v64 = (t[0, 0].astype(np.float64) for t in (q, k, v))
    scores = q64[rows] @ k64.T / np.sqrt(width)
    scores[np.arange(seq)[None, :] > rows[:, None]] = -np.inf
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    expected = (weights / weights.sum(axis=1, keepdims=True)) @ v64
    report["long"] = {
        "seq": seq, "devices": n, "compile_s": compiled_at - start, "run_s": done - compiled_at,
        "temp_bytes": int(cast(Any, compiled.memory_analysis()).temp_size_in_bytes),
        "max_error_rows": float(np.abs(out[0, 0, rows] - expected).max()), "rows_checked": len(rows),
    }
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")
    mode, out_path, *twins = sys.argv[1:]
    only = None
    if "--cases" in twins:  # --cases id,id,...: those cases only
        at = twins.index("--cases")
        only = set(twins[at + 1].split(","))
        del twins[at : at + 2]
    if mode == "parity":
        parity(out_path, twins[0] if twins else None, twins[1] if twins else None, only)
    else:
        scale(out_path)
