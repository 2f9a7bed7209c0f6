"""Interop: the contract's weights and checkpoints as other code holds them, framework-free.

What the twins' ``interop`` modules, the parity harness (``parity_tests``) and the examples
build on, beside the contract rather than part of it:

- ``specs``: the one weight map, ``Rule`` and its steps (transpose, reshapes, splits,
  packed q/k/v), run in either direction;
- ``conversion``: the declared weight map between the twins' own layouts (``rules_for``,
  ``torch_to_flax``, ``flax_to_torch``), read from the registry;
- ``packing``: packed q/k/v checkpoints (GPT-2, GPT-NeoX, Phi-3, ``in_proj_weight``) and
  Flax's head-shaped kernels, in our modules' names; ``qkv``: the packed q/k/v split and
  join that ``specs`` and ``packing`` share;
- ``files``: checkpoint files (safetensors, ``.pt``, msgpack, Orbax) and their safety rules;
- ``native``: the allow-lists that the native importers and exporters decide by;
- ``huggingface``: Hugging Face ``transformers`` options in our terms (``window_from_hf``);
- ``numpy_arrays``: reading any framework's arrays as NumPy (``as_numpy``) and the checks
  of a set of named arrays, the layer under all of these.

The layers go one way: this package imports the core (``attention_spec.registry``,
``attention_spec.rope``), and the core never imports it at import time
(``attention_spec.window_from_hf`` is looked up here on first use);
``tests/modules/test_layers.py`` checks both, and that no two modules import each other.
Importing the package imports none of its modules: import the one you use.
"""
