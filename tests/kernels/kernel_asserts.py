"""Shared checks for kernel tests: one `assert_close` with error statistics, and where Triton can run.

`assert_close` raises AssertionError with its full message itself (max / mean absolute error, the worst
element and its index, NaN counts), so it needs no assertion rewriting. `triton_runtime` says whether the
Triton kernels can run in this process: on CUDA, or on CPU through the interpreter, which only works when
TRITON_INTERPRET=1 was set before triton was first imported (the kernel test modules set it at import
on machines without CUDA; if something imported triton earlier, the Triton cases run in a child process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

# the tolerance each dtype is held to: |actual - expected| <= atol + rtol * |expected|
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    what: str = "output",
) -> None:
    """Elementwise |actual - expected| <= atol + rtol * |expected| (tolerances from `dtype`, default actual's).

    NaN anywhere in `actual` fails (an unwritten element of a NaN-poisoned buffer shows up this way).
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    default_atol, default_rtol = TOLERANCES[dtype or actual.dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    nan_a, nan_e = int(a.isnan().sum()), int(e.isnan().sum())
    if nan_e:
        raise AssertionError(f"{what}: the expected tensor has {nan_e} NaN (a broken reference or bad inputs)")
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = ~(err <= bound)  # NaN counts as bad
    if nan_a or bool(bad.any()):
        worst = int(torch.where(err.isnan(), torch.inf, err - bound).flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        finite = err[~err.isnan()]
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements outside atol={atol:g} + rtol={rtol:g}*|expected|; "
            f"{nan_a} NaN; max abs err {float(finite.max()) if finite.numel() else float('nan'):.3e}, "
            f"mean abs err {float(finite.mean()) if finite.numel() else float('nan'):.3e}; "
            f"worst at {index}: actual {float(a.flatten()[worst]):.6g}, expected {float(e.flatten()[worst]):.6g}"
        )


def triton_runtime() -> tuple[bool, str]:
    """(can the Triton kernels run in this process, why not)."""
    try:
        import triton  # noqa: F401 - only probing the install
        import triton.language as tl
    except ImportError:
        return False, "triton is not installed (pip install -e '.[test]' brings it on Linux)"
    if torch.cuda.is_available():
        return True, ""
    from triton.runtime.jit import JITFunction

    if isinstance(tl.sum, JITFunction):  # compiled mode: triton was imported before TRITON_INTERPRET=1
        return False, ("no CUDA, and triton was imported before TRITON_INTERPRET=1 was set, so its interpreter "
                       "is off in this process; the Triton cases run in a child process instead")
    return True, ""


def interpreter_off_but_installed() -> bool:
    """Triton is installed, there is no CUDA, and the in-process interpreter is unavailable."""
    ok, reason = triton_runtime()
    return not ok and "child process" in reason


def run_triton_cases_in_child(test_file: str, keyword: str, interpret: bool = True) -> None:
    """Run `test_file -k keyword` in a fresh interpreter with TRITON_INTERPRET=1 (0 with interpret=False: the
    kernels are compiled, for checks of their GPU builds); fail with its output tail."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    cmd = [sys.executable, "-m", "pytest", test_file, "-k", keyword, "-q", "-p", "no:cacheprovider", "-x"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
    tail = (proc.stdout + proc.stderr)[-4000:]
    if proc.returncode != 0 or " passed" not in proc.stdout:
        raise AssertionError(f"Triton cases in the interpreter child failed (rc {proc.returncode}): "
                             f"{' '.join(cmd)}\n{tail}")
