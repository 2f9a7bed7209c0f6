"""What a result was measured on: the machine (from the parent process, which imports
no framework and so holds no GPU memory) and each framework's runtime (from the worker
process that ran it)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import time
from typing import Any

PACKAGES = (
    "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
    "flax", "torch", "triton", "numpy",
)


def host_environment() -> dict[str, Any]:
    """Date, CPU, GPU (name, driver, memory, from ``nvidia-smi``) and package versions."""
    cpu_model = _cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = _nvidia_gpus()
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": gpus[0]["name"] if gpus else f"{cpu_model} ({cores} cores)",
        "gpus": gpus,
        "driver": gpus[0]["driver"] if gpus else None,
        "cpu": {"model": cpu_model, "cores": cores, "generation": cpu_generation(), **instruction_sets()},
        "load_average_at_start": load_average(),
        "cpu_busy_at_start": cpu_busy(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {},
        "git": _git_state(),
    }
    for name in PACKAGES:
        try:
            env["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return env


def instruction_sets() -> dict[str, Any]:
    """What decides the CPU path's speed: ``isa``, the widest vector instruction set among
    the CPU's flags; ``kernel_isa``, the one the library's CPU kernel is (or would be)
    built for, asked without building it; ``kernel_march``, ``$TWIN_ATTENTION_MARCH``
    (None: native); ``auto_declines``, why ``auto`` passes the kernel by (None: it
    takes it); and ``auto_basis``, what decided (the measurement cached for the build,
    or ``$TWIN_ATTENTION_CPU_AUTO``).  The kernel's entries are None where JAX is missing."""
    out: dict[str, Any] = {"isa": None, "kernel_isa": None,
                           "kernel_march": os.environ.get("TWIN_ATTENTION_MARCH") or None, "auto_declines": None,
                           "auto_basis": None}
    try:
        from jax_attention import _cpu_kernel
    except ImportError:
        return out
    out["isa"] = _cpu_kernel.cpu_instruction_set()
    out["kernel_isa"] = _cpu_kernel.predicted_instruction_set()
    out["auto_declines"] = _cpu_kernel.auto_would_decline()
    out["auto_basis"] = _cpu_kernel.auto_basis()
    return out


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages: other work on a shared machine shows here."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_ticks() -> dict[str, int] | None:
    """The machine's CPU time so far, all cores, in clock ticks (from /proc/stat; None
    elsewhere): ``total``, ``idle`` (idle + iowait), ``steal`` (time the hypervisor gave
    this virtual machine's cores to someone else)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]  # the "cpu" line: all cores
    except (OSError, ValueError):
        return None
    if len(ticks) < 8:
        return None
    return {"total": sum(ticks[:8]), "idle": ticks[3] + ticks[4], "steal": ticks[7]}


def host_share(before: dict[str, int] | None, after: dict[str, int] | None, own_cpu_s: float) -> dict[str, float] | None:
    """Over an interval of this process's work: the fraction of the machine's CPU time
    stolen by the hypervisor, and the fraction busy with other processes (busy time less
    the ``own_cpu_s`` seconds this process used).  Either above a few percent means the
    interval's timings were shared with other work."""
    if before is None or after is None or after["total"] <= before["total"]:
        return None
    total = after["total"] - before["total"]
    busy = total - (after["idle"] - before["idle"]) - (after["steal"] - before["steal"])
    own = own_cpu_s * os.sysconf("SC_CLK_TCK")
    return {"steal": (after["steal"] - before["steal"]) / total, "others": max(0.0, busy - own) / total}


def cpu_busy(seconds: float = 1.0) -> float | None:
    """The fraction of the machine's CPU time that was busy over the next ``seconds``
    (from /proc/stat; None elsewhere): taken while the benchmark itself is idle, it is
    other work on a shared machine.  (The load average lags by minutes.)"""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]  # the "cpu" line: all cores
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    try:
        total_0, idle_0 = sample()
        time.sleep(seconds)
        total_1, idle_1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total_1 - total_0
    return None if total <= 0 else 1.0 - (idle_1 - idle_0) / total


def device_slug(env: dict[str, Any]) -> str:
    """A folder name for the device: ``nvidia-h100-80gb-hbm3``,
    ``cpu-2core-intel-xeon-processor``, and where the model name hides the CPU's
    generation (a cloud's "AMD EPYC"), that generation too: ``cpu-2core-amd-epyc-zen5``."""
    if env["gpus"]:
        return _slug(env["gpus"][0]["name"])
    model = re.sub(r"\((R|TM)\)|\bCPU\b|@.*", " ", env["cpu"]["model"])
    generation = env["cpu"].get("generation")
    suffix = f"-{generation}" if generation and generation not in model.lower() else ""
    return f"cpu-{env['cpu']['cores']}core-{_slug(model)}{suffix}"


# AMD's CPU family (and, in family 0x19, model ranges) of each Zen generation.
_ZEN_19H = (("zen3", ((0x00, 0x0F), (0x20, 0x5F))), ("zen4", ((0x10, 0x1F), (0x60, 0xAF))))
# Intel's server cores (family 6) by model: a virtual machine's "Intel(R) Xeon(R) Processor"
_XEON_6H = {0x55: "skylake-sp", 0x6A: "ice-lake-sp", 0x6C: "ice-lake-d", 0x8F: "sapphire-rapids",
            0xCF: "emerald-rapids", 0xAD: "granite-rapids", 0xAE: "granite-rapids-d"}


def cpu_generation() -> str | None:
    """The CPU's generation where /proc/cpuinfo tells it and the model name may not (a
    virtual machine's "AMD EPYC", "Intel(R) Xeon(R) Processor"): ``zen3``, ``zen4`` or
    ``zen5`` for AMD (CPU family 0x19 by model, 0x1A), Intel's server cores by model
    (``sapphire-rapids``, ``emerald-rapids``, ...); None otherwise."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return None
    vendor = fields.get("vendor_id")
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return None
    if vendor == "GenuineIntel":
        return _XEON_6H.get(model) if family == 6 else None
    if vendor != "AuthenticAMD":
        return None
    if family == 0x1A:
        return "zen5"
    if family == 0x19:
        return next((name for name, ranges in _ZEN_19H if any(lo <= model <= hi for lo, hi in ranges)), None)
    return None


def runtime_environment(framework: str) -> dict[str, Any]:
    """The framework's view, from inside a worker: versions, backend, device, precision."""
    if framework == "jax":
        import jax
        import jaxlib

        device = jax.devices()[0]
        return {
            "matmul_gflops": _matmul_gflops("jax"),
            "matmul_bf16_tflops": _matmul_bf16_tflops("jax"),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(),
            "platform_version": device.client.platform_version,  # CUDA / cuDNN build on GPU
            "device_kind": device.device_kind,
            "device_count": jax.device_count(),
            "default_matmul_precision": jax.config.jax_default_matmul_precision,  # type: ignore[attr-defined]
            "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "xla_flags": os.environ.get("XLA_FLAGS"),
        }
    import torch

    cuda = torch.cuda.is_available()
    return {
        "matmul_gflops": _matmul_gflops("torch"),
        "matmul_bf16_tflops": _matmul_bf16_tflops("torch"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "num_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # its kernels' vectors ($ATEN_CPU_CAPABILITY)
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _matmul_bf16_tflops(framework: str) -> float | None:
    """On a GPU, the rate of a bfloat16 8192^3 product, TFLOP/s: the matrix units'
    ceiling that the attention kernels are measured against.  None on CPU."""
    if framework == "jax":
        import jax

        if jax.default_backend() != "gpu":
            return None
    else:
        import torch

        if not torch.cuda.is_available():
            return None
    return _matmul_gflops(framework, n=8192, dtype="bfloat16") / 1e3


def _matmul_gflops(framework: str, n: int = 1024, runs: int = 10, dtype: str = "float32") -> float:
    """The rate of a plain (n x n) @ (n x n) product (float32 by default, full
    precision), GFLOP/s, median of ``runs`` after a warm-up: the ceiling the attention
    modules are measured against."""
    import statistics
    import time

    if framework == "jax":
        import jax
        import jax.numpy as jnp

        a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
        product = jax.jit(lambda x: jnp.matmul(x, x, precision="highest"))

        def call() -> None:
            product(a).block_until_ready()
    else:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        t = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))

        def call() -> None:
            torch.matmul(t, t)
            if device == "cuda":
                torch.cuda.synchronize()

    call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _nvidia_gpus() -> list[dict[str, str]]:
    query = "name,driver_version,memory.total"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, driver, memory = (part.strip() for part in line.split(","))
        gpus.append({"name": name, "driver": driver, "memory": memory})
    return gpus


def _git_state() -> dict[str, Any] | None:
    """The commit measured, and whether tracked files differed from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        # "XY path" per line: stripping the whole output would eat the first line's " M"
        changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "modified": [line[3:] for line in changed]}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# Allocators the workers can run with (``python -m benchmarks --malloc``).
MALLOCS = ("system", "tcmalloc")
_TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def preload_for(malloc: str) -> str | None:
    """The shared library to preload (LD_PRELOAD) into every worker for ``malloc``: None
    for the system's own; ``ValueError`` naming what was looked for when it is missing."""
    if malloc not in MALLOCS:
        raise ValueError(f"unknown allocator {malloc!r}; expected one of {', '.join(MALLOCS)}")
    if malloc == "system":
        return None
    import ctypes.util

    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                   "/usr/local/lib"):
        for name in _TCMALLOC_NAMES:
            if os.path.exists(os.path.join(folder, name)):
                return os.path.join(folder, name)
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if found:
        return found
    raise ValueError(f"--malloc tcmalloc: none of {', '.join(_TCMALLOC_NAMES)} found "
                     "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4)")

