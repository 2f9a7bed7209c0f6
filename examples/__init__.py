"""Whole models ported from ``transformers`` to Flax NNX and proven: ``port_gpt2`` and
``port_llama`` (run each as ``python -m examples.port_gpt2``); ``_proof`` holds what they
share (the random init, the proofs through ``parity_tests``)."""
