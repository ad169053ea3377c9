"""Which GPU architecture kernels are compiled for.

The target is the current CUDA device's architecture. ``CUTE_KERNELS_ARCH`` (or the DSL's own
``CUTE_DSL_ARCH``) overrides it, which is how kernels are compiled for ``sm_90a`` on a machine
with no GPU at all (the compile tests and ``python -m cute_kernels`` do this).
"""

from __future__ import annotations

import functools
import os

import torch

from .errors import NoGPUError, UnsupportedError

ENV_VARS = ("CUTE_KERNELS_ARCH", "CUTE_DSL_ARCH")

# Architectures with kernels in this library; the "a" suffix enables wgmma/setmaxnreg.
SUPPORTED_ARCHS = ("sm_90a",)


def arch_override() -> str | None:
    """The architecture named by the environment, if any."""
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value:
            return value
    return None


def has_gpu() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


def target_arch(device: torch.device | int | None = None) -> str:
    """The architecture to compile for: the override, else the given (or current) device's."""
    override = arch_override()
    if override is not None:
        return override
    if not has_gpu():
        raise NoGPUError(
            "no CUDA device found; set CUTE_KERNELS_ARCH=sm_90a to compile without running"
        )
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_arch(index)


def check_supported(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedError(
            f"GPU architecture {arch!r} has no kernels in cute_kernels; supported: {SUPPORTED_ARCHS} "
            "(Hopper H100/H200)"
        )
    return arch


_SM_COUNTS: dict = {}


@torch.compiler.assume_constant_result
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (cached; a constant under torch.compile)."""
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


_MAX_CLUSTERS: dict = {}


@torch.compiler.assume_constant_result
def max_active_clusters(index: int, cluster_size: int) -> int:
    """Clusters of ``cluster_size`` CTAs that CUDA device ``index`` runs at once when each CTA
    takes a whole SM (cached; a constant under torch.compile). A cluster's CTAs share one GPC,
    so this can be below ``sm_count // cluster_size``: an H100 SXM runs 7 clusters of 16 at a
    time, not 8, and a persistent grid of 8 would run its last cluster after the other seven."""
    key = (index, cluster_size)
    if key not in _MAX_CLUSTERS:
        if cluster_size == 1:
            _MAX_CLUSTERS[key] = sm_count(index)
        else:
            from cutlass.utils import HardwareInfo

            with torch.cuda.device(index):
                _MAX_CLUSTERS[key] = HardwareInfo(index).get_max_active_clusters(cluster_size)
    return _MAX_CLUSTERS[key]
