"""Each benchmarked system, built for one ``Config`` as a ``Case``: a module with its
weights and a random-normal input, ready to run forward or forward+backward.

A case's ``forward()`` / ``forward_backward()`` return only once the device is done
(``block_until_ready`` / ``torch.cuda.synchronize``), so a host clock around them times
the work.  Frameworks are imported inside the builders: a benchmark worker process
imports only the framework of the system it runs.

Conventions shared by every system: d_in = d_out = heads * head_dim (the projections are
part of what is timed), dropout 0, eval mode, no gradient tracking for the forward; the
backward is the gradient of sum(out) (accumulated in float32) with respect to the input
and every parameter.  Parameters are created in the benchmark dtype, so that bfloat16
configs run bfloat16 throughout.

Each case also gives its forward's output (``output()``: the first example's, as NumPy)
and the float64 oracle's verdict on it (``oracle(out)``: the output rows and the oracle's
at them, ``benchmarks/oracle_check.py``): a module's from its own weights and input, every
head, the rows ``oracle_check.rows`` picks; a core's at its first and last head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from benchmarks import oracle_check
from benchmarks.configs import Config

SEED = 0


class Case(Protocol):
    """``forward(repeat)`` / ``forward_backward(repeat)`` make ``repeat`` calls back to
    back and return when the device has finished the last (one host clock around several
    short GPU calls, so that launch and synchronisation costs are not counted per call)."""

    def forward(self, repeat: int = 1) -> None: ...

    def forward_backward(self, repeat: int = 1) -> None: ...

    def memory(self) -> dict[str, Any]:
        """``peak_mem_bytes`` and ``peak_mem_source`` of the calls made so far (None on CPU)."""
        ...

    def output(self) -> np.ndarray:
        """One forward call's output for the first example (batch 0), as NumPy."""
        ...

    def oracle(self, out: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
        """(the rows of ``out`` checked, the float64 oracle's at them, what was checked)."""
        ...


Oracle = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, str]]


def _float64(array: Any) -> np.ndarray:
    """A framework's array (a parameter, bfloat16 included) as float64 NumPy."""
    if hasattr(array, "detach"):  # torch
        array = array.detach().cpu().float()
    return np.asarray(np.asarray(array).astype(np.float32), np.float64)


def module_oracle(config: Config, x0: Any, weights: dict[str, Any]) -> Oracle:
    """The oracle of a multi-head self-attention case: ``x0`` its first example's input,
    ``weights`` its projections as ``x @ w + b`` (``oracle_check.module_rows``)."""

    def check(out: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
        at = oracle_check.rows(config.seq, config.seq, config.heads, config.causal)
        want = oracle_check.module_rows(
            _float64(x0), {name: None if w is None else _float64(w) for name, w in weights.items()},
            heads=config.heads, kv_heads=config.heads, head_dim=config.head_dim, causal=config.causal, at=at)
        return out[at], want, f"batch 0, every head, {len(at)} of {config.seq} rows"

    return check


def core_oracle(config: Config, q0: Any, k0: Any, v0: Any, *, bshd: bool) -> Oracle:
    """The oracle of an attention core: q0, k0, v0 the first example's, (S, H, D) where
    ``bshd`` else (H, S, D); its first and last head are checked (heads are independent)."""
    heads = sorted({0, config.heads - 1})

    def by_head(a: Any) -> np.ndarray:
        a = _float64(a)
        return (a.transpose(1, 0, 2) if bshd else a)[heads]  # (checked heads, S, D)

    def check(out: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
        at = oracle_check.rows(config.seq, config.seq, len(heads), config.causal)
        want = oracle_check.attention_rows(by_head(q0), by_head(k0), by_head(v0), at,
                                           scale=1 / np.sqrt(config.head_dim), causal=config.causal)
        return by_head(out)[:, at], want, f"batch 0, heads {heads}, {len(at)} of {config.seq} rows"

    return check


def framework_of(system: str) -> str:
    return "torch" if "torch" in system else "jax"


def build(system: str, config: Config) -> Case:
    """The case of ``system`` (a name from ``configs.SYSTEMS``) at ``config``."""
    if system not in _BUILDERS:
        raise ValueError(f"unknown system {system!r}; expected one of {', '.join(_BUILDERS)}")
    return _BUILDERS[system](config)


# =========================================================================== JAX


def configure_jax() -> None:
    """float32 matmuls at full precision (JAX's GPU/TPU default is lower), as the
    PyTorch side with TF32 off.  The library's own modules ask for "highest" anyway;
    this makes flax.nnx.MultiHeadAttention's default (precision=None) match."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


def _ours_jax(config: Config, implementation: str) -> Case:
    import jax_attention as ja

    def make(rngs: Any, dtype: Any) -> Any:
        return ja.MultiHeadAttention(
            config.d_model, config.d_model, config.seq, 0.0, config.heads,
            causal=config.causal, implementation=implementation, param_dtype=dtype, rngs=rngs,
        )

    def weights(m: Any) -> dict[str, Any]:
        def get(layer: str, name: str) -> Any:
            param = getattr(getattr(m, layer), name, None)
            return None if param is None else param[...]

        return {f"{w}{kind}": get(layer, name) for kind, layer in
                (("q", "W_query"), ("k", "W_key"), ("v", "W_value"), ("o", "out_proj"))
                for w, name in (("w", "kernel"), ("b", "bias"))}

    return jax_module_case(config, make, lambda module, x: module(x), weights)


def _flax_mha(config: Config) -> Case:
    import jax.numpy as jnp
    from flax import nnx

    def make(rngs: Any, dtype: Any) -> Any:
        # Flax's defaults, except that the parameters take the benchmark dtype (with the
        # default float32 parameters a bfloat16 input would be promoted to float32).
        return nnx.MultiHeadAttention(
            config.heads, config.d_model, decode=False, param_dtype=dtype, rngs=rngs,
        )

    def call(module: Any, x: Any) -> Any:
        if not config.causal:
            return module(x)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]), dtype=jnp.bool_)  # (B, 1, S, S)
        return module(x, mask=mask)

    def weights(m: Any) -> dict[str, Any]:
        width = config.heads * config.head_dim  # kernels (E, H, D) and out (H, D, E): heads flattened
        found = {f"w{k}": getattr(m, layer).kernel[...].reshape(config.d_model, width)
                 for k, layer in (("q", "query"), ("k", "key"), ("v", "value"))}
        found |= {f"b{k}": getattr(m, layer).bias[...].reshape(width) for k, layer in
                  (("q", "query"), ("k", "key"), ("v", "value"))}
        return {**found, "wo": m.out.kernel[...].reshape(width, config.d_model), "bo": m.out.bias[...]}

    return jax_module_case(config, make, call, weights)


def jax_module_case(config: Config, make: Callable[[Any, Any], Any], call: Callable[[Any, Any], Any],
                    weights: Callable[[Any], dict[str, Any]]) -> Case:
    """A Flax NNX module as pure jitted functions of (params, rest, x): the forward, and
    the gradient of sum(out) with respect to params and x; ``weights(module)`` its
    projections for the oracle (``module_oracle``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    dtype = jnp.dtype(config.dtype)
    module = make(nnx.Rngs(SEED), dtype)
    module.eval()
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]

    def apply(params: Any, rest: Any, x: Any) -> Any:
        return call(nnx.merge(graphdef, params, rest), x)

    x = jax.random.normal(jax.random.key(SEED), (config.batch, config.seq, config.d_model), dtype)
    return CompiledPair(apply, (params, rest, x), argnums=(0, 2), oracle=module_oracle(config, x[0], weights(module)))


def _jax_core(config: Config, system: str) -> Case:
    """An attention function alone on random q, k, v of shape (B, S, H, D): the layout that
    ``jax.nn.dot_product_attention`` (cuDNN) and Flax's take, and ours with
    ``layout="bshd"``, so that no core pays a transpose that another does not."""
    import jax
    import jax.numpy as jnp

    if system == "core-jax-fused":
        import jax_attention as ja

        def attend(q: Any, k: Any, v: Any) -> Any:
            return ja.functional.dot_product_attention(q, k, v, causal=config.causal, implementation="fused",
                                                       layout="bshd")

        shape = (config.batch, config.seq, config.heads, config.head_dim)
    elif system == "core-jax-cudnn":

        def attend(q: Any, k: Any, v: Any) -> Any:
            return jax.nn.dot_product_attention(q, k, v, is_causal=config.causal, implementation="cudnn")

        shape = (config.batch, config.seq, config.heads, config.head_dim)
    else:  # core-flax
        from flax import nnx

        def attend(q: Any, k: Any, v: Any) -> Any:
            mask = None
            if config.causal:
                mask = nnx.make_causal_mask(jnp.ones(q.shape[:2]), dtype=jnp.bool_)  # (B, 1, S, S)
            return nnx.dot_product_attention(q, k, v, mask=mask)

        shape = (config.batch, config.seq, config.heads, config.head_dim)
    keys = jax.random.split(jax.random.key(SEED), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.dtype(config.dtype)) for key in keys)
    return CompiledPair(attend, (q, k, v), argnums=(0, 1, 2), oracle=core_oracle(config, q[0], k[0], v[0], bshd=True))


class CompiledPair:
    """A JAX case: ``apply(*args)`` jitted, and the gradient of sum(apply(*args))
    (accumulated in float32) with respect to ``argnums``.  Each is compiled ahead of time
    on its first call (which the caller times as the compile time)."""

    def __init__(self, apply: Callable[..., Any], args: tuple[Any, ...], argnums: tuple[int, ...], oracle: Oracle):
        import jax
        import jax.numpy as jnp

        def loss(*args: Any) -> Any:
            return jnp.sum(apply(*args), dtype=jnp.float32)

        self._functions = {"forward": jax.jit(apply), "forward_backward": jax.jit(jax.grad(loss, argnums=argnums))}
        self._compiled: dict[str, Any] = {}
        self._args = args
        self.oracle = oracle

    def output(self) -> np.ndarray:
        self._run("forward", 0)  # compiled (where it is not yet)
        return np.asarray(self._compiled["forward"](*self._args)[0])

    def forward(self, repeat: int = 1) -> None:
        self._run("forward", repeat)

    def forward_backward(self, repeat: int = 1) -> None:
        self._run("forward_backward", repeat)

    def _run(self, name: str, repeat: int) -> None:
        import jax

        if name not in self._compiled:
            self._compiled[name] = self._functions[name].lower(*self._args).compile()
        out = None
        for _ in range(repeat):
            out = self._compiled[name](*self._args)
        jax.block_until_ready(out)

    def memory(self) -> dict[str, Any]:
        """On GPU/TPU, the peak that XLA's buffer assignment plans for the largest of the
        compiled functions (arguments, outputs and temporaries): per case, where the
        allocator's ``peak_bytes_in_use`` only ever grows within a process.  On CPU XLA
        does not report temporaries, so nothing."""
        import jax

        if jax.default_backend() == "cpu":
            return {"peak_mem_bytes": None, "peak_mem_source": None}
        peaks = []
        for compiled in self._compiled.values():
            stats = compiled.memory_analysis()
            planned = (
                stats.argument_size_in_bytes + stats.output_size_in_bytes
                + stats.temp_size_in_bytes - stats.alias_size_in_bytes
            )
            peaks.append(max(getattr(stats, "peak_memory_in_bytes", 0) or 0, planned))
        return {"peak_mem_bytes": max(peaks, default=None), "peak_mem_source": "xla-compiled-memory-analysis"}


# =========================================================================== PyTorch


def configure_torch() -> None:
    """float32 matmuls at full precision: TF32 off for matmuls and cuDNN."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _ours_torch(config: Config, implementation: str, *, compiled: bool = False) -> Case:
    import torch

    import torch_attention as ta

    def make(dtype: Any, device: str) -> Any:
        return ta.MultiHeadAttention(
            config.d_model, config.d_model, config.seq, 0.0, config.heads,
            causal=config.causal, implementation=implementation, dtype=dtype, device=device,
        )

    def weights(m: Any) -> dict[str, Any]:
        return {f"{w}{kind}": None if getattr(getattr(m, layer), name) is None else
                (getattr(m, layer).weight.T if w == "w" else getattr(m, layer).bias)
                for kind, layer in (("q", "W_query"), ("k", "W_key"), ("v", "W_value"), ("o", "out_proj"))
                for w, name in (("w", "weight"), ("b", "bias"))}

    if not compiled:
        return TorchCase(config, make, lambda module, x: module(x), weights)
    # A fresh Dynamo state per case: otherwise each new shape counts against the
    # recompile limit of the one forward() code object, and after a second shape Dynamo
    # switches to dynamic shapes.  dynamic=False keeps every graph static.
    torch._dynamo.reset()
    return TorchCase(config, make, lambda module, x: module(x), weights, wrap=lambda m: torch.compile(m, dynamic=False))


def _torch_mha(config: Config) -> Case:
    import torch

    def make(dtype: Any, device: str) -> Any:
        return torch.nn.MultiheadAttention(
            config.d_model, config.heads, batch_first=True, dtype=dtype, device=device
        )

    blocked = None  # nn.MultiheadAttention's polarity: True = may not attend
    if config.causal:
        blocked = torch.ones(config.seq, config.seq, dtype=torch.bool, device=torch_device()).triu(1)

    def call(module: Any, x: Any) -> Any:
        out, _ = module(x, x, x, attn_mask=blocked, is_causal=config.causal, need_weights=False)
        return out

    def weights(m: Any) -> dict[str, Any]:
        wq, wk, wv = m.in_proj_weight.chunk(3)  # (3E, E): the query's rows, then the key's and value's
        bq, bk, bv = m.in_proj_bias.chunk(3)
        return {"wq": wq.T, "wk": wk.T, "wv": wv.T, "bq": bq, "bk": bk, "bv": bv, "wo": m.out_proj.weight.T,
                "bo": m.out_proj.bias}

    return TorchCase(config, make, call, weights)


class TorchCase:
    """A PyTorch module and an input on the GPU if there is one, else the CPU."""

    def __init__(
        self,
        config: Config,
        make: Callable[[Any, str], Any],
        call: Callable[[Any, Any], Any],
        weights: Callable[[Any], dict[str, Any]],
        *,
        wrap: Callable[[Any], Any] | None = None,
    ):
        import torch

        self._device = torch_device()
        dtype = getattr(torch, config.dtype)
        torch.manual_seed(SEED)
        self._module = make(dtype, self._device).eval()
        self._run_module = self._module if wrap is None else wrap(self._module)
        self._call = call
        shape = (config.batch, config.seq, config.d_model)
        self._x = torch.randn(shape, dtype=dtype, device=self._device)
        self._x_grad = self._x.detach().requires_grad_(True)  # the same storage
        self.oracle = module_oracle(config, self._x[0], weights(self._module))
        if self._device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def output(self) -> np.ndarray:
        import torch

        with torch.no_grad():
            return _float64(self._call(self._run_module, self._x)[0])

    def _sync(self) -> None:
        _sync(self._device)

    def forward(self, repeat: int = 1) -> None:
        import torch

        with torch.no_grad():
            for _ in range(repeat):
                self._call(self._run_module, self._x)
        self._sync()

    def forward_backward(self, repeat: int = 1) -> None:
        for _ in range(repeat):
            self._module.zero_grad(set_to_none=True)
            self._x_grad.grad = None
            out = self._call(self._run_module, self._x_grad)
            out.float().sum().backward()
        self._sync()

    def memory(self) -> dict[str, Any]:
        return _torch_memory(self._device)


_SDPA_BACKENDS = {"core-torch-sdpa-flash": "FLASH_ATTENTION", "core-torch-sdpa-cudnn": "CUDNN_ATTENTION",
                  "core-torch-sdpa-efficient": "EFFICIENT_ATTENTION"}


def _torch_core(config: Config, system: str) -> Case:
    """An attention function alone on random q, k, v of shape (B, H, S, D): ours, or
    ``F.scaled_dot_product_attention`` held to one backend (``sdpa_kernel``; a backend
    that cannot run the case raises, and the case records the error)."""
    import contextlib

    import torch.nn.functional as F

    if system == "core-torch-fused":
        import torch_attention as ta

        def attend(q: Any, k: Any, v: Any) -> Any:
            return ta.functional.dot_product_attention(q, k, v, causal=config.causal, implementation="fused")

        backend: Callable[[], Any] = contextlib.nullcontext
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        chosen = getattr(SDPBackend, _SDPA_BACKENDS[system])

        def attend(q: Any, k: Any, v: Any) -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=config.causal)

        def backend() -> Any:
            return sdpa_kernel(chosen)

    return TorchCoreCase(config, attend, backend)


class TorchCoreCase:
    """q, k, v on the GPU if there is one; the backward is the gradient of sum(out)
    with respect to all three."""

    def __init__(self, config: Config, attend: Callable[..., Any], backend: Callable[[], Any]):
        import torch

        self._device = torch_device()
        dtype = getattr(torch, config.dtype)
        generator = torch.Generator(device=self._device).manual_seed(SEED)
        shape = (config.batch, config.heads, config.seq, config.head_dim)
        self._qkv = [torch.randn(shape, dtype=dtype, device=self._device, generator=generator) for _ in range(3)]
        self._qkv_grad = [t.detach().requires_grad_(True) for t in self._qkv]
        self._attend, self._backend = attend, backend
        self.oracle = core_oracle(config, *(t[0] for t in self._qkv), bshd=False)
        if self._device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def forward(self, repeat: int = 1) -> None:
        import torch

        with torch.no_grad(), self._backend():
            for _ in range(repeat):
                self._attend(*self._qkv)
        _sync(self._device)

    def output(self) -> np.ndarray:
        import torch

        with torch.no_grad(), self._backend():
            return _float64(self._attend(*self._qkv)[0])

    def forward_backward(self, repeat: int = 1) -> None:
        with self._backend():
            for _ in range(repeat):
                for t in self._qkv_grad:
                    t.grad = None
                self._attend(*self._qkv_grad).float().sum().backward()
        _sync(self._device)

    def memory(self) -> dict[str, Any]:
        return _torch_memory(self._device)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _torch_memory(device: str) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return {"peak_mem_bytes": None, "peak_mem_source": None}
    return {
        "peak_mem_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_mem_source": "torch.cuda.max_memory_allocated",
    }


_BUILDERS: dict[str, Callable[[Config], Case]] = {
    "ours-jax-reference": lambda c: _ours_jax(c, "reference"),
    "ours-jax-fused": lambda c: _ours_jax(c, "fused"),
    "ours-jax-blockwise": lambda c: _ours_jax(c, "blockwise"),
    "ours-jax-auto": lambda c: _ours_jax(c, "auto"),
    "flax-nnx-mha": _flax_mha,
    "ours-torch-reference": lambda c: _ours_torch(c, "reference"),
    "ours-torch-sdpa": lambda c: _ours_torch(c, "fused"),
    "torch-nn-mha": _torch_mha,
    "ours-torch-compile": lambda c: _ours_torch(c, "fused", compiled=True),
    "core-jax-fused": lambda c: _jax_core(c, "core-jax-fused"),
    "core-jax-cudnn": lambda c: _jax_core(c, "core-jax-cudnn"),
    "core-flax": lambda c: _jax_core(c, "core-flax"),
    "core-torch-fused": lambda c: _torch_core(c, "core-torch-fused"),
    **{name: functools.partial(_torch_core, system=name) for name in _SDPA_BACKENDS},
}
