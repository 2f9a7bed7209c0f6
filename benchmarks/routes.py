"""Which path and kernel each twin's ``auto`` takes on this machine, and why, for a few
typical calls: ``python -m benchmarks.routes``.  Asking builds nothing and runs nothing
(``functional.route``); the GPU session prints it beside its checks."""

from __future__ import annotations

import numpy as np


def _cases() -> list[tuple[str, dict]]:
    return [
        ("causal", dict(causal=True)),
        ("padding (kv_lengths)", dict(kv_lengths=[16, 9])),
        ("softcap 30", dict(causal=True, softcap=30.0)),
        ("return_weights", dict(return_weights=True)),
    ]


def rows() -> list[tuple[str, int, str, str, object]]:
    """(dtype, length, case, twin, Route) for every typical call, both twins."""
    import jax.numpy as jnp
    import torch

    from jax_attention import functional as jf
    from torch_attention import functional as tf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    found = []
    for dtype in ("float32", "bfloat16"):
        for seq in (16, 8192):
            q = rng.standard_normal((2, 4, seq, 64)).astype(np.float32)
            x_jax = jnp.asarray(q, dtype)
            x_torch = torch.from_numpy(q).to(device=device, dtype=getattr(torch, dtype))
            for name, options in _cases():
                if "kv_lengths" in options:
                    options = dict(options, kv_lengths=[seq, seq // 2])
                for twin, functional, x in (("jax", jf, x_jax), ("torch", tf, x_torch)):
                    found.append((dtype, seq, name, twin, functional.route(x, x, x, **options)))
    return found


def main() -> None:
    import jax
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"jax backend: {jax.default_backend()}; torch device: {device}")
    for dtype, seq, name, twin, route in rows():
        why = "; ".join(route.reasons) or "-"
        print(f"{dtype:9} S={seq:<5} {name:21} {twin:5} {route.path:9} {route.kernel:15} {why}")


if __name__ == "__main__":
    main()
