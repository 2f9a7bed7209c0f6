"""Whole-model proofs of DeepSeek-V3.2 (``DeepseekV32ForCausalLM``: latent attention with
an indexer choosing each query's top ``index_topk`` keys, DSA) and GLM-5
(``GlmMoeDsaForCausalLM``: the same with the indexer's rope in interleaved pairs), built tiny (width 32, 2
layers, ``index_topk`` 8) with every weight random, every attention layer ``from_hf``-ported,
and the harness's selection-aware reports.

- The PyTorch twin: the model with each ``self_attn`` replaced by ours (``from_hf``), its
  second layer's MLP a mixture of experts (transformers' own): each layer's choice of keys
  equal to transformers' but for ties within the scores' rounding, and, given transformers'
  choice, the logits and every parameter's gradient equal.
- The JAX twin, one call (``check_causal_lm_parity``): the Flax skeleton written here has
  dense MLPs only (no MoE: DeepSeek's group-routed experts and V4's hyper-connections have
  no Flax skeleton in the tests), so the model is built with both layers dense
  (``first_k_dense_replace`` 3 > 2 layers, transformers' default); logits and gradients at
  the real rows of a left-padded batch of 512, AdamW steps, greedy decoding with our cache
  (the indexer's keys in it).
- ``locate_divergence`` names a planted indexer bug at the layer's choice of keys, and
  reports scores tied on purpose (every indexer query 0: each key's score the ReLU's 0,
  where ``torch.topk`` keeps other keys than ours, which keep the earliest) as ties, not
  as a divergence; ``check_causal_lm_parity`` likewise."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from tests.support import (
    assert_named_at,
    flax_logits,
    hf_logits,
    left_padded,
    lm_ids,
    needs_both,
    ported,
    proven,
)

pytestmark = needs_both
pytest.importorskip("transformers")

import jax  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from parity_tests import check_causal_lm_parity, locate_divergence, to_flax  # noqa: E402
from parity_tests.causal_lm import PaddedEmbed, randomise  # noqa: E402
from parity_tests.selection import compare_selections  # noqa: E402
from parity_tests.tolerances import GRAD_PARITY, PARITY  # noqa: E402
from tests.harness.test_family_proofs_2026 import _Cached, _CausalLM, _Inner  # noqa: E402
from tests.harness.test_hybrid_proofs import _MLP  # noqa: E402
from torch_attention.interop import from_hf  # noqa: E402

VOCAB, WIDTH, LONG, PADS, TOPK, SHORT = 96, 32, 512, 37, 8, 48
CONFIG = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8, index_topk=TOPK, index_head_dim=16, index_n_heads=16, max_position_embeddings=1024,
              bos_token_id=0, eos_token_id=1, pad_token_id=2, use_cache=False, tie_word_embeddings=False)


def _hf(family: str = "DeepseekV32", **changes: Any) -> Any:
    """A tiny random ``{family}ForCausalLM`` (``DeepseekV32``; ``GlmMoeDsa``: GLM-5's)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**CONFIG, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family}ForCausalLM")(config).float().eval()
    randomise(hf, 0)
    return hf


# --------------------------------------------------------------------------- the PyTorch twin


class _Ours(torch.nn.Module):
    """Our ``MultiHeadLatentAttention`` (``from_hf``) where a ``DeepseekV32DecoderLayer``
    calls its ``self_attn`` (the whole sequence, no padding): at the slots' positions, on
    ``given`` (another choice of keys) where set, its own choice recorded (``chosen``:
    the keys and the scores, from the layer's input)."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.ours, self.given, self.chosen = from_hf(layer), None, None

    def forward(self, hidden_states: Any, position_embeddings: Any = None, attention_mask: Any = None,
                cache: Any = None, position_ids: Any = None, **kwargs: Any) -> tuple[Any, None]:
        positions = position_ids.expand(hidden_states.shape[0], -1)
        self.chosen = self.ours.select_keys(hidden_states.detach(), positions=positions)
        return self.ours(hidden_states, positions=positions, selection=self.given), None


def test_a_deepseek_v32_with_our_pytorch_attention_gives_its_choices_logits_and_gradients() -> None:
    """Both layers ``from_hf``, the second's MLP a mixture of experts: each layer's choice
    (ours on transformers' inputs) is transformers' but for ties within the scores'
    rounding; given transformers' choice, the logits of 2 x 48 tokens and every
    parameter's gradient equal transformers' (float32 parity); where no choice differs,
    ours on its own choice gives them too."""
    hf = _hf(mlp_layer_types=["dense", "sparse"], n_routed_experts=4, num_experts_per_tok=2, n_group=1,
             topk_group=1, moe_intermediate_size=32)
    ours = copy.deepcopy(hf)
    for layer in ours.model.layers:
        layer.self_attn = _Ours(layer.self_attn)
    theirs: list[Any] = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, a, out: theirs.append(out.long()))
             for layer in hf.model.layers]
    ids = torch.from_numpy(lm_ids(SHORT, VOCAB))
    want = hf(input_ids=ids).logits
    for hook in hooks:
        hook.remove()
    causal = torch.ones(SHORT, SHORT, dtype=torch.bool).tril()
    chosen = [torch.zeros(2, SHORT, SHORT, dtype=torch.bool).scatter(-1, i, True) & causal for i in theirs]
    for layer, given in zip(ours.model.layers, chosen, strict=True):
        layer.self_attn.given = given
    got = ours(input_ids=ids).logits
    differ = 0
    for layer, given in zip(ours.model.layers, chosen, strict=True):
        keys, scores = layer.self_attn.chosen
        report = compare_selections(keys.numpy(), given.numpy(), scores.numpy(), scores.numpy(), TOPK)
        assert report.ok, report.summary()  # ties at the ReLU's 0 go either way in torch.topk
        differ += len(report.differences)
    tol, grad_tol = PARITY["float32"], GRAD_PARITY["float32"]
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=tol.rtol, atol=tol.atol)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * cotangent).sum().backward()
    (got * cotangent).sum().backward()
    theirs_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        g = theirs_grads[name.replace(".self_attn.ours.", ".self_attn.")].grad
        assert (p.grad is None) == (g is None), name  # (None: an expert no token was routed to, in both)
        if g is not None:
            np.testing.assert_allclose(p.grad.numpy(), g.numpy(), rtol=grad_tol.rtol,
                                       atol=grad_tol.atol * float(g.abs().max()), err_msg=name)
    assert len(theirs_grads) == len(list(ours.named_parameters()))
    if not differ:
        for layer in ours.model.layers:
            layer.self_attn.given = None
        with torch.no_grad():
            np.testing.assert_allclose(ours(input_ids=ids).logits.numpy(), want.detach().numpy(), rtol=tol.rtol,
                                       atol=tol.atol)


# --------------------------------------------------------------------------- the JAX twin


class _V32Layer(_Cached):
    """``DeepseekV32DecoderLayer`` with a dense MLP: ``x + self_attn(input_layernorm(x))``,
    then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, hf_layer: Any, eps: float, rngs: nnx.Rngs) -> None:
        width = hf_layer.hidden_size
        self.input_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.self_attn = to_flax(from_hf(hf_layer.self_attn))
        self.post_attention_layernorm = nnx.RMSNorm(width, epsilon=eps, rngs=rngs)
        self.mlp = _MLP(width, hf_layer.mlp.intermediate_size, rngs)

    def _forward(self, x: jax.Array, attend: Any) -> jax.Array:
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _V32ForCausalLM(_CausalLM):
    def __init__(self, hf: Any) -> None:
        c, rngs = hf.config, nnx.Rngs(0)
        self.model = _Inner(PaddedEmbed(c.vocab_size, c.hidden_size, c.pad_token_id, rngs),
                            [_V32Layer(layer, c.rms_norm_eps, rngs) for layer in hf.model.layers],
                            nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs))
        self.lm_head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, kernel_init=nnx.initializers.zeros_init(),
                                  rngs=rngs)

    def head(self, hidden: jax.Array) -> jax.Array:
        return self.lm_head(hidden)


@pytest.fixture(scope="module")
def v32() -> tuple[Any, Any, list[Any]]:
    hf = _hf()
    return ported(hf, _V32ForCausalLM(hf))


def test_a_whole_deepseek_v32_port_is_proven_in_one_call(v32: tuple[Any, Any, list[Any]]) -> None:
    """Both layers ``from_hf`` as sparse latent attention (``index_topk`` 8, the indexer's
    rope half-split); the one call on a left-padded batch of 512: each layer's choice of
    keys compared first (ties allowed), then logits, gradients, two AdamW steps, three
    greedy tokens with our caches."""
    _, flax, _ = v32
    specs = [layer.self_attn.spec for layer in flax.model.layers]
    assert [(s.index_topk, s.index_rope_layout) for s in specs] == [(TOPK, "half")] * 2
    report = proven(v32, lm_ids(LONG, VOCAB), left_padded(LONG, PADS),
                    {"model.layers.0.self_attn", "model.layers.0.self_attn.indexer.wq_b",
                     "model.layers.1.self_attn.indexer.weights_proj", "model.layers.1.self_attn.o_proj",
                     "model.layers.1.mlp"})
    assert [s.torch_name for s in report.selections] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert all(s.ok for s in report.selections), report.message()


@pytest.fixture(scope="module")
def glm5() -> tuple[Any, Any, list[Any]]:
    hf = _hf("GlmMoeDsa")
    return ported(hf, _V32ForCausalLM(hf))


def test_a_whole_glm5_port_is_proven_in_one_call(glm5: tuple[Any, Any, list[Any]]) -> None:
    """GLM-5 (``GlmMoeDsaForCausalLM``, every layer's indexer its own: ``indexer_types``
    "full"), whose indexer turns its rope in interleaved pairs where DeepSeek-V3.2's turns
    halves: both layers ``from_hf`` with that layout, the same one-call proof on a
    left-padded batch of 512 (choices first, ties allowed; logits, gradients, two AdamW
    steps, three greedy tokens). Module by module ``locate_divergence`` is not run: GLM-5's
    attention and decoder layers also return their top-k indices (for a next "shared"
    layer), a structure ours has not (it takes a given choice as ``selection=``)."""
    hf, flax, _ = glm5
    assert hf.config.indexer_types == ["full", "full"]
    specs = [layer.self_attn.spec for layer in flax.model.layers]
    assert [(s.index_topk, s.index_rope_layout) for s in specs] == [(TOPK, "interleaved")] * 2
    report = proven(glm5, lm_ids(LONG, VOCAB), left_padded(LONG, PADS),
                    set(), locate=False)
    assert [s.torch_name for s in report.selections] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert all(s.ok for s in report.selections), report.message()


def test_a_planted_indexer_bug_is_named_at_that_layers_choice_of_keys(v32: tuple[Any, Any, list[Any]]) -> None:
    """Layer 1's indexer turning its rope in the other layout on the Flax side (no module
    of its own computes it: the numbers of every module agree): ``locate_divergence`` names
    layer 1's choice of keys, beyond the scores' rounding, the outputs agreeing where the
    choices agree; a nudged indexer weight is named at that projection."""
    import dataclasses

    hf, flax, _ = v32
    attention = flax.model.layers[1].self_attn
    spec = attention.spec
    object.__setattr__(attention, "spec", dataclasses.replace(spec, index_rope_layout="interleaved"))
    try:
        report = locate_divergence(hf, flax, lm_ids(SHORT, VOCAB), torch_call=hf_logits, flax_call=flax_logits)
    finally:
        object.__setattr__(attention, "spec", spec)
    assert_named_at(report, "model.layers.1.self_attn", ("model", "layers", 1, "self_attn"), "selection")
    first, second = report.selections
    assert first.ok and not first.differs and not second.ok and second.report.divergent, str(report)
    assert second.agreeing.ok, str(report)
    assert "the choice of keys at model.layers.1.self_attn" in str(report).splitlines()[0]
    kernel = attention.indexer.wq_b.kernel
    saved = kernel[...]
    kernel[...] = saved.at[3, 5].add(1e-2)
    try:
        nudged = locate_divergence(hf, flax, lm_ids(SHORT, VOCAB), torch_call=hf_logits, flax_call=flax_logits)
    finally:
        kernel[...] = saved
    assert_named_at(nudged, "model.layers.1.self_attn.indexer.wq_b", ("model", "layers", 1, "self_attn", "indexer",
                                                                      "wq_b"))


def test_scores_tied_at_the_relus_zero_are_reported_as_ties_not_a_divergence() -> None:
    """Layer 0's indexer queries all 0 (``wq_b`` zeroed): every key's score is the ReLU's 0,
    ``torch.topk`` keeps other keys than ours (the earliest): ``locate_divergence`` finds no
    divergence, layer 0's choice differing by ties (the Flax model run on transformers'
    choice, every module agreeing); ``check_causal_lm_parity`` reports the same choices and
    proves the logits and gradients given transformers' choice."""
    hf = _hf()
    with torch.no_grad():
        hf.model.layers[0].self_attn.indexer.wq_b.weight.zero_()
    port = ported(hf, _V32ForCausalLM(hf))
    ids = lm_ids(SHORT, VOCAB)
    # forward only: check_causal_lm_parity below proves the gradients on transformers' choice
    report = locate_divergence(hf, port[1], ids, torch_call=hf_logits, flax_call=flax_logits, backward=False)
    assert report.ok, str(report)
    tied = report.selections[0]
    assert tied.ties_only and tied.report.differences and tied.report.score_error == 0.0, str(report)
    assert "chose other keys by ties" in str(report).splitlines()[0], str(report)
    lm = check_causal_lm_parity(hf, port[1], ids, param_map=port[2], steps=0)
    assert lm.ok and lm.same_selection, lm.message()
    assert len(lm.selections[0].report.differences) == len(tied.report.differences), lm.message()
    # each side on its own choice: the logits differ beyond any tolerance, while both are right
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    own = np.asarray(port[1](jax.numpy.asarray(ids))["logits"])
    assert np.abs(own - want).max() > 1e3 * PARITY["float32"].atol
