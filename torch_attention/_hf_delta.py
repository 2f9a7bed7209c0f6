"""``from_hf`` for the linear-attention layers of the hybrid models: transformers'
``Qwen3_5GatedDeltaNet`` (and the layers of its layout: Qwen3.5-MoE's, LaraMini's),
``Qwen3NextGatedDeltaNet`` (q, k, v, z and b, a packed per key head) -> our
``GatedDeltaNet``; ``KimiLinearDeltaAttention`` -> our ``KimiDeltaAttention``.

Recognised by what the layer holds (its sub-modules and parameters), read from the
attributes transformers sets from its config (``linear_num_key_heads`` ->
``num_k_heads``, ``linear_key_head_dim`` -> ``head_k_dim``, ``linear_num_value_heads``,
``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``hidden_act``, ``rms_norm_eps``
on the norm), the weights copied exactly, then ours and theirs run on one probe and must
agree (else ValueError): a layout these rules misread is refused, never ported wrong.  A
linear-attention layer of another layout (OLMo-hybrid's: separate q/k/v convs, beta
times 2) is not recognised and ``from_hf`` refuses it as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attention_spec.interop.specs import MergeAxes, Rule, Sections, SplitAxis, Transpose
from torch_attention.delta_net import GatedDeltaNet, KimiDeltaAttention

LINEAR_ATTENTION = "a linear-attention layer (gated delta rule), not softmax attention"
# What each layout holds: its sub-modules, and parameters of its own.
_LAYOUTS = {
    "qwen3_5": ({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj"},
                {"A_log", "dt_bias"}),
    "qwen3_next": ({"in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"}, {"A_log", "dt_bias"}),
    "kimi": ({"q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm",
              "o_proj"}, set()),
}


def layout(layer: Any) -> str | None:
    """The layout ``layer`` has ("qwen3_5", "qwen3_next", "kimi"), or None: not one of
    these linear-attention layers."""
    if not isinstance(layer, nn.Module):
        return None
    children = {n for n, _ in layer.named_children()}
    own = {n for n, _ in layer.named_parameters(recurse=False)}
    for name, (modules, params) in _LAYOUTS.items():
        if modules <= children and params <= own:
            gate: Any = getattr(layer, "forget_gate", None)
            if name == "kimi" and not {"A_log", "dt_bias"} <= {n for n, _ in gate.named_parameters()}:
                continue
            return name
    return None


def _refuse(layer: Any, why: str) -> ValueError:
    return ValueError(f"{type(layer).__name__}: {LINEAR_ATTENTION}, and from_hf cannot port it: {why}")


def _checked(layer: Any, kind: str) -> None:
    """Refuses, by name, what our layers do not compute."""
    if getattr(layer, "activation", "silu") != "silu":
        raise _refuse(layer, f"a conv activation {layer.activation!r} (ours: silu)")
    if layer.conv1d.bias is not None:
        raise _refuse(layer, "a bias on the causal conv (conv1d.bias)")
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    if any(m.bias is not None for m in linears):
        raise _refuse(layer, "a bias on a projection")
    if kind != "kimi" and getattr(layer, "allow_neg_eigval", False):
        raise _refuse(layer, "beta times 2 (allow_neg_eigval)")


def options(layer: Any) -> dict[str, Any]:
    """Our constructor keywords for ``layer`` (``layout(layer)`` not None)."""
    kind = layout(layer)
    if kind == "kimi":
        return {"d_in": layer.hidden_size, "num_heads": layer.num_heads, "head_dim": layer.head_dim,
                "conv_kernel_size": layer.conv_kernel_size, "norm_eps": float(layer.o_norm.variance_epsilon)}
    return {"d_in": layer.hidden_size, "num_key_heads": layer.num_k_heads, "key_head_dim": layer.head_k_dim,
            "num_value_heads": layer.num_v_heads, "value_head_dim": layer.head_v_dim,
            "conv_kernel_size": layer.conv_kernel_size, "norm_eps": float(layer.norm.variance_epsilon)}


def hf_state(layer: Any, values: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Our parameters {our parameter name (``W_query.weight``, ``conv_weight`` ...): tensor
    (PyTorch layout)} from the layer's, or from ``values`` given under the layer's
    parameter names (its gradients, say); see ``_unpacked``."""
    return {(f"{n}.weight" if n.startswith("W_") else n): t for n, t in _unpacked(layer, values).items()}


def _unpacked(layer: Any, values: dict[str, Tensor] | None) -> dict[str, Tensor]:
    """Our parameters by module name: the unpacking (Qwen3.5's q|k|v rows split; Qwen3-Next's per-key-head groups
    [q, k, v, z] and [b, a] regrouped; Kimi's ``A_log`` (1, 1, H, 1) flattened)."""
    kind = layout(layer)
    theirs = dict(layer.named_parameters()) if values is None else values
    opts = options(layer)
    if kind == "kimi":
        names = {"W_query": "q_proj.weight", "W_key": "k_proj.weight", "W_value": "v_proj.weight",
                 "W_decay_down": "forget_gate.f_a_proj.weight", "W_decay_up": "forget_gate.f_b_proj.weight",
                 "dt_bias": "forget_gate.dt_bias", "W_beta": "b_proj.weight", "W_gate_down": "g_a_proj.weight",
                 "W_gate_up": "g_b_proj.weight", "norm_weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}
        state = {ours: theirs[n] for ours, n in names.items()}
        state["A_log"] = theirs["forget_gate.A_log"].reshape(-1)
        state["conv_weight"] = theirs["conv1d.weight"][:, 0, :]
        return state
    hk, dk, h, dv = opts["num_key_heads"], opts["key_head_dim"], opts["num_value_heads"], opts["value_head_dim"]
    state = {"conv_weight": theirs["conv1d.weight"][:, 0, :], "A_log": theirs["A_log"], "dt_bias": theirs["dt_bias"],
             "norm_weight": theirs["norm.weight"], "out_proj.weight": theirs["out_proj.weight"]}
    if kind == "qwen3_5":
        qkv = theirs["in_proj_qkv.weight"]  # rows [q (Hk*Dk) | k (Hk*Dk) | v (H*Dv)]
        state.update({"W_query": qkv[:hk * dk], "W_key": qkv[hk * dk:2 * hk * dk], "W_value": qkv[2 * hk * dk:],
                      "W_gate": theirs["in_proj_z.weight"], "W_beta": theirs["in_proj_b.weight"],
                      "W_decay": theirs["in_proj_a.weight"]})
        return state
    r = h // hk  # value heads per key head; rows grouped per key head: [q Dk, k Dk, v r*Dv, z r*Dv], [b r, a r]
    qkvz = theirs["in_proj_qkvz.weight"]
    grouped = qkvz.reshape(hk, 2 * dk + 2 * r * dv, qkvz.shape[-1])
    q, k, v, z = torch.split(grouped, [dk, dk, r * dv, r * dv], dim=1)
    ba = theirs["in_proj_ba.weight"].reshape(hk, 2 * r, qkvz.shape[-1])
    state.update({"W_query": q.reshape(hk * dk, -1), "W_key": k.reshape(hk * dk, -1), "W_value": v.reshape(h * dv, -1),
                  "W_gate": z.reshape(h * dv, -1), "W_beta": ba[:, :r].reshape(h, -1),
                  "W_decay": ba[:, r:].reshape(h, -1)})
    return state


def from_hf(layer: Any) -> GatedDeltaNet | KimiDeltaAttention:
    """Ours for a transformers linear-attention layer of a known layout, its weights
    copied exactly, in its dtype, device and train/eval mode; ValueError naming what ours
    does not compute (a conv activation other than silu, biases, beta times 2), or where
    ours and the layer disagree on a probe."""
    kind = layout(layer)
    if kind is None:
        raise ValueError(f"{type(layer).__name__}: {LINEAR_ATTENTION}, of a layout from_hf does not know")
    _checked(layer, kind)
    weight = layer.out_proj.weight if kind != "kimi" else layer.o_proj.weight
    cls = KimiDeltaAttention if kind == "kimi" else GatedDeltaNet
    ours = cls(**options(layer), dtype=weight.dtype, device="meta").to_empty(device=weight.device)
    state = hf_state(layer)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            given = state[name]
            if tuple(given.shape) != tuple(param.shape):
                raise _refuse(layer, f"{name} would take a {tuple(given.shape)} weight for its {tuple(param.shape)}")
            param.copy_(given)
    ours.train(layer.training)
    if not weight.is_meta:
        _self_check(layer, ours)
    return ours


def _self_check(layer: Any, ours: Any) -> None:
    """Ours and the layer on one probe (eval, no gradients, two examples, the second
    left-padded), float32-or-wider to 1e-5 of the layer's largest output, else ValueError."""
    import warnings

    weight = next(layer.parameters())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, ours.geometry.d_in, generator=gen).to(weight)
    mask = torch.ones(2, 5, dtype=torch.long, device=weight.device)
    mask[1, :2] = 0
    was = layer.training, ours.training
    layer.eval()
    ours.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' "falling back to its reference PyTorch implementation"
            want = layer(x, attention_mask=mask)
            got = ours(x, mask)
    finally:
        layer.train(was[0])
        ours.train(was[1])
    scale = float(want.abs().max()) or 1.0
    tol = 1e-5 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    error = float((got.float() - want.float()).abs().max()) / scale
    if not error <= tol:
        raise _refuse(layer, f"ours differs from it on a probe ({error:.2e} of its largest output)")


# --------------------------------------------------------------------------- the weight map, both ways


def hf_rules(layer: Any) -> list[Rule]:
    """The weight map from the layer's parameters (its own names: ``in_proj_qkv.weight``
    ...) to the Flax twin of what ``from_hf(layer)`` gives (``("W_query", "kernel")`` ...),
    shapes declared: an ``nn.Linear`` weight transposed into a kernel; Qwen3.5's
    ``in_proj_qkv`` rows split q | k | v (unequal widths); Qwen3-Next's ``in_proj_qkvz`` /
    ``in_proj_ba`` split per key head group ([q Dk, k Dk, v r*Dv, z r*Dv], [b r, a r]) and
    regrouped; ``conv1d.weight`` (C, 1, K) -> (C, K); Kimi's ``A_log`` (1, 1, H, 1) -> (H,).
    Read from the layer alone (no weight is copied); ValueError as ``from_hf`` refuses."""
    kind = _fitting(layer, "hf_rules")
    opts = options(layer)
    d, kernel = opts["d_in"], opts["conv_kernel_size"]

    def linear(theirs: str, ours: str, out: int, fan_in: int) -> Rule:
        return Rule(f"{theirs}.weight", (ours, "kernel"), (Transpose(),), ((out, fan_in),))

    def same(theirs: str, ours: str, shape: tuple[int, ...]) -> Rule:
        return Rule(theirs, (ours,), (), (shape,))

    if kind == "kimi":
        h, dk = opts["num_heads"], opts["head_dim"]
        return [linear("q_proj", "W_query", h * dk, d), linear("k_proj", "W_key", h * dk, d),
                linear("v_proj", "W_value", h * dk, d),
                Rule("conv1d.weight", ("conv_weight",), (MergeAxes(1, (1, kernel)),), ((3 * h * dk, 1, kernel),)),
                linear("forget_gate.f_a_proj", "W_decay_down", dk, d),
                linear("forget_gate.f_b_proj", "W_decay_up", h * dk, dk),
                Rule("forget_gate.A_log", ("A_log",), (MergeAxes(0, (1, 1, h, 1)),), ((1, 1, h, 1),)),
                same("forget_gate.dt_bias", "dt_bias", (h * dk,)), linear("b_proj", "W_beta", h, d),
                linear("g_a_proj", "W_gate_down", dk, d), linear("g_b_proj", "W_gate_up", h * dk, dk),
                same("o_norm.weight", "norm_weight", (dk,)), linear("o_proj", "out_proj", d, h * dk)]
    hk, dk, h, dv = opts["num_key_heads"], opts["key_head_dim"], opts["num_value_heads"], opts["value_head_dim"]
    channels = 2 * hk * dk + h * dv
    rules = [Rule("conv1d.weight", ("conv_weight",), (MergeAxes(1, (1, kernel)),), ((channels, 1, kernel),)),
             same("A_log", "A_log", (h,)), same("dt_bias", "dt_bias", (h,)), same("norm.weight", "norm_weight", (dv,)),
             linear("out_proj", "out_proj", d, h * dv)]
    kernels = [("W_query", "kernel"), ("W_key", "kernel"), ("W_value", "kernel")]
    if kind == "qwen3_5":
        rules += [Rule("in_proj_qkv.weight", kernels, (Sections(0, (hk * dk, hk * dk, h * dv)), Transpose()),
                       ((channels, d),)),
                  linear("in_proj_z", "W_gate", h * dv, d), linear("in_proj_b", "W_beta", h, d),
                  linear("in_proj_a", "W_decay", h, d)]
        return rules
    r = h // hk
    group = (hk, -1)
    rules += [Rule("in_proj_qkvz.weight", [*kernels, ("W_gate", "kernel")],
                   (SplitAxis(0, (hk, 2 * dk + 2 * r * dv)), Sections(1, (dk, dk, r * dv, r * dv)), MergeAxes(0, group),
                    Transpose()), ((hk * (2 * dk + 2 * r * dv), d),)),
              Rule("in_proj_ba.weight", [("W_beta", "kernel"), ("W_decay", "kernel")],
                   (SplitAxis(0, (hk, 2 * r)), Sections(1, (r, r)), MergeAxes(0, group), Transpose()),
                   ((hk * 2 * r, d),))]
    return rules


def _fitting(layer: Any, what: str) -> str:
    """The layer's layout, its refusals (``_checked``) raised naming ``what``."""
    kind = layout(layer)
    if kind is None:
        raise ValueError(f"{what}: {type(layer).__name__}: {LINEAR_ATTENTION}, of a layout {what} does not know")
    _checked(layer, kind)
    return kind


# their sub-module -> ours, per layout (the packed q/k/v(/z, b, a) have no one counterpart: ours are several)
_CHILDREN = {
    "qwen3_5": {"in_proj_z": "W_gate", "in_proj_b": "W_beta", "in_proj_a": "W_decay", "out_proj": "out_proj"},
    "qwen3_next": {"out_proj": "out_proj"},
    "kimi": {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value", "forget_gate.f_a_proj": "W_decay_down",
             "forget_gate.f_b_proj": "W_decay_up", "b_proj": "W_beta", "g_a_proj": "W_gate_down",
             "g_b_proj": "W_gate_up", "o_proj": "out_proj"},
}


def hf_children(layer: Any) -> dict[str, tuple[str, str | None]]:
    """The layer's sub-modules that have a counterpart in ours, for
    ``parity_tests.locate_divergence``: {their dotted name: (our sub-module's name, None)}
    (the projections; a packed projection, the conv and the norm have no one sub-module
    of ours).  ValueError as ``from_hf`` refuses."""
    return {theirs: (ours, None) for theirs, ours in _CHILDREN[_fitting(layer, "hf_children")].items()}


def to_hf(ours: Any, layer: Any) -> Any:
    """Writes our ``GatedDeltaNet`` / ``KimiDeltaAttention``'s weights into the
    transformers layer, in place (cast to its dtype, on its device), and returns it: the
    inverse of ``from_hf``, through ``hf_rules`` run backwards (bit-exact: every step
    permutes).  Checked first, nothing written unless all passes: the class (ours for
    the layout), the sizes (each keyword of ours against what ``from_hf`` reads from the
    layer, named), every parameter of the layer given exactly once in its shape.  Raises
    TypeError for a module not ours, ValueError naming each mismatch."""
    from attention_spec.interop.specs import apply_specs
    from torch_attention._state import flax_arrays

    kind = _fitting(layer, "to_hf")
    want = KimiDeltaAttention if kind == "kimi" else GatedDeltaNet
    if not isinstance(ours, (GatedDeltaNet, KimiDeltaAttention)):
        raise TypeError(f"to_hf takes torch_attention.{want.__name__} for a {type(layer).__name__}; "
                        f"got {type(ours).__name__}")
    if not isinstance(ours, want):
        raise ValueError(f"to_hf: a {type(layer).__name__} is a {want.__name__}, not a {type(ours).__name__} "
                         "(nothing was written)")
    theirs = options(layer)
    g = ours.geometry
    mine = ({"d_in": g.d_in, "num_heads": g.heads, "head_dim": g.key_dim, "conv_kernel_size": g.kernel,
             "norm_eps": ours.norm_eps} if kind == "kimi" else
            {"d_in": g.d_in, "num_key_heads": g.qk_heads, "key_head_dim": g.key_dim, "num_value_heads": g.heads,
             "value_head_dim": g.value_dim, "conv_kernel_size": g.kernel, "norm_eps": ours.norm_eps})
    problems = [f"{k}: ours {mine[k]!r}, the layer's {v!r}" for k, v in theirs.items() if mine[k] != v]
    if problems:
        raise ValueError(f"to_hf: this {type(ours).__name__} does not fit the {type(layer).__name__} "
                         "(nothing was written): " + "; ".join(problems))
    params = dict(layer.named_parameters())
    rules = hf_rules(layer)
    arrays = apply_specs(flax_arrays(ours), rules, "to_torch")  # names and shapes checked through every step
    missing = sorted(set(params) - set(arrays))
    misshaped = [f"{n}: ours {tuple(a.shape)}, the layer's {tuple(params[n].shape)}" for n, a in arrays.items()
                 if n not in params or tuple(a.shape) != tuple(params[n].shape)]
    if missing or misshaped:
        raise ValueError("to_hf: the weights do not fit the layer (nothing was written): "
                         + "; ".join([f"the layer's {n} has no counterpart in ours" for n in missing] + misshaped))
    ready = {n: torch.from_numpy(a.copy()).to(dtype=params[n].dtype, device=params[n].device) for n, a in arrays.items()}
    with torch.no_grad():
        for name, tensor in ready.items():
            params[name].copy_(tensor)
    return layer
