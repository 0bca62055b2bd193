"""Op dispatch, chosen once per device: Triton kernels on CUDA; on the CPU muser's C kernels at
every width (`cpu`); MUSER_OPS=ref forces the torch reference (`ref`) anywhere."""

from __future__ import annotations

from types import ModuleType

import torch

from muser.env import reference_ops
from muser.ops import cpu, ref


def backend(device: torch.device | str) -> ModuleType:
    """The op namespace for `device`: Triton on CUDA (unless MUSER_OPS=ref), else `cpu`."""
    if reference_ops():
        return ref
    if torch.device(device).type != "cuda":
        return cpu
    from muser.ops import triton as triton_ops  # NOTE: triton is the optional [gpu] extra

    return triton_ops
