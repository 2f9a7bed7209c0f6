"""Foreign 2-d masks, in both frameworks: ``nn.MultiheadAttention``'s ``key_padding_mask``
(bool (batch, kv_len), True = ignore) and Hugging Face's ``attention_mask`` (integer
(batch, seq), 1 = attend, 0 = padding), each to ours ((batch, 1, 1, kv_len) bool, True =
may attend).  Values, shapes, every refusal, and the same exception text in both.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from attention_spec.masks import HF_ATTENTION_MASK_VALUES_MESSAGE
from tests.support import HAS_JAX, HAS_TORCH, needs_both, needs_jax

FRAMEWORKS = [
    pytest.param("torch", marks=pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed")),
    pytest.param("flax", marks=pytest.mark.skipif(not HAS_JAX, reason="JAX / Flax are not installed")),
]

KEY_PADDING = np.array([[False, False, True, True], [False, False, False, False], [False, True, True, True]])
HF = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
LENGTHS = np.array([2, 4, 1])


def lib(fw: str) -> Any:
    if fw == "torch":
        import torch_attention

        return torch_attention
    import jax_attention

    return jax_attention


def to_fw(fw: str, array: np.ndarray) -> Any:
    if fw == "torch":
        import torch

        return torch.from_numpy(np.array(array))
    import jax.numpy as jnp

    return jnp.asarray(array)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_key_padding_mask_flips_polarity_and_adds_head_and_query_axes(fw):
    got = np.asarray(lib(fw).from_key_padding_mask(to_fw(fw, KEY_PADDING)))
    assert got.shape == (3, 1, 1, 4) and got.dtype == np.bool_
    np.testing.assert_array_equal(got[:, 0, 0], ~KEY_PADDING)
    # the same mask padding_mask builds from the lengths
    np.testing.assert_array_equal(got, np.asarray(lib(fw).padding_mask(to_fw(fw, LENGTHS), 4)))


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "bool"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_hf_attention_mask_to_ours(fw, dtype):
    got = np.asarray(lib(fw).from_hf_attention_mask(to_fw(fw, HF.astype(dtype))))
    assert got.shape == (3, 1, 1, 4) and got.dtype == np.bool_
    np.testing.assert_array_equal(got, np.asarray(lib(fw).padding_mask(to_fw(fw, LENGTHS), 4)))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_numpy_input_gives_the_frameworks_array(fw):
    array_type = type(to_fw(fw, KEY_PADDING))
    assert isinstance(lib(fw).from_key_padding_mask(KEY_PADDING), array_type)
    assert isinstance(lib(fw).from_hf_attention_mask(HF), array_type)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_float_key_padding_mask_recipe(fw):
    """The conversion the refusal of a float key_padding_mask points to."""
    additive = np.where(KEY_PADDING, -np.inf, 0.0).astype(np.float32)
    got = np.asarray(lib(fw).from_additive_mask(to_fw(fw, additive))[:, None, None, :])
    np.testing.assert_array_equal(got, np.asarray(lib(fw).from_key_padding_mask(to_fw(fw, KEY_PADDING))))


@needs_jax
def test_converters_under_jit():
    import jax

    import jax_attention as ja

    np.testing.assert_array_equal(jax.jit(ja.from_key_padding_mask)(KEY_PADDING)[:, 0, 0], ~KEY_PADDING)
    np.testing.assert_array_equal(jax.jit(ja.from_hf_attention_mask)(HF)[:, 0, 0], HF == 1)


# --------------------------------------------------------------------------- refusals

ERRORS = {
    # name: (converter, array, exception type, regex)
    "kpm-rank-1": ("from_key_padding_mask", np.array([True, False]), ValueError,
                   r"key_padding_mask must have shape \(batch, kv_len\) \(True = ignore\); got a 1-d array of shape \(2,\)"),
    "kpm-rank-4": ("from_key_padding_mask", np.zeros((2, 1, 1, 3), bool), ValueError,
                   r"got a 4-d array of shape \(2, 1, 1, 3\)"),
    "kpm-float": ("from_key_padding_mask", np.zeros((2, 3), np.float32), TypeError,
                  r"must be a bool array \(True = ignore\); got dtype float32\. A float key_padding_mask is additive"
                  r".*from_additive_mask\(mask\)\[:, None, None, :\]"),
    "kpm-int": ("from_key_padding_mask", np.zeros((2, 3), np.int32), TypeError,
                r"key_padding_mask must be a bool array \(True = ignore, as nn.MultiheadAttention takes it\); "
                r"got dtype int32"),
    "hf-rank-1": ("from_hf_attention_mask", np.array([1, 0]), ValueError,
                  r"must have shape \(batch, seq\); got a 1-d array of shape \(2,\)"),
    "hf-rank-4": ("from_hf_attention_mask", np.ones((2, 1, 3, 3), np.int32), ValueError,
                  r"got a 4-d array of shape \(2, 1, 3, 3\)"),
    "hf-float": ("from_hf_attention_mask", np.ones((2, 3), np.float32), TypeError,
                 r"must be an integer or bool array; got dtype float32\. A float mask may be additive"),
    "hf-value-2": ("from_hf_attention_mask", np.array([[1, 2, 0]], np.int32), ValueError,
                   re.escape(HF_ATTENTION_MASK_VALUES_MESSAGE)),
    "hf-value-negative": ("from_hf_attention_mask", np.array([[1, -1, 0]], np.int32), ValueError,
                          re.escape(HF_ATTENTION_MASK_VALUES_MESSAGE)),
}


def _raise(fw: str, name: str) -> BaseException:
    converter, array, error, pattern = ERRORS[name]
    with pytest.raises(error, match=pattern) as info:
        getattr(lib(fw), converter)(to_fw(fw, array))
    return info.value


@pytest.mark.parametrize("name", list(ERRORS))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_refusal(fw, name):
    _raise(fw, name)


@needs_both
@pytest.mark.parametrize("name", list(ERRORS))
def test_same_text_in_both_frameworks(name):
    assert str(_raise("torch", name)) == str(_raise("flax", name))


@needs_jax
def test_hf_values_checked_under_jit():
    """Under jit the values are unknown while tracing: a callback raises when the
    computation runs, and JAX reports it wrapped in its runtime error, same text."""
    import jax

    import jax_attention as ja

    with pytest.raises(Exception, match=re.escape(HF_ATTENTION_MASK_VALUES_MESSAGE)):
        np.asarray(jax.jit(ja.from_hf_attention_mask)(np.array([[1, 2, 0]], np.int32)))
