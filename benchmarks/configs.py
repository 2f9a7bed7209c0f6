"""What the benchmark measures: the attention shapes (``Config``), the systems, the
FLOP count, and the modes (full, quick, cpu-target, cpu-sweep).

Framework-free: nothing here imports JAX or PyTorch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The systems, in the order of every table and plot.  The module systems are multi-head
# self-attention with d_in = d_out = heads * head_dim (projections included).
MODULE_SYSTEMS = (
    "ours-jax-reference",  # jax_attention.MultiHeadAttention(implementation="reference")
    "ours-jax-fused",  # ... implementation="fused" (jax.nn.dot_product_attention)
    "ours-jax-blockwise",  # ... implementation="blockwise"
    "ours-jax-auto",  # ... implementation="auto"
    "flax-nnx-mha",  # flax.nnx.MultiHeadAttention with its defaults
    "ours-torch-reference",  # torch_attention.MultiHeadAttention(implementation="reference")
    "ours-torch-sdpa",  # ... implementation="fused" (F.scaled_dot_product_attention)
    "torch-nn-mha",  # torch.nn.MultiheadAttention(batch_first=True)
    "ours-torch-compile",  # torch.compile of ours-torch-sdpa
)
# The core systems time the attention function alone on q, k, v of shape (B, H, S, D)
# (or the kernel's own layout): no projections, so their TFLOP/s are the kernel's.
CORE_SYSTEMS = (
    "core-jax-fused",  # jax_attention.functional.dot_product_attention(implementation="fused", layout="bshd")
    "core-jax-cudnn",  # jax.nn.dot_product_attention(implementation="cudnn") on (B, S, H, D): what "fused" wraps
    "core-flax",  # flax.nnx.dot_product_attention, flax.nnx.MultiHeadAttention's default
    "core-torch-fused",  # torch_attention.functional.dot_product_attention(implementation="fused")
    "core-torch-sdpa-flash",  # F.scaled_dot_product_attention restricted to one backend each
    "core-torch-sdpa-cudnn",
    "core-torch-sdpa-efficient",
)
SYSTEMS = MODULE_SYSTEMS + CORE_SYSTEMS
COMPILE_SYSTEM = "ours-torch-compile"

# Timed-run ratios printed under every table (when both systems were measured):
# numerator / denominator of the median forward time, below 1.0 = the numerator is faster.
RATIOS = (
    ("ours-jax-auto", "ours-torch-sdpa"), ("ours-jax-auto", "flax-nnx-mha"), ("ours-jax-auto", "ours-jax-blockwise"),
    ("ours-jax-fused", "ours-torch-sdpa"), ("ours-jax-fused", "flax-nnx-mha"),
    ("core-jax-fused", "core-torch-fused"), ("core-jax-fused", "core-jax-cudnn"),
)

BACKWARD_FACTOR = 2.5  # backward FLOPs per forward FLOP (the usual FlashAttention count)


def flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> int:
    """Forward FLOPs of the attention core: two (S x S x D) matmuls per head, 2 FLOPs per
    multiply-add, so 4·B·H·S²·D; a causal mask halves it (the masked half is not work)."""
    total = 4 * batch * heads * seq * seq * head_dim
    return total // 2 if causal else total


def fwd_bwd_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> int:
    """Forward plus backward FLOPs of the attention core: (1 + 2.5) x the forward."""
    return int(flops(batch, heads, seq, head_dim, causal) * (1 + BACKWARD_FACTOR))


def is_core(system: str) -> bool:
    """Whether ``system`` times the attention function alone (no projections)."""
    return system.startswith("core-")


def projection_flops(batch: int, seq: int, d_model: int) -> int:
    """Forward FLOPs of the four d_model x d_model projections (query, key, value, out)
    that a module-level measurement includes but the attention-core count leaves out."""
    return 4 * 2 * batch * seq * d_model * d_model


@dataclass(frozen=True)
class Config:
    """One attention shape.  ``systems`` restricts which systems run it (None = all)."""

    batch: int
    seq: int
    heads: int
    head_dim: int
    causal: bool
    dtype: str  # "float32", "bfloat16" or "float16"
    systems: tuple[str, ...] | None = None

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def label(self) -> str:
        """A readable id, e.g. ``B4-S1024-H8-D64-causal-float32``."""
        mask = "causal" if self.causal else "full"
        return f"B{self.batch}-S{self.seq}-H{self.heads}-D{self.head_dim}-{mask}-{self.dtype}"

    @property
    def group(self) -> tuple[int, bool, str]:
        """Configs that differ only in sequence length (one subplot): head_dim, causal, dtype."""
        return (self.head_dim, self.causal, self.dtype)

    def runs_system(self, system: str) -> bool:
        return self.systems is None or system in self.systems

    def flops(self) -> int:
        return flops(self.batch, self.heads, self.seq, self.head_dim, self.causal)

    def fwd_bwd_flops(self) -> int:
        return fwd_bwd_flops(self.batch, self.heads, self.seq, self.head_dim, self.causal)

    def projection_flops(self) -> int:
        return projection_flops(self.batch, self.seq, self.d_model)

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["systems"] = None if self.systems is None else list(self.systems)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Config:
        systems = data.get("systems")
        return cls(**{**data, "systems": None if systems is None else tuple(systems)})


# --------------------------------------------------------------------------- modes

FULL_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
FULL_TOKENS = 16384  # batch * seq
FULL_WIDTH = 2048  # heads * head_dim
# The systems measured at S = 65536 (B1 H16 D128, bfloat16): the kernels, and the
# modules that might fit (the reference and Flax's module, S x S, are expected to run out
# of memory; the record says so).
LONG_SEQ_SYSTEMS = (
    "ours-jax-fused", "ours-jax-reference", "flax-nnx-mha", "ours-torch-sdpa", *CORE_SYSTEMS,
)
# Systems that the sweep runs in bfloat16 only (float16 repeats what they show) and
# torch.compile, whose first call compiles for tens of seconds, only at head_dim 128.
BFLOAT16_ONLY = ("ours-jax-reference", "ours-jax-blockwise", "ours-jax-auto", "ours-torch-reference")


def _full_systems(dtype: str, head_dim: int) -> tuple[str, ...]:
    return tuple(
        s for s in SYSTEMS
        if (dtype == "bfloat16" or s not in BFLOAT16_ONLY + (COMPILE_SYSTEM,))
        and (head_dim == 128 or s != COMPILE_SYSTEM)
    )


def full_configs() -> list[Config]:
    """The GPU sweep (issue 12): S in 512..16k with B·S = 16k tokens and H·D = 2048,
    head_dim 128 and 64, bfloat16 and float16, causal and not; then S = 64k (B=1, H=16,
    head_dim 128, bfloat16, causal and not) for ``LONG_SEQ_SYSTEMS``.  The issue's
    target group (bfloat16, head_dim 128) comes first, so that a run cut short by its
    time budget has measured it."""
    configs = [
        Config(FULL_TOKENS // seq, seq, FULL_WIDTH // head_dim, head_dim, causal, dtype,
               systems=_full_systems(dtype, head_dim))
        for dtype in ("bfloat16", "float16")
        for head_dim in (128, 64)
        for causal in (True, False)
        for seq in FULL_SEQS
    ]
    configs += [
        Config(1, 65536, 16, 128, causal, "bfloat16", systems=LONG_SEQ_SYSTEMS)
        for causal in (True, False)
    ]
    return configs


def quick_configs() -> list[Config]:
    """A CPU run of about a minute: S 256 and 512, B·S = 1024 tokens, H·D = 256."""
    return [Config(1024 // seq, seq, 4, 64, True, "float32") for seq in (256, 512)]


def cpu_target_configs() -> list[Config]:
    """The issue's CPU target: B=4, H=8, S=1024, head_dim 64, float32, causal."""
    return [Config(4, 1024, 8, 64, True, "float32")]


# The CPU sweep (issue 10): float32, causal, head_dim 64.  The S x S systems (Flax's and
# torch's own multi-head attention, which materialise the weights) stop at S = 4096: at
# S = 16384 one head's float32 weights alone are 1 GiB, and B1 H4 needs 4 of them at once.
CPU_SWEEP_SHAPES = ((32, 128, 4), (4, 1024, 8), (1, 4096, 8), (1, 16384, 4), (1, 32768, 4))
CPU_SWEEP_SYSTEMS = ("ours-jax-auto", "ours-jax-blockwise", "ours-torch-sdpa", "flax-nnx-mha", "torch-nn-mha")
QUADRATIC_SYSTEMS = ("flax-nnx-mha", "torch-nn-mha")


def cpu_sweep_configs() -> list[Config]:
    return [
        Config(b, s, h, 64, True, "float32",
               systems=None if s <= 4096 else tuple(x for x in CPU_SWEEP_SYSTEMS if x not in QUADRATIC_SYSTEMS))
        for b, s, h in CPU_SWEEP_SHAPES
    ]


@dataclass(frozen=True)
class Mode:
    """A named benchmark run: its shapes, systems, timed runs and whether to time the
    backward pass."""

    name: str
    configs: tuple[Config, ...]
    systems: tuple[str, ...]
    runs: int
    backward: bool
    warmup: int = 2  # untimed calls after the first (compiling) call
    # Floors in seconds: warm-up goes on until it has lasted warmup_s, and the timed runs
    # are as many as fill timed_s (at least `runs`, at most measure.MAX_RUNS), so that a
    # call of milliseconds is the median of tens of samples rather than of five.
    warmup_s: float = 0.0
    timed_s: float = 0.0
    # One worker process per (config, system), the workers of a config alive together and
    # timed in turns (a round is one run of each; runner._run_in_turns): each case's
    # resident high-water mark is its own, and a slow spell of the host hits every system.
    process_per_case: bool = False


def mode(name: str, *, with_compile: bool = False) -> Mode:
    """The mode ``"full"``, ``"quick"``, ``"cpu-target"`` or ``"cpu-sweep"``.

    ``with_compile`` adds ours-torch-compile to quick mode (the others decide themselves:
    the full run has it, the CPU target does not)."""
    if name == "full":
        # 10 samples, each at least measure.SAMPLE_S of back-to-back calls: a lent GPU's
        # time is short, and a sample of many calls is steadier than a single call.
        return Mode(name, tuple(full_configs()), SYSTEMS, runs=10, backward=True)
    if name == "quick":
        systems = tuple(s for s in MODULE_SYSTEMS if with_compile or s != COMPILE_SYSTEM)
        return Mode(name, tuple(quick_configs()), systems, runs=5, backward=False, warmup=1)
    if name == "cpu-target":
        systems = (
            "ours-jax-auto", "ours-jax-blockwise", "ours-jax-reference", "ours-jax-fused",
            "ours-torch-sdpa", "ours-torch-reference", "flax-nnx-mha", "torch-nn-mha",
        )
        return Mode(name, tuple(cpu_target_configs()), systems, runs=20, backward=False)
    if name == "cpu-sweep":
        return Mode(name, tuple(cpu_sweep_configs()), CPU_SWEEP_SYSTEMS, runs=5, backward=True, warmup=1,
                    process_per_case=True, warmup_s=0.5, timed_s=2.0)
    raise ValueError(f"unknown mode {name!r}; expected 'full', 'quick', 'cpu-target' or 'cpu-sweep'")
