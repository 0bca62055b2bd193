"""Kernels are loaded on the compile threads as their first launch would load them; a kernel
whose load fails there is left as Triton leaves an unloaded one, for its first launch to load
(a kernel too large for the device keeps Triton's error for that launch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from triton.runtime.errors import OutOfResources

from muser.ops.triton import tuning


class Kernel:
    name = "k"

    def __init__(self, error: Exception | None) -> None:
        self.error, self.module, self.function, self._run = error, None, None, None

    @property
    def run(self):
        self._run, self.module = "launcher", "module"
        if self.error is not None:
            raise self.error
        self.function = "function"
        return self._run


def test_a_loaded_kernel_keeps_its_handles() -> None:
    kernel = Kernel(None)
    tuning._load(kernel)
    assert (kernel.module, kernel.function, kernel._run) == ("module", "function", "launcher")


def test_a_failed_load_is_undone() -> None:
    kernel = Kernel(RuntimeError("no context"))
    with pytest.warns(UserWarning, match="first launch loads it"):
        tuning._load(kernel)
    assert (kernel.module, kernel.function, kernel._run) == (None, None, None)


def test_a_kernel_too_large_keeps_its_error() -> None:
    kernel = Kernel(OutOfResources(300000, 232448, "shared memory"))
    tuning._load(kernel)
    assert kernel._run == "launcher"


def test_jit_misses_are_named_and_kept_for_the_kernel_list() -> None:
    before = len(tuning.JIT.misses)
    fn = SimpleNamespace(name="_k", jit_function="jit")
    assert not tuning._count_compile(key="key", fn=fn, repr="", compile={
        "specialization_data": "{}"}, is_manual_warmup=False, already_compiled=False)
    assert tuning.JIT.misses[before:] == ["_k key"]
    assert tuning.JIT.compiled[before:] == [("jit", "key", "{}")]
