"""Sparse attention (DSA: DeepSeek-V3.2, GLM-5), ``MultiHeadLatentAttention(index_topk=...)``
in both twins: the indexer's parameters (``transformers``' names); the twins' choices of
keys compared as data (``parity_tests.selection``: ties within the scores' rounding told
from divergences) and their outputs given one choice; each twin against the float64 oracle
(which chooses with float64 scores) given the same choice, on every path and absorbed;
gradients through the chosen keys against the float64 module and the oracle's central
differences, the choice not differentiated; decoding (a prompt, then one token at a time,
the indexer's keys in the cache) equal to the whole sequence; against ``transformers``'
``DeepseekV32Attention`` and ``GlmMoeDsaAttention`` (``from_hf``, float32, positions 480..),
their round trips bit-exact, GLM-5's shared layers refused by name; scores tied on purpose
reported as ties, a planted indexer bug as a divergence; one error text per bad option or
call in all three places."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest

from attention_spec.rope import RopeConfig
from parity_tests.tolerances import GRAD_ORACLE, GRAD_PARITY, ORACLE, PARITY
from tests.support import constructor_errors, decode_in_steps, needs_both, needs_torch, random_x

B, T, FIRST, TOPK = 2, 24, 480, 8
CONFIG: dict[str, Any] = {
    "d_in": 32, "num_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "q_lora_rank": 16, "rope": RopeConfig(theta=10000.0, layout="interleaved"), "index_topk": TOPK,
    "index_heads": 4, "index_head_dim": 16,
}
POSITIONS = (FIRST + 5 * np.arange(B)[:, None] + np.arange(T)[None]).astype(np.int64)


def _torch_module(config: dict[str, Any], seed: int = 0) -> Any:
    """Our PyTorch module, every norm's weight (and the indexer's LayerNorm bias) drawn."""
    import torch

    import torch_attention

    torch.manual_seed(seed)
    module = torch_attention.MultiHeadLatentAttention(**config).eval()
    with torch.no_grad():
        for name, _ in module.spec.latent_norms():
            getattr(module, name).weight.uniform_(0.5, 1.5)
        if module.spec.index_topk is not None:
            module.indexer.k_norm.weight.uniform_(0.5, 1.5)
            module.indexer.k_norm.bias.normal_(0.0, 0.1)
    return module


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any, np.ndarray, dict[str, np.ndarray]]:
    """(torch module, its Flax twin, x, the float64 parameters for the oracle)."""
    from parity_tests import to_flax
    from torch_attention.interop import torch_state_dict

    module = _torch_module(CONFIG)
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(module).items()}
    return module, to_flax(module), random_x((B, T, CONFIG["d_in"]), seed=1), params


def _flax(module: Any, x: np.ndarray, selection: Any = None, **options: Any) -> np.ndarray:
    """The Flax module's output at ``POSITIONS`` under ``nnx.jit`` (one compile: JAX's eager
    dispatch of a layer's many small operations costs more)."""
    import jax.numpy as jnp
    from flax import nnx

    run = nnx.jit(lambda m, xs, pos, chosen: m(xs, positions=pos, selection=chosen, **options))
    return np.asarray(run(module, jnp.asarray(x), jnp.asarray(POSITIONS),
                          None if selection is None else jnp.asarray(selection)))


def _choices(torch_m: Any, flax_m: Any, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Both twins' choices and scores, as NumPy (the Flax twin's under ``nnx.jit``)."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    chosen_t, scores_t = torch_m.select_keys(torch.from_numpy(x), positions=torch.from_numpy(POSITIONS))
    select = nnx.jit(lambda m, xs, pos: m.select_keys(xs, positions=pos))
    chosen_f, scores_f = select(flax_m, jnp.asarray(x), jnp.asarray(POSITIONS))
    return chosen_t.numpy(), np.asarray(chosen_f), scores_t.numpy(), np.asarray(scores_f)


def _oracle(config: dict[str, Any], params: dict[str, np.ndarray], x: np.ndarray, selection: Any = None) -> np.ndarray:
    from parity_tests import reference

    return reference.forward("MultiHeadLatentAttention", config, params, x.astype(np.float64), positions=POSITIONS,
                             selection=selection)[0]


@needs_both
def test_the_indexer_has_transformers_names_in_both_twins(pair: Any) -> None:
    """``indexer.wq_b`` / ``wk`` / ``k_norm`` (weight and bias) / ``weights_proj``, the
    shapes of ``DeepseekV32Indexer``'s; the Flax twin's paths from the declared map; the
    cache holds the latent, then the indexer's key, then the rope key."""
    from flax import nnx

    from attention_spec.interop.conversion import rules_for

    torch_m, flax_m, _, _ = pair
    heads, width, d_in = CONFIG["index_heads"], CONFIG["index_head_dim"], CONFIG["d_in"]
    indexer = {k: tuple(v.shape) for k, v in torch_m.state_dict().items() if k.startswith("indexer.")}
    assert indexer == {"indexer.wq_b.weight": (heads * width, CONFIG["q_lora_rank"]),
                       "indexer.wk.weight": (width, d_in), "indexer.k_norm.weight": (width,),
                       "indexer.k_norm.bias": (width,), "indexer.weights_proj.weight": (heads, d_in)}
    rules = rules_for("MultiHeadLatentAttention", torch_m.config)
    flax_params = {tuple(p): v.get_value().shape for p, v in nnx.to_flat_state(nnx.state(flax_m, nnx.Param))}
    assert {r.flax_path: r.flax_shape for r in rules} == flax_params
    cache = torch_m.init_cache(B, 40)
    assert tuple(cache.key.shape) == (B, 1, 40, CONFIG["kv_lora_rank"] + width)
    assert torch_m.cache_bytes_per_token(cache) == (CONFIG["kv_lora_rank"] + width + CONFIG["qk_rope_head_dim"]) * 4


@needs_both
def test_the_twins_choose_alike_and_match_the_oracle_given_one_choice(pair: Any) -> None:
    """The twins' choices agree but for ties within the scores' rounding; the oracle's
    (float64 scores) too; every path and the absorbed form of each twin equals the oracle
    run on that twin's choice."""
    import torch

    from parity_tests.reference_sparse import indexer_scores, top_keys, visible_keys
    from parity_tests.selection import compare_selections

    torch_m, flax_m, x, params = pair
    chosen_t, chosen_f, scores_t, scores_f = _choices(torch_m, flax_m, x)
    report = compare_selections(chosen_t, chosen_f, scores_t, scores_f, TOPK)
    assert report.ok, report.summary()
    assert chosen_t.sum(-1).max() == TOPK and chosen_t.sum(-1).min() == 1  # query 0 sees one key
    # the oracle's own choice, from float64 scores
    q_resid = _q_resid(params, x)
    scores64 = indexer_scores(torch_m.config, params, x.astype(np.float64), q_resid, POSITIONS)
    seen = visible_keys(torch_m.config, B, T)
    chosen64 = top_keys(scores64, seen, TOPK)
    oracle_report = compare_selections(chosen_t, chosen64, scores_t, np.where(seen, scores64, -np.inf), TOPK)
    assert oracle_report.ok, oracle_report.summary()
    want = _oracle(CONFIG, params, x, chosen_t)
    tol = ORACLE["float32"]
    with torch.no_grad():  # every path, each absorbed or expanded in one twin or the other
        for path, absorb in (("reference", False), ("blockwise", True), ("fused", False), ("auto", True)):
            got = torch_m(torch.from_numpy(x), positions=torch.from_numpy(POSITIONS), implementation=path,
                          absorb=absorb, selection=torch.from_numpy(chosen_t)).numpy()
            np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol, err_msg=f"torch {path} {absorb}")
        natural = torch_m(torch.from_numpy(x), positions=torch.from_numpy(POSITIONS)).numpy()
    np.testing.assert_allclose(natural, want, rtol=tol.rtol, atol=tol.atol)  # its own choice, as given
    for path, absorb in (("reference", True), ("blockwise", False), ("fused", True), ("auto", False)):
        got = _flax(flax_m, x, chosen_t, implementation=path, absorb=absorb)
        np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol, err_msg=f"flax {path} {absorb}")


def _q_resid(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The queries' low-rank input q_a_layernorm(q_a_proj(x)) in float64."""
    from parity_tests.reference import _linear, _qk_norm

    return _qk_norm(params, "q_a_layernorm", _linear(params, "q_a_proj", x.astype(np.float64)), "rms", 1e-6)


@needs_both
def test_gradients_flow_through_the_chosen_keys_only(pair: Any) -> None:
    """Input and parameter gradients of sum(out * cot), the choice fixed: the float32 twins
    against the same module in float64 and each other; the input gradient along a random
    direction against the float64 oracle's central difference; the indexer gets none (its
    choice is not differentiated, as transformers' no_grad)."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    torch_m, flax_m, x, params = pair
    chosen = _choices(torch_m, flax_m, x)[0]
    cot = random_x((B, T, CONFIG["d_in"]), seed=5)

    def torch_grads(module: Any, dtype: Any, selection: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        module.zero_grad()
        xt = torch.from_numpy(x).to(dtype).requires_grad_(True)
        out = module(xt, positions=torch.from_numpy(POSITIONS), selection=selection)
        (out * torch.from_numpy(cot).to(dtype)).sum().backward()
        return xt.grad.numpy(), {n: p.grad.numpy() for n, p in module.named_parameters() if p.grad is not None}

    gx, gp = torch_grads(torch_m, torch.float32, None)  # the module's own choice, made inside
    assert not any(n.startswith("indexer.") for n in gp)
    assert set(gp) == {n for n, _ in torch_m.named_parameters() if not n.startswith("indexer.")}
    gx64, gp64 = torch_grads(copy.deepcopy(torch_m).double(), torch.float64, torch.from_numpy(chosen))
    tol = GRAD_ORACLE["float32"]
    for name, g in [("x", gx), *gp.items()]:
        want = gx64 if name == "x" else gp64[name]
        assert np.abs(g - want).max() <= tol.atol + tol.rtol * np.abs(want).max(), name
    # the oracle's central difference along one direction u: <grad, u> = (f(x + eu) - f(x - eu)) / 2e
    u, eps = random_x((B, T, CONFIG["d_in"]), seed=6).astype(np.float64), 1e-6
    fd = ((_oracle(CONFIG, params, x + eps * u, chosen) - _oracle(CONFIG, params, x - eps * u, chosen)) * cot).sum()
    assert abs((gx64 * u).sum() - fd / (2 * eps)) <= 1e-6 * (np.abs(gx64 * u).sum() + abs(fd / (2 * eps)))

    def loss(module: Any, xs: Any) -> Any:
        return (module(xs, positions=jnp.asarray(POSITIONS)) * jnp.asarray(cot)).sum()

    def loss_on(module: Any, xs: Any) -> Any:  # on the PyTorch twin's choice
        out = module(xs, positions=jnp.asarray(POSITIONS), selection=jnp.asarray(chosen))
        return (out * jnp.asarray(cot)).sum()

    fgx = np.asarray(nnx.jit(lambda m, xs: jax.grad(lambda v: loss_on(m, v))(xs))(flax_m, jnp.asarray(x)))
    parity = GRAD_PARITY["float32"]
    assert np.abs(fgx - gx).max() <= parity.atol + parity.rtol * np.abs(gx).max()
    fgp = nnx.jit(nnx.grad(loss))(flax_m, jnp.asarray(x))  # its own choice, made inside
    indexer_grads = jax.tree.leaves(fgp["indexer"])
    assert len(indexer_grads) == 5 and all(float(jnp.abs(g).max()) == 0.0 for g in indexer_grads)


@needs_both
@pytest.mark.parametrize("absorb", [False, True])
def test_decoding_keeps_the_indexers_keys_and_equals_the_whole_sequence(pair: Any, absorb: bool) -> None:
    """A prompt of 17 tokens, then one token at a time (PyTorch eager, Flax under
    ``nnx.jit``): the indexer's keys in the cache, its choice over every filled position,
    equal to the whole sequence's outputs (positions 0..T-1)."""
    import torch

    torch_m, flax_m, x, _ = pair
    with torch.no_grad():
        whole = torch_m(torch.from_numpy(x), absorb=absorb).numpy()
    tol = PARITY["float32"]
    if absorb:  # the Flax step through its absorbed form; the PyTorch one as given
        import jax.numpy as jnp
        from flax import nnx

        step = nnx.jit(lambda m, chunk, c: m(chunk, cache=c, absorb=True))
        cache = flax_m.init_cache(B, 32)
        out, cache = step(flax_m, jnp.asarray(x[:, :17]), cache)
        outs = [np.asarray(out)]
        for t in range(17, T):
            out, cache = step(flax_m, jnp.asarray(x[:, t:t + 1]), cache)
            outs.append(np.asarray(out))
        np.testing.assert_allclose(np.concatenate(outs, 1), whole, rtol=tol.rtol, atol=tol.atol)
        return
    for module in (torch_m, flax_m):
        np.testing.assert_allclose(decode_in_steps(module, x, 17, 32), whole, rtol=tol.rtol, atol=tol.atol)


@needs_both
def test_scores_tied_on_purpose_are_reported_as_ties_and_a_planted_bug_diverges(pair: Any) -> None:
    """The harness's selection parity (``sparse_parity``): the twins agree; scores made to
    tie (an indexer whose weights give every key of a query the same score but for
    rounding) differ in their choice only within the rounding and their outputs on one
    choice agree; an indexer whose rope is planted wrong on one side diverges, named."""
    import jax.numpy as jnp
    import torch

    from parity_tests import to_flax
    from parity_tests.selection import compare_selections, sparse_parity

    torch_m, flax_m, x, _ = pair
    report, error, agree = sparse_parity(torch_m, flax_m, x, positions=POSITIONS)
    assert report.ok and agree, (report.summary(), error)
    # ties on purpose: without rope, the indexer's keys all k_norm's bias but for a part
    # 1e-7 as large, so each query's scores differ only in their last bits
    from parity_tests.selection import SCORE_ATOL, SCORE_RTOL, _gaps

    tied = _torch_module({**CONFIG, "rope": None})
    with torch.no_grad():
        tied.indexer.k_norm.weight.fill_(1e-7)
        tied.indexer.k_norm.bias.uniform_(0.5, 1.0)
    report, error, agree = sparse_parity(tied, to_flax(tied), x)
    assert agree, error
    assert report.ok, report.summary()
    scores = tied.select_keys(torch.from_numpy(x))[1].numpy().reshape(B * T, T)
    gaps, scale = _gaps(scores, TOPK)
    rows = np.isfinite(scores).sum(-1) > TOPK
    assert (gaps[rows] <= SCORE_ATOL + SCORE_RTOL * scale[rows]).all()  # each k-th key a tie within rounding
    # a planted bug: the Flax twin's indexer turns its rope in the other layout
    bugged = to_flax(torch_m)
    assert bugged.spec.index_rope_layout == "half"
    object.__setattr__(bugged, "spec", dataclasses.replace(bugged.spec, index_rope_layout="interleaved"))
    chosen_t, scores_t = torch_m.select_keys(torch.from_numpy(x), positions=torch.from_numpy(POSITIONS))
    chosen_b, scores_b = bugged.select_keys(jnp.asarray(x), positions=jnp.asarray(POSITIONS))
    report = compare_selections(chosen_t.numpy(), np.asarray(chosen_b), scores_t.numpy(), np.asarray(scores_b), TOPK)
    assert not report.ok and report.divergent and report.score_error > report.score_rounding, report.summary()
    assert "DIVERGES" in report.summary()


@needs_torch
@pytest.mark.parametrize("options,text", [
    ({"index_topk": 8}, "index_topk (sparse attention) needs index_heads"),
    ({"index_topk": 0, "index_heads": 2, "index_head_dim": 16}, "index_topk must be >= 1; got 0"),
    ({"index_heads": 2}, "index_heads is the sparse attention indexer's: it needs index_topk"),
    ({"index_topk": 8, "index_heads": 2, "index_head_dim": 4}, "index_head_dim must be >= qk_rope_head_dim 8"),
    ({"index_topk": 8, "index_heads": 2, "index_head_dim": 16, "q_lora_rank": None},
     "index_topk (sparse attention) needs q_lora_rank"),
    ({"index_topk": 8, "index_heads": 2, "index_head_dim": 16, "index_rope_layout": "spiral"},
     "index_rope_layout must be one of"),
])
def test_a_bad_indexer_option_has_one_error_text(options: dict[str, Any], text: str) -> None:
    base = {k: v for k, v in CONFIG.items() if not k.startswith("index_")}
    found = constructor_errors({**base, **options}, "MultiHeadLatentAttention")
    assert len(set(found)) == 1 and text in found[0][1], found


@needs_both
def test_a_bad_selection_has_one_error_text(pair: Any) -> None:
    """``selection`` of the wrong shape or dtype, on a dense module, and ``select_keys`` on
    a dense module: the same ValueError from both twins, before any work."""
    import jax.numpy as jnp
    import torch

    from parity_tests import to_flax

    torch_m, flax_m, x, _ = pair
    dense = _torch_module({k: v for k, v in CONFIG.items() if not k.startswith("index_")})
    dense_flax = to_flax(dense)
    cases = [(torch_m, flax_m, np.ones((B, T, T - 1), bool), "selection must be a bool array of shape (2, 24, 24)"),
             (torch_m, flax_m, np.ones((B, T, T), np.float32), "selection must be a bool array"),
             (dense, dense_flax, np.ones((B, T, T), bool), "selection= is the sparse attention indexer's")]
    for tm, fm, selection, text in cases:
        texts = []
        for module, xs, chosen in ((tm, torch.from_numpy(x), torch.from_numpy(selection)),
                                   (fm, jnp.asarray(x), jnp.asarray(selection))):
            with pytest.raises(ValueError) as info:
                module(xs, selection=chosen)
            texts.append(str(info.value))
        assert texts[0] == texts[1] and text in texts[0], texts
    for m, xs in ((dense, torch.from_numpy(x)), (dense_flax, jnp.asarray(x))):
        with pytest.raises(ValueError, match="select_keys is sparse attention's"):
            m.select_keys(xs)


# --------------------------------------------------------------------------- transformers

def _hf_layer(family: str, seed: int = 0) -> tuple[Any, Any]:
    """(layer, its rotary embedding): a tiny float32 DeepSeek-V3.2 / GLM-5 attention layer,
    eager, weights drawn N(0, 0.3^2) (norm weights near 1)."""
    import torch
    import transformers as tf

    if family == "deepseek_v32":
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mod

        config_cls, attention, rotary = tf.DeepseekV32Config, mod.DeepseekV32Attention, mod.DeepseekV32RotaryEmbedding
    else:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod

        config_cls, attention, rotary = tf.GlmMoeDsaConfig, mod.GlmMoeDsaAttention, mod.GlmMoeDsaRotaryEmbedding
    config = config_cls(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_topk=TOPK, index_head_dim=16,
                        index_n_heads=4, num_hidden_layers=2, vocab_size=64, max_position_embeddings=2048)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_((1.0 if "norm.weight" in name or "layernorm" in name else 0.0) + 0.3 * torch.randn_like(p))
    return layer, rotary(config)


@needs_both
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_from_hf_matches_transformers_sparse_attention(pair: Any, family: str) -> None:
    """``from_hf`` of DeepSeek-V3.2's / GLM-5's layer (its indexer's rope half-split /
    interleaved) and the Flax twin: the choice equal to the layer's but for ties, the
    outputs equal given the layer's choice (float32 parity), at positions 480..; the round
    trip bit-exact."""
    import torch

    from parity_tests import to_flax
    from parity_tests.selection import compare_selections
    from torch_attention.interop import from_hf, to_hf

    layer, rotary = _hf_layer(family)
    ours = from_hf(layer)
    assert ours.spec.index_rope_layout == ("half" if family == "deepseek_v32" else "interleaved")
    x, positions = torch.from_numpy(pair[2]), torch.from_numpy(POSITIONS)
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    cos_sin = rotary(x, positions)
    with torch.no_grad():
        want = layer(x, cos_sin, causal, position_ids=positions)[0].numpy()
        q_resid = layer.q_a_layernorm(layer.q_a_proj(x))
        indices = layer.indexer(x, q_resid, cos_sin, causal[:, 0], positions).long()
    theirs = torch.zeros(B, T, T, dtype=torch.bool).scatter(-1, indices, True) & torch.ones(T, T, dtype=torch.bool).tril()
    chosen, scores = ours.select_keys(x, positions=positions)
    report = compare_selections(chosen.numpy(), theirs.numpy(), scores.numpy(), scores.numpy(), TOPK)
    assert not report.divergent, report.summary()  # ties at 0 (ReLU) go either way in torch.topk
    tol = PARITY["float32"]
    with torch.no_grad():
        got = ours(x, positions=positions, selection=theirs).numpy()
    np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    got_flax = _flax(to_flax(ours), pair[2], theirs.numpy())
    np.testing.assert_allclose(got_flax, want, rtol=tol.rtol, atol=tol.atol)
    if not report.differences:  # the choices agree: our own choice gives the layer's outputs
        with torch.no_grad():
            np.testing.assert_allclose(ours(x, positions=positions).numpy(), want, rtol=tol.rtol, atol=tol.atol)
    fresh, _ = _hf_layer(family, seed=1)
    to_hf(ours, fresh)
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), fresh.state_dict().values(), strict=True))
    assert list(layer.state_dict()) == list(fresh.state_dict())


@needs_torch
def test_glm_shared_layers_are_refused_by_name() -> None:
    """GLM-5's ``indexer_types`` "shared" layer (no indexer: the previous layer's choice)
    is refused, naming it, before any weight is read."""
    import transformers as tf
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod

    from torch_attention.interop import from_hf

    config = tf.GlmMoeDsaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_topk=TOPK,
                                index_head_dim=16, index_n_heads=4, num_hidden_layers=2, vocab_size=64,
                                indexer_types=["full", "shared"])
    layer = mod.GlmMoeDsaAttention(config, layer_idx=1)
    with pytest.raises(ValueError, match="reuses the previous layer's choice of keys"):
        from_hf(layer)
