"""Op dispatch: the torch reference (`ref`) or Triton kernels, chosen once per device."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from muser.ops import ref


def backend(device: torch.device | str) -> ModuleType:
    """The op namespace for `device`: Triton on CUDA (unless MUSER_OPS=ref), else `ref`."""
    if torch.device(device).type != "cuda" or os.environ.get("MUSER_OPS") == "ref":
        return ref
    from muser.ops import triton as triton_ops

    return triton_ops
