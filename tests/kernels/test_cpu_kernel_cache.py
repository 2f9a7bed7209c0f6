"""The CPU kernel's cache (``jax_attention._cpu_kernel``): a cached build is verified
before it is loaded, a bad one is rebuilt, and whatever cannot be mended falls back as a
failed build does (``available()`` False, ``build_error()`` saying why; ``"fused"`` then
runs XLA's kernel and ``"auto"`` the blockwise path).

Each test has a cache of its own and a stand-in compiler (``$CXX``, a shell script) that
"compiles" by copying the library this process built (or writes nothing, or fails, as its
mode file says), so no test pays for a real build.  Every load happens in a process of its
own: a library that kills its loader (a truncated file maps pages past its end: SIGBUS)
cannot take pytest with it, and each process starts with no library loaded."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import needs_jax

pytestmark = needs_jax

REPO = Path(__file__).resolve().parents[2]

# A fresh process: the kernel's state, then an attention call on the "auto" and "fused"
# paths against the reference, and which of them ran the kernel.
_CHECK = """
import json, numpy as np, jax.numpy as jnp
from jax_attention import _cpu_kernel
from jax_attention.functional import dot_product_attention
calls = []
forward = _cpu_kernel.forward
_cpu_kernel.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
available = _cpu_kernel.available()
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 70, 32)), jnp.float32) for _ in range(3))
want = np.asarray(dot_product_attention(q, k, v, causal=True, implementation="reference"))
ran = {}
for path in ("auto", "fused"):
    before = len(calls)
    got = np.asarray(dot_product_attention(q, k, v, causal=True, implementation=path))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ran[path] = len(calls) > before
print(json.dumps({"available": available, "error": _cpu_kernel.build_error(), "kernel_ran": ran,
                  "auto_takes_it": available and _cpu_kernel.auto_declines() is None}))
"""


@pytest.fixture(scope="module")
def built_library() -> Path:
    """The library this process built (the default cache), for the stand-in compiler to copy."""
    import jax

    from jax_attention import _cpu_kernel

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernel runs on XLA's CPU backend")
    assert _cpu_kernel.available(), _cpu_kernel.build_error()
    compiler = _cpu_kernel._compiler()
    assert compiler is not None
    return _cpu_kernel._library_path(compiler, Path(jax.ffi.include_dir()))


class Cache:
    """A test's own kernel cache and stand-in compiler; ``mode`` is what the compiler does
    next: "copy" (writes the good library), "silent" (exits 0, writes nothing), "fail"."""

    def __init__(self, root: Path, good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import jax

        from jax_attention import _cpu_kernel

        self.dir = root / "cache"
        self.compiler = root / "fake-cxx"
        self.compiler.write_text(
            "#!/bin/sh\n"
            'if [ "$1" = "--version" ]; then echo "fake-cxx 1.0"; exit 0; fi\n'
            'out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done\n'
            f'mode=$(cat "{root / "mode"}")\n'
            'case "$mode" in\n'
            f'  copy) cp "{good}" "$out";;\n'
            "  silent) ;;\n"
            '  *) echo "fake-cxx: refusing" >&2; exit 1;;\n'
            "esac\n"
        )
        self.compiler.chmod(0o755)
        self.mode("copy")
        self.env = {**os.environ, "TWIN_ATTENTION_CACHE": str(self.dir), "CXX": str(self.compiler),
                    "JAX_PLATFORMS": "cpu"}
        # the name the library gets in this cache with this compiler (what the process computes)
        monkeypatch.setenv("TWIN_ATTENTION_CACHE", str(self.dir))
        monkeypatch.setenv("CXX", str(self.compiler))
        self.target = _cpu_kernel._library_path(str(self.compiler), Path(jax.ffi.include_dir()))

    def mode(self, mode: str) -> None:
        (self.compiler.parent / "mode").write_text(mode)

    def run(self) -> dict:
        """The check above in a fresh process; it must exit normally (no SIGBUS, no traceback)."""
        done = subprocess.run([sys.executable, "-c", _CHECK], env=self.env, cwd=REPO, capture_output=True,
                              text=True, timeout=300, check=False)
        assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    def libraries(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob("*.so"))


@pytest.fixture
def cache(tmp_path: Path, built_library: Path, monkeypatch: pytest.MonkeyPatch) -> Cache:
    return Cache(tmp_path, built_library, monkeypatch)


def _works(result: dict) -> None:
    assert result["available"] and result["error"] is None, result
    # auto takes the kernel where its decision says so (the suite forces it: tests/conftest.py)
    assert result["kernel_ran"] == {"auto": result["auto_takes_it"], "fused": True}, result


def _falls_back(result: dict) -> None:
    assert not result["available"] and result["error"], result
    assert result["kernel_ran"] == {"auto": False, "fused": False}, result


@pytest.mark.parametrize("rebuild", ["copy", "fail"], ids=["rebuilt", "rebuild-fails"])
def test_a_truncated_library_is_rebuilt_not_loaded(cache: Cache, rebuild: str):
    """A cached library cut short (a full disk, a copy killed half way) is never handed to
    the loader, where it would die of SIGBUS in every later process: it is rebuilt, or,
    where the rebuild fails, the kernel falls back, saying why."""
    _works(cache.run())  # builds the library into the cache
    assert cache.libraries() == [cache.target.name]
    size = cache.target.stat().st_size
    with open(cache.target, "r+b") as f:
        f.truncate(size // 2)
    cache.mode(rebuild)
    if rebuild == "copy":
        _works(cache.run())
        assert cache.target.stat().st_size == size
    else:
        result = cache.run()
        _falls_back(result)
        assert "fake-cxx: refusing" in result["error"]


def _library_without_symbols(path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("c++")
    assert compiler is not None, "a C compiler, to build a library without the kernel's symbols"
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_name("unrelated.c")
    source.write_text("int twin_attention_unrelated = 1;\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", str(source), "-o", str(path)], check=True)
    source.unlink()


def test_a_library_without_the_kernels_symbols_is_rebuilt(cache: Cache):
    """A loadable library at the cache's name that lacks the kernel's entry points (which
    gave AttributeError on every default JAX call) is not taken for the kernel: rebuilt."""
    _library_without_symbols(cache.target)
    _works(cache.run())
    assert cache.libraries() == [cache.target.name]


@pytest.mark.slow  # about 14 s; the quick tier checks the cache in test_a_truncated_library_is_rebuilt_not_loaded
def test_the_symbols_are_checked_after_load(cache: Cache):
    """Even with a record that vouches for it (size and checksum), a library without the
    kernel's symbols is caught after loading: rebuilt, or, where the rebuild fails, the
    kernel falls back and ``build_error`` names the missing symbol."""
    from jax_attention import _cpu_kernel

    _library_without_symbols(cache.target)
    _cpu_kernel._seal(cache.target)
    cache.mode("fail")
    result = cache.run()
    _falls_back(result)
    assert "TwinAttention" in result["error"] and "fake-cxx: refusing" in result["error"], result
    cache.mode("copy")
    _works(cache.run())
    digest = hashlib.sha256(cache.target.read_bytes()).hexdigest()
    assert digest in _cpu_kernel._record_path(cache.target).read_text()


@pytest.mark.slow  # about 14 s; the quick tier checks the cache in test_a_truncated_library_is_rebuilt_not_loaded
def test_a_compiler_that_writes_nothing_caches_nothing(cache: Cache):
    """A compiler that exits 0 without writing its output is a failed build (said so),
    leaves no empty library behind, and the next process builds again."""
    cache.mode("silent")
    result = cache.run()
    _falls_back(result)
    assert "wrote no library" in result["error"], result
    assert cache.libraries() == [] and [p.name for p in cache.dir.iterdir()] == []
    cache.mode("copy")
    _works(cache.run())
