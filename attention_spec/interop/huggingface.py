"""Hugging Face ``transformers`` options in this library's terms, framework-free.

A port reads a ``transformers`` config and must say the same thing here; where the two
conventions differ by one, the difference lives in one function, with its proof in the
tests (against ``transformers``' own mask functions and layers).  Nothing here imports
``transformers``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["window_from_hf"]


def window_from_hf(sliding_window: Any) -> tuple[int, int] | None:
    """Hugging Face's ``sliding_window=W`` -> our ``window=(W - 1, 0)``; None for None or 0.

    In ``transformers`` (``masking_utils.sliding_window_overlay``, Mistral, Qwen2, Gemma 2,
    Phi-3) query ``i`` sees key ``j`` when ``i - W < j <= i``: itself and the ``W - 1``
    keys before it, ``W`` keys in all.  Our ``window=(left, right)`` lets query ``i`` see
    keys ``i - left .. i + right``, so the same band is ``(W - 1, 0)`` (``(W, 0)`` would
    let one key more in).  ``right=0`` already keeps out every later key: ``causal=True``
    beside it changes nothing.  ``sliding_window=0`` or None means no window there (a
    config that turns the window off), None here.

    Raises TypeError for anything but an int (a bool included) or None, ValueError for a
    negative one.
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window must be an int >= 0 or None; got {type(sliding_window).__name__} "
                        f"{sliding_window!r}")
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0 or None; got {sliding_window}")
    if sliding_window == 0:
        return None
    return (sliding_window - 1, 0)
