"""Whole-model proofs of two more families, each in one call: a Qwen3-MoE
(``Qwen3MoeForCausalLM``: every layer a sparse mixture of experts, top-2 of 4, the top-k
weights renormalised; qk-norms over each head) and a SmolLM3 (``SmolLM3ForCausalLM``: a
RoPE layer beside a NoPE layer, the head tied to the embedding), both built tiny (width 32,
2 layers) with every weight random.  The Flax side is ``examples.port_llama``'s skeleton,
the attention ``to_flax(from_hf(layer))`` per layer; the MoE block is written plainly here
(a router returning Hugging Face's ``(logits, weights, indices)``, the experts as Hugging
Face's 3-d ``gate_up_proj`` / ``down_proj``).  ``check_causal_lm_parity`` proves each at
the real rows of a left-padded batch of 512 positions (logits, every parameter's gradient),
AdamW steps and greedy decoding with one KV cache per layer (``parity_tests.causal_lm.greedy``:
the MoE's alike layers share their compiled step, SmolLM3's RoPE and NoPE layers do not);
``locate_divergence`` finds the clean port clean with no ``module_map`` and names a bug of
the family's own kind planted in layer 1 (a router that forgets to renormalise, a NoPE
layer that rotates)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from parity_tests import check_causal_lm_parity, copy_params, infer_param_map, locate_divergence  # noqa: E402
from parity_tests.causal_lm import greedy, randomise  # noqa: E402

VOCAB, WIDTH, LONG, SHORT, PADS = 96, 32, 512, 48, 37
COMMON = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              use_cache=False)


def _ids(seq: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, seq), dtype=np.int64)


def _left_padded() -> tuple[np.ndarray, np.ndarray]:
    mask = np.ones((2, LONG), np.int64)
    mask[1, :PADS] = 0
    return _ids(LONG), mask


def _torch_call(m: Any, ids: Any) -> Any:
    return m(input_ids=ids).logits


def _flax_call(m: Any, ids: Any) -> Any:
    return m(ids)["logits"]


def _ported(hf: Any, mlp: Any = None) -> tuple[Any, Any, list[Any]]:
    from examples.port_llama import LlamaForCausalLM

    flax = LlamaForCausalLM(hf, nnx.Rngs(0), mlp)
    rules = infer_param_map(hf, flax)
    copy_params(hf, flax, rules)
    return hf, flax, rules


def _proven(port: tuple[Any, Any, list[Any]], children: set[str]) -> Any:
    """The one call: logits and gradients at the real rows of the left-padded batch of
    512, two AdamW steps, three tokens decoded greedily with the caches; and
    ``locate_divergence`` on the clean port, forward, with no ``module_map``: nothing
    diverges, no boundary mismatch, ``children`` (Hugging Face's attention children among
    them) compared."""
    hf, flax, rules = port
    ids, mask = _left_padded()
    report = check_causal_lm_parity(hf, flax, ids, mask, param_map=rules, steps=2, decode_steps=3, flax_decode=greedy)
    assert report.ok and report.divergence is None, report.message()
    assert report.logits.rows_left_out == PADS and len(report.training.steps) == 2 and report.tokens_agree
    grads = [f for f in report.logits.findings if f.name.startswith("grad ") and not f.name.startswith("grad input[")]
    assert {f.name.removeprefix("grad ") for f in grads} == {n for n, _ in hf.named_parameters()}
    clean = locate_divergence(hf, flax, _ids(SHORT), torch_call=_torch_call, flax_call=_flax_call, backward=False)
    assert clean.ok and not clean.boundaries, str(clean)
    assert children <= {p.torch_name for p in clean.pairs if p.output.ok}, str(clean)
    return report


def _located(port: tuple[Any, Any, list[Any]], plant: Any) -> Any:
    """``locate_divergence`` with ``plant(flax)`` applied (it returns the undo)."""
    hf, flax, _ = port
    undo = plant(flax)
    try:
        return locate_divergence(hf, flax, _ids(SHORT), torch_call=_torch_call, flax_call=_flax_call)
    finally:
        undo()


# --------------------------------------------------------------------------- Qwen3-MoE


class _Router(nnx.Module):
    """Qwen3-MoE's router: logits ``x @ weight.T``, the softmax in float32, its top k,
    renormalised to sum to 1 where ``norm_topk_prob``; returns Hugging Face's
    ``(router_logits, top-k weights, top-k indices)``."""

    def __init__(self, experts: int, width: int, top_k: int, norm_topk_prob: bool) -> None:
        self.weight = nnx.Param(jnp.zeros((experts, width), jnp.float32))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # (N, C)
        logits = x @ self.weight[...].T
        top, index = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), self.top_k)
        if self.norm_topk_prob:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        return logits, top.astype(logits.dtype), index


class _Experts(nnx.Module):
    """Every expert on every token (a tiny model: dense is the plain way), each token's sum
    weighted by its top-k weights (zero for the experts it was not routed to).  The weights
    as Hugging Face stores them: ``gate_up_proj`` (E, 2 I, C), ``down_proj`` (E, C, I)."""

    def __init__(self, experts: int, width: int, inner: int) -> None:
        self.gate_up_proj = nnx.Param(jnp.zeros((experts, 2 * inner, width), jnp.float32))
        self.down_proj = nnx.Param(jnp.zeros((experts, width, inner), jnp.float32))

    def __call__(self, x: jax.Array, index: jax.Array, weights: jax.Array) -> jax.Array:  # (N, C), (N, k), (N, k)
        gate, up = jnp.split(jnp.einsum("nc,eoc->neo", x, self.gate_up_proj[...]), 2, axis=-1)
        out = jnp.einsum("nei,eci->nec", jax.nn.silu(gate) * up, self.down_proj[...])
        routed = jnp.sum(jax.nn.one_hot(index, out.shape[1], dtype=x.dtype) * weights[..., None], axis=1)  # (N, E)
        return jnp.einsum("ne,nec->nc", routed, out)


class _SparseMoe(nnx.Module):
    """Hugging Face's ``Qwen3MoeSparseMoeBlock``, its sizes and options read from it."""

    def __init__(self, hf_moe: Any) -> None:
        gate, experts = hf_moe.gate, hf_moe.experts
        self.gate = _Router(gate.num_experts, gate.hidden_dim, gate.top_k, gate.norm_topk_prob)
        self.experts = _Experts(experts.num_experts, experts.hidden_dim, experts.intermediate_dim)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, C), the tokens routed one by one
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(flat)
        return self.experts(flat, index, weights).reshape(x.shape)


def _moe_mlp(hf_layer: Any, rngs: nnx.Rngs) -> Any:
    from examples.port_llama import MLP

    if hasattr(hf_layer.mlp, "experts"):
        return _SparseMoe(hf_layer.mlp)
    return MLP(WIDTH, hf_layer.mlp.gate_proj.out_features, rngs)  # a dense layer (mlp_only_layers)


@pytest.fixture(scope="module")
def qwen3_moe() -> tuple[Any, Any, list[Any]]:
    import transformers

    config = transformers.Qwen3MoeConfig(**COMMON, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[])
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).float().eval()
    randomise(hf, 0)
    assert all(hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    return _ported(hf, _moe_mlp)


def test_a_whole_qwen3_moe_port_is_proven_in_one_call(qwen3_moe: tuple[Any, Any, list[Any]]) -> None:
    """The router's and the experts' weights are paired by name and shape (``gate.weight``
    (E, C), ``experts.gate_up_proj`` (E, 2 I, C) as they are), the attention's by ``from_hf``'s
    map; the clean port agrees at every module (the router's three outputs, the experts')."""
    _, flax, rules = qwen3_moe
    report = _proven(qwen3_moe, {"model.layers.1.mlp.gate", "model.layers.1.mlp.experts",
                                 "model.layers.1.self_attn.k_norm", "model.layers.1.self_attn.o_proj"})
    mapped = {r.torch_names[0]: r.flax_paths[0] for r in rules}
    assert mapped["model.layers.1.mlp.experts.gate_up_proj"] == ("model", "layers", 1, "mlp", "experts", "gate_up_proj")
    assert mapped["model.layers.1.self_attn.q_norm.weight"][-2:] == ("q_norm", "scale")
    assert type(flax.model.layers[1].self_attn).__name__ == "MultiHeadAttention"
    assert [f.name for f in report.decoding] == [f"decode step {s} logits" for s in range(3)]


def test_a_qwen3_moe_router_that_forgets_to_renormalise_is_named_at_its_gate(
        qwen3_moe: tuple[Any, Any, list[Any]]) -> None:
    """A router in layer 1 that forgets ``norm_topk_prob`` (its routing and its logits
    right, the weights summing to less than 1) is named at ``model.layers.1.mlp.gate``."""
    def plant(flax: Any) -> Any:
        gate = flax.model.layers[1].mlp.gate
        gate.norm_topk_prob = False
        return lambda: setattr(gate, "norm_topk_prob", True)

    report = _located(qwen3_moe, plant)
    first = report.first
    assert first is not None and (first.torch_name, first.direction) == ("model.layers.1.mlp.gate", "forward"), \
        str(report)
    assert first.flax_path == ("model", "layers", 1, "mlp", "gate")


# --------------------------------------------------------------------------- SmolLM3


@pytest.fixture(scope="module")
def smollm3() -> tuple[Any, Any, list[Any]]:
    import transformers

    config = transformers.SmolLM3Config(**COMMON, no_rope_layers=[1, 0])  # layer 0 rotates, layer 1 does not
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.SmolLM3ForCausalLM(config).float().eval()
    randomise(hf, 0)
    return _ported(hf)


def test_a_whole_smollm3_port_with_a_nope_layer_is_proven_in_one_call(smollm3: tuple[Any, Any, list[Any]]) -> None:
    """``from_hf`` finds which layer rotates (layer 1 gets ``rope=None`` and takes no
    positions); the head is tied to the embedding in both (no rule for ``lm_head``)."""
    _, flax, rules = smollm3
    assert [layer.self_attn.spec.rope is None for layer in flax.model.layers] == [False, True]
    assert not hasattr(flax, "lm_head") and not any(r.torch_names[0].startswith("lm_head") for r in rules)
    _proven(smollm3, {"model.layers.1.self_attn", "model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.o_proj"})


def test_a_smollm3_nope_layer_that_rotates_is_named_at_that_layer(smollm3: tuple[Any, Any, list[Any]]) -> None:
    """Layer 1 given layer 0's rotation (the port forgot ``no_rope_layers``): the first
    divergence is that attention layer (its projections agree; the rotation between them
    and ``o_proj`` has no module of Hugging Face's to pair), ``o_proj`` the earliest call
    whose output fails."""
    def plant(flax: Any) -> Any:
        attention = flax.model.layers[1].self_attn
        saved = attention.spec
        attention.spec = dataclasses.replace(saved, rope=flax.model.layers[0].self_attn.spec.rope)
        return lambda: setattr(attention, "spec", saved)

    report = _located(smollm3, plant)
    first = report.first
    assert first is not None and (first.torch_name, first.direction) == ("model.layers.1.self_attn", "forward"), \
        str(report)
    earliest = min((p for p in report.pairs if p.output.ok is False), key=lambda p: p.exit_order)
    assert earliest.torch_name == "model.layers.1.self_attn.o_proj", str(report)
    ids = _ids(SHORT)
    with pytest.raises(ValueError, match="steps must be a positive int; got 0"):
        greedy(smollm3[1], ids, np.ones_like(ids), 0)
