"""What a flex mask mod may answer, checked alike in both twins (one error text).

A mask mod ``(b, h, q_idx, kv_idx) -> bool`` runs on index arrays of rank 4 (b
(B', 1, 1, 1), h (1, H', 1, 1), q_idx (1, 1, rows, 1), kv_idx (1, 1, 1, keys)).  Its answer
may be any bool array that broadcasts to (B', H', rows, keys): a 0-d one (PyTorch's
``noop_mask``, ``True``), one of the query alone (``q_idx < 30``) or of the key alone;
each twin broadcasts it.  A non-bool answer (0/1 integers, floats) is refused, as
PyTorch's own ``flex_attention`` refuses it (``mask.dtype must be torch.bool``): a float
answer has no one reading as a mask (is 0.5 visible?), and a score mod is the place for
numbers.
"""

from __future__ import annotations

from typing import Any

from attention_spec.arrays import as_shape

__all__ = ["check_mask_answer"]


def check_mask_answer(where: str, dtype: str, shape: Any, want: tuple[int, ...]) -> None:
    """A mask mod's answer of dtype name ``dtype`` (``attention_spec.arrays.dtype_name``)
    and ``shape``, for index arrays that span ``want`` (B', H', rows, keys): a bool array
    that broadcasts to ``want``.  ``where``: the function that ran the mod
    (``"flex_attention"``, ``"create_block_mask"``).  The texts name what the answer
    holds (integers, floats) and its shape, not ``want`` or the exact dtype, which differ
    between the twins for one mod (JAX's default integers are int32; its flex path runs a
    mod per (example, head)).

    Raises:
      TypeError: a non-bool answer.
      ValueError: an answer that does not broadcast to ``want``."""
    got = as_shape(shape)
    if dtype != "bool":
        kind = ("integers" if dtype.startswith(("int", "uint")) else
                "floating-point numbers" if "float" in dtype else f"dtype {dtype}")
        raise TypeError(f"{where}: mask_mod must answer bool (True = may attend), as PyTorch's flex_attention "
                        f"requires; got {kind}; compare instead (e.g. q_idx >= kv_idx, answer != 0)")
    fits = len(got) <= len(want) and all(g in (1, w) for g, w in zip(reversed(got), reversed(want), strict=False))
    if not fits:
        raise ValueError(f"{where}: mask_mod's answer must broadcast against its index arrays (b, h, q_idx, "
                         f"kv_idx), to (B, H, q_len, kv_len); got shape {got}")
