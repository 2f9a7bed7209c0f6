"""The ahead-of-time build of the CPU kernel: ``python -m jax_attention.build_kernel``
builds the library into the cache with its checksum record and prints where, so that a
later process loads it without compiling; a build that fails exits non-zero saying why.
And what a build is made of: the cached library's name covers every file of ``csrc``, and
the package ships them all.

The build runs with a stand-in compiler (``$CXX``, a shell script that copies the library
this process built, or fails, as its mode file says), so no test pays for a real build;
each command and each load runs in a process of its own."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import needs_jax

pytestmark = needs_jax

REPO = Path(__file__).resolve().parents[2]

_LOAD = ("from jax_attention import _cpu_kernel; "
         "print(_cpu_kernel.available(), _cpu_kernel.build_error())")


@pytest.fixture(scope="module")
def built_library() -> Path:
    """The library this process built (the default cache), for the stand-in to copy."""
    import jax

    from jax_attention import _cpu_kernel

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernel runs on XLA's CPU backend")
    assert _cpu_kernel.available(), _cpu_kernel.build_error()
    compiler = _cpu_kernel._compiler()
    assert compiler is not None
    return _cpu_kernel._library_path(compiler, Path(jax.ffi.include_dir()))


def _stand_in(root: Path, good: Path) -> Path:
    compiler = root / "fake-cxx"
    compiler.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake-cxx 1.0"; exit 0; fi\n'
        'out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
        f'echo built >> "{root / "builds"}"\n'
        f'if [ "$(cat "{root / "mode"}")" = copy ]; then cp "{good}" "$out"; '
        'else echo "fake-cxx: refusing" >&2; exit 1; fi\n'
    )
    compiler.chmod(0o755)
    return compiler


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)


def test_the_command_builds_into_the_cache_and_a_later_load_does_not_rebuild(tmp_path: Path,
                                                                             built_library: Path):
    """After the command the cache holds the library and its record, the printed path;
    later processes, with a compiler that would now fail, load it (and the command
    verifies it) without building again."""
    cache = tmp_path / "cache"
    compiler = _stand_in(tmp_path, built_library)
    (tmp_path / "mode").write_text("copy")
    env = {**os.environ, "TWIN_ATTENTION_CACHE": str(cache), "CXX": str(compiler), "JAX_PLATFORMS": "cpu"}
    env.pop("TWIN_ATTENTION_CPU_KERNEL", None)
    done = _run(["-m", "jax_attention.build_kernel"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    library = Path(done.stdout.strip().splitlines()[-1])
    assert library.parent == cache and library.exists()
    assert sorted(p.name for p in cache.iterdir()) == [library.name, library.name + ".sha256"]
    assert (tmp_path / "builds").read_text() == "built\n"
    stamp = library.stat().st_mtime_ns

    (tmp_path / "mode").write_text("fail")  # a build from here on would fail
    loaded = _run(["-c", _LOAD], env)
    assert loaded.returncode == 0 and loaded.stdout.split() == ["True", "None"], (loaded.stdout, loaded.stderr[-3000:])
    again = _run(["-m", "jax_attention.build_kernel"], env)
    assert again.returncode == 0 and again.stdout.strip() == str(library), again.stderr[-3000:]
    assert (tmp_path / "builds").read_text() == "built\n"  # the stand-in ran once only
    assert library.stat().st_mtime_ns == stamp


def test_a_failed_build_exits_non_zero_saying_why(tmp_path: Path):
    """A compiler that fails (``CXX=false``): exit status 1, the failed command on stderr,
    nothing in the cache named by ``--cache``."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no false(1) to stand in for a failing compiler")
    cache = tmp_path / "cache"
    env = {**os.environ, "CXX": false, "JAX_PLATFORMS": "cpu"}
    env.pop("TWIN_ATTENTION_CACHE", None)
    done = _run(["-m", "jax_attention.build_kernel", "--cache", str(cache)], env)
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    assert done.stdout == ""
    assert "the CPU kernel could not be built" in done.stderr and f"{false} -O3" in done.stderr, done.stderr
    assert not list(cache.glob("*.so*"))


def test_the_librarys_name_covers_every_source_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A change to any file of ``csrc`` (the translation unit, a header it includes, a
    file added beside them) names another library, so a stale build is never loaded."""
    from jax_attention import _cpu_kernel

    sources = tmp_path / "csrc"
    shutil.copytree(_cpu_kernel._SOURCES, sources)
    monkeypatch.setattr(_cpu_kernel, "_SOURCES", sources)
    compiler = shutil.which("true")  # any program: only its path and --version's output are hashed
    assert compiler is not None
    include = tmp_path / "include"
    names = {_cpu_kernel._library_path(compiler, include).name}
    for header in sorted(sources.glob("*.h")):
        header.write_text(header.read_text() + "\n")
        names.add(_cpu_kernel._library_path(compiler, include).name)
    (sources / "added.inc").write_text("// a file the translation unit might include\n")
    names.add(_cpu_kernel._library_path(compiler, include).name)
    assert len(names) == len(list(sources.glob("*.h"))) + 2


def test_the_package_ships_every_source_file():
    """pyproject.toml's package-data names every file of ``csrc``: an installed package
    builds from what a checkout builds from."""
    tomllib = pytest.importorskip("tomllib")
    from jax_attention import _cpu_kernel

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["jax_attention"]
    for source in _cpu_kernel._source_files():
        relative = f"csrc/{source.name}"
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), f"{relative} is not in package-data"
