"""The package's layers (docs/architecture.md), read from its imports (tests/import_graph.py follows every import
form): only library/ loads the built library, the imports have no circle (one through a package's ``__init__``
included), and no import runs up the declared order of layers but the known ones listed here. Each rule is also
run on a copy of the package with a defect planted, which it must report."""

import shutil
from pathlib import Path

import pytest

from .import_graph import ImportGraph, within

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flashinfer_a2a"
JIT = f"{PACKAGE}.jit"
LIBRARY = f"{PACKAGE}.library"

#: The declared order of layers, top first (docs/architecture.md): "compat, bench -> MoeAlltoAll -> transports ->
#: memory -> library -> jit, and the functional API -> library; a transport never imports the API above it
#: (functional, split halves)". The modules that line leaves out sit where the layer tree puts them: the package's
#: face with compat and bench; testing (simulated ranks for the tests and the bench) above MoeAlltoAll; agreement
#: (construction checks) with MoeAlltoAll; comm, reference, config and _version, which import nothing above them, at
#: the bottom. A module may import its own layer and the layers below it. Prefixes are relative to the package ("" is
#: its __init__).
LAYERS = (
    ("", "compat", "bench"),
    ("testing",),
    ("moe_alltoall", "agreement"),
    ("functional", "split_phase"),
    ("transports",),
    ("memory",),
    ("library",),
    ("jit",),
    ("comm", "reference", "config", "_version"),
)

#: The imports that run up LAYERS today, each a transport importing the API above it: transports/nvlink.py calls the
#: functional API and its split halves, transports/nvlink_eager.py the functional API. The refactor that gives the
#: transports their own launch path removes them; until then the layer test expects exactly these, so that a new
#: violation fails it and a removed one makes it ask for this set to shrink.
KNOWN_LAYER_VIOLATIONS = {
    ("transports.nvlink", "functional"),
    ("transports.nvlink", "split_phase"),
    ("transports.nvlink_eager", "functional"),
}


def loaders_outside_the_library(graph: ImportGraph) -> dict[str, list[str]]:
    """Modules outside library/ and jit/ that reach the built library's loader (jit/), and how."""
    return {m: why for m, why in graph.reaching(JIT).items() if not within(m, LIBRARY)}


def layer_violations(graph: ImportGraph, layers=LAYERS) -> set[tuple[str, str]]:
    """(importer, imported), relative to the package, of every import running up ``layers``."""
    strip = len(PACKAGE) + 1
    return {(a[strip:], b[strip:]) for a, b in graph.layer_violations(layers)}


def _check_layers(graph: ImportGraph) -> None:
    found = layer_violations(graph)
    new, gone = found - KNOWN_LAYER_VIOLATIONS, KNOWN_LAYER_VIOLATIONS - found
    assert not new, f"imports running up the declared layers (LAYERS): {sorted(new)}"
    assert not gone, f"these known violations are gone: remove them from KNOWN_LAYER_VIOLATIONS: {sorted(gone)}"


def test_only_the_library_loads_the_built_module():
    graph = ImportGraph(ROOT, PACKAGE)
    assert graph.unresolved == [], f"import_module calls whose module the check cannot read: {graph.unresolved}"
    assert loaders_outside_the_library(graph) == {}
    assert f"{LIBRARY}.ops" in graph.reaching(JIT)  # the check sees the imports at all


def test_the_imports_have_no_circle():
    graph = ImportGraph(ROOT, PACKAGE)
    assert graph.circle() is None, " -> ".join(graph.circle())
    assert sum(len(t) for t in graph.edges().values()) > 150  # the graph was read


def test_imports_run_down_the_declared_layers():
    """The declared order does not hold yet: the imports running up LAYERS must be exactly KNOWN_LAYER_VIOLATIONS (a
    transport importing the functional API above it, which a pending refactor removes). Any other violation fails
    the test, and so does a known one that is gone: shrink KNOWN_LAYER_VIOLATIONS then, down to the empty set the
    declared order asks for."""
    _check_layers(ImportGraph(ROOT, PACKAGE))


# ------------------------------------------------------------------------------------------ planted defects


def _planted(tmp_path: Path, edits: dict[str, str], removed: tuple[str, str] = ("", "")) -> ImportGraph:
    """The import graph of a copy of the package's sources with ``edits`` (path relative to the package -> text
    appended, the file made if new) and the line ``removed[1]`` taken out of file ``removed[0]``."""
    def not_source(directory, names):
        return [n for n in names if n == "__pycache__" or not n.endswith(".py") and not Path(directory, n).is_dir()]

    shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE, ignore=not_source)
    for relative, text in edits.items():
        path = tmp_path / PACKAGE / relative
        path.write_text((path.read_text() + "\n" if path.exists() else "") + text + "\n")
    if removed[0]:
        path = tmp_path / PACKAGE / removed[0]
        lines = path.read_text().split("\n")
        assert removed[1] in lines, f"{removed[0]} no longer has {removed[1]!r}"
        path.write_text("\n".join(line for line in lines if line != removed[1]))
    return ImportGraph(tmp_path, PACKAGE)


@pytest.mark.parametrize("text", [
    "from .library.ops import get_a2a_module",  # the loader re-exported by library/ops.py
    "from .library import ops as _ops\n_ops.get_a2a_module()",  # read as an attribute
    "import flashinfer_a2a.library.ops\nflashinfer_a2a.library.ops.get_a2a_module()",
    "import importlib\nimportlib.import_module('flashinfer_a2a.jit')",
    "from importlib import import_module\nimport_module('.jit', __package__)",
    "__import__('flashinfer_a2a.jit.modules')",
    "from .jit.modules import get_a2a_module",
    "from . import jit",
    "def later():\n    from .jit import get_a2a_module",
])
def test_a_module_outside_the_library_that_loads_it_is_found(tmp_path, text):
    graph = _planted(tmp_path, {"sneaky.py": text})
    assert list(loaders_outside_the_library(graph)) == [f"{PACKAGE}.sneaky"]


def test_an_import_module_of_a_name_not_written_out_is_reported(tmp_path):
    graph = _planted(tmp_path, {"sneaky.py": "import importlib\nNAME = 'jit'\nimportlib.import_module(NAME)"})
    assert graph.unresolved == [f"{PACKAGE}.sneaky:3"]


@pytest.mark.parametrize("edits", [
    {"library/__init__.py": "from ..transports import nccl"},  # library/ops.py runs library/__init__ first
    {"memory/__init__.py": "from .. import moe_alltoall"},
    {"jit/spec.py": "from ..library.ops import register_fake_ops"},
])
def test_a_circle_through_a_package_init_is_found(tmp_path, edits):
    circle = _planted(tmp_path, edits).circle()
    assert circle is not None and circle[0] == circle[-1]


@pytest.mark.parametrize(("relative", "text", "edge"), [
    ("memory/call_order.py", "from ..moe_alltoall import MoeAlltoAll", ("memory.call_order", "moe_alltoall")),
    ("transports/base.py", "def f():\n    from .. import split_phase", ("transports.base", "split_phase")),
    ("jit/toolchain.py", "import importlib\nimportlib.import_module('flashinfer_a2a.library')",
     ("jit.toolchain", "library")),
])
def test_an_import_running_up_the_layers_is_found(tmp_path, relative, text, edge):
    graph = _planted(tmp_path, {relative: text})
    assert layer_violations(graph) - KNOWN_LAYER_VIOLATIONS == {edge}
    with pytest.raises(AssertionError, match="running up the declared layers"):
        _check_layers(graph)


def test_a_known_violation_removed_asks_for_the_list_to_shrink(tmp_path):
    graph = _planted(tmp_path, {}, removed=("transports/nvlink.py", "from .. import split_phase"))
    assert KNOWN_LAYER_VIOLATIONS - layer_violations(graph) == {("transports.nvlink", "split_phase")}
    with pytest.raises(AssertionError, match="remove them from KNOWN_LAYER_VIOLATIONS"):
        _check_layers(graph)


def test_a_module_in_no_layer_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"flashinfer_a2a\.sneaky is in 0 layers"):
        layer_violations(_planted(tmp_path, {"sneaky.py": ""}))


def test_launch_dispatch_is_a_deprecated_alias(monkeypatch):
    from flashinfer_a2a import functional as F

    monkeypatch.setattr(F, "dispatch_counts", lambda *args, **kwargs: (args, kwargs))
    with pytest.warns(DeprecationWarning, match="launch_dispatch is now dispatch_counts"):
        assert F.launch_dispatch(1, 2, num_sms=3) == ((1, 2), {"num_sms": 3})
