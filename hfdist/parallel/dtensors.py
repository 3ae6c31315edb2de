"""The one DTensor helper every module shares: this rank's piece of a tensor, whether or not it is a DTensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t`: a DTensor's local shard (no communication), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
