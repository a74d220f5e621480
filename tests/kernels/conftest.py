"""Kernel tests run the Triton kernels through the interpreter on CPU, or compiled on a GPU when one is present.

Triton picks interpreted or compiled when a `@triton.jit` function is defined, i.e. when a module defining kernels is
imported, so the switch is set here at import time; kernel modules that another test folder imported earlier are
imported again, and triton.language's own helpers are swapped for interpreted ones if triton came in first. With CUDA
present nothing changes: the same tests run the compiled kernels on the GPU. On CPU the variable stays set for the
rest of the process; other folders' code only reaches the torch references on CPU tensors. The worker's modules are
imported again too, so the models these tests build call the interpreted kernels.
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


def _interpret_preloaded_triton_helpers() -> None:
    """When another test folder imported transformers first, torch._dynamo has already imported triton without the
    interpreter switch, so triton.language's own @jit helpers (tl.zeros, tl.sum, ...) are compiled-mode functions that
    refuse to run inside an interpreted kernel. Swap them for interpreted twins."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    twins: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                twin = twins.setdefault(id(value), InterpretedFunction(value.fn))
                setattr(module, attr, twin)


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Drop every kernel module first and import them afresh, so that kernels calling helper kernels from another
    # module (exact_dot) get the interpreted helpers too; reloading one by one would leave stale references. The
    # worker's modules go too (imported again when a test here needs them): its layers bind kernel functions by
    # name, and those from an earlier import would be the compiled ones, which find no driver on a CPU.
    stale = [name for name in sys.modules if name.startswith("tidal.kernels.")]
    for name in [*stale, *(name for name in sys.modules if name.startswith("tidal.worker."))]:
        del sys.modules[name]
    for name in stale:
        importlib.import_module(name)
    _let_interpreter_scalars_bound_loops()
    _interpret_preloaded_triton_helpers()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
