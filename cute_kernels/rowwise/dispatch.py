"""Finding the compiled kernel for a call of a row-wise op, cheaply.

The config of a row kernel depends on the dtypes, the row length N and the vector width, and
the vector width on how the data pointers and row strides are aligned. Reading pointers and
strides costs more host time than the rest of the lookup, so it is done only when needed:

1. ``aligned[(dtypes, N)]`` holds the kernel compiled for 16-byte-aligned rows (the widest
   vectors N allows). It is called straight away; its TVM-FFI entry checks every pointer and
   stride against those assumptions in compiled code and raises ``ValueError`` before launching
   if one fails.
2. Only then (or on first use) are pointers and strides read, and the kernel for their actual
   alignment is looked up in ``exact[(dtypes, N, misalignment)]``, compiled on a miss.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..runtime import StreamSpec, Sym, TensorSpec, dtype_name, get_kernel

ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int8: 1}


def vector_width(n: int, widest: int, misalignment: int) -> int:
    """Largest power-of-two element count, at most 16 bytes of the widest dtype, that divides
    the row length and keeps every access aligned. ``misalignment`` is the OR of every data
    pointer and row stride in bytes, modulo 16 (0 when everything is 16-byte aligned)."""
    vec = 16 // widest
    while vec > 1 and (n % vec or misalignment % (vec * widest)):
        vec //= 2
    return vec


def row_specs(dtypes, n: int, vec: int) -> tuple:
    """Argument specs for (M, N) row tensors of these torch dtypes: M dynamic, row strides
    dynamic multiples of ``vec``, data aligned to ``vec`` elements."""
    return tuple(
        TensorSpec.rowmajor(dtype_name(d), (Sym("m"), n), vec, align=vec * ITEMSIZE[d]) for d in dtypes
    ) + (StreamSpec(),)


class RowKernels:
    """The compiled kernels of one row-wise op (see the module docstring).

    ``build(key, vec)`` returns (kernel class, config, argument specs) for a key and a vector
    width; the key holds everything else that decides the kernel (dtypes, N last).
    """

    def __init__(self, build: Callable):
        self.build = build
        self.aligned: dict = {}
        self.exact: dict = {}

    def __call__(self, key: tuple, tensors: tuple, *args) -> None:
        """Run the kernel for ``key`` on ``args``. ``tensors`` are the (M, N) rows and (N,)
        vectors whose alignment decides the vector width."""
        fn = self.aligned.get(key)
        if fn is not None:
            try:
                return fn(*args)
            except ValueError:  # a pointer or stride broke the 16-byte assumption
                pass
        return self._exact(key, tensors)(*args)

    def _exact(self, key: tuple, tensors: tuple):
        misalignment = 0
        for t in tensors:
            misalignment |= t.data_ptr()
            if t.dim() == 2:
                misalignment |= t.stride(0) * ITEMSIZE[t.dtype]
        misalignment &= 15
        fn = self.exact.get(key + (misalignment,))
        if fn is None:
            n = key[-1]
            widest = max(ITEMSIZE[t.dtype] for t in tensors)
            vec = vector_width(n, widest, misalignment)
            fn = get_kernel(*self.build(key, vec))
            self.exact[key + (misalignment,)] = fn
            if vec == vector_width(n, widest, 0):
                self.aligned[key] = fn
        return fn


def widest_itemsize(dtypes) -> int:
    return max(ITEMSIZE[d] for d in dtypes if d is not None)
