"""Test, lint and benchmark sessions, one per backend: ``nox --list`` shows them.

Every session builds its own virtual environment (Python 3.11; ``nox -P 3.12`` or
``--force-python`` runs one with another interpreter) and installs this package editable.

On a CPU-only machine torch must be pinned: a bare ``torch`` requirement makes pip fetch
the multi-GB CUDA build.  The pin comes from the environment variable ``TORCH_SPEC``
(default ``torch==2.13.0``; on this project's machines pip's configured find-links
supplies the CPU wheel for it), e.g. ``TORCH_SPEC="torch==2.13.0" nox -s tests``.

Plain ``nox`` runs the CPU sessions (tests, tests-torch, tests-jax, x64, lint);
quick (the tests not marked ``slow``: every feature once), exhaustive (the full products of
the option axes), tests-distributed (CPU, also part of ``tests``), tests-cuda, tests-tpu and
bench run only when named with ``-s``.  Every pytest session runs two worker processes
(``pyproject.toml``); ``-- -n 0`` runs one.
"""

from __future__ import annotations

import os

import nox

PYTHON = "3.11"
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "tests-torch", "tests-jax", "x64", "lint"]


def _install_all(session: nox.Session) -> None:
    """Both frameworks (CPU torch, pinned) and the test extras."""
    session.install(TORCH_SPEC, "-e", ".[all]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """CPU, both frameworks: the whole suite (arguments after ``--`` go to pytest)."""
    _install_all(session)
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def quick(session: nox.Session) -> None:
    """CPU, both frameworks: the quick tier, ``pytest -m "not slow"``: every feature at
    least once, the larger grids and the longest tests left out (``tests`` runs them)."""
    _install_all(session)
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session(python=PYTHON)
def exhaustive(session: nox.Session) -> None:
    """CPU, both frameworks: ``pytest --exhaustive``, the default run plus the rest of
    every full product of option axes that the default run covers pairwise."""
    _install_all(session)
    session.run("pytest", "--exhaustive", *session.posargs)


@nox.session(name="tests-torch", python=PYTHON)
def tests_torch(session: nox.Session) -> None:
    """PyTorch only (no JAX installed): the JAX and parity tests must skip cleanly."""
    session.install(TORCH_SPEC, "-e", ".[torch,test]")
    session.run("pytest", *session.posargs)


@nox.session(name="tests-jax", python=PYTHON)
def tests_jax(session: nox.Session) -> None:
    """JAX / Flax only (no PyTorch installed): the PyTorch and parity tests must skip cleanly."""
    session.install("-e", ".[jax,test]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def x64(session: nox.Session) -> None:
    """The whole suite with ``JAX_ENABLE_X64=1``, so that float64 parity is exercised too."""
    _install_all(session)
    session.run("pytest", *session.posargs, env={"JAX_ENABLE_X64": "1"})


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """``ruff check .`` and ``mypy`` (the packages listed in pyproject.toml)."""
    session.install(TORCH_SPEC, "-e", ".[lint,torch,jax]")
    session.run("ruff", "check", ".")
    session.run("mypy", *session.posargs)


@nox.session(name="tests-distributed", python=PYTHON)
def tests_distributed(session: nox.Session) -> None:
    """CPU scale-out: ring attention and sharded training on 8 simulated JAX devices,
    ring attention and DDP on 2 and 4 PyTorch gloo processes (``tests/distributed/test_distributed.py``;
    the tests start those processes themselves)."""
    _install_all(session)
    session.run("pytest", "tests/distributed/test_distributed.py", *session.posargs)


@nox.session(name="tests-cuda", python=PYTHON)
def tests_cuda(session: nox.Session) -> None:
    """NVIDIA GPU: jax[cuda12], Flax and the CUDA build of torch, then the suite.

    Needs a machine with an NVIDIA GPU and its driver; it cannot run on a CPU-only
    machine (and installs several GB of CUDA libraries).  On a machine whose Python already
    has jax with CUDA, Flax and the CUDA build of torch, ``nox -s tests-cuda --no-venv
    --no-install`` runs the suite in that Python without installing anything.
    """
    session.install("jax[cuda12]", "flax")
    session.install("torch")  # the default index's build, which is the CUDA one
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "0", *session.posargs)  # one process: JAX takes most of the GPU's memory


@nox.session(name="tests-tpu", python=PYTHON)
def tests_tpu(session: nox.Session) -> None:
    """TPU: jax[tpu] and Flax, with CPU torch as the other side, then the suite.

    Needs a Cloud TPU VM; it cannot run anywhere else.
    """
    session.install("jax[tpu]", "flax")
    session.install(TORCH_SPEC, "--index-url", TORCH_CPU_INDEX)
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "0", *session.posargs)  # one process owns the TPU


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Speed and memory benchmarks: ``nox -s bench -- --quick`` passes ``--quick`` on."""
    _install_all(session)
    session.run("python", "-m", "benchmarks", *session.posargs)
