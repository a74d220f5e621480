"""Kernel tests run the Triton kernels through the interpreter on CPU, or compiled on a GPU when one is present.

Triton picks interpreted or compiled when a `@triton.jit` function is defined, i.e. when a tidal.kernels module is
imported, so the switch is set here at import time and any kernel module that another test folder imported earlier
is reloaded. With CUDA present nothing changes: the same tests then run the compiled kernels on the GPU. On CPU the
variable stays set for the rest of the process; other folders' code only reaches the torch references on CPU tensors.
"""

import importlib
import os
import sys

import pytest
import torch


def _let_interpreter_scalars_bound_loops() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with `int(array)`, which NumPy >= 2.3 refuses for
    its 1-element arrays; the kernels' `range(start, end)` over run-time bounds then fails only under the
    interpreter. Converting through `.item()` keeps the same value."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for name in [m for m in sys.modules if m.startswith("tidal.kernels.")]:
        importlib.reload(sys.modules[name])
    _let_interpreter_scalars_bound_loops()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
