"""The benchmark machinery (``benchmarks/``) on a tiny shape: every system gives a finite
positive time, the JSON has its environment block, the markdown table and the plot are
written; and the FLOP count against numbers worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import Config, Mode, flops, fwd_bwd_flops, run
from parity_tests.conftest import needs_both

SYSTEMS = ("ours-jax-fused", "flax-nnx-mha", "ours-torch-sdpa")


def test_flops_by_hand() -> None:
    # B=2, H=4, S=128, D=64: two S x S x D matmuls per head, 2 FLOPs per multiply-add.
    assert flops(2, 4, 128, 64, causal=False) == 4 * 2 * 4 * 128 * 128 * 64 == 33_554_432
    assert flops(2, 4, 128, 64, causal=True) == 16_777_216  # the masked half is not counted
    assert fwd_bwd_flops(2, 4, 128, 64, causal=False) == 117_440_512  # 3.5x: backward = 2.5x
    assert fwd_bwd_flops(2, 4, 128, 64, causal=True) == 58_720_256
    config = Config(batch=2, seq=128, heads=4, head_dim=64, causal=True, dtype="float32")
    assert (config.flops(), config.fwd_bwd_flops()) == (16_777_216, 58_720_256)


def test_modes_follow_the_issue() -> None:
    from benchmarks import mode

    full = mode("full")
    sweep = [c for c in full.configs if c.systems is None]
    assert len(sweep) == 6 * 2 * 2 * 2  # seq x head_dim x causal x dtype
    assert all(c.batch * c.seq == 16384 and c.heads * c.head_dim == 2048 for c in sweep)
    long = [c for c in full.configs if c.systems is not None]
    assert {(c.batch, c.seq, c.heads, c.head_dim, c.dtype) for c in long} == {(1, 65536, 16, 128, "bfloat16")}
    assert full.runs >= 20 and full.backward and "ours-torch-compile" in full.systems

    target = mode("cpu-target")
    assert [c.label for c in target.configs] == ["B4-S1024-H8-D64-causal-float32"]
    assert target.runs == 20 and not target.backward
    assert "ours-torch-compile" not in mode("quick").systems
    assert "ours-torch-compile" in mode("quick", with_compile=True).systems


@needs_both
def test_tiny_run_writes_json_table_and_plot(tmp_path) -> None:
    tiny = Mode(
        "tiny", (Config(batch=2, seq=32, heads=2, head_dim=16, causal=True, dtype="float32"),),
        SYSTEMS, runs=2, backward=True, warmup=1,
    )
    results = run(tiny, out_dir=tmp_path, echo=lambda _: None)

    saved = json.loads((tmp_path / "tiny.json").read_text())
    assert saved == json.loads(json.dumps(results))
    env = saved["env"]
    for key in ("device", "date", "cpu", "packages", "runtime"):
        assert key in env, key
    assert {"jax", "jaxlib", "flax", "torch"} <= set(env["packages"])
    assert set(env["runtime"]) == {"jax", "torch"}

    assert sorted(m["system"] for m in saved["measurements"]) == sorted(SYSTEMS)
    for m in saved["measurements"]:
        assert m["error"] is None, m
        for phase in ("fwd", "fwd_bwd"):
            timing = m[phase]
            assert len(timing["times_ms"]) == 2
            assert math.isfinite(timing["median_ms"]) and timing["median_ms"] > 0
            assert math.isfinite(timing["compile_s"]) and timing["compile_s"] > 0
            expected = (1 if phase == "fwd" else 3.5) * flops(2, 2, 32, 16, True) / (timing["median_ms"] / 1e3) / 1e12
            assert timing["tflops"] == pytest.approx(expected)

    table = (tmp_path / "tiny.md").read_text()
    assert "| config | system | fwd ms (IQR) |" in table
    for system in SYSTEMS:
        assert f"| B2-S32-H2-D16-causal-float32 | {system} |" in table
    png = (tmp_path / "tiny.png").read_bytes()
    assert png.startswith(b"\x89PNG")
