"""python -m cute_kernels [check] | precompile: see cute_kernels/commands.py."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Without a command: the self-check. On a GPU machine it runs every op on random data against a
float64 reference and prints the error and the time against torch. Without a GPU it compiles a
sample of kernel configurations for sm_90a in parallel processes and reports what their PTX
holds (reports are kept in the disk cache, so a second run is quick). The exit code is non-zero
on any failure.

precompile: compile every kernel configuration the heuristics can return into the disk cache
(CUTE_KERNELS_CACHE_DIR, default ~/.cache/cute_kernels) without a GPU, in parallel processes; a
GPU machine of the same arch with the same package and DSL versions loads them instead of
compiling. With --from FILE, also the kernels listed in FILE, as written by a run with
CUTE_KERNELS_RECORD=FILE (the kernels a workload or test suite used)."""


def main(argv=None) -> int:
    from .commands import FAMILY_MODULES, default_jobs

    parser = argparse.ArgumentParser(prog="python -m cute_kernels", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true",
                        help="self-check: compile for sm_90a even on a GPU machine")
    parser.add_argument("--all", action="store_true",
                        help="self-check: every configuration, not a sample")
    commands = parser.add_subparsers(dest="command", metavar="{check,precompile}")
    commands.add_parser("check", help="the self-check (the default)")
    pre = commands.add_parser("precompile", help="fill the disk cache without a GPU",
                              description="Compile kernels into the disk cache (see python -m "
                              "cute_kernels --help).")
    pre.add_argument("--arch", default="sm_90a", help="target architecture (default sm_90a)")
    pre.add_argument("--cache-dir", help="cache folder (default $CUTE_KERNELS_CACHE_DIR or "
                     "~/.cache/cute_kernels)")
    pre.add_argument("--families", default=",".join(FAMILY_MODULES),
                     help=f"comma-separated, from {', '.join(FAMILY_MODULES)} (default all)")
    pre.add_argument("--from", dest="recorded", metavar="FILE",
                     help="also compile the kernels listed in FILE (CUTE_KERNELS_RECORD output)")
    pre.add_argument("--jobs", type=int, default=default_jobs(),
                     help="parallel compile processes (default: the CPUs available)")
    args = parser.parse_args(argv)
    if args.command == "precompile":
        from .commands import precompile

        families = [f for f in args.families.split(",") if f]
        unknown = [f for f in families if f not in FAMILY_MODULES]
        if unknown:
            parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILY_MODULES)}")
        return 1 if precompile(args.arch, args.cache_dir, families, args.recorded, args.jobs) else 0
    from .commands import main_check

    return main_check(args.compile_only, args.all)


if __name__ == "__main__":
    sys.exit(main())
