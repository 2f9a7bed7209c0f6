"""``from_hf`` over every causal-LM family of the installed ``transformers``: a tiny random
model of each (2 layers, hidden 32, 4 heads over 2 key/value heads, head_dim 8, vocab 64,
float32, eager attention, seeded), every decoder layer's attention replaced by
``from_hf(layer)`` called as Hugging Face calls its layer, and the model's logits compared
with the native ones (<= 1e-5 relative to their largest) at positions 448..511 (64 tokens
given ``position_ids``: the rotation at positions > 400 without 512 tokens of compute; the
windows are 8 keys, shorter than the sequence); or the family refused with a message that
names its mechanism, before any weight is read.  One module-scope pass over all families,
each verdict cached; ``python -m tests.interop.test_hf_families`` prints the table that
``docs/porting.md`` keeps (``torch_attention._hf.hf_families_table``)."""

from __future__ import annotations

import functools
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.support import needs_torch

POSITIONS = (448, 512)
TOLERANCE = 1e-5
MAX_PARAMS = 2_000_000  # a tiny config bigger than this is "not tiny": its defaults resisted the overrides
TINY: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 1024, "moe_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_routed_experts": 4,
    "n_shared_experts": 1, "shared_expert_intermediate_size": 32, "sliding_window": 8, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "is_decoder": True, "use_cache": False, "tie_word_embeddings": False,
    "rotary_dim": 4,  # GPT-J's and CodeGen's (64 by default: wider than the sweep's heads)
    "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 64, "global_head_dim": 16,  # Gemma 4's
}
# a model type's own overrides, on top of TINY's
TINY_FOR: dict[str, dict[str, Any]] = {
    "mimo_v2_flash": {"v_head_dim": 12},  # value heads of their own width (its 0.707 attention_value_scale kept)
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 8, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 8, "v_head_dim": 8},
    # DSA (sparse attention): its indexer keeps every key (index_topk = the sweep's 64 tokens), since
    # the ReLU's exact ties (0) go either way in torch.topk; the choice itself is checked against the
    # layers in tests/modules/test_sparse_attention.py, ties told apart (parity_tests.selection)
    **{t: {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
           "qk_nope_head_dim": 8, "v_head_dim": 8, "index_topk": 64, "index_head_dim": 16, "index_n_heads": 4}
       for t in ("deepseek_v32", "glm_moe_dsa")},
}
MIXERS = ("self_attn", "attn", "attention", "self_attention", "linear_attn", "mixer", "mamba", "conv",
          "temporal_block")


def _tiny_config(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    base = cls()
    if hasattr(base, "text_config") and getattr(base, "text_config", None) is not None:
        raise LookupError("a composite (multimodal) config: its text model is swept on its own where it has one")
    tiny = {**TINY, **TINY_FOR.get(model_type, {})}
    return cls(**{k: v for k, v in tiny.items() if _has(base, k) or k in ("vocab_size", "num_hidden_layers")})


def _has(config: Any, name: str) -> bool:
    """Whether a config has ``name``; Gemma 4's raises (not AttributeError) for a global
    ``head_dim`` that differs per layer: it has one."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return True


def _mixers(model: Any, layers: int) -> list[tuple[Any, str, Any]]:
    """(decoder layer, child name, the child) for each layer's token mixer."""
    from torch import nn

    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == layers:
            found = [(layer, name, child) for layer in module for name, child in layer.named_children()
                     if name in MIXERS]
            if len(found) >= layers:
                return found
    return []


class _AsHF:
    """Ours called as Hugging Face calls its attention layer: (hidden_states, ...) ->
    (output, None) (a list where the layer gives one: GPT-1's; the output alone where the layer
    gives a tensor), at the sweep's positions;
    what is not ours applied as the layer does: BERT's residual and ``output.LayerNorm``
    after, RoBERTa-PreLayerNorm's ``LayerNorm`` before and the residual after."""

    @staticmethod
    def wrap(ours: Any, native: Any, positions: Any, gives: type = tuple, arity: int = 2) -> Any:
        from torch import nn

        from torch_attention._hf import _forward_takes, _recognise

        try:
            not_ours = _recognise(native, "sweep").not_ours
        except (TypeError, ValueError):  # a layer from_hf ports by another path (DeepSeek's latent attention)
            not_ours = None
        residual = "residual" in _forward_takes(native)

        class Port(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ours = ours

            def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
                spec = getattr(ours, "spec", None)  # (a query scale by position takes them without rope: Beam's)
                rope = getattr(spec, "rope", None) is not None or getattr(spec, "query_scale", None) is not None
                x = hidden_states
                if not_ours is not None and not_ours != "output.LayerNorm":  # a pre-norm
                    x = getattr(native, not_ours)(hidden_states)
                out = ours(x, positions=positions) if rope else ours(x)
                if residual:  # Bloom's layer adds its decoder's residual: the caller's, with ours
                    out = out + (kwargs["residual"] if "residual" in kwargs else args[0])
                if not_ours == "output.LayerNorm":
                    out = native.output.LayerNorm(out + hidden_states)
                elif not_ours is not None:
                    out = out + hidden_states
                if gives is list:
                    return [out, None]
                return (out, *(None,) * (arity - 1)) if gives is tuple else out  # (GLM-5's: out, None, None)

        return Port()


def _randomise(layer: Any) -> None:
    """Every bias, sink and norm weight of an attention layer drawn (no zero biases, no
    unit norms)."""
    import torch

    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.1 * torch.randn_like(p))


def _verdict(model_type: str) -> tuple[str, str, float | None]:
    """(``"ports"``, ``"refused"`` or ``"not built"``, the detail, the logits' largest
    relative error)."""
    import torch
    from transformers import AutoModelForCausalLM

    from torch_attention.interop import from_hf

    try:
        config = _tiny_config(model_type)
        config._attn_implementation = "eager"
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        size = sum(p.numel() for p in shell.parameters())
        if size > MAX_PARAMS:
            return "not built", f"not tiny with the sweep's overrides ({size:,} parameters)", None
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    except Exception as e:  # noqa: BLE001 - a family that cannot be built tiny here is reported, not failed
        return "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", None
    mixers = _mixers(model, int(config.num_hidden_layers))
    if not mixers:
        return "not built", "no attention layer found in a ModuleList of its decoder layers", None
    ports = []
    given: set[str] = set()  # what a layer without its model's config was given, as its refusal asks
    for layer, name, child in mixers:
        _randomise(child)
        try:
            try:
                ports.append((layer, name, child, from_hf(child)))
            except ValueError as e:  # a layer that keeps no config (GPT-NeoX-Japanese, Bloom, MPT): its model's
                remedies = {"layer.config": ("config", config), "layer.is_causal": ("is_causal", True)}
                asked = [r for r in remedies if f"set {r}" in str(e)]
                if not asked:
                    raise
                for remedy in asked:
                    setattr(child, *remedies[remedy])  # the config it was built from; causal: a causal LM
                given.update(asked)
                ports.append((layer, name, child, from_hf(child)))
        except (TypeError, ValueError) as e:
            return "refused", str(e), None
        except Exception as e:  # noqa: BLE001 - from_hf must refuse with TypeError / ValueError: flagged below
            return "error", f"from_hf raised {type(e).__name__}: {e}", None
    ids = torch.randint(0, 64, (1, POSITIONS[1] - POSITIONS[0]), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(*POSITIONS)[None]
    gives: dict[int, type] = {}  # what each layer returns: a tuple, a list (GPT-1's) or a tensor; the port too
    arity: dict[int, int] = {}  # how many things a tuple holds

    def note(module: Any, _args: Any, out: Any) -> None:
        gives.setdefault(id(module), type(out))
        arity.setdefault(id(module), len(out) if isinstance(out, tuple) else 2)

    hooks = [child.register_forward_hook(note) for _, _, child, _ in ports]
    try:
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=positions).logits
            for hook in hooks:
                hook.remove()
            for layer, name, child, ours in ports:
                kind = gives.get(id(child), tuple)
                setattr(layer, name, _AsHF.wrap(ours, child, positions, kind if kind in (list, tuple) else object,
                                                arity.get(id(child), 2)))
            got = model(input_ids=ids, position_ids=positions).logits
    except Exception as e:  # noqa: BLE001 - reported with the family
        return "not built", f"the native forward failed here: {type(e).__name__}: {str(e).splitlines()[0][:160]}", None
    error = float((got - want).abs().max() / want.abs().max())
    classes = ", ".join(sorted({type(c).__name__ for _, _, c, _ in ports}))
    return "ports", classes + (f" (given {' and '.join(sorted(given))})" if given else ""), error


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def sweep() -> dict[str, tuple[str, str, float | None, float]]:
    """{model type: (verdict, detail, logits error, seconds)} for every family."""
    import transformers

    transformers.logging.set_verbosity_error()
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in _families():
            start = time.perf_counter()
            verdict = _verdict(model_type)
            results[model_type] = (*verdict, time.perf_counter() - start)
    return results


@pytest.fixture(scope="module")
def verdicts() -> dict[str, tuple[str, str, float | None, float]]:
    return sweep()


@needs_torch
def test_every_family_ports_within_1e_5_or_is_refused_naming_its_mechanism(verdicts: Any) -> None:
    wrong = {t: v for t, v in verdicts.items() if v[0] == "error" or (v[0] == "ports" and not v[2] <= TOLERANCE)}
    assert not wrong, wrong
    unnamed = {t: v[1] for t, v in verdicts.items() if v[0] == "refused" and ":" not in v[1] and "; got " not in v[1]}
    assert not unnamed, unnamed


# The families the issue names: each ports (or, where it has a mechanism ours lacks, is refused naming it).
MUST_PORT = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phimoe", "olmoe", "olmo",
             "olmo2", "olmo3", "glm4_moe", "minimax_m2", "seed_oss", "arcee", "starcoder2",
             "granite", "stablelm", "exaone4", "smollm3", "apertus", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
             "gpt_oss", "gpt2", "gpt_neox", "lfm2",
             # recognised by mechanism (issue 56): interleaved rotary pairs, packings found by a probe, a
             # layer without its model's config, a pre-norm left to the caller, a rotary table without inv_freq
             "cohere", "cohere2", "cohere2_moe", "ernie4_5", "ernie4_5_moe", "glm", "glm4", "helium", "gpt_bigcode",
             "persimmon", "gptj", "openai-gpt", "roberta-prelayernorm", "xlm-roberta-xl", "modernbert-decoder",
             # 2026's mechanisms: chunks, query scales, weightless norms, keys as values, a value norm, proportional
             # rope, linear attention (the gated delta rule, KDA) beside softmax or latent layers
             "llama4_text", "ministral3", "gemma4_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
             "kimi_linear", "deepseek_v32", "glm_moe_dsa",
             # a separate sigmoid gate_proj as our output gate (rows interleaved per head), halves turned by -angle
             "afmoe", "nanochat",
             # a qk-norm after rope (HunYuan), a norm of the merged heads (BitNet), a softplus gate per head (Laguna)
             "hunyuan_v1_dense", "hunyuan_v1_moe", "bitnet", "laguna",
             # a sigmoid gate with a bias per head and a scalable softmax (queries scaled by position) on NoPE layers
             "beam",
             # CodeGen's qkv_proj in 4 model-parallel shards of [q; v; k] (packing="codegen", found by a probe)
             "codegen",
             # layers that keep no config of their model (given layer.config / layer.is_causal, as their refusal
             # asks): GPT-NeoX-Japanese's returned dense_bias as out_proj's bias, Bloom's and MPT's ALiBi slopes
             # computed as their models do (Bloom's residual its decoder's, added by the caller)
             "gpt_neox_japanese", "bloom", "mpt",
             # value heads of their own width (v_head_dim) scaled as they leave v_proj (v_scale), sliding layers
             # with twice the config's key/value heads
             "mimo_v2_flash")
MUST_REFUSE = {"xglm": "self- or cross-attention by its caller",
               "trocr": "self- or cross-attention by its caller", "rembert": "self- or cross-attention by its caller",
               "megatron-bert": "self- or cross-attention by its caller", "roformer": "sinusoidal_pos",
               "big_bird": "block-sparse attention",
               "dory": "a parameter no mechanism accounts for: `sqk`"}


@needs_torch
def test_the_named_families_port_and_the_others_name_their_mechanism(verdicts: Any) -> None:
    assert {t: verdicts[t][:2] for t in MUST_PORT if verdicts[t][0] != "ports"} == {}
    assert {t: verdicts[t][1] for t, text in MUST_REFUSE.items() if text not in verdicts[t][1]} == {}


@needs_torch
def test_docs_list_the_families_from_hf_ports(verdicts: Any) -> None:
    from torch_attention._hf import hf_families_table

    text = (Path(__file__).parents[2] / "docs" / "porting.md").read_text()
    table = hf_families_table({t: v[:3] for t, v in verdicts.items()})
    assert table in text, "docs/porting.md's family table is stale: python -m tests.interop.test_hf_families"


def _print() -> None:
    from torch_attention._hf import hf_families_table

    results = sweep()
    print(hf_families_table({t: v[:3] for t, v in results.items()}))
    slow = sorted(results.items(), key=lambda kv: -kv[1][3])[:10]
    print("slowest:", ", ".join(f"{t} {v[3]:.2f}s" for t, v in slow), f"total {sum(v[3] for v in results.values()):.1f}s")


if __name__ == "__main__":
    _print()
