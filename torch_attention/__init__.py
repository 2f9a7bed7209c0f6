"""Self-attention, every variant the classic tutorials teach, as PyTorch modules.

Twin of ``jax_attention``: same class names, constructor keywords, parameter names, and
the same numbers out for the same weights.  Masks are bool, ``True`` = may attend.
"""

from torch_attention import functional, interop, masks, parallel
from torch_attention.causal import CausalAttention, Head
from torch_attention.compressed import CompressedAttention, CompressedCache
from torch_attention.delta_net import DeltaCache, GatedDeltaNet, KimiDeltaAttention
from torch_attention.functional import KVCache, attention_weights, dot_product_attention
from torch_attention.latent import MultiHeadLatentAttention
from torch_attention.masks import (
    alibi_bias,
    causal_mask,
    combine_masks,
    from_additive_mask,
    from_blocked_mask,
    from_hf_attention_mask,
    from_key_padding_mask,
    padding_mask,
)
from torch_attention.multihead import MultiHeadAttention, MultiHeadAttentionWrapper
from torch_attention.self_attention import SelfAttention_v1, SelfAttention_v2
from torch_attention.simplified import SimplifiedAttention

__all__ = [
    "CausalAttention",
    "CompressedAttention",
    "CompressedCache",
    "DeltaCache",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "KVCache",
    "Head",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "SimplifiedAttention",
    "attention_weights",
    "causal_mask",
    "alibi_bias",
    "combine_masks",
    "dot_product_attention",
    "from_additive_mask",
    "from_blocked_mask",
    "from_hf_attention_mask",
    "from_key_padding_mask",
    "functional",
    "interop",
    "masks",
    "padding_mask",
    "parallel",
]
