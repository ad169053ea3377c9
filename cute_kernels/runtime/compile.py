"""The compile cache every kernel family goes through.

A kernel is compiled once per (kernel class, config, argument signature, arch). The argument
signature is made of :class:`TensorSpec` / :class:`ScalarSpec` / :class:`StreamSpec` values:
fake tensors whose dims may be symbolic (:class:`Sym`), so a new batch size or sequence length
reuses the same compiled kernel. Compiled kernels take torch tensors directly through TVM-FFI
and run on torch's current stream.

Two levels of caching:

* in memory, a dict from the key to the callable;
* on disk, the compiled object (``export_to_c``) under
  ``$CUTE_KERNELS_CACHE_DIR`` (default ``~/.cache/cute_kernels``), in a folder named by a
  fingerprint of this package's source, the DSL version and the TVM-FFI version, so a change
  to any kernel invalidates everything compiled before it. A per-key file lock makes parallel
  processes compile a key once; the others load what the first one wrote.
  ``CUTE_KERNELS_DISK_CACHE=0`` turns the disk side off.

Kernels compiled without a GPU (``CUTE_KERNELS_ARCH=sm_90a``) go to the same disk cache under
the same key, so a GPU of that arch loads them instead of compiling: ``python -m cute_kernels
precompile`` fills a cache for a deployment image or a test machine. The self-check's PTX
reports are kept beside the objects (``<key>.report.json``, the PTX in ``<key>.ptx.gz``), so a
second self-check reads them, and the compile tests read a configuration's report and PTX there
rather than compile it again.

``CUTE_KERNELS_RECORD=FILE`` appends one line per kernel a process uses (``record_line``), which
``precompile --from FILE`` compiles on another machine: the kernels a workload needs, built
ahead of time for the machine that will run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import gzip
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import cutlass
import cutlass.cute as cute
import tvm_ffi

from .arch import check_supported, target_arch
from .dtypes import cutlass_dtype
from .errors import CompileError

EXPORT_NAME = "func"
LOCK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sym:
    """A dimension or stride known only at run time.

    Shape entries with the same ``name`` share one symbolic integer (the kernel may assume they
    are equal); an unnamed entry is its own symbol. ``divisibility`` is what the kernel may
    assume the value is a multiple of (checked at call time).
    """

    name: str | None = None
    divisibility: int = 1


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument: torch dtype name, shape and stride (ints are static, :class:`Sym`
    entries dynamic) and the alignment in bytes that the data pointer is assumed to have."""

    dtype: str
    shape: tuple
    stride: tuple
    align: int = 16

    @staticmethod
    def rowmajor(dtype: str, shape: tuple, divisibility: int, align: int = 16) -> "TensorSpec":
        """A tensor whose last dim is contiguous and whose other strides are dynamic multiples
        of ``divisibility`` elements."""
        stride = tuple(Sym(divisibility=divisibility) for _ in shape[:-1]) + (1,)
        return TensorSpec(dtype, tuple(shape), stride, align)


@dataclass(frozen=True)
class ScalarSpec:
    """A scalar passed at run time: ``"float32"``, ``"int32"`` or ``"int64"``."""

    dtype: str


@dataclass(frozen=True)
class StreamSpec:
    """The launch stream: torch's current stream, taken by TVM-FFI at call time."""


def _fake_args(specs: tuple) -> list:
    symbols: dict[str, Any] = {}

    def sym(entry: Sym, width: int):
        if entry.name is not None:
            if entry.name not in symbols:
                symbols[entry.name] = cute.sym_int(width, divisibility=entry.divisibility)
            return symbols[entry.name]
        return cute.sym_int(width, divisibility=entry.divisibility)

    args = []
    for spec in specs:
        if spec is None:  # an optional tensor left out: the kernel is compiled without it
            args.append(None)
        elif isinstance(spec, TensorSpec):
            shape = tuple(sym(d, 32) if isinstance(d, Sym) else d for d in spec.shape)
            stride = tuple(sym(s, 64) if isinstance(s, Sym) else s for s in spec.stride)
            args.append(
                cute.runtime.make_fake_tensor(
                    cutlass_dtype(spec.dtype), shape, stride=stride, assumed_align=spec.align
                )
            )
        elif isinstance(spec, ScalarSpec):
            args.append({"float32": cutlass.Float32, "int32": cutlass.Int32, "int64": cutlass.Int64}[spec.dtype](0))
        elif isinstance(spec, StreamSpec):
            args.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
        else:
            raise TypeError(f"not an argument spec: {spec!r}")
    return args


def _hash_tree(h, root: Path) -> None:
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        data = path.read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """Hash of this package's source plus the DSL and TVM-FFI versions. (Not Python's: the
    compiled objects are machine code behind a C ABI, so a cache built under one Python serves
    another.)"""
    h = hashlib.sha256()
    h.update(f"cutlass-dsl={cutlass.__version__};tvm-ffi={tvm_ffi.__version__}".encode())
    _hash_tree(h, Path(__file__).resolve().parent.parent)
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    root = os.environ.get("CUTE_KERNELS_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cute_kernels"


def disk_cache_enabled() -> bool:
    return os.environ.get("CUTE_KERNELS_DISK_CACHE", "1") not in ("0", "false", "off")


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float = LOCK_TIMEOUT_S):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise CompileError(f"timed out after {timeout:.0f} s waiting for {path}")
                time.sleep(0.05)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _qualname(kernel_cls: type) -> str:
    return f"{kernel_cls.__module__}.{kernel_cls.__qualname__}"


def cache_key(kernel_cls: type, config, specs: tuple, arch: str) -> str:
    """The disk cache's file stem for one kernel: a digest of its class, config, specs and arch."""
    key_text = repr((_qualname(kernel_cls), config, tuple(specs), arch))
    return hashlib.sha256(key_text.encode()).hexdigest()[:32]


def cache_folder() -> Path:
    folder = cache_dir() / source_fingerprint()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def record_line(kernel_cls: type, config, specs: tuple, arch: str) -> str:
    """One line naming a kernel: ``kernel class<TAB>repr(config)<TAB>repr(specs)<TAB>arch``
    (``precompile --from`` reads it back with :func:`parse_record_line`)."""
    return "\t".join((_qualname(kernel_cls), repr(config), repr(tuple(specs)), arch))


def parse_record_line(line: str):
    """(kernel class, config, specs, arch) from a :func:`record_line`. The config and specs are
    read back by evaluating their reprs with nothing in scope but the spec classes and the
    dataclasses of this package's loaded modules (no builtins)."""
    import dataclasses
    import importlib

    qualname, config_text, specs_text, arch = line.rstrip("\n").split("\t")
    module_name, _, class_name = qualname.rpartition(".")
    kernel_cls = getattr(importlib.import_module(module_name), class_name)
    package = __name__.split(".")[0]
    names = {}
    for name, module in list(sys.modules.items()):
        if name == package or name.startswith(package + "."):
            for value in vars(module).values():
                if isinstance(value, type) and dataclasses.is_dataclass(value):
                    names.setdefault(value.__name__, value)
    names.update(Sym=Sym, TensorSpec=TensorSpec, ScalarSpec=ScalarSpec, StreamSpec=StreamSpec)
    scope = {"__builtins__": {}, **names}
    return kernel_cls, eval(config_text, scope), eval(specs_text, scope), arch


def _record(kernel_cls, config, specs, arch) -> None:
    path = os.environ.get("CUTE_KERNELS_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(record_line(kernel_cls, config, specs, arch) + "\n")


def _compile_options(arch: str, extra: str = "") -> str:
    return f"--enable-tvm-ffi --gpu-arch {arch} {extra}".strip()


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_loads: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0


class KernelCache:
    """Compiled kernels by (kernel class, config, argument specs, arch)."""

    def __init__(self):
        self._kernels: dict[tuple, Callable] = {}
        self._owners: list = []
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, kernel_cls: type, config, specs: tuple, arch: str | None = None) -> Callable:
        arch = check_supported(arch or target_arch())
        key = (kernel_cls, config, specs, arch)
        fn = self._kernels.get(key)
        if fn is not None:
            self.stats.memory_hits += 1
            return fn
        with self._lock:
            fn = self._kernels.get(key)
            if fn is None:
                fn = self._load_or_compile(kernel_cls, config, specs, arch)
                self._kernels[key] = fn
                _record(kernel_cls, config, specs, arch)
        return fn

    def clear_memory(self) -> None:
        with self._lock:
            self._kernels.clear()

    def _compile(self, kernel_cls, config, specs, arch):
        start = time.perf_counter()
        try:
            compiled = cute.compile(
                kernel_cls(config), *_fake_args(specs), options=_compile_options(arch)
            )
        except Exception as exc:  # the DSL raises many types; surface one
            raise CompileError(
                f"compiling {kernel_cls.__name__} with {config} for {arch} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self.stats.compiles += 1
        self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def _callable(self, compiled):
        """The raw TVM-FFI function (no Python kwargs wrapper: a few microseconds less per
        call); the compiled object stays referenced because it owns the loaded code."""
        raw = getattr(compiled, "__tvm_ffi_object__", None)
        if raw is None:
            return compiled
        self._owners.append(compiled)
        return raw()

    def _load_or_compile(self, kernel_cls, config, specs, arch):
        if not disk_cache_enabled():
            return self._callable(self._compile(kernel_cls, config, specs, arch))
        digest = cache_key(kernel_cls, config, specs, arch)
        folder = cache_folder()
        obj = folder / f"{digest}.o"
        with _file_lock(folder / f"{digest}.lock"):
            if obj.exists():
                try:
                    return self._load(obj)
                except Exception:
                    obj.unlink(missing_ok=True)  # a truncated or stale object: rebuild it
            compiled = self._compile(kernel_cls, config, specs, arch)
            export_object(compiled, obj)
            return self._callable(compiled)

    def _load(self, obj: Path):
        start = time.perf_counter()
        fn = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)[EXPORT_NAME]
        self.stats.disk_loads += 1
        self.stats.load_seconds += time.perf_counter() - start
        return fn


def export_object(compiled, obj: Path) -> None:
    """Write a compiled kernel's object file to ``obj`` atomically (a temporary file, renamed)."""
    tmp = Path(tempfile.mkstemp(dir=obj.parent, suffix=".o.tmp")[1])
    compiled.export_to_c(object_file_path=str(tmp), function_name=EXPORT_NAME)
    os.replace(tmp, obj)


KERNELS = KernelCache()


def get_kernel(kernel_cls: type, config, specs: tuple, arch: str | None = None) -> Callable:
    """The compiled kernel for this class, config and argument signature (see module doc)."""
    return KERNELS.get(kernel_cls, config, tuple(specs), arch)


# Instructions a report remembers when it is kept on disk without its PTX.
REPORTED_INSTRUCTIONS = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "stmatrix",
                         "ld.local", "st.local")


@dataclass(frozen=True)
class CompileReport:
    """What the compiler produced for one kernel configuration."""

    kernel: str
    config: Any
    arch: str
    ptx: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    seconds: float
    # ptxas's "wgmma.mma_async instructions are serialized" remarks (C7510-C7515: each wgmma
    # waits for the previous one, e.g. for want of registers), one line each.
    wgmma_serialized: tuple = ()
    cubins: tuple = ()  # the ELF images, with ``inspect_kernel(..., keep_cubin=True)`` only
    # Which of REPORTED_INSTRUCTIONS the PTX has (what a report read from disk still knows).
    instructions: frozenset = frozenset()
    cached: bool = False  # read from the disk cache rather than compiled now

    def has(self, instruction: str) -> bool:
        if self.ptx:
            return instruction in self.ptx
        if instruction not in REPORTED_INSTRUCTIONS:
            raise ValueError(f"a cached report knows only {REPORTED_INSTRUCTIONS}, not {instruction!r}")
        return instruction in self.instructions

    @property
    def local_memory(self) -> bool:
        """True if the kernel spills or touches local memory at all."""
        return (
            self.spill_stores > 0
            or self.spill_loads > 0
            or self.has("ld.local")
            or self.has("st.local")
        )

    def summary(self) -> dict:
        return {
            "wgmma": self.has("wgmma.mma_async"),
            "tma": self.has("cp.async.bulk.tensor"),
            "setmaxnreg": self.has("setmaxnreg"),
            "registers": self.registers,
            "spills": self.spill_stores + self.spill_loads,
            "local_memory": self.local_memory,
            "wgmma_serialized": bool(self.wgmma_serialized),
        }

    def to_json(self) -> str:
        return json.dumps({
            "kernel": self.kernel, "arch": self.arch, "registers": self.registers,
            "spill_stores": self.spill_stores, "spill_loads": self.spill_loads,
            "stack_bytes": self.stack_bytes, "seconds": self.seconds,
            "wgmma_serialized": list(self.wgmma_serialized),
            "instructions": sorted(i for i in REPORTED_INSTRUCTIONS if self.has(i)),
        })

    @staticmethod
    def from_json(text: str, config) -> "CompileReport":
        data = json.loads(text)
        return CompileReport(
            kernel=data["kernel"], config=config, arch=data["arch"], ptx="",
            registers=data["registers"], spill_stores=data["spill_stores"],
            spill_loads=data["spill_loads"], stack_bytes=data["stack_bytes"],
            seconds=data["seconds"], wgmma_serialized=tuple(data["wgmma_serialized"]),
            instructions=frozenset(data["instructions"]), cached=True,
        )


_PTXAS_NUMBERS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
}
_WGMMA_SERIALIZED = re.compile(r"\(C75\d\d\)[^(]*?wgmma[^(]*?serialized[^(]*")


def wgmma_serialized_remarks(log: str) -> tuple:
    """ptxas's remarks that it serialized the wgmma (C7510-C7516), one string each. The log
    wraps a remark over several indented lines, so its whitespace is collapsed first; a
    remark ends where the next ``ptxas`` line or parenthesis starts."""
    flat = re.sub(r"\s+", " ", log)
    return tuple(m.group(0).split(" ptxas ")[0].strip() for m in _WGMMA_SERIALIZED.finditer(flat))


def inspect_kernel(kernel_cls: type, config, specs: tuple, arch: str = "sm_90a",
                   keep_cubin: bool = False, cache: bool = False, reuse: bool = False) -> CompileReport:
    """Compile one configuration with the PTX kept and the ptxas report captured (and with
    ``keep_cubin`` the machine code, for a disassembler: ``benchmarks/dump_sass.py``).

    Works without a GPU. With ``cache`` (and the disk cache on), the report and its PTX are
    kept beside the kernel's object in the disk cache, which is written too: a later call
    returns the kept report (without the PTX text, ``cached=True``) and a GPU of ``arch`` loads
    the object. With ``reuse``, a report kept that way is returned with its PTX instead of
    compiling again (the compile tests after the self-check), and nothing is written.
    """
    specs = tuple(specs)
    report_path = obj = ptx_path = None
    reuse = reuse and not keep_cubin
    if (cache or reuse) and disk_cache_enabled():
        folder = cache_folder()
        digest = cache_key(kernel_cls, config, specs, arch)
        report_path, obj = folder / f"{digest}.report.json", folder / f"{digest}.o"
        ptx_path = folder / f"{digest}.ptx.gz"
        if report_path.exists() and (cache or ptx_path.exists()):
            try:
                report = CompileReport.from_json(report_path.read_text(), config)
                if reuse:
                    report = dataclasses.replace(report, ptx=gzip.decompress(ptx_path.read_bytes()).decode())
                return report
            except (ValueError, KeyError, OSError, EOFError):  # a torn file: compile again
                report_path.unlink(missing_ok=True)
        if not cache:
            report_path = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cute_kernels_ptx_") as dump:
        keep = "--keep-ptx --keep-cubin" if keep_cubin else "--keep-ptx"
        options = _compile_options(arch, f"{keep} --dump-dir {dump} remarks{{ptx}}")
        log = io.StringIO()
        try:
            with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
                compiled = cute.compile(kernel_cls(config), *_fake_args(specs), options=options)
        except Exception as exc:
            raise CompileError(
                f"compiling {kernel_cls.__name__} with {config} for {arch} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        ptx = "\n".join(p.read_text() for p in sorted(Path(dump).rglob("*.ptx")))
        cubins = tuple(p.read_bytes() for p in sorted(Path(dump).rglob("*.cubin")))
    text = log.getvalue()
    numbers = {}
    for name, pattern in _PTXAS_NUMBERS.items():
        found = [int(v) for v in pattern.findall(text)]
        numbers[name] = max(found) if found else -1
    if not ptx or numbers["registers"] < 0:
        raise CompileError(f"no PTX or ptxas report captured for {kernel_cls.__name__} {config}")
    report = CompileReport(
        kernel=kernel_cls.__name__,
        config=config,
        arch=arch,
        ptx=ptx,
        seconds=time.perf_counter() - start,
        wgmma_serialized=wgmma_serialized_remarks(text),
        cubins=cubins,
        instructions=frozenset(i for i in REPORTED_INSTRUCTIONS if i in ptx),
        **numbers,
    )
    if report_path is not None:
        with _file_lock(obj.with_suffix(".lock")):
            if not obj.exists():
                export_object(compiled, obj)
        tmp = Path(tempfile.mkstemp(dir=report_path.parent, suffix=".ptx.tmp")[1])
        tmp.write_bytes(gzip.compress(ptx.encode(), compresslevel=1))
        os.replace(tmp, ptx_path)
        tmp = Path(tempfile.mkstemp(dir=report_path.parent, suffix=".json.tmp")[1])
        tmp.write_text(report.to_json())
        os.replace(tmp, report_path)
    return report
