"""Checkpoint writers never lose what they did not write.

Real files in ``tmp_path``: an existing directory that is not an Orbax checkpoint of
ours is refused (``.`` as OUT included), a directory where a file is expected is refused,
errors name the user's path (never the hidden temporary) and the entry of a bad
safetensors header, outputs get the mode ``open()`` would give them, and a symlink OUT
is written through.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_spec.interop import files
from tests.support import needs_both, needs_jax

ROOT = Path(__file__).resolve().parents[2]
CONFIG: dict[str, Any] = {"d_in": 6, "d_out": 4, "context_length": 8, "dropout": 0.0, "num_heads": 2, "qkv_bias": True}
ARGS = ["--variant", "MultiHeadAttention", "--config", json.dumps(CONFIG)]


def _torch_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """A MultiHeadAttention state dict in PyTorch's layout, as NumPy (no framework needed)."""
    rng = np.random.default_rng(seed)
    d_in, d_out = CONFIG["d_in"], CONFIG["d_out"]
    arrays = {}
    for name in ("W_query", "W_key", "W_value"):
        arrays[f"{name}.weight"] = rng.standard_normal((d_out, d_in)).astype(np.float32)
        arrays[f"{name}.bias"] = rng.standard_normal(d_out).astype(np.float32)
    arrays["out_proj.weight"] = rng.standard_normal((d_out, d_out)).astype(np.float32)
    arrays["out_proj.bias"] = rng.standard_normal(d_out).astype(np.float32)
    return arrays


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "in.safetensors"
    files.write_safetensors(_torch_arrays(), path)
    return path


def _convert(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str]:
    from parity_tests.convert import main

    capsys.readouterr()
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err.strip()


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.fixture
def umask() -> Iterator[Any]:
    """Sets the process umask for a test and restores it."""
    old = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- directories


def _foreign_dir(path: Path) -> dict[str, bytes | None]:
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    (path / "sub").mkdir()
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return _tree(path)


@needs_jax
@pytest.mark.parametrize("named", (True, False), ids=("format-orbax", "format-from-directory"))
def test_cli_refuses_a_directory_that_is_not_our_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path, named: bool
) -> None:
    out = tmp_path / "out"
    before = _foreign_dir(out)
    status, err = _convert(capsys, checkpoint, out, "--to", "flax", *ARGS, *(["--format", "orbax"] if named else []))
    assert status == 2
    assert len(err.splitlines()) == 1 and repr(str(out)) in err and "not an Orbax checkpoint" in err, err
    assert _tree(out) == before
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors", "out"]


@needs_jax
def test_cli_dot_as_out_leaves_the_working_directory(tmp_path: Path) -> None:
    """``convert in.safetensors .`` in a subprocess run in a temporary working directory."""
    work = tmp_path / "work"
    work.mkdir()
    files.write_safetensors(_torch_arrays(), work / "in.safetensors")
    (work / "keep.txt").write_text("keep")
    before = _tree(work)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "parity_tests.convert", "in.safetensors", ".", "--to", "flax", *ARGS],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "'.'" in done.stderr, done.stderr
    assert (work / "in.safetensors").is_file()
    assert _tree(work) == before
    assert sorted(os.listdir(tmp_path)) == ["work"]


@needs_jax
def test_cli_dot_as_out_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    files.write_safetensors(_torch_arrays(), tmp_path / "in.safetensors")
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    status, err = _convert(capsys, "in.safetensors", ".", "--to", "flax", *ARGS, "--format", "orbax")
    assert status == 2 and "'.'" in err, err
    assert _tree(tmp_path) == before


@needs_jax
def test_jax_save_refuses_a_foreign_directory_and_replaces_its_own(tmp_path: Path) -> None:
    from flax import nnx

    import jax_attention as ja

    out = tmp_path / "ckpt"
    before = _foreign_dir(out)
    module = ja.MultiHeadAttention(**CONFIG, rngs=nnx.Rngs(0))
    for fmt in ("orbax", None):  # named, or found from the existing directory
        with pytest.raises(files.CheckpointError, match="not an Orbax checkpoint") as info:
            ja.interop.save(module, out, format=fmt)
        assert repr(str(out)) in str(info.value)
        assert _tree(out) == before
    # our own checkpoint is replaced, again and again
    mine = tmp_path / "mine"
    ja.interop.save(module, mine, format="orbax")
    other = ja.MultiHeadAttention(**CONFIG, rngs=nnx.Rngs(1))
    ja.interop.save(other, mine)
    ja.interop.save(other, mine, format="orbax")
    got = files.read_arrays(mine)[1]
    want = files.flax_names(ja.interop.flax_arrays(other))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    # ... unless something has been added to it since
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(files.CheckpointError, match="notes.txt"):
        ja.interop.save(module, mine)
    assert (mine / "notes.txt").read_text() == "mine"
    np.testing.assert_array_equal(files.read_arrays(mine)[1]["W_query/kernel"], want["W_query/kernel"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "mine"]


@needs_jax
def test_orbax_refuses_an_existing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    out = tmp_path / "out"
    out.write_bytes(b"a file of mine")
    status, err = _convert(capsys, checkpoint, out, "--to", "flax", *ARGS, "--format", "orbax")
    assert status == 2 and repr(str(out)) in err and "not a directory" in err, err
    assert out.read_bytes() == b"a file of mine"


@needs_both
@pytest.mark.parametrize("name", ("out.safetensors", "out.pt", "out.msgpack"))
def test_a_directory_where_a_file_is_expected(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              checkpoint: Path, name: str) -> None:
    out = tmp_path / name
    before = _foreign_dir(out)
    to = "torch" if name.endswith(".pt") else "flax"
    status, err = _convert(capsys, checkpoint, out, "--to", to, *ARGS)
    assert status == 2 and len(err.splitlines()) == 1, err
    assert repr(str(out)) in err and "is a directory" in err and ".tmp" not in err, err
    assert _tree(out) == before
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors", name]


@needs_both
def test_interop_save_refuses_a_directory_where_a_file_is_expected(tmp_path: Path) -> None:
    from flax import nnx

    import jax_attention as ja
    import torch_attention as ta

    cases: list[tuple[Any, Any, str]] = [
        (ta.interop.save, ta.MultiHeadAttention(**CONFIG), "t.pt"),
        (ta.interop.save, ta.MultiHeadAttention(**CONFIG), "t.safetensors"),
        (ja.interop.save, ja.MultiHeadAttention(**CONFIG, rngs=nnx.Rngs(0)), "j.msgpack"),
        (ja.interop.save, ja.MultiHeadAttention(**CONFIG, rngs=nnx.Rngs(0)), "j.safetensors"),
    ]
    for save, module, name in cases:
        out = tmp_path / name
        before = _foreign_dir(out)
        with pytest.raises(files.CheckpointError, match="is a directory") as info:
            save(module, out)
        assert repr(str(out)) in str(info.value)
        assert _tree(out) == before


def test_a_fifo_is_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    os.mkfifo(out)
    with pytest.raises(files.CheckpointError, match="not a regular file"):
        files.write_arrays(_torch_arrays(), out, layout="torch")
    assert stat.S_ISFIFO(os.lstat(out).st_mode)


# --------------------------------------------------------------------------- errors name the user's path


@needs_both
def test_a_write_error_names_out_not_the_temporary(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   checkpoint: Path) -> None:
    out = tmp_path / "no-such-dir" / "out.safetensors"
    status, err = _convert(capsys, checkpoint, out, "--to", "flax", *ARGS)
    assert status == 2 and repr(str(out)) in err and ".tmp" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]


_FULL_DISK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))  # Python ignores SIGXFSZ: a write fails with EFBIG
from parity_tests.convert import main
out, to, fmt = sys.argv[1:4]
sys.exit(main([sys.argv[4], out, "--to", to, *sys.argv[5:], *(["--format", fmt] if fmt != "-" else [])]))
"""


@needs_both
@pytest.mark.parametrize(("name", "to", "fmt"), [("out.safetensors", "flax", "-"), ("out.pt", "torch", "-"),
                                                 ("out.msgpack", "flax", "-"), ("out", "flax", "orbax")])
def test_a_full_disk_names_out(tmp_path: Path, checkpoint: Path, name: str, to: str, fmt: str) -> None:
    """A real failing write (a file size limit): exit 2 naming OUT and the system's reason,
    no temporary left."""
    out = tmp_path / name
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(out), to, fmt, str(checkpoint), *ARGS],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    # Orbax's writer threads log their own tracebacks, before or (still running) after ours
    ours = [line for line in done.stderr.splitlines() if line.startswith("convert: error: ")]
    assert len(ours) == 1, done.stderr
    err = ours[0]
    assert f"cannot write {str(out)!r}" in err and ".tmp" not in err, err
    assert err.endswith("File too large"), err
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]


def _safetensors_with(path: Path, entry: Any, data: bytes = b"\x00" * 16, name: str = "W_query.weight",
                      extra: dict[str, Any] | None = None) -> None:
    header = json.dumps({name: entry, **(extra or {})}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}, "negative"),
        ({"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}, "negative"),
        ({"dtype": "F32", "shape": ["2", 2], "data_offsets": [0, 16]}, "shape"),
        ({"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}, "shape"),
        ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "shape"),
        ({"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}, "shape"),
        ({"dtype": "F8", "shape": [4], "data_offsets": [0, 16]}, "dtype"),
        ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "dtype"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16.0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}, "truncated"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}, "does not fit"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, "offsets"),
        ({"dtype": "F32", "shape": [4]}, "data_offsets"),
        ([1, 2], "malformed"),
    ],
)
def test_a_bad_safetensors_header_names_the_file_and_entry(tmp_path: Path, entry: Any, words: str) -> None:
    path = tmp_path / "bad.safetensors"
    _safetensors_with(path, entry)
    with pytest.raises(files.CheckpointError) as info:
        files.read_safetensors(path)
    message = str(info.value)
    assert repr(str(path)) in message and "'W_query.weight'" in message and words in message, message


def test_safetensors_entries_must_tile_the_data(tmp_path: Path) -> None:
    """As the safetensors library: the entries, by offset, cover the data exactly once."""
    path = tmp_path / "overlap.safetensors"
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    _safetensors_with(path, entry, b"\x00" * 8, extra={"W_key.weight": dict(entry)})
    with pytest.raises(files.CheckpointError, match="'W_key.weight'|'W_query.weight'") as info:
        files.read_safetensors(path)
    assert repr(str(path)) in str(info.value)
    _safetensors_with(path, {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, b"\x00" * 12)
    with pytest.raises(files.CheckpointError, match="trailing|after") as info:
        files.read_safetensors(path)
    assert repr(str(path)) in str(info.value)
    _safetensors_with(path, {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, b"\x00" * 8,
                      extra={"__metadata__": {"format": 1}})
    with pytest.raises(files.CheckpointError, match="__metadata__"):
        files.read_safetensors(path)
    # a valid one still reads, zero-sized arrays included
    _safetensors_with(path, {"dtype": "F32", "shape": [2, 0], "data_offsets": [0, 0]}, b"\x00" * 8,
                      extra={"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    got = files.read_safetensors(path)
    assert got["W_query.weight"].shape == (2, 0) and got["b"].shape == (2,)


def test_the_cli_names_the_bad_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.safetensors"
    _safetensors_with(path, {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]})
    out = tmp_path / "out.safetensors"
    status, err = _convert(capsys, path, out, "--to", "flax", *ARGS)
    assert status == 2 and repr(str(path)) in err and "'W_query.weight'" in err and "negative" in err, err
    assert not out.exists()


# --------------------------------------------------------------------------- modes and symlinks


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@needs_both
@pytest.mark.parametrize(("name", "to", "fmt"), [("out.safetensors", "torch", None), ("out.pt", "torch", None),
                                                 ("out.msgpack", "flax", None), ("out", "flax", "orbax")])
def test_outputs_get_the_usual_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                    umask: Any, name: str, to: str, fmt: str | None) -> None:
    extra = ["--format", fmt] if fmt else []
    for mask in (0o022, 0o002, 0o077):
        umask(mask)
        status, err = _convert(capsys, checkpoint, tmp_path / f"{mask:o}{name}", "--to", to, *ARGS, *extra)
        assert status == 0, err
        made = tmp_path / f"{mask:o}{name}"
        assert _mode(made) == (0o777 if made.is_dir() else 0o666) & ~mask, (oct(_mode(made)), oct(mask))


@needs_both
def test_interop_save_mode_and_symlinks(tmp_path: Path, umask: Any) -> None:
    from flax import nnx

    import jax_attention as ja
    import torch_attention as ta

    umask(0o002)
    ta.interop.save(ta.MultiHeadAttention(**CONFIG), tmp_path / "t.pt")
    ja.interop.save(ja.MultiHeadAttention(**CONFIG, rngs=nnx.Rngs(0)), tmp_path / "j.msgpack")
    assert _mode(tmp_path / "t.pt") == 0o664 and _mode(tmp_path / "j.msgpack") == 0o664
    # an existing file keeps its mode, as open() keeps it
    os.chmod(tmp_path / "t.pt", 0o640)
    ta.interop.save(ta.MultiHeadAttention(**CONFIG), tmp_path / "t.pt")
    assert _mode(tmp_path / "t.pt") == 0o640
    # a symlink is written through by either framework
    cases: list[tuple[Any, Any, str]] = [
        (ta.interop.save, ta.MultiHeadAttention(**CONFIG), "t.safetensors"),
        (ja.interop.save, ja.MultiHeadAttention(**CONFIG, rngs=nnx.Rngs(0)), "j.safetensors"),
    ]
    for save, module, name in cases:
        (tmp_path / f"real-{name}").write_bytes(b"old")
        (tmp_path / f"link-{name}").symlink_to(tmp_path / f"real-{name}")
        save(module, tmp_path / f"link-{name}")
        assert (tmp_path / f"link-{name}").is_symlink()
        assert files.read_arrays(tmp_path / f"real-{name}")[1]


@needs_both
@pytest.mark.parametrize(("name", "to"), [("out.safetensors", "flax"), ("out.pt", "torch"), ("out.msgpack", "flax")])
def test_a_symlink_out_is_written_through(tmp_path: Path, capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                          name: str, to: str) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / name).write_bytes(b"old")
    link = tmp_path / name
    link.symlink_to(real / name)
    status, err = _convert(capsys, checkpoint, link, "--to", to, *ARGS)
    assert status == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real / name)
    assert (real / name).read_bytes() != b"old"
    assert sorted(files.read_arrays(real / name)[1]) == sorted(files.read_arrays(link)[1])
    assert sorted(os.listdir(real)) == [name]
    # a dangling link: its target is created, as open() creates it
    dangling = tmp_path / f"d{name}"
    dangling.symlink_to(real / f"new{name}")
    assert _convert(capsys, checkpoint, dangling, "--to", to, *ARGS)[0] == 0
    assert dangling.is_symlink() and (real / f"new{name}").is_file()


@needs_jax
def test_a_symlink_to_our_orbax_checkpoint_is_written_through(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              checkpoint: Path) -> None:
    real = tmp_path / "real"
    assert _convert(capsys, checkpoint, real, "--to", "flax", *ARGS, "--format", "orbax")[0] == 0
    link = tmp_path / "link"
    link.symlink_to(real)
    files.write_safetensors(_torch_arrays(seed=3), tmp_path / "other.safetensors")
    status, err = _convert(capsys, tmp_path / "other.safetensors", link, "--to", "flax", *ARGS)
    assert status == 0, err
    assert link.is_symlink() and real.is_dir()
    np.testing.assert_array_equal(files.read_arrays(real)[1]["W_query/kernel"], _torch_arrays(seed=3)["W_query.weight"].T)


@pytest.mark.parametrize("name", ("in.safetensors", "in.msgpack", "in.pt"))
def test_reading_a_directory_as_a_file_says_so(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    with pytest.raises(files.CheckpointError, match="is a directory") as info:
        files.read_arrays(tmp_path / name)
    assert repr(str(tmp_path / name)) in str(info.value)
