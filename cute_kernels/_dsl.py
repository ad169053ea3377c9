"""Makes ``import cutlass`` work when only the DSL's libraries are installed.

The DSL's Python packages live in ``nvidia_cutlass_dsl/dsl_packages``, which the
``nvidia-cutlass-dsl`` meta-package puts on ``sys.path`` with a ``.pth`` file. This library
depends on ``nvidia-cutlass-dsl-libs-cu13`` alone (the meta-package would also pull the CUDA 12
libraries, ~92 MB more), so it adds that folder itself, once, before anything imports cutlass.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def add_dsl_packages() -> None:
    if importlib.util.find_spec("cutlass") is not None:
        return
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "dsl_packages")
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
            return


add_dsl_packages()
