"""Bundling a submission that imports cute_kernels into one standalone file.

``python -m cute_kernels.contest bundle PROBLEM_DIR [--submission FILE] -o standalone.py``

The output holds the submission and exactly the package modules it reaches (module-level and
function-level imports followed from the submission), flattened through the AST -- real source,
not exec'd strings, because the DSL re-reads the source of every jit function:

- every module-level name of a package module is renamed ``<module tag>__<name>``, and every
  reference to it (scope-aware: function locals and parameters are left alone) follows; names
  bound by imports from the package, and ``module.attr`` through an imported package module,
  point at the renamed definitions;
- imports of other packages are hoisted to the top (after the few lines that put the DSL's
  packages on ``sys.path``), package imports are dropped;
- modules come in dependency order of their module-level imports;
- the disk cache is off: compiled kernels live in the module-level in-memory cache;
- ``#!POPCORN`` directives stay in the first comment block.

It needs only torch and nvidia-cutlass-dsl (and apache-tvm-ffi) where it runs. What it cannot
flatten (a package module used as a value, ``import *``) raises :class:`BundleError`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "cute_kernels"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
FIRST = f"{PACKAGE}._dsl"  # puts the DSL on sys.path: runs before any hoisted import


class BundleError(ValueError):
    """A construct the bundler cannot flatten."""


def _module_path(name: str) -> Path:
    rel = Path(*name.split(".")[1:])
    folder = PACKAGE_ROOT / rel
    if folder.is_dir():
        return folder / "__init__.py"
    return PACKAGE_ROOT / rel.with_suffix(".py")


def _is_package(name: str) -> bool:
    return _module_path(name).name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _internal(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _exists(name: str) -> bool:
    return _module_path(name).exists()


class Module:
    """One package module: its AST and what its imports bind."""

    def __init__(self, name: str, source: str, path: str):
        self.name = name
        self.tag = name.replace(".", "_")
        self.tree = ast.parse(source, path)
        self.deps: list[str] = []  # module-level internal imports, in statement order
        self.reached: set[str] = set()  # every internal module it imports, anywhere
        self.aliases: dict[str, tuple[str, str | None]] = {}  # local name -> (module, attr | None)
        self.external: list[ast.stmt] = []  # module-level imports of other packages
        self._scan()

    def _depend(self, module: str, top: bool):
        self.reached.add(module)
        if top and module != self.name and module not in self.deps:
            self.deps.append(module)

    def _bind(self, local: str, module: str, attr: str | None, top: bool):
        if self.aliases.get(local, (module, attr)) != (module, attr):
            raise BundleError(f"{self.name}: '{local}' imported from two places "
                              f"({self.aliases[local]} and {(module, attr)})")
        self.aliases[local] = (module, attr)
        self._depend(module, top)

    def _scan(self):
        top = set(id(n) for n in self.tree.body)
        for node in sorted((n for n in ast.walk(self.tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
                           key=lambda n: (n.lineno, n.col_offset)):
            at_top = id(node) in top
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _internal(a.name):
                        if a.asname is None and "." in a.name:
                            raise BundleError(f"{self.name}: 'import {a.name}' without 'as'")
                        self._bind(a.asname or a.name, a.name, None, at_top)
                    elif at_top:
                        self.external.append(node)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(self.name, node)
                if not _internal(target):
                    if at_top and target != "__future__":
                        self.external.append(node)
                    continue
                for a in node.names:
                    if a.name == "*":
                        raise BundleError(f"{self.name}: 'from {target} import *'")
                    sub = f"{target}.{a.name}"
                    if _exists(sub):  # a module imported by name
                        self._bind(a.asname or a.name, sub, None, at_top)
                    else:
                        self._bind(a.asname or a.name, target, a.name, at_top)

    def globals(self) -> set[str]:
        names = set()
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                        names.add(sub.name)
                    elif isinstance(sub, ast.Assign):
                        for t in sub.targets:
                            names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        return names


def _bound_in(fn: ast.AST) -> set[str]:
    """Names local to a function / lambda / comprehension scope."""
    names: set[str] = set()
    args = fn.args if hasattr(fn, "args") else None
    if args is not None:
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            names.add(a.arg)
        for a in (args.vararg, args.kwarg):
            if a is not None:
                names.add(a.arg)
    declared_global = set()
    if isinstance(fn, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        stack = [g.target for g in fn.generators]
    else:
        stack = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Global):
            declared_global.update(node.names)
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            stack.extend(node.decorator_list)
            continue  # their bodies are their own scopes
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if not _internal(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and not _internal(node.module or ""):
                names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return names - declared_global


def _imported_in(fn: ast.AST) -> set[str]:
    """Names a function binds by importing from the package (nested scopes excluded): inside
    it they mean the import, not a module-level name of the same spelling."""
    names: set[str] = set()
    stack = list(fn.body) if isinstance(getattr(fn, "body", None), list) else []
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if _internal(a.name))
        elif isinstance(node, ast.ImportFrom) and (node.level > 0 or _internal(node.module or "")):
            names.update(a.asname or a.name for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names


class _Rename(ast.NodeTransformer):
    """Rewrite one module: its globals renamed, package imports pointed at their targets."""

    def __init__(self, module: Module, renamed: dict[tuple[str, str], str], modules: dict):
        self.module = module
        self.renamed = renamed
        self.modules = modules
        # (names, is_class): a class body's names hide globals only in the body itself, not in
        # the methods nested in it (Python's scoping).
        self.scopes: list[tuple[set[str], bool]] = []
        self.imported: list[set[str]] = []  # per function scope: names of its package imports
        self.globals = module.globals()

    def _shadowed(self, name: str) -> bool:
        for depth, (names, is_class) in enumerate(reversed(self.scopes)):
            if is_class and depth > 0:
                continue
            if name in names:
                return True
        return False

    def _imported_here(self, name: str) -> bool:
        return any(name in names for names in self.imported)

    def _global_name(self, name: str) -> str | None:
        if self._shadowed(name):
            return None
        if name in self.globals and not self._imported_here(name):
            return self.renamed[(self.module.name, name)]
        if name in self.module.aliases:
            target, attr = self.module.aliases[name]
            if attr is None:
                raise BundleError(f"{self.module.name}: the package module {target} used as a value ({name})")
            return self._definition(target, attr)
        return None

    def _definition(self, module: str, attr: str) -> str:
        seen = set()
        while (module, attr) not in self.renamed:  # re-exported: follow the chain of imports
            if (module, attr) in seen or module not in self.modules:
                raise BundleError(f"cannot find {attr} in {module}")
            seen.add((module, attr))
            source = self.modules[module]
            if attr not in source.aliases:
                raise BundleError(f"{module} has no {attr}")
            module, attr = source.aliases[attr]
            if attr is None:
                raise BundleError(f"{module} is a module, not a definition")
        return self.renamed[(module, attr)]

    def _scoped(self, node):
        self.scopes.append((_bound_in(node), False))
        self.generic_visit(node)
        self.scopes.pop()
        return node

    def visit_FunctionDef(self, node):
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.args.defaults = [self.visit(d) for d in node.args.defaults]
        node.args.kw_defaults = [None if d is None else self.visit(d) for d in node.args.kw_defaults]
        for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            if arg.annotation is not None:
                arg.annotation = self.visit(arg.annotation)
        if node.returns is not None:
            node.returns = self.visit(node.returns)
        if not self.scopes and node.name in self.globals:
            node.name = self.renamed[(self.module.name, node.name)]
        self.scopes.append((_bound_in(node), False))
        self.imported.append(_imported_in(node))
        node.body = [self.visit(s) for s in node.body]
        node.body = [s for s in node.body if s is not None] or [ast.Pass()]
        self.imported.pop()
        self.scopes.pop()
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.bases = [self.visit(b) for b in node.bases]
        node.keywords = [self.visit(k) for k in node.keywords]
        if not self.scopes and node.name in self.globals:
            node.name = self.renamed[(self.module.name, node.name)]
        bound = set()
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                bound.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        self.scopes.append((bound, True))
        node.body = [s for s in (self.visit(s) for s in node.body) if s is not None] or [ast.Pass()]
        self.scopes.pop()
        return node

    def visit_Lambda(self, node):
        return self._scoped(node)

    def visit_ListComp(self, node):
        return self._scoped(node)

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp

    def _hoisted(self) -> bool:
        """A module-level import of another package moves to the top (not the first module's:
        it runs before the hoisted imports)."""
        return not self.scopes and self.module.name != FIRST

    def visit_Import(self, node):
        names = [a for a in node.names if not _internal(a.name)]
        if not names or self._hoisted():
            return None
        node.names = names
        return node

    def visit_ImportFrom(self, node):
        if _internal(_resolve(self.module.name, node)) or node.module == "__future__":
            return None
        return None if self._hoisted() else node

    def visit_Global(self, node):
        node.names = [self.renamed.get((self.module.name, n), n) for n in node.names]
        return node

    def visit_Name(self, node):
        new = self._global_name(node.id)
        if new is not None:
            return ast.copy_location(ast.Name(id=new, ctx=node.ctx), node)
        return node

    def visit_Attribute(self, node):
        # pkg_module.attr (through an imported package module) -> the renamed definition.
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and not self._shadowed(base.id) \
                and (base.id not in self.globals or self._imported_here(base.id)) \
                and base.id in self.module.aliases and self.module.aliases[base.id][1] is None:
            module = self.module.aliases[base.id][0]
            chain.reverse()
            while len(chain) > 1 and f"{module}.{chain[0]}" in self.modules:
                module = f"{module}.{chain.pop(0)}"
            new: ast.expr = ast.Name(id=self._definition(module, chain[0]), ctx=ast.Load())
            for attr in chain[1:]:
                new = ast.Attribute(value=new, attr=attr, ctx=ast.Load())
            if isinstance(node.ctx, ast.Store):
                raise BundleError(f"{self.module.name}: assigning to {module}.{'.'.join(chain)}")
            return ast.copy_location(new, node)
        self.generic_visit(node)
        return node


def _collect(roots: set[str]) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    todo = list(roots) + [FIRST]
    while todo:
        name = todo.pop()
        if name in modules or not _internal(name):
            continue
        path = _module_path(name)
        if not path.exists():
            raise BundleError(f"no module {name} ({path})")
        module = Module(name, path.read_text(), str(path))
        modules[name] = module
        # A package's __init__ runs before its submodules: treat it as reached too.
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(module.reached)
    return modules


def _order(modules: dict[str, Module]) -> list[str]:
    order, state = [], {}

    def visit(name, path):
        # Python's own order: a module runs its imports, in statement order, before its body
        # (a module already being imported is not waited for).
        if name in state:
            return
        state[name] = "active"
        for dep in modules[name].deps:
            if dep in modules:
                visit(dep, path + [name])
        state[name] = "done"
        order.append(name)

    visit(FIRST, [])
    visit(PACKAGE, [])
    for name in sorted(modules):
        visit(name, [])
    return order


def bundle_source(submission: str, path: str = "submission.py") -> str:
    """The standalone source for ``submission`` (module docstring)."""
    sub = Module("__submission__", submission, path)
    roots = {m for m, _ in sub.aliases.values()}
    modules = _collect(roots)
    renamed = {(m.name, g): f"{m.tag}__{g}" for m in modules.values() for g in m.globals()}
    order = _order(modules)
    hoisted, seen = [], set()
    for name in order:
        if name == FIRST:
            continue
        for node in modules[name].external:
            text = ast.unparse(node)
            if text not in seen:
                seen.add(text)
                hoisted.append(text)
    sections = []
    for name in order:
        module = modules[name]
        tree = _Rename(module, renamed, modules).visit(module.tree)
        body = [n for n in tree.body if n is not None and not (
            isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str))]
        sections.append(f"# ---- {name}\n" + "\n".join(ast.unparse(n) for n in body))
        if name == FIRST:
            sections.append("# ---- imports of other packages\n" + "\n".join(hoisted))
    # The submission itself: its package names point at the renamed definitions.
    sub_globals = sub.globals()
    for g in sub_globals:
        renamed[("__submission__", g)] = g
    modules["__submission__"] = sub
    sub_tree = _Rename(sub, renamed, modules).visit(sub.tree)
    sub_external = [ast.unparse(n) for n in sub.external if ast.unparse(n) not in seen]
    sub_body = [ast.unparse(n) for n in sub_tree.body if n is not None]
    directives = [line for line in submission.splitlines() if line.startswith("#!POPCORN")]
    header = directives + [
        "from __future__ import annotations",
        "# Standalone: the submission and the cute_kernels modules it reaches, flattened",
        "# (python -m cute_kernels.contest bundle). Needs torch and nvidia-cutlass-dsl.",
        "import os",
        'os.environ.setdefault("CUTE_KERNELS_DISK_CACHE", "0")  # compiled kernels stay in memory',
    ]
    parts = ["\n".join(header)] + sections + ["# ---- submission\n" + "\n".join(sub_external + sub_body)]
    return "\n\n\n".join(parts) + "\n"


def bundle(submission: Path, out: Path) -> Path:
    out.write_text(bundle_source(Path(submission).read_text(), str(submission)))
    return out
