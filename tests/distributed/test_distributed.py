"""Scale-out, all on one CPU machine: JAX on 8 simulated devices, PyTorch as 2
and 4 gloo processes.  The work runs in subprocesses (``parity_tests/distributed/``):
this process has initialised JAX with one device, and the device count is fixed when
jax is imported.  Each subprocess runs once per module (fixtures); the tests read its
report.

- Data + tensor parallelism: a Flax training step on a (data=2, model=4) mesh equals the
  unsharded step (1e-6, float32): loss, output, gradients, parameters after SGD.
- Ring attention, JAX (2, 4, 8 devices) and PyTorch (2, 4 processes, the default group
  and subgroups): forward and gradients equal single-device attention within 1e-5,
  causal or not, contiguous or zigzag, with padding that holds NaN and fully masked rows,
  and with q, k, v scaled by 1e5 (logits of 1e10), relative to the values' size; and
  every ring output, those three regressions included, finite and within float32's
  oracle tolerance of the float64 oracle.
- Attention sinks and RoPE at global positions on both rings (contiguous and zigzag,
  causal or not, padding, grouped heads, large sinks, huge logits; rope at the default
  positions and at given ones): forward and gradients (the sinks' too) equal
  single-device attention on ``apply_rope``d q and k, and the outputs the float64 oracle.
- The two rings agree with each other (and with the float64 oracle) on the same inputs.
- The forward permutes N - 1 times; per-device memory falls with the device count;
  S = 65536 runs on 8 devices.
- Bad input: the same error texts from both rings.

The default run checks eight of the JAX ring's cases, which hold every value of every
axis (``DEFAULT_RING_CASES``); ``--exhaustive`` checks them all.  The quick tier (``-m
"not slow"``) leaves out the tests that read the JAX rings' and the four-process
PyTorch ring's subprocesses (minutes); the sharded step, the two-process ring,
DDP, the one-device JAX ring and the zigzag helpers stay.

Measured on the 2-core CPU machine (float32): every ring error <= 1.5e-6, the sharded
step <= 2e-7, within the tolerances (1e-5 for the rings, 1e-6 for the step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_spec.arrays import check_sinks
from attention_spec.parallel import RING_POSITIONS_WITHOUT_ROPE, check_ring_rope
from parity_tests.distributed import CASES, DEFAULT_RING_CASES, case_inputs, oracle_output, twin_cases
from parity_tests.tolerances import ORACLE
from tests.support import HAS_JAX, HAS_TORCH, needs_both, needs_jax, needs_torch

ROOT = Path(__file__).resolve().parents[2]
RING_TOL = 1e-5  # the float32 bound for a ring against one device; measured <= 1.5e-6
STEP_TOL = 1e-6  # the bound for the sharded training step; measured <= 2e-7
TIMEOUT = 300


def _run(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def _wait(processes: list[subprocess.Popen[str]]) -> None:
    logs = [p.communicate(timeout=TIMEOUT)[0] for p in processes]
    failed = [(i, log) for i, (p, log) in enumerate(zip(processes, logs, strict=True)) if p.returncode]
    assert not failed, "\n".join(f"--- process {i} failed:\n{log[-4000:]}" for i, log in failed)


def _twin_inputs(directory: Path) -> Path:
    path = directory / "twins_in.npz"
    np.savez(path, **{f"{c.id}/{n}": t for c in twin_cases() for n, t in case_inputs(c, seed=1).items()})  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("distributed")
    _twin_inputs(path)
    return path


@pytest.fixture(scope="module")
def jax_parity(workdir: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if not HAS_JAX:
        pytest.skip("JAX / Flax are not installed")
    out = workdir / "jax_parity.json"
    only = [] if request.config.getoption("--exhaustive") else ["--cases", ",".join(DEFAULT_RING_CASES)]
    _wait([_run(["parity_tests.distributed.jax_ring", "parity", str(out), str(workdir / "twins_in.npz"),
                 str(workdir / "jax_twins.npz"), *only])])
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def jax_scale(workdir: Path) -> dict[str, Any]:
    if not HAS_JAX:
        pytest.skip("JAX / Flax are not installed")
    out = workdir / "jax_scale.json"
    _wait([_run(["parity_tests.distributed.jax_ring", "scale", str(out)])])
    return dict(json.loads(out.read_text()))


def _torch_job(workdir: Path, world: int) -> list[dict[str, Any]]:
    if not HAS_TORCH:
        pytest.skip("PyTorch is not installed")
    out = workdir / f"torch{world}"
    out.mkdir()
    twins = [str(workdir / "twins_in.npz")] if world == 4 else []
    _wait([_run(["parity_tests.distributed.torch_ring", str(rank), str(world), str(out / "init"), str(out), *twins])
           for rank in range(world)])
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def torch_world2(workdir: Path) -> list[dict[str, Any]]:
    return _torch_job(workdir, 2)


@pytest.fixture(scope="module")
def torch_world4(workdir: Path) -> list[dict[str, Any]]:
    return _torch_job(workdir, 4)


def _case_errors(report: dict[str, Any], case_id: str) -> list[dict[str, Any]]:
    found = [c for c in report["cases"] if c["id"] == case_id]
    assert found, f"case {case_id} did not run"
    return found


def _within_tolerance(case_id: str, result: dict[str, Any]) -> bool:
    """Each of out, dq, dk, dv within RING_TOL of the single-device reference path.  For a
    case whose inputs are scaled by a huge magnitude M (logits of about M^2), relative to
    the values' own size: out and dv to the reference's largest value (at least 1), dq and
    dk to M^2.  A saturated softmax's dq and dk are 0 in exact arithmetic and in the
    reference path's autodiff; every FlashAttention-style backward (blockwise, fused, the
    rings) leaves the rounding of dO.v - rowsum(dO * O), amplified by scale * k: measured
    6.3e3 and 9.9e3 at M = 1e5 on the JAX ring, 6.9e3 on the JAX blockwise path."""
    magnitude = next(c.magnitude for c in CASES if c.id == case_id)
    if magnitude == 1.0:
        return max(result["errors"].values()) <= RING_TOL
    size = {"dq": magnitude**2, "dk": magnitude**2}  # the rest (out, dv, dsinks): their own size
    return all(error <= RING_TOL * max(1.0, size.get(n, result["scales"][n])) for n, error in result["errors"].items())


def _matches_the_oracle(case_id: str, result: dict[str, Any]) -> bool:
    """The ring's output is finite and within float32's oracle tolerance of the float64
    oracle (``parity_tests.reference``): elementwise, or for inputs scaled by a huge
    magnitude, relative to the values' largest size (``ORACLE["float32"]`` normwise)."""
    found = result["oracle"]
    if not found["finite"]:
        return False
    magnitude = next(c.magnitude for c in CASES if c.id == case_id)
    if magnitude == 1.0:
        return bool(found["units"] <= 1.0)
    tol = ORACLE["float32"]
    return bool(found["error"] <= tol.atol + tol.rtol * found["scale"])


# --------------------------------------------------------------------------- JAX


@needs_jax
def test_sharded_training_step_equals_unsharded() -> None:
    """(data=2, model=4): q/k/v kernels split by heads, out_proj by its input features (an
    all-reduce in the compiled step), the batch by data; everything equals one device.  The
    same for a module with flex attention's mods (ALiBi over a prefix LM: the flex path)."""
    report = _sharded_step_report()
    assert report["devices"] == 8
    for name in ("loss", "output", "gradients", "parameters"):
        assert report[name] <= STEP_TOL, (name, report[name])
    specs = report["param_specs"]
    assert specs["W_query.kernel"] == specs["W_key.kernel"] == specs["W_value.kernel"] == "P(None, 'model')"
    assert specs["W_query.bias"] == "P('model',)"
    assert specs["out_proj.kernel"] == "P('model',)" and specs["out_proj.bias"] == "P()"
    assert report["output_spec"] == "P('data',)"
    assert report["all_reduce"]
    # a module with flex mods (the flex path): the same step sharded equals it unsharded
    assert report["flex"] <= STEP_TOL and report["flex_output_spec"] == "P('data',)"


def _sharded_step_report() -> dict[str, Any]:
    """The JSON line that ``jax_sharded_step`` prints last."""
    proc = _run(["parity_tests.distributed.jax_sharded_step"])
    log, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, log[-4000:]
    return dict(json.loads(log.strip().splitlines()[-1]))


def test_the_default_ring_cases_hold_every_value_of_every_axis() -> None:
    """The default run's JAX ring cases (the rest under --exhaustive) show every value that
    some case holds: devices, causality, layout, padding (one example fully masked),
    widths, grouped heads, key lengths, magnitude, sinks and rope."""
    chosen = [c for c in CASES if c.id in DEFAULT_RING_CASES]
    assert len(chosen) == len(DEFAULT_RING_CASES)

    def values(case: Any) -> dict[str, Any]:
        return {"devices": case.devices, "causal": case.causal, "layout": case.layout,
                "padded": case.lengths is not None, "fully masked": 0 in (case.lengths or ()),
                "v_width": case.v_width, "kv_heads": case.kv_heads, "kv_seq": case.kv_seq,
                "magnitude": case.magnitude, "sinks": case.sinks, "rope": case.rope}

    for axis in values(CASES[0]):
        assert {values(c)[axis] for c in chosen} == {values(c)[axis] for c in CASES}, axis


@needs_jax
@pytest.mark.slow
@pytest.mark.parametrize("case", [c.id if c.id in DEFAULT_RING_CASES else pytest.param(c.id, marks=pytest.mark.exhaustive)
                                  for c in CASES])
def test_jax_ring_equals_single_device(jax_parity: dict[str, Any], case: str) -> None:
    for result in _case_errors(jax_parity, case):
        assert result["finite"]
        assert _within_tolerance(case, result), result
        assert _matches_the_oracle(case, result), result["oracle"]


@needs_jax
@pytest.mark.slow
def test_jax_ring_permutes_n_minus_1_times_forward(jax_parity: dict[str, Any]) -> None:
    """k and v travel packed in one array: N - 1 permutes forward (jaxpr and compiled HLO);
    the backward moves k, v, dk, dv packed N - 1 times and dk/dv home once more."""
    counts = jax_parity["permutes"]
    n = counts["devices"]
    assert counts["forward_jaxpr_ppermute"] == n - 1
    assert counts["forward_hlo_collective_permute"] == n - 1
    assert counts["forward_backward_hlo_collective_permute"] == (n - 1) + n


@needs_jax
@pytest.mark.slow
def test_jax_ring_memory_per_device_falls(jax_scale: dict[str, Any]) -> None:
    """S = 8192, causal zigzag: XLA's per-device memory (temporaries + arguments + output)
    for 1, 2, 4, 8 devices: each at most 0.6 of the one before (the arguments and output
    scale as 1/N, the temporaries about so; measured 37.4, 19.5, 10.1, 3.4 MB)."""
    memory = jax_scale["memory"]
    totals = [sum(memory[str(n)].values()) for n in (1, 2, 4, 8)]
    for more, fewer in zip(totals[1:], totals[:-1], strict=True):
        assert more <= 0.6 * fewer, totals


@needs_jax
@pytest.mark.slow
def test_jax_ring_runs_65536_positions_on_8_devices(jax_scale: dict[str, Any]) -> None:
    long = jax_scale["long"]
    assert long["seq"] == 65536 and long["devices"] == 8
    assert long["max_error_rows"] <= RING_TOL, long


@needs_jax
def test_jax_ring_on_one_device_in_process() -> None:
    """A ring of one (no permute) is the plain computation; runs in this process."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from jax_attention.functional import dot_product_attention
    from jax_attention.parallel import ring_attention

    inputs = case_inputs(CASES[2])
    q, k, v = (jnp.asarray(inputs[n]) for n in ("q", "k", "v"))
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    ring = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=True,
                                                  kv_lengths=[29, 0], layout="zigzag"))
    out = ring(q, k, v)
    expected = dot_product_attention(q, k, v, causal=True, kv_lengths=[29, 0], implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=RING_TOL, rtol=0)
    assert not np.asarray(out)[1].any()  # example 1 has no valid key: zeros


# --------------------------------------------------------------------------- PyTorch


@needs_torch
@pytest.mark.parametrize("case", [c.id for c in CASES if c.devices == 2])
def test_torch_ring_two_processes(torch_world2: list[dict[str, Any]], case: str) -> None:
    for report in torch_world2:
        for result in _case_errors(report, case):
            assert result["finite"]
            assert _within_tolerance(case, result), (report["rank"], result)
            assert _matches_the_oracle(case, result), (report["rank"], result["oracle"])


@needs_torch
@pytest.mark.slow
@pytest.mark.parametrize("case", [c.id for c in CASES if c.devices in (2, 4)])
def test_torch_ring_four_processes(torch_world4: list[dict[str, Any]], case: str) -> None:
    """Rings of 4 on the default group, and rings of 2 on the subgroups {0, 1}, {2, 3}."""
    for report in torch_world4:
        for result in _case_errors(report, case):
            assert result["finite"]
            assert _within_tolerance(case, result), (report["rank"], result)
            assert _matches_the_oracle(case, result), (report["rank"], result["oracle"])


@needs_torch
def test_ddp_gives_single_process_gradients(torch_world2: list[dict[str, Any]]) -> None:
    for report in torch_world2:
        ddp = report["ddp"]
        assert ddp["world"] == 2
        assert ddp["gradients"] <= STEP_TOL and ddp["parameters"] <= STEP_TOL, ddp


@needs_torch
def test_torch_zigzag_helpers() -> None:
    """S = 8 over 2 ranks: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    import torch

    from torch_attention.parallel import from_zigzag, to_zigzag

    x = torch.arange(8.0).reshape(1, 8, 1)
    zig = to_zigzag(x, 2)
    assert zig.flatten().tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert torch.equal(from_zigzag(zig, 2), x)


@needs_jax
def test_jax_zigzag_helpers() -> None:
    import jax.numpy as jnp

    from jax_attention.parallel import from_zigzag, to_zigzag

    x = jnp.arange(8.0).reshape(1, 8, 1)
    zig = to_zigzag(x, 2)
    assert np.asarray(zig).flatten().tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    np.testing.assert_array_equal(np.asarray(from_zigzag(zig, 2)), np.asarray(x))


# --------------------------------------------------------------------------- twins


@needs_both
@pytest.mark.slow
def test_rings_are_twins(jax_parity: dict[str, Any], torch_world4: list[dict[str, Any]], workdir: Path) -> None:
    """The same inputs through the JAX ring (4 devices) and the PyTorch ring (4 ranks):
    outputs and gradients agree, and the outputs equal the float64 oracle."""
    with (np.load(workdir / "jax_twins.npz") as jax_out, np.load(workdir / "torch4" / "twins.npz") as torch_out,
          np.load(workdir / "twins_in.npz") as inputs):
        _check_twins(jax_out, torch_out, inputs)


def _check_twins(jax_out: Any, torch_out: Any, inputs: Any) -> None:
    for case in twin_cases():
        for name in case.names:
            key = f"{case.id}/{name}"
            np.testing.assert_allclose(jax_out[key], torch_out[key], atol=RING_TOL, rtol=0, err_msg=key)
        given = {n: inputs[f"{case.id}/{n}"] for n in ("q", "k", "v", "sinks", "positions") if f"{case.id}/{n}" in inputs}
        expected = oracle_output(case, given)  # rope and sinks included
        np.testing.assert_allclose(jax_out[f"{case.id}/out"], expected, atol=RING_TOL, rtol=0)


@needs_both
@pytest.mark.slow
def test_rings_raise_the_same_errors(jax_parity: dict[str, Any], torch_world4: list[dict[str, Any]]) -> None:
    jax_texts, torch_texts = jax_parity["errors"], torch_world4[0]["errors"]
    assert set(torch_texts) == {"layout", "zigzag_length", "to_zigzag", "shapes", "heads", "sinks_shape",
                                "sinks_dtype", "rope_cross", "positions_without_rope", "positions_dtype"}
    for name, text in torch_texts.items():
        assert text == jax_texts[name], name
    assert jax_texts["zigzag_length"] == (
        "ValueError: ring attention with layout='zigzag' needs a sequence length divisible by 8 "
        "(twice the ring size); got sequence length 12 over a ring of 4"
    )
    assert jax_texts["mesh_axis"] == (
        "ValueError: the mesh has no axis 'sequence' to run the ring over; its axes are ('seq',)"
    )
    assert "divisible by 4 (the ring size); got sequence length 10" in jax_texts["contiguous_length"]
    assert jax_texts["shapes"] == (
        "ValueError: ring attention needs q of shape (B, H, T, D), k of shape (B, Hkv, S, D) and v of shape "
        "(B, Hkv, S, Dv); got q (2, 12, 8), k (2, 12, 8), v (2, 12, 8)"
    )
    assert jax_texts["heads"] == (  # the functional call's text: grouped heads must divide q's
        "ValueError: q, k and v must have the same leading (batch, heads) dimensions, or k and v fewer heads "
        "that divide q's (grouped-query attention); got q (1, 2, 12, 8), k (1, 3, 12, 8), v (1, 3, 12, 8)"
    )
    for name, shape, dtype in (("sinks_shape", (3,), "float32"), ("sinks_dtype", (2,), "int32")):
        with pytest.raises((TypeError, ValueError)) as error:  # check_sinks' own text
            check_sinks(shape, dtype, (1, 2, 12, 8), "softmax")
        assert jax_texts[name] == f"{error.type.__name__}: {error.value}"
    with pytest.raises(ValueError) as error:
        check_ring_rope(12, 20, object(), False)
    assert jax_texts["rope_cross"] == f"ValueError: {error.value}" and "12 queries and 20 keys" in jax_texts["rope_cross"]
    assert jax_texts["positions_without_rope"] == f"ValueError: {RING_POSITIONS_WITHOUT_ROPE}"
    assert jax_texts["positions_dtype"] == "TypeError: rope positions must be integers; got dtype float32"
