"""The imports between a package's modules, read from its source (no import runs): what each module makes Python
run, which modules reach the built library's loader, and which imports run up a declared order of layers.

Every import form counts: ``import a.b``, ``from a import b`` (a module or a name), relative forms, imports inside
functions, ``importlib.import_module("a.b")`` / ``import_module(".b", __package__)`` / ``__import__("a.b")`` with a
constant name, and a name re-exported by another module (``from .library.ops import get_a2a_module`` takes the
loader as surely as ``from .jit import get_a2a_module``). Importing ``a.b.c`` runs the ``__init__`` of ``a.b``
first, so an edge into a package also reaches what that ``__init__`` imports — but not the importer's own packages,
which are already running when it runs.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Iterable, Optional

_IMPORT_FUNCTIONS = ("import_module", "__import__")


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root/package`` (a package is its ``__init__.py``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


@dataclasses.dataclass(frozen=True)
class Import:
    """One import in ``importer``: ``target`` is the module named (absolute); ``names`` what a from-import takes
    from it (``None`` for ``import target`` and import_module); ``line`` where it is."""

    importer: str
    target: str
    names: Optional[tuple[str, ...]]
    line: int


def _resolve(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if not level:
        return module or ""
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[: len(parts) - level + 1]
    return ".".join(parts + ([module] if module else []))


def _constant_str(node: Optional[ast.AST]) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dynamic_import(call: ast.Call, importer: str, is_package: bool) -> Optional[str]:
    """The module an ``import_module``/``__import__`` call names: absolute, or relative to a constant package or to
    this module's (``__package__``/``__name__``); ``"?"`` where the name is not a constant; None for other calls."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in _IMPORT_FUNCTIONS or not call.args:
        return None
    target = _constant_str(call.args[0])
    if target is None:
        return "?"
    if not target.startswith("."):
        return target
    anchor = call.args[1] if len(call.args) > 1 and name == "import_module" else next(
        (k.value for k in call.keywords if k.arg == "package"), None)
    package = _constant_str(anchor)
    if package is None and isinstance(anchor, ast.Name) and anchor.id in ("__package__", "__name__"):
        package = importer if is_package or anchor.id == "__name__" else importer.rsplit(".", 1)[0]
    if package is None:
        return "?"
    level = len(target) - len(target.lstrip("."))
    return _resolve(package, True, level, target[level:] or None)


def within(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its modules."""
    return module == package or module.startswith(package + ".")


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _prefixes(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


class ImportGraph:
    """The package's modules, their imports, and what follows from them."""

    def __init__(self, root: Path, package: str) -> None:
        self.package = package
        self.modules = package_modules(root, package)
        self.imports: list[Import] = []
        self.unresolved: list[str] = []  # "module:line" of an import_module whose name is not a constant
        self._modules_bound: dict[str, dict[str, str]] = {}  # module -> local name -> the module it is bound to
        self._names_bound: dict[str, dict[str, tuple[str, str]]] = {}  # module -> local name -> (module, its name)
        self._attributes: dict[str, list[tuple[list[str], int]]] = {}  # module -> (a.b.c as [a, b, c], line)
        self._star: dict[str, list[tuple[str, int]]] = {}  # module -> (module it star-imports, line)
        for name, path in self.modules.items():
            self._read(name, path)

    # ------------------------------------------------------------------------------------------------- reading

    def _read(self, name: str, path: Path) -> None:
        is_package = path.name == "__init__.py"
        modules_bound = self._modules_bound.setdefault(name, {})
        names_bound = self._names_bound.setdefault(name, {})
        attributes = self._attributes.setdefault(name, [])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports.append(Import(name, alias.name, None, node.lineno))
                    if alias.asname:
                        modules_bound[alias.asname] = alias.name
                    elif alias.name.split(".")[0] == self.package:
                        modules_bound[self.package] = self.package
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, is_package, node.level, node.module)
                self.imports.append(Import(name, target, tuple(a.name for a in node.names), node.lineno))
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name == "*":
                        self._star.setdefault(name, []).append((target, node.lineno))
                    elif f"{target}.{alias.name}" in self.modules:
                        modules_bound[local] = f"{target}.{alias.name}"
                    else:
                        names_bound[local] = (target, alias.name)
            elif isinstance(node, ast.Call):
                target = _dynamic_import(node, name, is_package)
                if target == "?":
                    self.unresolved.append(f"{name}:{node.lineno}")
                elif target is not None:
                    self.imports.append(Import(name, target, None, node.lineno))
            elif isinstance(node, ast.Attribute):
                chain, inner = [node.attr], node.value
                while isinstance(inner, ast.Attribute):
                    chain, inner = [inner.attr] + chain, inner.value
                if isinstance(inner, ast.Name):
                    attributes.append(([inner.id] + chain, node.lineno))

    # ----------------------------------------------------------------------------------------- what runs what

    def runs(self, imp: Import) -> set[str]:
        """The package's modules whose code ``imp`` needs run: every package on the target's path (but the
        importer's own, already running), the target, and each submodule a from-import names."""
        needed = {p for p in _prefixes(imp.target) if p in self.modules} - _ancestors(imp.importer)
        for n in imp.names or ():
            if f"{imp.target}.{n}" in self.modules:
                needed.add(f"{imp.target}.{n}")
            elif imp.target in self.modules:
                needed.add(imp.target)  # a name (or "*") out of the target's namespace: its code must have run
        return needed - {imp.importer}

    def edges(self) -> dict[str, set[str]]:
        """Module -> the package's modules importing it runs (or needs to have run)."""
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            out[imp.importer] |= self.runs(imp)
        return out

    def circle(self) -> Optional[list[str]]:
        """A circle of imports (its modules, the first repeated at the end), or None."""
        edges, state, path = self.edges(), {}, []

        def visit(module: str) -> Optional[list[str]]:
            state[module] = 1
            path.append(module)
            for target in sorted(edges[module]):
                if state.get(target) == 1:
                    return path[path.index(target):] + [target]
                if target not in state:
                    found = visit(target)
                    if found:
                        return found
            path.pop()
            state[module] = 2
            return None

        for module in sorted(edges):
            if module not in state:
                found = visit(module)
                if found:
                    return found
        return None

    # ---------------------------------------------------------------------------------------- the loader

    def derived_from(self, module: str, name: str, source: str, seen: Optional[set] = None) -> bool:
        """Whether ``module``'s global ``name`` is (a re-export of) something defined in package ``source``."""
        if within(module, source):
            return True
        seen = set() if seen is None else seen
        if (module, name) in seen:
            return False
        seen.add((module, name))
        if within(self._modules_bound.get(module, {}).get(name, ""), source):
            return True
        bound = self._names_bound.get(module, {}).get(name)
        if bound is not None:
            return self.derived_from(*bound, source, seen)
        return any(self.derived_from(star, name, source, seen) for star, _ in self._star.get(module, ()))

    def reaching(self, source: str) -> dict[str, list[str]]:
        """Module -> how it reaches package ``source`` (imports it, imports one of its names from wherever it is
        re-exported, or reads such a name as an attribute of another module): the modules outside ``source``."""
        found: dict[str, list[str]] = {}
        for imp in self.imports:
            if within(imp.importer, source):
                continue
            why = None
            if any(within(m, source) for m in self.runs(imp)) or within(imp.target, source):
                why = f"line {imp.line}: imports {imp.target}"
            else:
                names = [n for n in imp.names or () if n == "*" and self._star_reaches(imp.target, source)
                         or n != "*" and self.derived_from(imp.target, n, source)]
                if names:
                    why = f"line {imp.line}: imports {', '.join(names)} of {source} through {imp.target}"
            if why:
                found.setdefault(imp.importer, []).append(why)
        for module, attributes in self._attributes.items():
            if within(module, source):
                continue
            for chain, line in attributes:
                held = self._modules_bound.get(module, {}).get(chain[0])
                for i, part in enumerate(chain[1:], 1):
                    if held not in self.modules:
                        break
                    if within(held, source) or self.derived_from(held, part, source):
                        why = f"line {line}: reads {'.'.join(chain[: i + 1])}, {source}'s"
                        if why not in found.get(module, ()):
                            found.setdefault(module, []).append(why)
                        break
                    held = f"{held}.{part}"
        return found

    def _star_reaches(self, module: str, source: str) -> bool:
        return any(self.derived_from(module, n, source) for n in self._names_bound.get(module, {})) or any(
            within(m, source) for m in self._modules_bound.get(module, {}).values())

    # ------------------------------------------------------------------------------------------- layers

    def layer_violations(self, layers: Iterable[tuple[str, ...]]) -> set[tuple[str, str]]:
        """(importer, imported) of every import that runs up ``layers`` (top first; each a tuple of module prefixes
        relative to the package, ``""`` for the package's own ``__init__``): a module may import its own layer and
        the layers below it. Raises ValueError for a module in no layer or in two."""
        layers = list(layers)
        rank = {}
        for module in self.modules:
            relative = module[len(self.package) + 1 :] if module != self.package else ""
            places = [i for i, layer in enumerate(layers)
                      if any(relative == p or p and relative.startswith(p + ".") for p in layer)]
            if len(places) != 1:
                raise ValueError(f"{module} is in {len(places)} layers (place it in one)")
            rank[module] = places[0]
        return {(importer, target) for importer, targets in self.edges().items() for target in targets
                if rank[target] < rank[importer]}
