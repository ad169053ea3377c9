"""Registering kernels as ``torch.library`` custom ops.

Kernels write into outputs the Python wrapper allocated, so each op is registered as mutating
those outputs and its fake (meta) implementation does nothing: shapes are already decided by
the wrapper, which torch.compile traces like any other Python code. In eager mode the op's body
is called directly, skipping the dispatcher (tens of microseconds per call); under
``torch.compile`` the registered op is called so that it appears in the graph.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch

NAMESPACE = "cute_kernels"


class KernelOp:
    """A custom op that bypasses the dispatcher in eager mode (see module doc)."""

    def __init__(self, op, fn: Callable):
        self.op = op
        self._fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.op(*args, **kwargs)
        return self._fn(*args, **kwargs)


def kernel_op(name: str, *, mutates_args: Iterable[str], schema: str | None = None):
    """Decorator: register ``fn`` as ``cute_kernels::<name>`` writing into ``mutates_args``."""

    def register(fn: Callable) -> KernelOp:
        kwargs = {"mutates_args": tuple(mutates_args), "device_types": "cuda"}
        if schema is not None:
            kwargs["schema"] = schema
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, **kwargs)

        @op.register_fake
        def _fake(*args, **kw):
            return None

        return KernelOp(op, fn)

    return register
