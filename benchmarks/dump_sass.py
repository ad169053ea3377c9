"""SASS of GEMM configurations, compiled here for sm_90a (no GPU needed).

    python benchmarks/dump_sass.py OUT_DIR [--match TEXT] [--cuobjdump PATH]

Compiles every configuration of ``cute_kernels.gemm.op.compile_configurations()`` whose
description contains ``--match`` (e.g. ``pingpong=True``), writes ``OUT_DIR/<index>.sass``
and prints a count of the instructions that tell a schedule apart: tensor-core MMAs, the
waits for them, named barriers, sleeping mbarrier waits. ``cuobjdump`` comes with the CUDA
toolkit, or from PyPI as ``nvidia-cuda-cuobjdump`` (``nvidia/cu13/bin/cuobjdump``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from cute_kernels.gemm.op import compile_configurations
from cute_kernels.runtime import inspect_kernel

COUNTED = ("HGMMA", "QGMMA", "WARPGROUP.DEPBAR", "BAR.SYNC", "BAR.ARV", "NANOSLEEP", "CS2R")


def disassemble(cubins, cuobjdump: str) -> str:
    text = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, image in enumerate(cubins):
            path = Path(tmp) / f"{i}.cubin"
            path.write_bytes(image)
            text.append(subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True,
                                       text=True, check=True).stdout)
    return "".join(text)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--match", default="")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    args = parser.parse_args()
    if not args.cuobjdump:
        parser.error("cuobjdump not found: pass --cuobjdump PATH")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for index, (kernel, config, specs) in enumerate(compile_configurations()):
        description = f"{config} {[getattr(s, 'dtype', None) for s in specs]}"
        if args.match not in description:
            continue
        report = inspect_kernel(kernel, config, specs, keep_cubin=True)
        sass = disassemble(report.cubins, args.cuobjdump)
        (args.out_dir / f"{index}.sass").write_text(sass)
        counts = " ".join(f"{name} {sass.count(name)}" for name in COUNTED)
        print(f"{index}: {counts} | {description}")


if __name__ == "__main__":
    main()
