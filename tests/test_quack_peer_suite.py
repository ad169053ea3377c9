"""quack's own row-wise tests (softmax, cross-entropy, RMSNorm), pointed at ``ck.softmax``,
``ck.cross_entropy`` and ``ck.rms_norm``.

quack's ``tests/`` folder is not part of its pip package: set ``CK_QUACK_TESTS`` to that folder
(the version of the installed ``quack-kernels``) to run this file; without it, or without a
GPU and ``quack``, the file skips. The upstream test functions that call only quack's public
functions run unchanged (with their own parameter grids, torch references and tolerances),
those functions replaced by shims on top of ours:

  - ``quack.softmax.softmax(x)``: ``ck.softmax(x, dim=-1)``
  - ``quack.cross_entropy.cross_entropy`` and the per-row ``cross_entropy_fwd`` (loss only):
    ``ck.cross_entropy`` (``reduction="none"`` for the latter); ``lse_partial`` (a precomputed
    partial log-sum-exp that only saves quack work) is ignored; a given ``target_logit`` or
    the LSE / gradient outputs of ``cross_entropy_fwd`` have no counterpart here: skip
  - ``quack.rmsnorm.rmsnorm``: ``ck.rms_norm`` (``residual_dtype`` -> ``residual_out_dtype``;
    with a residual, quack returns the residual sum only with ``prenorm=True``)

The tests of quack's internals (its kernel entry points, tuned configurations, compile cache)
and of its error messages' wording are not collected. A test file whose imports the installed
quack lacks is left out with a warning at collection.

Every collected case passes with quack 0.6.5 and torch 2.11: softmax and cross-entropy on an
H100, RMSNorm on an H200 (591 passed, 6 skipped), the compiled cases that reuse one function
over changing shapes included.

    CK_QUACK_TESTS=../quack/tests python -m pytest -q -n 4 tests/test_quack_peer_suite.py
"""
import importlib.util
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

_DIR = os.environ.get("CK_QUACK_TESTS")
if not _DIR or not os.path.isdir(_DIR):
    pytest.skip("CK_QUACK_TESTS is not set to quack's tests/ folder", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine", allow_module_level=True)
pytest.importorskip("quack")

import cute_kernels as ck  # noqa: E402


def _load(name):
    """quack's ``tests/<name>.py`` as a module, or None (with a warning) if it cannot be imported."""
    path = os.path.join(_DIR, f"{name}.py")
    try:
        spec = importlib.util.spec_from_file_location(f"quack_upstream_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, FileNotFoundError) as exc:
        warnings.warn(f"quack's {name}.py left out: {exc}")
        return None
    return module


def softmax(x):
    return ck.softmax(x, dim=-1)


def cross_entropy(x, target, lse_partial=None, weight=None, ignore_index=-100, reduction="mean",
                  inplace_backward=False):
    # lse_partial (the rows' log-sum-exp over chunks of 128, precomputed) only saves quack
    # work; the loss is that of x either way, so ours ignores it
    return ck.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction,
                            inplace_backward=inplace_backward, weight=weight)


def cross_entropy_fwd(x, target, target_logit=None, weight=None, ignore_index=-100,
                      return_lse=False, return_dx=False, inplace_backward=False):
    if target_logit is not None or return_lse or return_dx or inplace_backward:
        pytest.skip("cross_entropy_fwd's target_logit / LSE / gradient outputs have no counterpart")
    return ck.cross_entropy(x, target, ignore_index=ignore_index, reduction="none", weight=weight)


def rmsnorm(x, weight=None, bias=None, residual=None, out_dtype=None, residual_dtype=None,
            eps=1e-6, prenorm=False, weight_offset=0.0):
    result = ck.rms_norm(x, weight, eps, residual, out_dtype, bias=bias,
                         weight_offset=weight_offset, residual_out_dtype=residual_dtype)
    if residual is None:
        return result
    return result if prenorm else result[0]


def _export(name, shims, tests):
    """quack's ``tests/<name>.py`` with ``shims`` (name: function) put in place of quack's public
    functions, and its test functions ``tests`` made this module's (so pytest collects them with
    their upstream parameter grids)."""
    module = _load(name)
    if module is None:
        return
    for attr, shim in shims.items():
        setattr(module, attr, shim)
    for test in tests:
        globals()[test] = getattr(module, test)


_export("test_softmax", {"softmax": softmax},
        ("test_softmax", "test_softmax_extreme_values", "test_softmax_numerical_stability"))
_export("test_cross_entropy",
        {"cross_entropy": cross_entropy, "cross_entropy_fwd": cross_entropy_fwd},
        ("test_cross_entropy", "test_cross_entropy_lse_partial",
         "test_cross_entropy_extreme_values", "test_cross_entropy_numerical_stability",
         "test_cross_entropy_edge_targets", "test_cross_entropy_ignore_index_edge_cases",
         "test_cross_entropy_weight_reduction"))
_export("test_rmsnorm", {"rmsnorm": rmsnorm},
        ("test_rmsnorm_forward_backward", "test_rmsnorm_weight_offset",
         "test_rmsnorm_noncontiguous_grad", "test_rmsnorm_compile_2d_then_4d", "test_rmsnorm_qk",
         "test_rmsnorm_strided_tensor", "test_rmsnorm_with_bias", "test_rmsnorm_with_residual",
         "test_rmsnorm_prenorm_false"))
