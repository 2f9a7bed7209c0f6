"""Data and tensor parallelism for the Flax modules: one training step of
``MultiHeadAttention`` on a (data=2, model=4) mesh of 8 simulated CPU devices against the
same step unsharded; the same for a module with flex attention's mods (the flex path).

Run as ``python -m parity_tests.distributed.jax_sharded_step`` (``XLA_FLAGS`` asks for 8
host devices before jax is imported); prints one JSON object: the largest differences of
loss, output, gradients and updated parameters, the shardings the parameters got, and
whether the compiled step all-reduces (the out_proj contraction over "model").
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"  # the 8 devices are the host's, also where a GPU is present

import json  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import jax_attention as ja  # noqa: E402
from attention_spec import mods  # noqa: E402

# Plain SGD: the update is a multiple of the gradient, so the parameters differ by the
# gradients' rounding.  (Adam divides by the gradient's size: on a parameter whose gradient
# is ~1e-8, float32 rounding of the gradient moves the update by ~1e-4, sharded or not.)
OPTIMIZER = optax.sgd(0.5)


def loss_fn(model: ja.MultiHeadAttention, x: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    out = model(x)  # (B, T, d_out), causal
    return jnp.mean(out * target), out  # linear in out: the gradient is target / size


@nnx.jit
def train_step(model: ja.MultiHeadAttention, optimizer: nnx.Optimizer, x: jax.Array, target: jax.Array) -> Any:
    (loss, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, target)
    optimizer.update(model, grads)
    return loss, out, grads


def run(model: ja.MultiHeadAttention, x: jax.Array, target: jax.Array) -> tuple[Any, ...]:
    optimizer = nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param)
    loss, out, grads = train_step(model, optimizer, x, target)
    return loss, out, nnx.to_pure_dict(grads), nnx.to_pure_dict(nnx.state(model, nnx.Param))


def largest(a: Any, b: Any) -> float:
    return max(float(np.abs(np.asarray(u) - np.asarray(w)).max()) for u, w in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def step_on_mesh(model: ja.MultiHeadAttention, x: jax.Array, target: jax.Array) -> tuple[Any, ...]:
    """The compiled step's HLO text, then ``run``'s results, on a (data=2, model=4) mesh:
    the parameters sharded as the modules declare, the batch by "data"."""
    # Auto axes (GSPMD propagates the shardings): jax >= 0.7 makes Explicit ones by default,
    # under which lax.map (the blockwise path's loop over (batch, head) slices) refuses a
    # sharded leading dimension.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    state = nnx.state(model)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), nnx.get_partition_spec(state))
    nnx.update(model, jax.device_put(state, shardings))
    batch = NamedSharding(mesh, PartitionSpec("data"))
    xs, ts = jax.device_put(x, batch), jax.device_put(target, batch)
    optimizer = nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param)
    hlo = str(train_step.lower(model, optimizer, xs, ts).compile().as_text())
    loss, out, grads = train_step(model, optimizer, xs, ts)
    return hlo, loss, out, nnx.to_pure_dict(grads), nnx.to_pure_dict(nnx.state(model, nnx.Param))


def main() -> None:
    jax.config.update("jax_numpy_rank_promotion", "raise")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 12, 32)), jnp.float32)  # (B, T, d_in)
    target = jnp.asarray(rng.standard_normal((8, 12, 32)), jnp.float32)

    def build(**options: Any) -> ja.MultiHeadAttention:
        return ja.MultiHeadAttention(d_in=32, d_out=32, context_length=None, dropout=0.0, num_heads=8,
                                     qkv_bias=True, rngs=nnx.Rngs(0), **options)

    single = run(build(), x, target)
    sharded = step_on_mesh(build(), x, target)
    # Flex attention's mods that stand for no named option (ALiBi over a prefix LM): the
    # flex path, one (example, head) slice at a time, with the batch sharded by "data"
    flex = {"causal": False, "score_mod": mods.alibi(2.0 ** (-np.arange(1, 9))), "mask_mod": mods.prefix_lm(5)}
    flex_single, flex_sharded = run(build(**flex), x, target), step_on_mesh(build(**flex), x, target)

    hlo, sharded = sharded[0], sharded[1:]
    out = sharded[1]
    report = {
        "loss": largest(single[0], sharded[0]),
        "output": largest(single[1], sharded[1]),
        "gradients": largest(single[2], sharded[2]),
        "parameters": largest(single[3], sharded[3]),
        "param_specs": {f"{layer}.{name}": str(value.sharding.spec)
                        for layer, params in sharded[3].items() for name, value in params.items()},
        "output_spec": str(out.sharding.spec),
        "all_reduce": "all-reduce" in hlo,
        "devices": len(jax.devices()),
        "flex": max(largest(a, b) for a, b in zip(flex_single, flex_sharded[1:], strict=True)),
        "flex_output_spec": str(flex_sharded[2].sharding.spec),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
