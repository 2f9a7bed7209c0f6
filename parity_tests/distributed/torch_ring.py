"""One rank of a PyTorch gloo job, run by ``test_distributed.py`` as WORLD subprocesses:

``python -m parity_tests.distributed.torch_ring RANK WORLD INIT_FILE OUT_DIR [TWINS_IN.npz]``

Every rank writes ``OUT_DIR/rank{RANK}.json``:
- ``cases``: for each case of ``CASES`` with ``devices == WORLD`` (the default group) and,
  in a world of 4, ``devices == 2`` (on the subgroups {0, 1} and {2, 3}): the largest
  differences between this rank's part of the ring's output and gradients and the
  single-process ``dot_product_attention`` (reference path).
- world 2: ``ddp``, ``MultiHeadAttention`` under ``DistributedDataParallel``, each rank
  half the batch, against the single-process gradient and SGD step.
- world 4, rank 0: ``errors``, the texts of the bad calls that ``jax_ring`` makes too.
Cases with sinks also report ``dsinks`` (the whole gradient, on every rank); rope cases
compare with ``dot_product_attention`` on ``apply_rope``d q and k.
With ``TWINS_IN`` (world 4), rank 0 also writes ``OUT_DIR/twins.npz``: the ring's outputs
and gradients, gathered, in natural order, for ``twin_cases``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch_attention as ta
from parity_tests.distributed import (
    CASES,
    ROPE,
    Case,
    case_inputs,
    case_positions,
    oracle_error,
    oracle_output,
    twin_cases,
)
from torch_attention.functional import apply_rope, dot_product_attention
from torch_attention.parallel import from_zigzag, ring_attention, to_zigzag


def local_part(t: torch.Tensor, case: Case, rank: int) -> torch.Tensor:
    """This member's slice of the sequence (dim 2) in the case's layout."""
    if case.layout == "zigzag":
        t = to_zigzag(t, case.devices)
    return t.chunk(case.devices, dim=2)[rank].contiguous()


def ring_results(case: Case, inputs: dict[str, np.ndarray], group: Any, rank: int) -> dict[str, torch.Tensor]:
    """This member's out, dq, dk, dv (and the whole dsinks) from the ring."""
    q, k, v = (local_part(torch.from_numpy(inputs[n]), case, rank).requires_grad_() for n in ("q", "k", "v"))
    leaves = [q, k, v]
    options: dict[str, Any] = {}
    if case.sinks is not None:
        options["sinks"] = torch.from_numpy(inputs["sinks"]).requires_grad_()
        leaves.append(options["sinks"])
    if case.rope is not None:
        options["rope"] = ROPE
    if case.rope == "given":  # this member's rows' positions, in its layout: (B, T/N)
        options["positions"] = local_part(torch.from_numpy(inputs["positions"])[:, None, :, None], case, rank)[:, 0, :, 0]
    out = ring_attention(q, k, v, group=group, causal=case.causal, kv_lengths=case.lengths, layout=case.layout,
                         **options)
    out.backward(local_part(torch.from_numpy(inputs["d_out"]), case, rank))
    return dict(zip(case.names, (out.detach(), *grads(*leaves)), strict=True))


def grads(*leaves: torch.Tensor) -> list[torch.Tensor]:
    found = [t.grad for t in leaves]
    assert all(g is not None for g in found)
    return [g for g in found if g is not None]


def reference_results(case: Case, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """out and the gradients of single-process ``dot_product_attention`` (reference path) on
    the whole sequences, q and k turned by ``apply_rope`` first in rope cases."""
    q, k, v = (torch.from_numpy(inputs[n]).requires_grad_() for n in ("q", "k", "v"))
    leaves = [q, k, v]
    sinks = None
    if case.sinks is not None:
        sinks = torch.from_numpy(inputs["sinks"]).requires_grad_()
        leaves.append(sinks)
    q_in, k_in = q, k
    if case.rope is not None:
        positions = torch.from_numpy(case_positions(case, inputs))
        q_in, k_in = apply_rope(q, positions, ROPE), apply_rope(k, positions, ROPE)
    out = dot_product_attention(q_in, k_in, v, causal=case.causal, kv_lengths=case.lengths, sinks=sinks,
                                implementation="reference")
    assert isinstance(out, torch.Tensor)
    out.backward(torch.from_numpy(inputs["d_out"]))
    return dict(zip(case.names, (out.detach(), *grads(*leaves)), strict=True))


def check_case(case: Case, group: Any, rank: int) -> dict[str, Any]:
    inputs = case_inputs(case)
    ring = ring_results(case, inputs, group, rank)
    ref = reference_results(case, inputs)
    errors = {n: float((ring[n] - (ref[n] if n == "dsinks" else local_part(ref[n], case, rank))).abs().max())
              for n in case.names}
    scales = {n: float(ref[n].abs().max()) for n in case.names}
    finite = all(bool(torch.isfinite(t).all()) for t in ring.values())
    expected = local_part(torch.from_numpy(oracle_output(case, inputs)), case, rank).numpy()
    return {"id": case.id, "errors": errors, "scales": scales, "finite": finite,
            "oracle": oracle_error(ring["out"].numpy(), expected)}


def gathered(t: torch.Tensor, case: Case) -> np.ndarray:
    """Every rank's part, in natural order (called on every rank of the world)."""
    parts = [torch.empty_like(t) for _ in range(case.devices)]
    dist.all_gather(parts, t.contiguous())
    whole = torch.cat(parts, dim=2)
    return (from_zigzag(whole, case.devices) if case.layout == "zigzag" else whole).numpy()


def twins(path: str, out_dir: str, rank: int) -> None:
    with np.load(path) as stored:
        data = dict(stored)
    results = {}
    for case in twin_cases():
        inputs = {n: data[f"{case.id}/{n}"] for n in ("q", "k", "v", "d_out", "sinks", "positions")
                  if f"{case.id}/{n}" in data}
        for n, t in ring_results(case, inputs, None, rank).items():
            results[f"{case.id}/{n}"] = t.numpy() if n == "dsinks" else gathered(t, case)
    if rank == 0:
        np.savez(f"{out_dir}/twins.npz", **results)  # type: ignore[arg-type]


def ddp(rank: int) -> dict[str, float]:
    """Gradients and one SGD step of ``MultiHeadAttention`` under DDP (half the batch per
    rank, DDP averages) against one process on the whole batch."""
    torch.manual_seed(0)
    model = ta.MultiHeadAttention(d_in=16, d_out=16, context_length=None, dropout=0.0, num_heads=4, qkv_bias=True)
    single = copy.deepcopy(model)
    rng = np.random.default_rng(1)
    x, target = (torch.from_numpy(rng.standard_normal((4, 12, 16)).astype(np.float32)) for _ in range(2))

    (single(x) * target).mean().backward()
    wrapped = DistributedDataParallel(model)
    (wrapped(x.chunk(2)[rank]) * target.chunk(2)[rank]).mean().backward()
    names = [n for n, _ in model.named_parameters()]
    pairs = zip(grads(*model.parameters()), grads(*single.parameters()), strict=True)
    assert names == [n for n, _ in single.named_parameters()]
    grad_error = max(float((a - b).abs().max()) for a, b in pairs)
    for m in (model, single):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    params = {n: p.detach() for n, p in model.named_parameters()}
    param_error = max(float((params[n] - p.detach()).abs().max()) for n, p in single.named_parameters())
    return {"gradients": grad_error, "parameters": param_error, "world": dist.get_world_size()}


def error_texts() -> dict[str, str]:
    """The bad calls of ``jax_ring.error_texts`` that a ring of 4 ranks can make."""
    x = torch.zeros(1, 2, 3, 8)  # 3 positions per rank: S = 12
    long = torch.zeros(1, 2, 12, 8)
    calls = {
        "layout": lambda: ring_attention(x, x, x, layout="zig"),
        "zigzag_length": lambda: ring_attention(x, x, x, layout="zigzag"),
        "to_zigzag": lambda: to_zigzag(long, 4),
        "shapes": lambda: ring_attention(long[0], long[0], long[0]),  # no batch axis
        "heads": lambda: ring_attention(long, torch.zeros(1, 3, 12, 8), torch.zeros(1, 3, 12, 8)),
        "sinks_shape": lambda: ring_attention(x, x, x, sinks=torch.zeros(3)),
        "sinks_dtype": lambda: ring_attention(x, x, x, sinks=torch.zeros(2, dtype=torch.int32)),
        "rope_cross": lambda: ring_attention(x, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), rope=ROPE),
        "positions_without_rope": lambda: ring_attention(x, x, x, positions=torch.zeros(1, 3, dtype=torch.int64)),
        "positions_dtype": lambda: ring_attention(x, x, x, rope=ROPE, positions=torch.zeros(1, 3)),
    }
    texts = {}
    for name, call in calls.items():
        try:
            call()
        except (ValueError, TypeError) as error:
            texts[name] = f"{type(error).__name__}: {error}"
    return texts


def main() -> None:
    rank, world, init_file, out_dir, *twins_in = sys.argv[1:]
    rank_i, world_i = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_i, world_size=world_i)
    report: dict[str, Any] = {"rank": rank_i, "cases": []}
    for case in CASES:
        if case.devices == world_i:
            report["cases"].append(check_case(case, None, rank_i))
    if world_i == 4:
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        for case in CASES:
            if case.devices == 2:
                report["cases"].append(check_case(case, halves[rank_i // 2], rank_i % 2))
        if twins_in:
            twins(twins_in[0], out_dir, rank_i)
        if rank_i == 0:
            report["errors"] = error_texts()
    if world_i == 2:
        report["ddp"] = ddp(rank_i)
    with open(f"{out_dir}/rank{rank_i}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()  # every rank is done with every collective and has written its report
    # No destroy_process_group and no interpreter teardown: gloo's threads, torn down
    # while the other rank closes its connections, once aborted a finished rank
    # ("terminate called without an active exception", SIGABRT) in CI.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
