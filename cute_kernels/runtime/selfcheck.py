"""One line of the self-check table (``python -m cute_kernels``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class SelfCheck:
    op: str
    shape: str
    dtype: str
    ours: Callable[[], torch.Tensor]
    torch: Callable[[], torch.Tensor]
    reference: torch.Tensor  # float64
    tolerance: float  # on the max error relative to the largest reference value

    def error(self, out: torch.Tensor) -> float:
        scale = self.reference.abs().max().clamp_min(1e-30)
        return ((out.double() - self.reference).abs().max() / scale).item()
