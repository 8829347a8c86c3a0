"""The checks of the C++ entry points, read from csrc/: every ``A2A_CHECK`` and every call of a function that checks,
in each function an op's entry reaches (tests/test_fake_checks.py holds an input failing each)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"

# The C++ functions behind the ops that have fakes (initialize, get_workspace_size, dispatch, dispatch_recv, combine,
# sanitize_expert_ids, and the nccl transport's nccl_pack, nccl_select, nccl_combine_wire, nccl_combine_sum:
# csrc/a2a_binding.cu).
ENTRIES = ("Initialize", "GetWorkspaceSize", "Dispatch", "DispatchRecv", "Combine", "SanitizeExpertIds", "NcclPack",
           "NcclSelect", "NcclCombineWire", "NcclCombineSum")

# A function definition: a line at column 0 with a return type, the name and "(" (csrc follows Google style: no
# indentation inside namespaces). Declarations match too and add nothing.
_DEF = re.compile(r"^(?!#|//|namespace\b|using\b|return\b|TVM_FFI|static_assert)[A-Za-z_][^;(=\n]*?\b(\w+)\(", re.M)


def _parenthesized(text: str, open_at: int) -> str:
    """What lies between the parenthesis at ``open_at`` and its match (parentheses in string literals skipped)."""
    depth, quoted, i = 0, False, open_at
    while i < len(text):
        c = text[i]
        if quoted:
            i += c == "\\"  # an escaped character
            quoted = c != '"'
        elif c == '"':
            quoted = True
        else:
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    raise ValueError(f"unbalanced parentheses after {text[open_at:open_at + 60]!r}")


def _split_last_comma(args: str) -> tuple[str, str]:
    depth = 0
    for i in range(len(args) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(args[i], 0)
        if args[i] == "," and depth == 0:
            return args[:i], args[i + 1 :]
    raise ValueError(f"no argument list: {args!r}")


def _squash(text: str) -> str:
    return " ".join(text.split())


def _function_bodies() -> dict[str, str]:
    """Function name -> its text after the parameter list (definitions of one name joined)."""
    bodies: dict[str, str] = {}
    for path in sorted(CSRC.glob("*.*")):
        text = re.sub(r"//[^\n]*", "", path.read_text())  # comments name functions too
        defs = list(_DEF.finditer(text))
        for d, following in zip(defs, defs[1:] + [None]):
            rest = text[d.end() - 1 : following.start() if following else len(text)]
            params = _parenthesized(rest, 0)
            bodies[d.group(1)] = bodies.get(d.group(1), "") + rest[len(params) + 2 :]
    return bodies


def _checks(body: str) -> list[tuple[str, str]]:
    """(condition, exception kind) of every A2A_CHECK in ``body``, but those inside a macro (A2A_CUDA_CHECK's)."""
    found = []
    for m in re.finditer(r"\bA2A_CHECK\(", body):
        if body[m.end() : body.find("\n", m.end())].rstrip().endswith("\\"):
            continue
        cond, kind = _split_last_comma(_parenthesized(body, m.end() - 1))
        found.append((_squash(cond), kind.strip()))
    return found


@dataclasses.dataclass
class CxxChecks:
    rows: dict[str, str]  # "Function: condition" -> its kind; "Function: Helper(args)" -> "call"
    kinds: dict[str, set[str]]  # checking function -> the kinds it may raise, the functions it calls included
    unreached: list[str]  # functions with checks no op's entry reaches


def read_cxx_checks() -> CxxChecks:
    """Every check the ops' entries (:data:`ENTRIES`) make, directly or in the functions they call."""
    bodies = _function_bodies()
    direct = {name: _checks(body) for name, body in bodies.items()}
    calls = {name: [(m.group(1), _squash(m.group(1) + "(" + _parenthesized(body, m.end() - 1) + ")"))
                    for m in re.finditer(r"\b(\w+)\(", body) if m.group(1) in bodies and m.group(1) != name]
             for name, body in bodies.items()}
    kinds = {name: {kind for _, kind in found} for name, found in direct.items()}
    changed = True
    while changed:  # a function that calls a checking function checks too
        changed = False
        for name, callees in calls.items():
            more = set().union(*(kinds[callee] for callee, _ in callees)) if callees else set()
            if not more <= kinds[name]:
                kinds[name] |= more
                changed = True
    reached, todo = set(), list(ENTRIES)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(callee for callee, _ in calls[name] if kinds[callee])
    rows: dict[str, str] = {}

    def add(key: str, value: str) -> None:  # the same check twice in one function: "key", "key #2"
        unique, n = key, 1
        while unique in rows:
            n += 1
            unique = f"{key} #{n}"
        rows[unique] = value

    for name in sorted(reached):
        for cond, kind in direct[name]:
            add(f"{name}: {cond}", kind)
        for callee, text in calls[name]:
            if kinds[callee]:
                add(f"{name}: {text}", "call")
    unreached = sorted(name for name, found in direct.items() if found and name not in reached)
    return CxxChecks(rows, kinds, unreached)
