"""The package's layers (docs/architecture.md): only library/ loads the built library, and the imports between the
package's modules (at module level or inside functions) have no circle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flashinfer_a2a"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from .x import y`` counts ``x.y`` where that is a module)."""
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules and target != name:
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules and a.name != name)
    return edges


def test_only_the_library_loads_the_built_module():
    edges = _imports(_modules())
    loaders = {m for m, targets in edges.items() if any(t.startswith("flashinfer_a2a.jit") for t in targets)}
    assert loaders <= {m for m in edges if m.startswith(("flashinfer_a2a.library", "flashinfer_a2a.jit"))}, loaders
    assert "flashinfer_a2a.library.ops" in loaders  # the check sees imports at all


def test_the_imports_have_no_circle():
    edges = _imports(_modules())
    # A package's __init__ is imported before its modules: an edge into a package is to its __init__ only.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            assert state.get(target) != 1, " -> ".join(path[path.index(target):] + [target])
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert sum(len(t) for t in edges.values()) > 50  # the graph was read


def test_launch_dispatch_is_a_deprecated_alias(monkeypatch):
    import pytest

    from flashinfer_a2a import functional as F

    monkeypatch.setattr(F, "dispatch_counts", lambda *args, **kwargs: (args, kwargs))
    with pytest.warns(DeprecationWarning, match="launch_dispatch is now dispatch_counts"):
        assert F.launch_dispatch(1, 2, num_sms=3) == ((1, 2), {"num_sms": 3})
