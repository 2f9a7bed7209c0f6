"""Checkpoint files: ``python -m parity_tests.convert`` and the interop ``save`` / ``load``.

Every format in both directions, bit for bit (dtype and bytes), for MultiHeadAttention
and the wrapper (whose Flax paths hold integer keys, ``heads/0/W_query/kernel``); bad
files refused with exit status 2 and one line, never leaving a partial or changed OUT;
a converted checkpoint loaded into the twin gives parity.
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

from attention_spec.interop import files
from attention_spec.interop.conversion import rules_for
from tests.support import needs_both

pytestmark = needs_both

DTYPES = ("float32", "bfloat16", "float16")
# Non-square (d_in != d_out), so that a missing transpose cannot go unnoticed.
CONFIGS: dict[str, dict[str, Any]] = {
    "MultiHeadAttention": {"d_in": 6, "d_out": 4, "context_length": 8, "dropout": 0.0, "num_heads": 2,
                           "qkv_bias": True},
    "MultiHeadAttentionWrapper": {"d_in": 6, "d_out": 3, "context_length": 8, "dropout": 0.0, "num_heads": 2},
    # DeepSeek's latent attention: q through a low-rank pair, the kv latent, biases
    "MultiHeadLatentAttention": {"d_in": 6, "num_heads": 2, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
                                 "qk_rope_head_dim": 2, "v_head_dim": 3, "q_lora_rank": 4, "attention_bias": True},
}
ROOT = Path(__file__).resolve().parents[2]


def _torch_module(variant: str, dtype: str = "float32", seed: int = 0) -> Any:
    import torch

    import torch_attention as ta

    torch.manual_seed(seed)
    return getattr(ta, variant)(**CONFIGS[variant]).to(getattr(torch, dtype)).eval()


def _flax_module(variant: str, dtype: str = "float32", seed: int = 1) -> Any:
    import jax.numpy as jnp
    from flax import nnx

    import jax_attention as ja

    return getattr(ja, variant)(**CONFIGS[variant], param_dtype=getattr(jnp, dtype), rngs=nnx.Rngs(seed))


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """Bit-exact: the same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert np.ascontiguousarray(a[name]).tobytes() == np.ascontiguousarray(b[name]).tobytes(), name


def _torch_named(module: Any) -> dict[str, np.ndarray]:
    import torch_attention as ta

    return ta.interop.torch_state_dict(module)


def _flax_named(module: Any) -> dict[str, np.ndarray]:
    import torch_attention as ta

    return files.flax_names(ta.interop.flax_arrays(module))


def _convert(*argv: Any) -> int:
    from parity_tests.convert import main

    return main([str(a) for a in argv])


def _args(variant: str, to: str) -> list[str]:
    return ["--to", to, "--variant", variant, "--config", json.dumps(CONFIGS[variant])]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(CONFIGS))
def test_cli_every_format_both_directions_bit_exact(tmp_path: Path, variant: str, dtype: str) -> None:
    import torch_attention as ta

    module = _torch_module(variant, dtype)
    torch_ref, flax_ref = _torch_named(module), _flax_named(module)
    assert flax_ref and any("/" in n for n in flax_ref)
    source = tmp_path / "model.pt"
    ta.interop.save(module, source)
    flax_files = {"safetensors": tmp_path / "f.safetensors", "msgpack": tmp_path / "f.msgpack",
                  "orbax": tmp_path / "f_orbax"}
    for fmt, out in flax_files.items():
        extra = ["--format", "orbax"] if fmt == "orbax" else []
        assert _convert(source, out, *_args(variant, "flax"), *extra) == 0
        layout, arrays = files.read_arrays(out, fmt)
        assert layout == "flax"
        _same(arrays, flax_ref)  # transposed by the map, bytes and dtype kept
    for fmt, src in flax_files.items():
        for ext in (".safetensors", ".pt"):
            out = tmp_path / f"back_from_{fmt}{ext}"
            extra = ["--input-format", "orbax"] if fmt == "orbax" else []
            assert _convert(src, out, *_args(variant, "torch"), *extra) == 0
            layout, arrays = files.read_arrays(out)
            assert layout == "torch"
            _same(arrays, torch_ref)
    # torch layout -> torch layout across formats, flax -> flax as well
    assert _convert(tmp_path / "back_from_msgpack.safetensors", tmp_path / "again.pt", *_args(variant, "torch")) == 0
    _same(files.read_arrays(tmp_path / "again.pt")[1], torch_ref)
    assert _convert(flax_files["safetensors"], tmp_path / "again.msgpack", *_args(variant, "flax")) == 0
    _same(files.read_arrays(tmp_path / "again.msgpack")[1], flax_ref)


def test_safetensors_files_are_the_librarys(tmp_path: Path) -> None:
    """Our reader and writer and the safetensors library read each other's files, bfloat16
    included (written by the library from torch, read here, and the other way)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    import torch

    import torch_attention as ta

    module = _torch_module("MultiHeadAttention", "bfloat16")
    ours = tmp_path / "ours.safetensors"
    ta.interop.save(module, ours)
    loaded = safetensors_torch.load_file(str(ours))
    own = module.state_dict()
    assert sorted(loaded) == sorted(own)
    assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], own[k]) for k in own)
    theirs = tmp_path / "theirs.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in own.items()}, str(theirs))
    _same(files.read_arrays(theirs)[1], _torch_named(module))


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_interop_save_load_every_format(tmp_path: Path, dtype: str) -> None:
    import jax_attention as ja
    import torch_attention as ta

    variant = "MultiHeadAttentionWrapper"
    source = _torch_module(variant, dtype)
    torch_ref, flax_ref = _torch_named(source), _flax_named(source)
    # PyTorch side: safetensors (either layout) and .pt, back into a fresh module.
    for name, kwargs in (("a.safetensors", {}), ("a.pt", {}), ("f.safetensors", {"layout": "flax"}),
                         ("a.bin", {"format": "pt"})):
        ta.interop.save(source, tmp_path / name, **kwargs)
        fresh = _torch_module(variant, dtype, seed=5)
        ta.interop.load(fresh, tmp_path / name, format=kwargs.get("format"))
        _same(_torch_named(fresh), torch_ref)
    # Flax side: reads PyTorch's safetensors, then each of its own formats round trips.
    fx = ja.interop.load(_flax_module(variant, dtype), tmp_path / "a.safetensors")
    _same(files.flax_names(ja.interop.flax_arrays(fx)), flax_ref)
    for name, kwargs in (("b.safetensors", {}), ("b.msgpack", {}), ("b_orbax", {"format": "orbax"}),
                         ("t.safetensors", {"layout": "torch"})):
        ja.interop.save(fx, tmp_path / name, **kwargs)
        fresh = ja.interop.load(_flax_module(variant, dtype, seed=7), tmp_path / name)
        _same(files.flax_names(ja.interop.flax_arrays(fresh)), flax_ref)
    # and what Flax wrote, PyTorch reads
    back = ta.interop.load(_torch_module(variant, dtype, seed=9), tmp_path / "b.safetensors")
    _same(_torch_named(back), torch_ref)
    with pytest.raises(files.CheckpointError, match="needs flax"):
        ta.interop.load(_torch_module(variant, dtype), tmp_path / "b.msgpack")
    with pytest.raises(files.CheckpointError, match="needs torch"):
        ja.interop.save(fx, tmp_path / "c.pt")
    assert not (tmp_path / "c.pt").exists()


def test_cli_in_a_subprocess(tmp_path: Path) -> None:
    import torch_attention as ta

    module = _torch_module("MultiHeadAttention")
    ta.interop.save(module, tmp_path / "m.safetensors")
    done = subprocess.run(
        [sys.executable, "-m", "parity_tests.convert", str(tmp_path / "m.safetensors"), str(tmp_path / "m.msgpack"),
         *_args("MultiHeadAttention", "flax")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    _same(files.read_arrays(tmp_path / "m.msgpack")[1], _flax_named(module))
    bad = subprocess.run(
        [sys.executable, "-m", "parity_tests.convert", str(tmp_path / "m.msgpack"), str(tmp_path / "x.pt"),
         "--to", "torch", "--variant", "NoSuchVariant"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "NoSuchVariant" in bad.stderr
    assert not (tmp_path / "x.pt").exists()


def test_converted_checkpoint_gives_parity(tmp_path: Path) -> None:
    """PyTorch .pt -> Flax msgpack by the CLI -> a Flax twin with other weights: parity."""
    import jax_attention as ja
    import torch_attention as ta
    from parity_tests import assert_parity

    pt = _torch_module("MultiHeadAttention")
    ta.interop.save(pt, tmp_path / "pt.pt")
    assert _convert(tmp_path / "pt.pt", tmp_path / "fx.msgpack", *_args("MultiHeadAttention", "flax")) == 0
    fx = _flax_module("MultiHeadAttention", seed=3)
    x = np.random.default_rng(0).standard_normal((2, 5, 6)).astype(np.float32)
    assert not assert_parity_holds(pt, fx, x)  # the fresh twin differs: the check can fail
    ja.interop.load(fx, tmp_path / "fx.msgpack")
    assert_parity(pt, fx, x)


def assert_parity_holds(pt: Any, fx: Any, x: np.ndarray) -> bool:
    from parity_tests import check_parity

    return check_parity(pt, fx, x).ok


# --------------------------------------------------------------------------- refusals


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    import torch_attention as ta

    path = tmp_path / "in.safetensors"
    ta.interop.save(_torch_module("MultiHeadAttention"), path)
    return path


def _refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[Any], out: Path, *words: str) -> None:
    """Exit status 2, one line naming the problem, and OUT as it was (absent, or its old
    bytes), with no temporary left in its directory."""
    before = sorted(os.listdir(out.parent))
    old = out.read_bytes() if out.is_file() else None
    capsys.readouterr()
    assert _convert(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err
    assert sorted(os.listdir(out.parent)) == before
    assert (out.read_bytes() if out.is_file() else None) == old


@pytest.mark.parametrize("existing", (False, True), ids=("no-out", "existing-out"))
@pytest.mark.parametrize("fmt", ("safetensors", "pt", "msgpack"))
def test_truncated_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path,
                        fmt: str, existing: bool) -> None:
    full = tmp_path / f"full.{fmt}"
    to = "flax" if fmt == "msgpack" else "torch"
    if fmt != "safetensors":
        assert _convert(checkpoint, full, *_args("MultiHeadAttention", to)) == 0
    else:
        full = checkpoint
    cut = tmp_path / f"cut.{fmt}"
    blob = full.read_bytes()
    cut.write_bytes(blob[: len(blob) * 2 // 3])
    out = tmp_path / "out.safetensors"
    if existing:
        out.write_bytes(b"an older checkpoint")
    _refused(capsys, tmp_path, [cut, out, *_args("MultiHeadAttention", "flax")], out, f"cut.{fmt}", "truncated")


def test_another_variants_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    out = tmp_path / "out.msgpack"
    other = dict(CONFIGS["MultiHeadAttention"], d_out=6, num_heads=3)
    _refused(capsys, tmp_path, [checkpoint, out, "--to", "flax", "--variant", "MultiHeadAttention",
                                "--config", json.dumps(other)], out, "misshaped: W_query.weight is (4, 6)")
    wrapper = tmp_path / "wrapper.safetensors"
    import torch_attention as ta

    ta.interop.save(_torch_module("MultiHeadAttentionWrapper"), wrapper)
    out.write_bytes(b"old")
    _refused(capsys, tmp_path, [wrapper, out, *_args("MultiHeadAttention", "flax")], out,
             "missing: W_query.weight", "unexpected: heads.0.W_query.weight")


def test_missing_parameter(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    arrays = files.read_safetensors(checkpoint)
    del arrays["W_key.bias"]
    partial = tmp_path / "partial.safetensors"
    files.write_safetensors(arrays, partial)
    out = tmp_path / "out.pt"
    _refused(capsys, tmp_path, [partial, out, *_args("MultiHeadAttention", "torch")], out, "missing: W_key.bias (4,)")


def test_non_float_parameter(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    arrays = files.read_safetensors(checkpoint)
    arrays["W_key.bias"] = arrays["W_key.bias"].astype(np.int32)
    bad = tmp_path / "ints.safetensors"
    files.write_safetensors(arrays, bad)
    out = tmp_path / "out.msgpack"
    _refused(capsys, tmp_path, [bad, out, *_args("MultiHeadAttention", "flax")], out, "W_key.bias: dtype int32")


@pytest.mark.parametrize("which", ("in", "out"))
def test_unknown_extension(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path, which: str) -> None:
    src = checkpoint
    if which == "in":
        src = tmp_path / "model.bin"
        src.write_bytes(checkpoint.read_bytes())
    out = tmp_path / ("out.safetensors" if which == "in" else "out.bin")
    _refused(capsys, tmp_path, [src, out, *_args("MultiHeadAttention", "flax")], out, ".bin")
    # naming the format reads it
    if which == "in":
        assert _convert(src, out, *_args("MultiHeadAttention", "flax"), "--input-format", "safetensors") == 0


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--to", "flax", "--variant", "Nope"], ("unknown variant", "'Nope'", "MultiHeadAttention")),
        (["--to", "flax", "--variant", "MultiHeadAttention", "--config", '{"d_in": 6}'],
         ("bad --config", "'d_out'")),
        (["--to", "flax", "--variant", "MultiHeadAttention", "--config",
          json.dumps(dict(CONFIGS["MultiHeadAttention"], num_heads=3))], ("bad --config", "num_heads")),
        (["--to", "flax", "--variant", "MultiHeadAttention", "--config",
          json.dumps(dict(CONFIGS["MultiHeadAttention"], heads=2))], ("bad --config", "'heads'")),
        (["--to", "flax", "--variant", "MultiHeadAttention", "--config", "{d_in: 6"], ("not valid JSON",)),
        (["--to", "flax", "--variant", "MultiHeadAttention", "--config", "[1]"], ("JSON object",)),
        (["--to", "flax", "--variant", "MultiHeadAttention", "--config",
          json.dumps(dict(CONFIGS["MultiHeadAttention"], rope={"theta": 1e4, "base": 2}))],
         ("bad --config", "rope has no field 'base'", "theta")),
        (["--to", "flax", "--variant", "MultiHeadAttention", "--config",
          json.dumps(dict(CONFIGS["MultiHeadAttention"], rope={"scaling": "linear"}))],
         ("bad --config", "linear")),
    ],
    ids=("variant", "missing-keyword", "heads-do-not-divide", "unknown-keyword", "not-json", "not-object",
         "rope-unknown-field", "rope-incomplete"),
)
def test_bad_variant_or_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path,
                               argv: list[str], words: tuple[str, ...]) -> None:
    out = tmp_path / "out.msgpack"
    out.write_bytes(b"old")
    _refused(capsys, tmp_path, [checkpoint, out, *argv], out, *words)


def test_a_rope_travels_in_the_json_config(tmp_path: Path, checkpoint: Path) -> None:
    """Issue 40, probe item 4: ``--config`` with a rope was refused ("rope must be a
    RopeConfig; got dict"), though rope adds no weight.  A JSON object of its fields is
    read as a ``RopeConfig``, and the arrays are those of the same module without it."""
    rope = {"theta": 500000.0, "scaling": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    config = ["--config", json.dumps(dict(CONFIGS["MultiHeadAttention"], rope=rope))]
    with_rope, without = tmp_path / "rope.safetensors", tmp_path / "plain.safetensors"
    assert _convert(checkpoint, with_rope, "--to", "flax", "--variant", "MultiHeadAttention", *config) == 0
    assert _convert(checkpoint, without, *_args("MultiHeadAttention", "flax")) == 0
    _same(files.read_arrays(with_rope)[1], files.read_arrays(without)[1])


def test_layout_the_format_cannot_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    out = tmp_path / "out.pt"
    _refused(capsys, tmp_path, [checkpoint, out, *_args("MultiHeadAttention", "flax")], out, "pt file holds torch")
    out = tmp_path / "out.msgpack"
    _refused(capsys, tmp_path, [checkpoint, out, *_args("MultiHeadAttention", "torch")], out, "msgpack file holds flax")


def test_a_failing_write_leaves_no_partial_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    """A writer that fails half way (a full disk): the temporary is removed, OUT is kept."""
    def half(arrays: Any, path: Any, metadata: Any = None) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_safetensors", half)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old")
    _refused(capsys, tmp_path, [checkpoint, out, *_args("MultiHeadAttention", "flax")], out, "No space left")


def test_orbax_replaces_an_existing_directory_only_when_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], checkpoint: Path
) -> None:
    out = tmp_path / "ckpt"
    assert _convert(checkpoint, out, *_args("MultiHeadAttention", "flax"), "--format", "orbax") == 0
    first = files.read_arrays(out)[1]

    def broken(arrays: Any, path: str) -> None:
        os.makedirs(path)
        raise OSError("disk gone")

    monkeypatch.setattr(files, "_write_orbax", broken)
    assert _convert(checkpoint, out, *_args("MultiHeadAttention", "flax"), "--format", "orbax") == 2
    assert "disk gone" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "in.safetensors"]
    monkeypatch.undo()
    _same(files.read_arrays(out)[1], first)  # an existing directory is found as Orbax


def test_declared_map_is_what_the_files_hold() -> None:
    """The names a Flax file holds are the declared map's paths, joined with '/'."""
    rules = rules_for("MultiHeadAttentionWrapper", CONFIGS["MultiHeadAttentionWrapper"])
    module = _torch_module("MultiHeadAttentionWrapper")
    assert sorted(_flax_named(module)) == sorted("/".join(map(str, r.flax_path)) for r in rules)
    assert sorted(_torch_named(module)) == sorted(r.torch_name for r in rules)
