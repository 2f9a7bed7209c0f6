"""No global state: neither the library nor the harness changes global JAX or PyTorch flags.

* ``check_parity`` runs with full-precision matmuls (JAX "highest", PyTorch TF32 off)
  inside a context, and leaves every flag as it found it, also when a module raises.
* In a fresh interpreter with the default configuration (no test conftest, no global
  precision flag, and a lowered default matmul precision around the calls), the modules
  alone give float32-accurate results on every path: their own ``precision=`` plumbing
  is what makes them accurate.  (On CPU, XLA computes float32 matmuls in full precision
  whatever the flag; on GPU/TPU the lowered default is TF32/bfloat16, which this test
  would catch if a matmul lost its ``precision=``.)
* Importing the library, running it and running the parity report change no flag, and
  the report does not import the test conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import needs_both

pytestmark = needs_both

ROOT = Path(__file__).resolve().parents[2]


def _flags() -> dict[str, Any]:
    import jax
    import torch

    return {
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
        "jax_enable_x64": jax.config.jax_enable_x64,
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


@pytest.fixture
def unusual_flags():
    """Flags set to values the harness must not keep: lowered precision everywhere."""
    import jax
    import torch

    before = _flags()
    jax.config.update("jax_default_matmul_precision", "bfloat16")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    try:
        yield _flags()
    finally:
        jax.config.update("jax_default_matmul_precision", before["jax_default_matmul_precision"])
        torch.backends.cuda.matmul.allow_tf32 = before["allow_tf32"]
        torch.backends.cudnn.allow_tf32 = before["cudnn_allow_tf32"]
        torch.set_float32_matmul_precision(before["float32_matmul_precision"])


def test_check_parity_sets_full_precision_inside_and_restores_the_flags(monkeypatch, unusual_flags) -> None:
    import torch

    import parity_tests.harness as harness
    from parity_tests import check_parity, to_flax
    from torch_attention import SelfAttention_v2

    seen: dict[str, Any] = {}
    real = harness.run_torch

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(_flags())  # JAX's setting is a context: this reads its value here
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "run_torch", spy)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tm = SelfAttention_v2(8, 4, qkv_bias=True)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    assert check_parity(tm, to_flax(tm), x).ok
    assert seen["jax_default_matmul_precision"] == "highest"
    assert seen["allow_tf32"] is False and seen["cudnn_allow_tf32"] is False
    assert seen["float32_matmul_precision"] == "highest"
    assert _flags() == unusual_flags
    # and when the modules refuse the call
    with pytest.raises(ValueError):
        check_parity(tm, to_flax(tm), x[..., :5])
    assert _flags() == unusual_flags


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jax, torch

    def flags():
        return [jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64,
                jax.config.jax_numpy_rank_promotion, torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()]

    before = flags()
    import jax_attention, torch_attention
    from flax import nnx
    from parity_tests import reference
    from torch_attention.interop import torch_state_dict
    import parity_tests.__main__ as report
    after_import = flags()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 16)).astype(np.float32)
    mask = rng.random((2, 2, 9, 9)) < 0.7
    errors = {}
    torch.manual_seed(0)
    tm = torch_attention.MultiHeadAttention(16, 16, 16, 0.0, 2, qkv_bias=True).eval()
    fm = jax_attention.MultiHeadAttention(16, 16, 16, 0.0, 2, qkv_bias=True, rngs=nnx.Rngs(0))
    jax_attention.interop.load_torch_state_dict(fm, tm.state_dict())
    params = {k: v.astype(np.float64) for k, v in torch_state_dict(tm).items()}
    want, _ = reference.forward("MultiHeadAttention", tm.config, params, x, mask)
    scale = np.abs(want).max()
    for path in ("reference", "fused", "blockwise", "auto"):
        # A lowered default (TF32/bfloat16 on GPU/TPU): the modules' precision= must win.
        with jax.default_matmul_precision("bfloat16"):
            got_jax = np.asarray(fm(jax.numpy.asarray(x), jax.numpy.asarray(mask), implementation=path))
        got_torch = tm(torch.tensor(x), torch.tensor(mask), implementation=path).detach().numpy()
        errors[path] = [float(np.abs(got_jax - want).max() / scale),
                        float(np.abs(got_torch - want).max() / scale)]
    after_run = flags()
    status = report.main(["--variant", "simplified-sum", "--implementation", "fused"])
    print(json.dumps({"before": before, "after_import": after_import, "after_run": after_run,
                      "after_report": flags(), "errors": errors, "status": status,
                      "conftest": "tests.conftest" in sys.modules or "tests.support" in sys.modules}))
    """
)


def test_the_modules_are_float32_accurate_without_any_global_flag() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["before"][0] is None  # the default configuration: no precision flag
    assert result["after_import"] == result["after_run"] == result["after_report"] == result["before"]
    assert result["conftest"] is False, "the parity report imported the test conftest"
    assert result["status"] == 0
    from parity_tests.tolerances import FLOAT32_ORACLE_RELATIVE

    for path, (jax_error, torch_error) in result["errors"].items():
        assert jax_error <= FLOAT32_ORACLE_RELATIVE, (path, "jax", jax_error)
        assert torch_error <= FLOAT32_ORACLE_RELATIVE, (path, "torch", torch_error)
