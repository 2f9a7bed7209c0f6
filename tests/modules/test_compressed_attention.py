"""DeepSeek-V4's attention (``CompressedAttention``: the sliding window alone, with HCA's
compressed keys, with CSA's indexer-chosen compressed keys) in both twins: against
transformers' ``DeepseekV4Attention`` built tiny (weights ported by ``from_hf``) at 420
positions, whole and cached (a prompt of 404, then one-token and short steps, beside
transformers' own cache); against the float64 oracle (``parity_tests/reference_compressed``),
outputs and gradients (directional derivatives by central differences, per parameter
group); twin against twin (outputs, gradients, a cached decode); weights moved bit-exactly
(``to_flax`` / ``to_torch``, ``from_hf`` / ``to_hf``); bad options and calls refused with
one text in both twins, before any work.

The indexer's scores go through a ReLU, so with weights drawn at random many entries
score exactly 0 and tie; which of tied entries a top-k keeps is arbitrary (transformers'
own whole-sequence and cached passes keep different ones).  ``_untie`` gives the weights
a constant input feature that keeps every score positive and distinct, so each test here
compares one selection; the oracle's margins are checked to say so.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

D_IN, HEADS, HEAD_DIM, ROPE_DIM, Q_RANK, GROUPS, O_RANK, WINDOW = 32, 4, 16, 8, 12, 2, 8, 16
TYPES = ("sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention")
LONG, PROMPT, STEPS = 420, 404, (1, 1, 5, 1, 8)
# Measured (this file, float32, 2-core Zen 5): ours against transformers 7e-7..1.5e-6 (whole and
# cached, outputs up to ~7); float32 twins against the float64 oracle 5e-7..1.3e-6; the twins
# 1e-6; float64 against the oracle 2.5e-15.
FLOAT32, FLOAT64 = 2e-5, 1e-12


def _hf_config(layer_type: str) -> Any:
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=64, hidden_size=D_IN, num_attention_heads=HEADS, head_dim=HEAD_DIM, q_lora_rank=Q_RANK,
        partial_rotary_factor=ROPE_DIM / HEAD_DIM, sliding_window=WINDOW, o_groups=GROUPS, o_lora_rank=O_RANK,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_n_heads=2, index_head_dim=12, index_topk=3, num_hidden_layers=1, layer_types=[layer_type],
        mlp_layer_types=["moe"], n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    config._attn_implementation = "eager"
    return config


def _untie(layer: Any) -> None:
    """Weights that keep the indexer's scores positive and apart (see the module
    docstring): input feature 0 is a constant 2, and it feeds the indexer's queries, keys
    and head weights positive parts."""
    import torch

    with torch.no_grad():
        layer.q_a_proj.weight[:, 0] = 3.0
        layer.q_a_norm.weight.abs_().add_(0.5)
        indexer = getattr(getattr(layer, "compressor", None), "indexer", None)
        if indexer is not None:
            indexer.q_b_proj.weight.view(2, 12, Q_RANK)[:, :4] += 1.0
            indexer.kv_proj.weight.view(2, 12, D_IN)[:, :4, 0] = 4.0
            indexer.kv_norm.weight.abs_().add_(0.5)
            indexer.scorer.weights_proj.weight[:, 0] = 3.0


@functools.cache
def _layers(layer_type: str) -> tuple[Any, Any]:
    """transformers' layer (weights N(0, 0.5), seeded, ``_untie``d, float32, eval) and ours
    from ``from_hf``."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    from torch_attention.interop import from_hf

    torch.manual_seed(TYPES.index(layer_type))
    layer = m.DeepseekV4Attention(_hf_config(layer_type), 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    _untie(layer)
    return layer, from_hf(layer)


def _x(batch: int, length: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((batch, length, D_IN)).astype(np.float32)
    x[..., 0] = 2.0
    return x


def _hf_run(layer: Any, x: Any, cache: Any = None, start: int = 0) -> Any:
    """transformers' layer on x at positions start.., its mask and rope as its model
    builds them."""
    import torch
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    positions = torch.arange(start, start + x.shape[1])[None]
    rotary = m.DeepseekV4RotaryEmbedding(layer.config)
    embeddings = {kind: rotary(x, positions, kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=layer.config, inputs_embeds=x, attention_mask=None, cache=cache,
                                             position_ids=positions)
    return layer(x, embeddings, positions, mask, cache=cache)[0]


def _params(module: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().double().numpy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("layer_type", TYPES)
def test_against_transformers_whole_and_cached(layer_type: str) -> None:
    """420 positions, whole and as a prompt of 404 then steps of 1, 1, 5, 1, 8 tokens in
    both caches: ours equals transformers' (the positions past 400 included), and our
    cached steps equal our whole sequence (the compressors' open windows, entry counts
    and overlaps carried)."""
    import torch
    from transformers.cache_utils import DynamicCache

    layer, ours = _layers(layer_type)
    x = torch.from_numpy(_x(1, LONG))
    with torch.no_grad():
        theirs, whole = _hf_run(layer, x), ours(x)
        assert (whole - theirs).abs().max().item() < FLOAT32
        assert (whole[:, 400:] - theirs[:, 400:]).abs().max().item() < FLOAT32
        hf_cache, cache, start, ours_steps, hf_steps = DynamicCache(config=layer.config), ours.init_cache(1), 0, [], []
        for n in (PROMPT, *STEPS):
            part = x[:, start:start + n]
            hf_steps.append(_hf_run(layer, part, hf_cache, start))
            out, cache = ours(part, cache=cache)
            ours_steps.append(out)
            start += n
        stepped = torch.cat(ours_steps, 1)
        assert (stepped - torch.cat(hf_steps, 1)).abs().max().item() < FLOAT32
        assert (stepped - whole[:, :start]).abs().max().item() < FLOAT32
    assert cache.length == start and cache.keys.shape[2] == WINDOW - 1
    hf_layer = hf_cache.layers[0]
    if layer_type != "sliding_attention":  # the compressor's state as transformers keeps it
        assert cache.entries.shape[1] == hf_layer.entry_count["compressor"] == start // ours.geometry.compress_rate
        assert cache.buffer_kv.shape[1] == hf_layer.buffer_kv["compressor"].shape[1]
        assert torch.equal(cache.entries, hf_layer.compressed_kv["compressor"]) or \
            (cache.entries - hf_layer.compressed_kv["compressor"]).abs().max().item() < FLOAT32


@functools.cache
def _oracle_case(layer_type: str) -> tuple[Any, np.ndarray, np.ndarray]:
    _, ours = _layers(layer_type)
    x = _x(2, 24, seed=1)
    from parity_tests import reference_compressed

    return ours, x, reference_compressed.forward(_params(ours), ours.config, x)


@pytest.mark.parametrize("layer_type", TYPES)
def test_against_the_oracle(layer_type: str) -> None:
    """B 2, T 24: float32 and float64 modules against the float64 oracle; for CSA the
    oracle's selection has a margin (no near-tie decides it)."""
    import torch

    ours, x, expected = _oracle_case(layer_type)
    with torch.no_grad():
        got = ours(torch.from_numpy(x)).numpy()
        got64 = copy.deepcopy(ours).double()(torch.from_numpy(x).double()).numpy()
    assert np.abs(got - expected).max() < FLOAT32
    assert np.abs(got64 - expected).max() < FLOAT64
    if layer_type == "compressed_sparse_attention":
        from parity_tests.reference_compressed import selection_of

        chosen, scores = selection_of(_params(ours), ours.config, x)
        for b, t in np.ndindex(*chosen.shape[:2]):
            live = np.sort(scores[b, t][np.isfinite(scores[b, t])])[::-1]
            if 0 < ours.geometry.index_topk < live.size:  # the kept and the first left out apart
                k = ours.geometry.index_topk
                assert live[k - 1] - live[k] > 1e-6


GROUPS_OF_PARAMETERS = {
    "queries": ("q_a_proj", "q_a_norm", "q_b_proj"),
    "keys": ("kv_proj", "kv_norm"),
    "output": ("o_a_proj", "o_b_proj", "sinks"),
    "compressor": ("compressor.kv_proj", "compressor.gate_proj", "compressor.position_bias", "compressor.kv_norm"),
}


@pytest.mark.parametrize("layer_type", TYPES)
def test_gradients_against_the_oracle(layer_type: str) -> None:
    """The float64 module's gradients (of x and of each group of parameters, along a
    random direction) equal the oracle's central differences; the indexer, whose choice is
    not differentiated, gets none."""
    import torch

    from parity_tests.reference_compressed import forward

    ours, x, _ = _oracle_case(layer_type)
    module = copy.deepcopy(ours).double()
    rng = np.random.default_rng(7)
    cot = rng.standard_normal((2, 24, D_IN))
    xt = torch.from_numpy(x).double().requires_grad_(True)
    (module(xt) * torch.from_numpy(cot)).sum().backward()
    params = _params(module)
    grads = {n: p.grad for n, p in module.named_parameters()}
    indexer = [n for n in grads if ".indexer." in n]
    assert all(grads[n] is None or not grads[n].any() for n in indexer)
    eps = 1e-5
    groups = {"x": ()} | {k: v for k, v in GROUPS_OF_PARAMETERS.items()
                          if k != "compressor" or layer_type != "sliding_attention"}
    for group, prefixes in groups.items():
        names = [n for n in params if n.startswith(prefixes) and ".indexer." not in n] if prefixes else []
        direction = {n: rng.standard_normal(params[n].shape) for n in names}
        dx = rng.standard_normal(x.shape) if group == "x" else np.zeros(x.shape)
        analytic = float((xt.grad.numpy() * dx).sum()) + sum(float((grads[n].numpy() * direction[n]).sum())
                                                            for n in names)

        def at(s: float, names: list[str] = names, direction: dict[str, np.ndarray] = direction,
               dx: np.ndarray = dx) -> float:
            moved = dict(params) | {n: params[n] + s * direction[n] for n in names}
            return float((forward(moved, module.config, x + s * dx) * cot).sum())

        numeric = (at(eps) - at(-eps)) / (2 * eps)
        assert abs(analytic - numeric) <= 1e-6 * max(1.0, abs(numeric)), (group, analytic, numeric)


@functools.cache
def _twin(layer_type: str) -> Any:
    from parity_tests import to_flax

    return to_flax(_layers(layer_type)[1])


@functools.cache
def _flax_whole(layer_type: str) -> np.ndarray:
    from flax import nnx

    return np.asarray(nnx.jit(lambda m, x: m(x))(_twin(layer_type), _oracle_case(layer_type)[1]))


@pytest.mark.parametrize("layer_type", TYPES)
def test_twins_agree(layer_type: str) -> None:
    """The Flax twin (``to_flax``, under ``nnx.jit``) equals the PyTorch module and the
    oracle; its gradients (of x and every parameter) equal PyTorch's (CSA: the window, both
    compressors' overlapping windows, the indexer's parameters getting none)."""
    import jax
    import torch
    from flax import nnx

    ours, x, expected = _oracle_case(layer_type)
    twin = _twin(layer_type)
    got = _flax_whole(layer_type)
    with torch.no_grad():
        assert np.abs(got - ours(torch.from_numpy(x)).numpy()).max() < FLOAT32
    assert np.abs(got - expected).max() < FLOAT32
    if layer_type != "compressed_sparse_attention":  # CSA's gradients run through every part HCA's do
        return
    cot = np.random.default_rng(3).standard_normal(x.shape).astype(np.float32)

    def loss(m: Any, x: Any) -> Any:
        return (m(x) * cot).sum()

    grads, gx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(twin, x)
    xt = torch.from_numpy(x).requires_grad_(True)
    module = copy.deepcopy(ours)
    (module(xt) * torch.from_numpy(cot)).sum().backward()
    assert np.abs(np.asarray(gx) - xt.grad.numpy()).max() < FLOAT32
    from attention_spec.interop.compressed import compressed_rules

    flat = dict(nnx.to_flat_state(grads))
    for rule in compressed_rules(module.config):
        g = module.get_parameter(rule.torch_name).grad
        theirs = np.asarray(flat[rule.flax_path].get_value())
        theirs = theirs.T if rule.transpose else theirs
        mine = np.zeros(theirs.shape, np.float32) if g is None else g.numpy()
        assert np.abs(theirs - mine).max() < 1e-4 * max(1.0, np.abs(mine).max()), rule.torch_name
    del jax


def test_flax_cached_decode() -> None:
    """CSA in the Flax twin under ``nnx.jit``: a prompt of 20 tokens, then steps of 1 and 3,
    equal its whole sequence (its own cache: buffers, entries, overlaps of both
    compressors; the cache's length is static, so each step compiles for its shapes)."""
    from flax import nnx

    _, x, _ = _oracle_case("compressed_sparse_attention")
    twin = _twin("compressed_sparse_attention")
    step = nnx.jit(lambda m, x, cache: m(x, cache=cache))
    cache, outs = twin.init_cache(2), []
    for a, b in ((0, 20), (20, 21), (21, 24)):
        out, cache = step(twin, x[:, a:b], cache)
        outs.append(np.asarray(out))
    assert np.abs(np.concatenate(outs, 1) - _flax_whole("compressed_sparse_attention")).max() < FLOAT32
    assert cache.length == 24 and cache.entries.shape[1] == cache.index_entries.shape[1] == 6
    assert cache.buffer_kv.shape[1] == 0 and cache.keys.shape[2] == WINDOW - 1


def test_weights_move_bit_exactly() -> None:
    """``to_flax`` then ``to_torch`` gives every parameter back bit for bit (CSA: every
    rule of the map), and ``to_hf`` of ``from_hf`` writes transformers' weights back bit
    for bit into a fresh layer of the same config."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    import torch_attention as ta
    from parity_tests import to_torch
    from torch_attention.interop import to_hf

    layer, ours = _layers("compressed_sparse_attention")
    back = to_torch(_twin("compressed_sparse_attention"))
    assert back.state_dict().keys() == ours.state_dict().keys()
    assert all(torch.equal(a, back.state_dict()[n]) for n, a in ours.state_dict().items())
    fresh = to_hf(ours, m.DeepseekV4Attention(layer.config, 0))
    assert all(torch.equal(a, fresh.state_dict()[n]) for n, a in layer.state_dict().items())
    with pytest.raises(ValueError, match="its compression is 'csa', ours 'hca'"):
        to_hf(_layers("heavily_compressed_attention")[1], m.DeepseekV4Attention(layer.config, 0))
    mixed = copy.deepcopy(layer).to(torch.bfloat16)
    mixed.sinks.data = mixed.sinks.data.float()
    with pytest.raises(ValueError, match="sinks are in another dtype than its torch.bfloat16 weights"):
        ta.interop.from_hf(mixed)
    with pytest.raises(TypeError, match="takes our CompressedAttention; got MultiHeadAttention"):
        to_hf(ta.MultiHeadAttention(D_IN, D_IN, None, 0.0, HEADS), m.DeepseekV4Attention(layer.config, 0))


def test_selections_that_tie_are_told_from_divergences() -> None:
    """CSA with weights drawn at random (not ``_untie``d): the indexer's ReLU gives many
    scores of exactly 0, so the twins and the oracle choose differently among tied
    entries; ``parity_tests.selection.compare_selections`` calls every difference a tie
    (the margin at the k-th entry within the scores' rounding) and the scores equal; run
    on one side's choice (``selection=``) the twins and the oracle agree at the float32
    tolerance.  A planted bug in the indexer (its queries' projection nudged by 1e-3)
    shows as scores beyond their rounding: a divergence."""
    import torch
    from flax import nnx

    from parity_tests import to_flax
    from parity_tests.reference_compressed import forward, selection_of
    from parity_tests.selection import compare_selections

    layer, ours = _layers("compressed_sparse_attention")
    module = copy.deepcopy(ours)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    twin = to_flax(module)
    x = np.random.default_rng(5).standard_normal((2, 24, D_IN)).astype(np.float32)
    xt = torch.from_numpy(x)
    chosen_t, scores_t = module.select_keys(xt)
    chosen_f, scores_f = nnx.jit(lambda m, x: m.select_keys(x))(twin, x)
    chosen_o, scores_o = selection_of(_params(module), module.config, x)
    topk = module.geometry.index_topk
    visible = np.isfinite(scores_o)
    assert ((scores_o == 0) & visible).sum() > 10  # ties on purpose: exact zeros among the visible entries
    for other, other_scores in ((np.asarray(chosen_f), np.asarray(scores_f)), (chosen_o, scores_o)):
        report = compare_selections(chosen_t.numpy(), other, scores_t.numpy(), other_scores, topk)
        assert report.ok, report.summary()
        assert all(d.tie for d in report.differences)
    with torch.no_grad():
        out_t = module(xt, selection=chosen_t).numpy()
    out_f = np.asarray(nnx.jit(lambda m, x, s: m(x, selection=s))(twin, x, chosen_t.numpy()))
    assert np.abs(out_t - out_f).max() < FLOAT32
    assert np.abs(out_t - forward(_params(module), module.config, x, selection=chosen_t.numpy())).max() < FLOAT32
    for run in (lambda s: module(xt, selection=torch.from_numpy(s)), lambda s: twin(x, selection=s)):
        with pytest.raises(ValueError, match=r"selection must be bool \(B, T, W\) = \(2, 24, 6\)"):
            run(np.ones((2, 24, 6), np.int32))
    bugged = copy.deepcopy(module)
    with torch.no_grad():
        bugged.compressor.indexer.q_b_proj.weight.add_(1e-3)
    chosen_b, scores_b = bugged.select_keys(xt)
    report = compare_selections(chosen_b.numpy(), np.asarray(chosen_f), scores_b.numpy(), np.asarray(scores_f), topk)
    assert not report.ok and report.score_error > report.score_rounding


def _ours_in_their_place(layer: Any) -> Any:
    """Our ``CompressedAttention`` (``from_hf``) where a ``DeepseekV4DecoderLayer`` calls its
    ``self_attn``: the whole sequence without transformers' cache; with it, a call at
    position 0 starts our own cache and later calls continue it."""
    from torch import nn

    from torch_attention.interop import from_hf

    class Ours(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ours, self.state = from_hf(layer), None

        def forward(self, hidden_states: Any, position_embeddings: Any = None, position_ids: Any = None,
                    attention_mask: Any = None, cache: Any = None, **kwargs: Any) -> tuple[Any, None]:
            if cache is None:
                return self.ours(hidden_states), None
            if int(position_ids[0, 0]) == 0:
                self.state = self.ours.init_cache(hidden_states.shape[0])
            out, self.state = self.ours(hidden_states, cache=self.state)
            return out, None

    return Ours()


def test_a_tiny_deepseek_v4_model_with_our_attention_gives_its_logits_and_tokens() -> None:
    """A tiny ``DeepseekV4ForCausalLM`` (its hyper-connections and MoE, one layer of each
    attention type) with each ``self_attn`` replaced by ours: the logits of 2 x 44 tokens,
    then ``generate``'s 8 greedy steps (ours on its own cache: windows close, CSA's indexer
    chooses among new entries), equal transformers'."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    config = _hf_config("sliding_attention")
    config.num_hidden_layers, config.layer_types, config.mlp_layer_types = 3, list(TYPES), ["moe"] * 3
    config.hc_mult = 2
    torch.manual_seed(4)
    model = m.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." in name or name.startswith("lm_head"):
                p.normal_(0.0, 0.5)
    ours = copy.deepcopy(model)
    for layer in ours.model.layers:
        layer.self_attn = _ours_in_their_place(layer.self_attn)
    ids = torch.randint(0, 64, (2, 44))
    options = {"max_new_tokens": 8, "do_sample": False, "output_logits": True, "return_dict_in_generate": True,
               "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
    with torch.no_grad():
        assert (model(ids).logits - ours(ids).logits).abs().max().item() < FLOAT32
        theirs, mine = model.generate(ids, **options), ours.generate(ids, **options)
    assert torch.equal(theirs.sequences, mine.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(theirs.logits, mine.logits, strict=True)) < FLOAT32


ROPE_KW = {"theta": 10000.0, "rotary_dim": ROPE_DIM, "layout": "interleaved"}
BAD_OPTIONS = [
    ({"o_groups": 3}, ValueError, r"num_heads \* head_dim \(64\) must be a multiple of o_groups \(3\)"),
    ({"rope": "rope"}, TypeError, "takes rope= a RopeConfig"),
    ({"rope": {"layout": "half"}}, ValueError, "rope layout must be 'interleaved'"),
    ({"compression": "sparse"}, ValueError, "compression must be None, 'hca' or 'csa'"),
    ({"compress_rate": 4}, ValueError, "compress_rate need compression='hca' or 'csa'"),
    ({"compression": "hca"}, TypeError, "compress_rate must be an int"),
    ({"compression": "hca", "compress_rate": 4, "index_topk": 2}, ValueError, "index_topk belong to compression='csa'"),
    ({"compression": "csa", "compress_rate": 4, "index_heads": 2, "index_head_dim": 4, "index_topk": 2},
     ValueError, r"rope slice \(8\) must fit the indexer's heads"),
    ({"window": 0}, ValueError, "window must be >= 1"),
    ({"norm_eps": 0.0}, ValueError, "norm_eps must be a positive finite number"),
]


def _build(framework: str, **changes: Any) -> Any:
    from attention_spec.rope import RopeConfig

    rope = changes.pop("rope", None)
    rope = RopeConfig(**(ROPE_KW | rope)) if isinstance(rope, dict) else (rope or RopeConfig(**ROPE_KW))
    keywords = {"d_in": D_IN, "num_heads": HEADS, "head_dim": HEAD_DIM, "q_lora_rank": Q_RANK, "o_groups": GROUPS,
                "o_lora_rank": O_RANK, "window": WINDOW, "rope": rope, **changes}
    if framework == "torch":
        import torch_attention as ta

        return ta.CompressedAttention(**keywords)
    from flax import nnx

    import jax_attention as ja

    return ja.CompressedAttention(**keywords, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(("changes", "error", "text"), BAD_OPTIONS)
def test_bad_options_refused_alike(changes: dict[str, Any], error: type, text: str) -> None:
    messages = []
    for framework in ("torch", "jax"):
        with pytest.raises(error, match=text) as caught:
            _build(framework, **dict(changes))
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_bad_calls_refused_alike() -> None:
    """A wrong x, a cache of another batch or of another layer type: one text in both
    twins, before any work."""
    import torch

    x = _x(2, 5)
    expected = [(ValueError, r"x of shape \(batch, tokens, d_in=32\)"), (TypeError, "compute dtype float32; got float64"),
                (ValueError, "must be a CompressedCache"), (ValueError, r"init_cache\(batch_size=2\)"),
                (ValueError, "got buffer_kv None"), (ValueError, "selection= is the choice of CSA's indexer")]

    def calls(module: Any, other: Any, wrap: Any) -> list[Any]:
        return [lambda: module(wrap(np.zeros((2, 5, 8), np.float32))), lambda: module(wrap(x.astype(np.float64))),
                lambda: module(wrap(x), cache="cache"), lambda: module(wrap(x), cache=module.init_cache(3)),
                lambda: module(wrap(x), cache=other.init_cache(2)),
                lambda: module(wrap(x), selection=wrap(np.ones((2, 5, 0), bool)))]

    torch_calls = calls(_layers("heavily_compressed_attention")[1], _layers("sliding_attention")[1], torch.from_numpy)
    flax_calls = calls(_twin("heavily_compressed_attention"), _twin("sliding_attention"), np.asarray)
    for (error, text), in_torch, in_flax in zip(expected, torch_calls, flax_calls, strict=True):
        messages = []
        for call in (in_torch, in_flax):
            with pytest.raises(error, match=text) as caught:
                call()
            messages.append(str(caught.value))
        assert messages[0] == messages[1]


def test_a_padding_mask_is_refused_by_name_alike() -> None:
    """No padding mask (its compressors pool consecutive tokens, pads included): ``mask=``
    is refused, one text in both twins, before any work; None passes."""
    import jax.numpy as jnp
    import torch

    x = np.zeros((1, 4, D_IN), np.float32)
    mask = np.ones((1, 1, 1, 4), bool)
    messages = []
    for framework, array in (("torch", torch.from_numpy), ("jax", jnp.asarray)):
        module = _build(framework)
        with pytest.raises(ValueError, match="CompressedAttention takes no mask") as caught:
            module(array(x), array(mask))
        messages.append(str(caught.value))
        assert module(array(x), None).shape == (1, 4, D_IN)
    assert messages[0] == messages[1]
