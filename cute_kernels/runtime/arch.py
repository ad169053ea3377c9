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


def constant_under_compile(fn):
    """Mark ``fn`` as returning a constant under torch.compile, as
    ``torch.compiler.assume_constant_result`` does, without that call's import of torch._dynamo
    (seconds at ``import cute_kernels``; tests/test_runtime.py checks the mark is the same)."""
    fn._dynamo_marked_constant = True
    return fn


_SM_COUNTS: dict = {}


@constant_under_compile
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (cached; a constant under torch.compile)."""
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


_MAX_CLUSTERS: dict = {}


@constant_under_compile
def max_active_clusters(index: int, cluster_size: int, ctas_per_sm: int = 1) -> int:
    """Clusters of ``cluster_size`` CTAs that CUDA device ``index`` runs at once when each SM
    holds ``ctas_per_sm`` of the CTAs (cached; a constant under torch.compile). A cluster's CTAs
    share one GPC, so this can be below ``sm_count * ctas_per_sm // cluster_size``: an H100 SXM
    runs 7 clusters of 16 one-per-SM CTAs at a time, not 8, and a persistent grid of 8 would
    run its last cluster after the other seven."""
    key = (index, cluster_size, ctas_per_sm)
    if key not in _MAX_CLUSTERS:
        if cluster_size == 1:
            _MAX_CLUSTERS[key] = sm_count(index) * ctas_per_sm
        else:
            try:
                with torch.cuda.device(index):
                    _MAX_CLUSTERS[key] = _occupancy_clusters(index, cluster_size, ctas_per_sm)
            except Exception:
                # A DSL without the empty kernel or a driver error: fall back to the SM count
                # bound. A persistent grid that large is still correct, only slower.
                _MAX_CLUSTERS[key] = max(1, sm_count(index) * ctas_per_sm // cluster_size)
    return _MAX_CLUSTERS[key]


def _occupancy_clusters(index: int, cluster_size: int, ctas_per_sm: int) -> int:
    """The driver's occupancy answer for an empty 128-thread kernel whose dynamic shared
    memory leaves room for exactly ``ctas_per_sm`` CTAs per SM (with the whole carveout, as the
    row kernels that run several CTAs per SM ask for)."""
    from cuda.bindings import driver
    from cutlass.utils import HardwareInfo

    def check(result):
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA occupancy query failed: {result[0]}")
        return result[1] if len(result) > 1 else None

    device = check(driver.cuDeviceGet(index))
    check(driver.cuCtxSetCurrent(check(driver.cuDevicePrimaryCtxRetain(device))))
    kernel = HardwareInfo(index)._get_device_function()  # the DSL's own empty kernel
    attribute = driver.CUfunction_attribute
    most = check(driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
    check(driver.cuFuncSetAttribute(kernel, attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, most))
    # Less 1 KB: without it the cluster query fits one CTA fewer per SM than the plain one.
    smem = check(driver.cuOccupancyAvailableDynamicSMemPerBlock(kernel, ctas_per_sm, 128)) - 1024
    check(driver.cuFuncSetAttribute(kernel, attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
    check(driver.cuFuncSetAttribute(kernel, attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 128, 1, 1
    config.sharedMemBytes = smem
    cluster = driver.CUlaunchAttribute()
    cluster.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    value = driver.CUlaunchAttributeValue()
    value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = cluster_size, 1, 1
    cluster.value = value
    config.attrs = [cluster]
    config.numAttrs = 1
    return check(driver.cuOccupancyMaxActiveClusters(kernel, config))
