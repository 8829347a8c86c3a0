"""Our FlashInfer-shaped signatures against FlashInfer's own, parameter by parameter (name, kind, default, order):

- with ``inspect.signature`` against the installed ``flashinfer`` (0.7.4's ``flashinfer.moe_ep``); skipped where it
  does not import (no test needs FlashInfer);
- with ``ast`` against the sources of unpacked wheels, read without importing them: the folder holding
  ``flashinfer/`` (or the ``flashinfer`` folder itself) of 0.7.4 in ``FLASHINFER_A2A_TEST_FLASHINFER_074`` and of
  0.7.2 in ``FLASHINFER_A2A_TEST_FLASHINFER_072``; each skipped when its variable is unset.

Where ours has more, the extras come after FlashInfer's parameters, keyword-only with a default (or ``**options``).
"""

from __future__ import annotations

import ast
import enum
import inspect
import os
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from flashinfer_a2a.compat import flashinfer as fi
from flashinfer_a2a.compat import moe_ep

NO_DEFAULT = "<no default>"
POSITIONAL, KEYWORD, VAR_POSITIONAL, VAR_KEYWORD = "positional", "keyword-only", "*args", "**kwargs"
_KINDS = {inspect.Parameter.POSITIONAL_ONLY: POSITIONAL, inspect.Parameter.POSITIONAL_OR_KEYWORD: POSITIONAL,
          inspect.Parameter.KEYWORD_ONLY: KEYWORD, inspect.Parameter.VAR_POSITIONAL: VAR_POSITIONAL,
          inspect.Parameter.VAR_KEYWORD: VAR_KEYWORD}
# FlashInfer defaults spelled as names in its source, and the value ours has for them.
_NAMED_DEFAULTS = {"SfLayout.layout_linear": fi.SF_LAYOUT_LINEAR}

Row = tuple[str, str, Any]


def _default(value: Any) -> Any:
    """Enum defaults compare by value (FlashInfer's SfLayout.layout_linear is our 2)."""
    return value.value if isinstance(value, enum.Enum) else value


def rows_of(fn: Callable) -> list[Row]:
    """(name, kind, default) of each parameter of ``fn`` (a class: its constructor), ``self``/``cls`` left out."""
    rows = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "cls"):
            continue
        rows.append((p.name, _KINDS[p.kind], NO_DEFAULT if p.default is p.empty else _default(p.default)))
    return rows


def assert_matches(ours: list[Row], theirs: list[Row], what: str) -> None:
    assert ours[:len(theirs)] == theirs, f"{what}: ours {ours} differs from FlashInfer's {theirs}"
    for name, kind, default in ours[len(theirs):]:
        assert kind == VAR_KEYWORD or (kind == KEYWORD and default != NO_DEFAULT), (
            f"{what}: our extra parameter {name} must be keyword-only with a default")


# What FlashInfer offers and where ours is: (path in the 0.7.4 wheel, dotted name there, ours).
MOE_EP_CALLS = [
    ("moe_ep/config.py", "BootstrapConfig", moe_ep.BootstrapConfig),
    ("moe_ep/core/comm/communication.py", "MoEEpCommParams", moe_ep.MoEEpCommParams),
    ("moe_ep/core/comm/communication.py", "MoEEpDispatchResult", moe_ep.MoEEpDispatchResult),
    ("moe_ep/core/comm/communication.py", "create_communication", moe_ep.create_communication),
    ("moe_ep/core/comm/communication.py", "register_communication", moe_ep.register_communication),
    ("moe_ep/core/comm/communication.py", "available_communication_backends",
     moe_ep.available_communication_backends),
    ("moe_ep/core/comm/communication.py", "communication_backend_name", moe_ep.communication_backend_name),
    ("moe_ep/core/comm/communication.py", "is_communication_backend", moe_ep.is_communication_backend),
    *[("moe_ep/core/comm/communication.py", f"MoEEpCommunication.{m}", getattr(moe_ep.MoEEpCommunication, m))
      for m in ("__init__", "is_platform_supported", "dispatch", "combine", "get_combine_input_buffer", "destroy")],
    ("moe_ep/backends/split/comm/nvlink_one_sided/config.py", "NVLinkOneSidedConfig", moe_ep.NVLinkOneSidedConfig),
    *[("moe_ep/backends/split/comm/nvlink_one_sided/communication.py", f"NVLinkOneSidedAlltoAll.{m}",
       getattr(moe_ep.NVLinkOneSidedAlltoAll, m))
      for m in ("__init__", "is_platform_supported", "active_rank_mask", "dispatch", "get_combine_input_buffer",
                "combine", "checkpoint_prepare", "checkpoint_restore", "destroy")],
]
MOE_EP_PROPERTIES = [
    ("moe_ep/core/comm/communication.py", "MoEEpCommParams", ("token_dtype", "dispatch_bytes_per_token"),
     moe_ep.MoEEpCommParams),
    ("moe_ep/backends/split/comm/nvlink_one_sided/communication.py", "NVLinkOneSidedAlltoAll", ("lamport_enabled",),
     moe_ep.NVLinkOneSidedAlltoAll),
]
COMM_CALLS = [  # FlashInfer 0.7.2's flashinfer.comm.trtllm_moe_alltoall
    ("comm/trtllm_moe_alltoall.py", "moe_a2a_get_workspace_size_per_rank", fi.moe_a2a_get_workspace_size_per_rank),
    ("comm/trtllm_moe_alltoall.py", "moe_a2a_active_rank_mask", fi.moe_a2a_active_rank_mask),
    *[("comm/trtllm_moe_alltoall.py", f"MoeAlltoAll.{m}", getattr(fi.MoeAlltoAll, m))
      for m in ("__init__", "get_moe_workspace_size_per_rank", "dispatch", "combine",
                "get_combine_payload_tensor_in_workspace", "checkpoint_prepare", "checkpoint_restore")],
]


# ------------------------------------------------------------------------------------------------ inspect


def _flashinfer_moe_ep():
    try:
        import flashinfer.moe_ep as fi_moe_ep
    except Exception as exc:  # noqa: BLE001 - absent, or present without what it needs here (a GPU, its libraries)
        pytest.skip(f"flashinfer.moe_ep does not import here: {type(exc).__name__}: {exc}")
    return fi_moe_ep


def test_signatures_against_the_installed_flashinfer():
    theirs = _flashinfer_moe_ep()
    for _, dotted, ours in MOE_EP_CALLS:
        head, *rest = dotted.split(".")
        target = getattr(theirs, head)
        for attribute in rest:
            target = getattr(target, attribute)
        assert_matches(rows_of(ours), rows_of(target), dotted)
    from flashinfer.fused_moe import QuantFormat

    assert [(m.name, m.value) for m in QuantFormat] == [(m.name, m.value) for m in moe_ep.QuantFormat]


# ------------------------------------------------------------------------------------------------ ast


def _wheel(variable: str) -> Path:
    """The ``flashinfer`` folder of an unpacked wheel named by ``variable``."""
    folder = os.environ.get(variable)
    if not folder:
        pytest.skip(f"{variable} is not set (the folder of an unpacked FlashInfer wheel)")
    root = Path(folder)
    root = root / "flashinfer" if (root / "flashinfer").is_dir() else root
    assert root.is_dir(), f"{variable}={folder}: no such folder"
    return root


_TREES: dict[Path, ast.Module] = {}


def _find(root: Path, path: str, dotted: str) -> ast.AST:
    file = root / path
    tree = _TREES.get(file) or _TREES.setdefault(file, ast.parse(file.read_text()))
    node: ast.AST = tree
    for name in dotted.split("."):
        found = [n for n in getattr(node, "body", ()) if getattr(n, "name", None) == name]
        assert found, f"{path}: no {dotted} (missing {name})"
        node = found[-1]
    return node


def _literal(node: Optional[ast.AST]) -> Any:
    if node is None:
        return NO_DEFAULT
    source = ast.unparse(node)
    if source in _NAMED_DEFAULTS:
        return _NAMED_DEFAULTS[source]
    try:
        return ast.literal_eval(node)
    except ValueError:
        return source


def rows_of_def(fn: ast.FunctionDef) -> list[Row]:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    rows = [(a.arg, POSITIONAL, _literal(d)) for a, d in zip(positional, defaults)]
    if args.vararg is not None:
        rows.append((args.vararg.arg, VAR_POSITIONAL, NO_DEFAULT))
    rows += [(a.arg, KEYWORD, _literal(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        rows.append((args.kwarg.arg, VAR_KEYWORD, NO_DEFAULT))
    return [row for row in rows if row[0] not in ("self", "cls")]


def rows_of_dataclass(cls: ast.ClassDef) -> list[Row]:
    """The parameters a ``@dataclass``'s generated ``__init__`` takes: its annotated fields in order, a
    ``field(kw_only=True)`` one after the others (as dataclasses places them); ClassVars left out."""
    positional, keyword = [], []
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or "ClassVar" in ast.unparse(node.annotation):
            continue
        name, value, kw_only = node.target.id, node.value, False
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
            options = {k.arg: k.value for k in value.keywords}
            value, kw_only = options.get("default"), _literal(options.get("kw_only")) is True
        (keyword if kw_only else positional).append((name, KEYWORD if kw_only else POSITIONAL, _literal(value)))
    return positional + keyword


def _rows_of_source(node: ast.AST) -> list[Row]:
    if isinstance(node, ast.ClassDef):
        assert any("dataclass" in ast.unparse(d) for d in node.decorator_list), node.name
        return rows_of_dataclass(node)
    return rows_of_def(node)


def _properties(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)
            and any(ast.unparse(d) == "property" for d in n.decorator_list)}


def test_moe_ep_signatures_against_the_074_sources():
    root = _wheel("FLASHINFER_A2A_TEST_FLASHINFER_074")
    for path, dotted, ours in MOE_EP_CALLS:
        assert_matches(rows_of(ours), _rows_of_source(_find(root, path, dotted)), f"{path}:{dotted}")
    for path, dotted, names, ours in MOE_EP_PROPERTIES:
        assert set(names) <= _properties(_find(root, path, dotted)), (dotted, names)
        for name in names:
            assert isinstance(inspect.getattr_static(ours, name), property), (dotted, name)
    members = [(t.targets[0].id, ast.literal_eval(t.value)) for t in _find(root, "fused_moe/api.py", "QuantFormat").body
               if isinstance(t, ast.Assign)]
    assert members == [(m.name, m.value) for m in moe_ep.QuantFormat]
    # the registered name, and the one-sided backend's name in its config
    backend = _find(root, "moe_ep/backends/split/comm/nvlink_one_sided/communication.py", "NVLinkOneSidedAlltoAll")
    assert [ast.literal_eval(d.args[0]) for d in backend.decorator_list if isinstance(d, ast.Call)] == [
        moe_ep.NVLinkOneSidedAlltoAll.backend_name]


def test_comm_signatures_against_the_072_sources():
    root = _wheel("FLASHINFER_A2A_TEST_FLASHINFER_072")
    for path, dotted, ours in COMM_CALLS:
        assert_matches(rows_of(ours), _rows_of_source(_find(root, path, dotted)), f"{path}:{dotted}")
    assert "eplb_gathered_stats" in _properties(_find(root, "comm/trtllm_moe_alltoall.py", "MoeAlltoAll"))
    assert isinstance(inspect.getattr_static(fi.MoeAlltoAll, "eplb_gathered_stats"), property)


def test_the_comparison_sees_a_difference():
    """The checks above can fail: a renamed, reordered, re-defaulted or extra positional parameter is caught."""
    def flashinfers(a, b=1, *, c=None):
        pass

    tree = ast.parse(inspect.getsource(flashinfers).strip()).body[0]
    assert rows_of_def(tree) == rows_of(flashinfers) == [("a", POSITIONAL, NO_DEFAULT), ("b", POSITIONAL, 1),
                                                         ("c", KEYWORD, None)]

    def extra_keyword(a, b=1, *, c=None, d=0, **more):
        pass

    assert_matches(rows_of(extra_keyword), rows_of(flashinfers), "extras")
    for wrong in ("def f(a, b=2, *, c=None): pass", "def f(b=1, a=0, *, c=None): pass",
                  "def f(a, b=1, c=None): pass", "def f(a, b=1, e=0, *, c=None): pass"):
        with pytest.raises(AssertionError):
            assert_matches(rows_of_def(ast.parse(wrong).body[0]), rows_of(flashinfers), wrong)
