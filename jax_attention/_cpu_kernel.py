"""The CPU flash-attention kernel (``csrc/``: ``flash_attention_cpu.cc``, one translation
unit, and the headers it includes): built on first use, registered with XLA as FFI custom
calls, and called from ``functional``'s fused path.

JAX has no fused attention kernel for XLA's CPU backend (``jax.nn.dot_product_attention``
runs the explicit math there), so the library carries one, as the other backends carry
cuDNN (GPU) and splash attention (TPU).  Like ``torch.compile`` on CPU, it is compiled
on the machine that runs it, once, with the machine's C++ compiler (``$CXX``, else
``c++``, ``g++`` or ``clang++``) at ``-O3 -march=native`` (``$TWIN_ATTENTION_MARCH``
names another target) against the XLA FFI headers that jaxlib ships.  The shared
library is cached under ``$TWIN_ATTENTION_CACHE`` (else ``$XDG_CACHE_HOME/twin-attention``,
else ``~/.cache/twin-attention``), named by a hash of every file in ``csrc``, the FFI
headers, the compiler and the CPU, so a change of any of them builds anew.  Beside each library a record (``<name>.so.sha256``: its sha256 and size, written
after the library is complete and in place) vouches for it: a cached library is loaded
only if it matches its record (a file cut short would kill the process with SIGBUS in
the loader) and kept only if it has the kernel's symbols; otherwise it is rebuilt.  A
build is loaded and checked before it enters the cache, so a compiler that exits 0
without writing, or writes something else, caches nothing.

``$TWIN_ATTENTION_CPU_KERNEL`` (``mode()``) turns it off (``off``) or makes a failure an
error (``require``); the default, ``auto``, builds it on first use.  ``build()`` (the
command ``python -m jax_attention.build_kernel``) builds it ahead of time, for a
container image or an installation whose users should not compile.

Where it cannot be built (no compiler, a failed build, a bad cached library that cannot
be rebuilt, a build for an instruction set that this CPU lacks), ``available()`` is False and ``build_error()`` says why: the fused path then runs XLA's kernel, and ``"auto"`` the
blockwise path, as before.  Nothing here runs at import.

Where it is available, ``"auto"`` takes it or the blockwise path (for few query rows: its
forward for few rows or the explicit math) as a short measurement on this machine says
(``_cpu_measure``: made by the first ``"auto"`` call that needs it, once per build,
cached beside the library as ``<name>.so.auto.json``; ``$TWIN_ATTENTION_CPU_AUTO``
``kernel`` or ``blockwise`` forces it): ``auto_declines``, ``auto_would_decline``
(asked without building or measuring) and ``auto_basis`` (what decided).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_attention import _cpu_measure

if TYPE_CHECKING:
    from jax_attention._canonical import Operands

_SOURCES = Path(__file__).with_name("csrc")
_SOURCE = _SOURCES / "flash_attention_cpu.cc"  # the translation unit: includes the headers beside it
_FORWARD, _BACKWARD = "twin_attention_flash_fwd", "twin_attention_flash_bwd"
_DECODE, _MATMUL = "twin_attention_decode_fwd", "twin_attention_matmul"
_SYMBOLS = ("TwinAttentionFlashFwd", "TwinAttentionFlashBwd", "TwinAttentionDecodeFwd", "TwinAttentionMatmul",
            "TwinAttentionInstructionSet")


def _flags() -> tuple[str, ...]:
    # $TWIN_ATTENTION_MARCH: another target than this CPU (e.g. x86-64-v3, AVX2 only,
    # for a cache shared by machines of several kinds).
    march = os.environ.get("TWIN_ATTENTION_MARCH") or "native"
    return ("-O3", f"-march={march}", "-std=c++17", "-shared", "-fPIC")


_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ok": bool, "error": str | None, "library": ctypes.CDLL, "path": Path


def cache_dir() -> Path:
    """Where built kernels are kept."""
    if os.environ.get("TWIN_ATTENTION_CACHE"):
        return Path(os.environ["TWIN_ATTENTION_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "twin-attention"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_signature() -> str:
    # -march=native: the build is for this CPU's instruction sets.
    return platform.machine() + _cpu_flags_line()


# The /proc/cpuinfo flag each x86 instruction set that the library reports needs.
_NEEDS_FLAG = {"AVX-512": "avx512f", "AVX2": "avx2", "AVX": "avx", "SSE2": "sse2"}


def _check_runs_here(library: ctypes.CDLL) -> None:
    """A library built for an instruction set that this CPU lacks (a $TWIN_ATTENTION_MARCH
    for another machine) would die of SIGILL in its first call: refused, as a failed build
    is.  Where the CPU's flags cannot be read (no /proc/cpuinfo) the build is trusted."""
    function = library.TwinAttentionInstructionSet
    function.restype = ctypes.c_char_p
    isa = function().decode()
    flags = _cpu_flags_line().split(":", 1)[-1].split()
    needed = _NEEDS_FLAG.get(isa)
    if flags and needed is not None and needed not in flags:
        march = os.environ.get("TWIN_ATTENTION_MARCH") or "native"
        raise RuntimeError(f"the kernel was built for {isa} (-march={march}), which this CPU lacks "
                           f"(no {needed} among its flags); unset $TWIN_ATTENTION_MARCH or name this CPU's")


def _source_files() -> list[Path]:
    """Every file of the kernel's source: the translation unit and all it may include."""
    return sorted(path for path in _SOURCES.iterdir() if path.is_file())


def _library_path(compiler: str, include: Path) -> Path:
    digest = hashlib.sha256()
    for source in _source_files():
        digest.update(source.name.encode() + source.read_bytes())
    for header in sorted((include / "xla" / "ffi" / "api").glob("*.h")):
        digest.update(header.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest.update("\0".join((compiler, version, *_flags(), _cpu_signature())).encode())
    return cache_dir() / f"flash_attention_cpu-{digest.hexdigest()[:16]}.so"


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _seal(library: Path) -> None:
    """Write the record that vouches for a complete library: its sha256 and size, beside
    it, written aside and renamed into place after the library itself."""
    record = _record_path(library)
    fd, scratch = tempfile.mkstemp(suffix=".sha256", dir=library.parent)
    with os.fdopen(fd, "w") as f:
        f.write(f"{_digest(library)} {library.stat().st_size}\n")
    os.chmod(scratch, 0o644)  # as readable as the library (mkstemp makes it 0600)
    os.replace(scratch, record)


def _fault(library: Path) -> str | None:
    """Why a cached library must not be loaded (None: it matches its record).  A file cut
    short would kill the loading process with SIGBUS (the loader maps pages past its end),
    so nothing is loaded that its record does not vouch for."""
    try:
        digest, size = _record_path(library).read_text().split()
    except (OSError, ValueError):
        return "no readable record of its checksum"
    try:
        if library.stat().st_size != int(size):
            return f"{library.stat().st_size} bytes, its record says {size}"
        return None if _digest(library) == digest else "its checksum differs from its record's"
    except (OSError, ValueError) as error:
        return str(error)


def _open(path: Path) -> ctypes.CDLL:
    """Load a library and check that it has the kernel's entry points."""
    library = ctypes.CDLL(str(path))
    missing = [name for name in _SYMBOLS if not hasattr(library, name)]
    if missing:
        raise RuntimeError(f"{path} lacks the kernel's symbols {', '.join(missing)}")
    return library


def _build(compiler: str, include: Path, target: Path) -> ctypes.CDLL:
    """Compile the kernel, load and check it, then put it in the cache with its record."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built in a folder of its own beside the target and renamed into place: processes
    # building at once each write their own file, and a reader never sees half of one.
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        built = scratch / target.name
        command = [compiler, *_flags(), "-isystem", str(include), str(_SOURCE), "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
        if not built.exists() or built.stat().st_size == 0:
            raise RuntimeError(f"{' '.join(command)} exited 0 but wrote no library")
        library = _open(built)  # loaded from here, so only a library that works is ever cached
        os.replace(built, target)
        _seal(target)
        return library
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _verified() -> tuple[Path, ctypes.CDLL]:
    """The cached library, verified and loaded, or built into the cache; checked to run
    on this CPU."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
    include = Path(jax.ffi.include_dir())
    target = _library_path(compiler, include)
    library = None
    if target.exists():
        # A cached build is verified before it is loaded and checked after; a bad one is rebuilt.
        fault = _fault(target)
        if fault is None:
            try:
                library = _open(target)
            except (OSError, RuntimeError) as error:
                fault = str(error)
        if library is None:
            try:
                library = _build(compiler, include, target)
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                raise RuntimeError(f"the cached {target} was refused ({fault}); rebuilding it: {error}") from error
    else:
        library = _build(compiler, include, target)
    _check_runs_here(library)
    return target, library


def _load() -> tuple[Path, ctypes.CDLL]:
    path, library = _verified()
    jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(library.TwinAttentionFlashFwd), platform="cpu")
    jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(library.TwinAttentionFlashBwd), platform="cpu")
    jax.ffi.register_ffi_target(_DECODE, jax.ffi.pycapsule(library.TwinAttentionDecodeFwd), platform="cpu")
    jax.ffi.register_ffi_target(_MATMUL, jax.ffi.pycapsule(library.TwinAttentionMatmul), platform="cpu")
    return path, library


def build() -> Path:
    """Build the kernel into the cache (``cache_dir()``), or verify the build already
    there, and return the library's path; this process does not register it.  Ahead of
    time, so that later processes load it without compiling.  RuntimeError or OSError
    saying why it cannot be had; ``mode()`` is not consulted."""
    path, _ = _verified()
    return path


MODES = ("auto", "off", "require")


def mode() -> str:
    """``$TWIN_ATTENTION_CPU_KERNEL``: ``"auto"`` (the default: built on first use, and a
    machine where it does not build falls back), ``"off"`` (never built nor loaded: the
    fused path runs XLA's kernel, ``"auto"`` the blockwise path) or ``"require"`` (a
    failure to build or load raises instead of falling back).  ValueError for another
    value."""
    value = os.environ.get("TWIN_ATTENTION_CPU_KERNEL") or "auto"
    if value not in MODES:
        raise ValueError(f"$TWIN_ATTENTION_CPU_KERNEL must be one of {', '.join(MODES)}; got {value!r}")
    return value


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call, unless
    ``mode()`` is ``"off"``; the mode is read then, once a process).  With ``"require"``,
    a kernel that cannot be had raises RuntimeError, saying why, at every call."""
    with _lock:
        if "ok" not in _state:
            _state["mode"] = mode()
            if _state["mode"] == "off":
                _state["ok"], _state["error"] = False, "turned off ($TWIN_ATTENTION_CPU_KERNEL=off)"
            else:
                try:
                    _state["path"], _state["library"] = _load()
                    _state["ok"], _state["error"] = True, None
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    _state["ok"], _state["error"] = False, str(error)
        if not _state["ok"] and _state["mode"] == "require":
            raise RuntimeError(f"$TWIN_ATTENTION_CPU_KERNEL=require, and the CPU kernel is not available: "
                               f"{_state['error']}")
        return bool(_state["ok"])


def warn_fallback() -> None:
    """The warning of an explicit ``"fused"`` call that runs XLA's kernel because this one
    cannot be had (a failed build, say); none where it is turned off on purpose."""
    if _state.get("mode") != "off":
        warnings.warn(f"implementation='fused' runs XLA's kernel: the library's CPU kernel is not available "
                      f"({build_error()})", RuntimeWarning, stacklevel=4)


def build_error() -> str | None:
    """Why the kernel is not available (None if it is, or has not been asked for)."""
    return _state.get("error")


def instruction_set() -> str | None:
    """The instruction set the kernel was compiled for, as the library itself reports it
    ("AVX-512", "AVX2", "AVX", "SSE2", "NEON" or "generic"; the ``-march`` of the build,
    native or ``$TWIN_ATTENTION_MARCH``), building it on the first call; None where it
    is not available."""
    if not available():
        return None
    with _lock:
        if "isa" not in _state:
            function = _state["library"].TwinAttentionInstructionSet
            function.restype = ctypes.c_char_p
            _state["isa"] = function().decode()
        return str(_state["isa"])


def cpu_instruction_set() -> str | None:
    """The widest x86 vector instruction set among this CPU's flags (None: none read)."""
    flags = _cpu_flags_line().split(":", 1)[-1].split()
    return next((isa for isa, flag in _NEEDS_FLAG.items() if flag in flags), None)


def known_unavailable() -> str | None:
    """Why the kernel cannot be had, where that is known without building it: turned off
    (``mode()`` ``"off"``) or a build or load in this process that failed; None
    otherwise (also where a failure would raise, ``"require"``: the call then raises)."""
    if "ok" in _state:
        return None if _state["ok"] or _state.get("mode") == "require" else str(_state["error"])
    if mode() == "off":
        return "turned off ($TWIN_ATTENTION_CPU_KERNEL=off)"
    return None


# The compiler's macro for each instruction set that the library reports, in its order.
_MACROS = (("__AVX512F__", "AVX-512"), ("__AVX2__", "AVX2"), ("__AVX__", "AVX"), ("__SSE2__", "SSE2"),
           ("__ARM_NEON", "NEON"))


_targets: dict[tuple[str, str], str | None] = {}  # (compiler, march) -> its instruction set


def _target_instruction_set(compiler: str, march: str) -> str | None:
    """The instruction set of a build for ``-march=march``, from the compiler's
    predefined macros (its preprocessor alone, on an empty file: nothing is built), asked
    once a process; None where the compiler does not answer."""
    if (compiler, march) not in _targets:
        _targets[compiler, march] = _macro_instruction_set(compiler, march)
    return _targets[compiler, march]


def _macro_instruction_set(compiler: str, march: str) -> str | None:
    try:
        done = subprocess.run([compiler, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull],
                              capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    defined = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return next((isa for macro, isa in _MACROS if macro in defined), "generic")


def predicted_instruction_set() -> str | None:
    """The instruction set the kernel is (or would be) compiled for, without building
    it: the library's own word where it is loaded; for ``-march=native`` the flags of
    this CPU (/proc/cpuinfo); else (``$TWIN_ATTENTION_MARCH``, or no flags to read) the
    compiler's predefined macros for that target.  None where none of these can tell."""
    if _state.get("ok"):
        return instruction_set()
    march = os.environ.get("TWIN_ATTENTION_MARCH") or "native"
    if march == "native" and _cpu_flags_line():
        return cpu_instruction_set() or "generic"
    compiler = _compiler()
    return None if compiler is None else _target_instruction_set(compiler, march)


# ---------------------------------------------------------------------- "auto": the kernel or not

_names: dict[tuple[str, ...], str] = {}  # what names the library -> its name, asked once a process


def _library_name() -> str | None:
    """The name of the library in force: the loaded one's, else the one a build would have
    (nothing built: the sources hashed and the compiler's version asked, once a process
    for each compiler, target and cache); None without a compiler."""
    if _state.get("ok") and "path" in _state:
        return str(_state["path"].name)
    compiler = _compiler()
    if compiler is None:
        return None
    include = Path(jax.ffi.include_dir())
    key = (compiler, str(include), str(_SOURCES), str(cache_dir()), *_flags())
    if key not in _names:
        _names[key] = _library_path(compiler, include).name
    return _names[key]


def auto_record() -> Path | None:
    """Where ``"auto"``'s decision for the library in force is cached (``<name>.auto.json``
    in ``cache_dir()``, beside the library), found without building; None without a
    compiler."""
    name = _library_name()
    return None if name is None else _cpu_measure.record_path(cache_dir() / name)


def _library_name_of(record: Path) -> str:
    return record.name[:-len(_cpu_measure.SUFFIX)]


def auto_declines(few_rows: bool = False) -> str | None:
    """Why ``implementation="auto"`` does not run the kernel on this machine, or None
    where it does, building the kernel on the first call (a kernel that cannot be had is
    passed by, saying why).  ``$TWIN_ATTENTION_CPU_AUTO`` (``kernel``, ``blockwise``)
    forces the answer; otherwise the measurement of this build on this machine decides
    (``_cpu_measure``): read from its record, or, where there is none (or it is
    unreadable, or from another JAX or other CPUs), measured now (about a second, once
    per build and machine) and cached.  ``few_rows``: the decision for a call of few
    query rows (the kernel's forward for few rows against the explicit math); the other
    (full calls: the kernel against the blockwise path) also decides a projection's
    ``"auto"`` (``functional.linear``).  An explicit ``"fused"`` runs the kernel
    whatever this says."""
    isa = instruction_set()
    if isa is None:
        return f"the CPU kernel is not available: {build_error()}"
    decision = _cpu_measure.forced()
    if decision is not None:
        return _cpu_measure.forced_reason(decision, few_rows)
    name = _library_name()
    if name is None:  # loaded, so not reached; no record without a name
        return None
    record = _cpu_measure.decide(_cpu_measure.record_path(cache_dir() / name), name, may_measure=True)
    return None if record is None else _cpu_measure.reason(record, few_rows)


def auto_would_decline(few_rows: bool = False) -> str | None:
    """``auto_declines``'s answer asked without building the kernel or measuring it: a
    kernel known to be missing (turned off, a failed build) is passed by, saying why;
    ``$TWIN_ATTENTION_CPU_AUTO`` forces the answer; otherwise the cached measurement of
    the build that would be loaded (``auto_record``) answers.  Where none is cached yet
    the answer is None: the call takes the kernel, builds it if need be and measures it
    (``auto_declines``); should the measurement find the blockwise path faster, that call
    runs it instead (``functional`` asks again after the build, as after a build that
    fails), and from then on this answers as the call did."""
    missing = known_unavailable()
    if missing is not None:
        return f"the CPU kernel is not available: {missing}"
    decision = _cpu_measure.forced()
    if decision is not None:
        return _cpu_measure.forced_reason(decision, few_rows)
    path = auto_record()
    if path is None:  # no compiler: the call's build fails, and it falls back then
        return None
    record = _cpu_measure.decide(path, _library_name_of(path), may_measure=False)
    return None if record is None else _cpu_measure.reason(record, few_rows)


def auto_basis(few_rows: bool = False) -> str:
    """One line saying what decides ``implementation="auto"``'s choice of the kernel here
    (``few_rows``: for a call of few query rows), asked without building or measuring:
    the kernel missing, ``$TWIN_ATTENTION_CPU_AUTO``, the measurement cached for this
    build (its medians and where it is cached), a decision set by ``python -m
    jax_attention.build_kernel --auto``, or none yet (the first call measures)."""
    missing = known_unavailable()
    if missing is not None:
        return f"the CPU kernel is not available: {missing}"
    decision = _cpu_measure.forced()
    if decision is not None:
        return f"forced by ${_cpu_measure.OVERRIDE}={decision}"
    path = auto_record()
    if path is None:
        return ("no C++ compiler found ($CXX, c++, g++ or clang++): auto tries the CPU kernel, whose build then "
                "fails, and takes the blockwise path")
    record = _cpu_measure.decide(path, _library_name_of(path), may_measure=False)
    return _cpu_measure.basis(record, few_rows, path)


def measure_auto() -> tuple[Path, dict[str, Any]]:
    """Measure ``"auto"``'s decision for this build now, whatever is cached, cache it and
    hold it for this process (``python -m jax_attention.build_kernel --measure``): the
    record's path and the record.  The kernel is built and loaded first; RuntimeError
    where it cannot be (turned off included)."""
    if not available():
        raise RuntimeError(f"the CPU kernel is not available: {build_error()}")
    name = _state["path"].name
    path = _cpu_measure.record_path(cache_dir() / name)
    record = _cpu_measure.measured_record(name, _cpu_measure.measure())
    _cpu_measure.remember(path, record, _cpu_measure.write(path, record))
    return path, record


def set_auto(decision: str) -> tuple[Path, dict[str, Any]]:
    """Build (or verify) the kernel and cache ``decision`` (``"kernel"`` or
    ``"blockwise"``) as ``"auto"``'s for this build without measuring (``python -m
    jax_attention.build_kernel --auto``): the record's path and the record.  OSError
    where it cannot be written; RuntimeError or OSError where the kernel cannot be built."""
    library = build()
    path = _cpu_measure.record_path(library)
    record = _cpu_measure.set_record(library.name, decision)
    why = _cpu_measure.write(path, record)
    if why is not None:
        raise OSError(f"{path} could not be written: {why}")
    _cpu_measure.remember(path, record)
    return path, record


def _attributes(scale: float, offset: int, left: int | None, right: int | None) -> dict[str, Any]:
    # left / right None (unbounded) travel as -1.
    return {
        "scale": np.float32(scale), "offset": np.int64(offset),
        "left": np.int64(-1 if left is None else left), "right": np.int64(-1 if right is None else right),
    }


def _sinks_operand(ops: Operands) -> jax.Array:
    # No sinks travel as float32 (0,): the kernel then runs as it did before it had them.
    return jnp.zeros((0,), jnp.float32) if ops.sinks is None else ops.sinks


def forward(q: jax.Array, k: jax.Array, v: jax.Array, ops: Operands, *, scale: float, offset: int,
            left: int | None, right: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 q (B, T, H, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv), and ``ops`` holding
    int32 ``lengths`` (B,) and float32 ``sinks`` (H,) or None (no bias or mask) -> (out
    (B, T, H, Dv), row max (B, H, T), row normaliser (B, H, T), the sink's share
    included); see the source's header.  Tokens come before heads, as a module's
    projections produce them."""
    batch, q_len, heads, _ = q.shape
    rows = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
    shapes = (jax.ShapeDtypeStruct((batch, q_len, heads, v.shape[-1]), jnp.float32), rows, rows)
    call = jax.ffi.ffi_call(_FORWARD, shapes, vmap_method="sequential")
    out, row_max, row_sum = call(q, k, v, ops.lengths, _sinks_operand(ops),
                                 **_attributes(scale, offset, left, right))
    return out, row_max, row_sum


def decode_forward(q: jax.Array, k: jax.Array, v: jax.Array, ops: Operands, *, scale: float, offset: int,
                   left: int | None, right: int | None,
                   heads_first: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``forward`` for few query rows (``csrc/decode.h``), ``ops`` as it takes them:
    keys and values read where they lie, none past a length, in either layout: tokens before heads as ``forward``
    takes them, or with ``heads_first`` q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S,
    Dv) and out (B, H, T, Dv), as a module's cache holds them.  The row statistics are
    ``forward``'s, (B, H, T)."""
    batch = q.shape[0]
    heads, q_len = (q.shape[1], q.shape[2]) if heads_first else (q.shape[2], q.shape[1])
    rows = jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)
    shapes = (jax.ShapeDtypeStruct((*q.shape[:3], v.shape[-1]), jnp.float32), rows, rows)
    call = jax.ffi.ffi_call(_DECODE, shapes, vmap_method="sequential")
    out, row_max, row_sum = call(q, k, v, ops.lengths, _sinks_operand(ops), heads_first=np.bool_(heads_first),
                                 **_attributes(scale, offset, left, right))
    return out, row_max, row_sum


def backward(q: jax.Array, k: jax.Array, v: jax.Array, ops: Operands, out: jax.Array, d_out: jax.Array,
             row_max: jax.Array, row_sum: jax.Array, *, scale: float, offset: int, left: int | None,
             right: int | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv, dsinks), float32, in the layouts of q, k, v and ``ops.sinks`` ((0,)
    without sinks), from the forward's inputs (``ops`` as ``forward`` takes them), output
    and row statistics."""
    sinks = _sinks_operand(ops)
    shapes = tuple(jax.ShapeDtypeStruct(t.shape, jnp.float32) for t in (q, k, v, sinks))
    call = jax.ffi.ffi_call(_BACKWARD, shapes, vmap_method="sequential")
    dq, dk, dv, dsinks = call(q, k, v, ops.lengths, out, d_out, row_max, row_sum, sinks,
                              **_attributes(scale, offset, left, right))
    return dq, dk, dv, dsinks


def matmul(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """float32 op(a) @ op(b), op(x) = x or x.T, both 2-d (a (M, K) or, transposed, (K, M);
    b (K, N) or (N, K)) -> (M, N): a projection and its two gradients, with no transposed
    copy made."""
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    call = jax.ffi.ffi_call(_MATMUL, jax.ShapeDtypeStruct((m, n), jnp.float32), vmap_method="sequential")
    return call(a, b, trans_a=np.bool_(trans_a), trans_b=np.bool_(trans_b))
