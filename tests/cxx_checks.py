"""How the C++ entry points refuse their arguments, read from the sources (no compiler; tests/cxx_source.py reads
them): csrc/ and every header under include/ that csrc/ includes, directly or through another header.

A refusal is any use of a refusing macro: tvm-ffi's ``TVM_FFI_THROW``, ``TVM_FFI_CHECK`` and ``TVM_FFI_ICHECK`` with
their ``_EQ``/``_LT``/... forms (every ``TVM_FFI_`` macro whose name holds CHECK or THROW), and every macro defined in
csrc/ or include/ whose body uses one, on one line or several (``A2A_CHECK``, ``A2A_CUDA_CHECK``, any new wrapper).
A use is expanded as the preprocessor would, so a wrapper's kind, condition and message are those of the tvm-ffi
macro inside it; a throw refuses when the ``if`` it sits under holds. Uses are found in every function definition,
however indented (namespaces, member functions, constructors, a header's inline functions); one outside any function
fails the parse (:attr:`CxxChecks.stray`).

The rows (:func:`read_cxx_checks`): ``"Function: condition"`` for each refusal, the condition being what must hold
(``"Function: MACRO(args)"`` for a wrapper whose condition is not its first argument, ``"Function: throw ..."`` for
a throw under no ``if``), and ``"Function: Callee(args)"`` for each call of a refusing function, in every function
an op's entry (:data:`ENTRIES`) reaches. Each row carries the exception kinds and the messages of the refusals
behind it: the streamed string literals, a value as a hole, a call's string-literal arguments put in the callee's
holes for them. A refusal whose condition is a CUDA call's status (``err == cudaSuccess``, what ``A2A_CUDA_CHECK``
checks) reports a failing device, not an argument: it is counted apart (:attr:`CxxChecks.status_checks`) and makes
no row.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from . import cxx_source as src
from .cxx_source import Macro, arguments, squash

# The C++ functions behind the ops that have fakes (initialize, get_workspace_size, dispatch, dispatch_recv, combine,
# sanitize_expert_ids, and the nccl transport's nccl_pack, nccl_select, nccl_combine_wire, nccl_combine_sum:
# csrc/a2a_binding.cu).
ENTRIES = ("Initialize", "GetWorkspaceSize", "Dispatch", "DispatchRecv", "Combine", "SanitizeExpertIds", "NcclPack",
           "NcclSelect", "NcclCombineWire", "NcclCombineSum")

_TVM_REFUSING = re.compile(r"TVM_FFI_\w*(?:CHECK|THROW)\w*")
_TVM_CHECK = re.compile(r"TVM_FFI_([ID]?)CHECK(?:_(LT|GT|LE|GE|EQ|NE|NOTNULL))?")
_OPERATORS = {"LT": "<", "GT": ">", "LE": "<=", "GE": ">=", "EQ": "==", "NE": "!="}
_STATUS = re.compile(r"\(?\w+\)? == cudaSuccess")
_LITERALS = re.compile(r'\s*(?:"(?:[^"\\]|\\.)*"\s*)+')


# ------------------------------------------------------------------------------------------------ messages


@dataclasses.dataclass(frozen=True)
class Value:
    """A value streamed into a message: any text at run time."""

    expr: str


#: A C++ message as streamed: literal text (str), a :class:`Value`, or a choice between literals (tuple of str).
Message = tuple


def read_message(stream: str) -> Message:
    """The message streamed by ``stream`` (``<< "literal" << value ...``)."""
    out: list = []
    for piece in src.split_top(stream, "<<")[1:]:
        piece = piece.strip()
        while piece.startswith("(") and src.close(src.masked(piece), 0) == len(piece) - 1:
            piece = piece[1:-1].strip()
        choice = src.split_top(piece, "?")
        options = src.split_top(choice[1], ":") if len(choice) == 2 else []
        if _LITERALS.fullmatch(piece):
            out.append(src.unquote(piece))
        elif len(options) == 2 and all(_LITERALS.fullmatch(o) for o in options):
            out.append(tuple(src.unquote(o) for o in options))
        else:
            out.append(Value(squash(piece)))
    return tuple(out)


def _specialized(message: Message, params: tuple[str, ...], args: list[str]) -> Message:
    """``message`` of a function called with ``args``: a value naming a parameter becomes that argument (its text
    when a string literal)."""
    given = dict(zip(params, args))
    out = []
    for p in message:
        arg = given.get(re.sub(r"\.c_str\(\)$", "", p.expr)) if isinstance(p, Value) else None
        out.append(p if arg is None else src.unquote(arg) if _LITERALS.fullmatch(arg) else Value(squash(arg)))
    return tuple(out)


def message_regex(message: Message) -> str:
    """A regex matching every text ``message`` can make."""
    return "".join(".*" if isinstance(p, Value) else re.escape(p) if isinstance(p, str) else
                   "(?:" + "|".join(map(re.escape, p)) + ")" for p in message)


def _stretches(message: Message) -> list[list[str]]:
    """For each way of taking ``message``'s choices: its literal text between values (one between each two)."""
    variants = [[""]]
    for p in message:
        if isinstance(p, Value):
            variants = [v + [""] for v in variants]
        else:
            variants = [v[:-1] + [v[-1] + option] for v in variants for option in ((p,) if isinstance(p, str) else p)]
    return variants


def _fits(run: str, stretches: list[str]) -> bool:
    """Whether ``run`` is part of some text with ``stretches`` between its values. A run starts in a value only
    where no literal text comes before that value (a pattern claiming a value's text next to a literal it leaves
    out, as ``payloads\\[0\\] has`` against ``"payload " << p << " has"``, fits no message)."""
    if any(run in s for s in stretches):
        return True
    for i in range(len(stretches) - 1):
        for j in range(i + 1, len(stretches)):
            first = range(len(stretches[i]) + (not stretches[i]))  # a suffix; the empty one only after no literal
            suffix = "(?:" + "|".join(re.escape(stretches[i][k:]) for k in first) + ")"
            prefix = "(?:" + "|".join(re.escape(stretches[j][:k]) for k in range(len(stretches[j]) + 1)) + ")"
            if re.fullmatch(".*".join([suffix, *map(re.escape, stretches[i + 1 : j]), prefix]), run, re.S):
                return True
    return False


def pattern_runs(pattern: str) -> list[str]:
    """The literal stretches of regex ``pattern``: escaped punctuation taken as itself; a class, a group, ``.``, an
    anchor or a letter escape (``\\d``) ends one, and a quantifier takes its character off."""
    runs, current, i = [], "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            current, i = current + pattern[i + 1], i + 2
            continue
        if c in "*+?{" and current:
            current = current[:-1]
        if c in "\\.^$*+?{}[]|()":
            runs.append(current)
            current = ""
            i = pattern.index("]", i + 1) + 1 if c == "[" else pattern.index("}", i) + 1 if c == "{" else \
                i + 1 + (c == "\\")
            continue
        current, i = current + c, i + 1
    return [r for r in runs + [current] if r]


def pattern_fits(pattern: str, message: Message) -> bool:
    """Whether each literal stretch of regex ``pattern`` is part of some text ``message`` can make: the pattern is
    read off that message, not another."""
    runs = pattern_runs(pattern)
    return any(all(_fits(r, stretches) for r in runs) for stretches in _stretches(message))


# ------------------------------------------------------------------------------------------------ refusals


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One use of a refusing macro: ``condition`` must hold (None for a throw under no ``if``); ``key`` names it
    in its function's rows; ``kinds`` and ``messages`` are what it raises."""

    key: str
    condition: Optional[str]
    kinds: frozenset[str]
    messages: tuple[Message, ...]
    status: bool  # tests a CUDA call's status, not an argument


def refusing_macros(macros: dict[str, Macro]) -> dict[str, Macro]:
    """The macros whose body uses a tvm-ffi refusing macro or another refusing macro (to any depth)."""
    refusing: dict[str, Macro] = {}
    changed = True
    while changed:
        changed = False
        for name, macro in macros.items():
            if name not in refusing and (_TVM_REFUSING.search(macro.body) or any(
                    re.search(rf"\b{re.escape(other)}\b", macro.body) for other in refusing)):
                refusing[name] = macro
                changed = True
    return refusing


def _negated(condition: str) -> str:
    """What must hold for ``if (condition) throw`` not to throw."""
    condition = squash(condition)
    m = re.fullmatch(r"TVM_FFI_PREDICT_FALSE\((.*)\)", condition)
    if m and src.close(src.masked(condition), len("TVM_FFI_PREDICT_FALSE")) == len(condition) - 1:
        condition = m.group(1).strip()
    if condition.startswith("!(") and src.close(src.masked(condition), 1) == len(condition) - 1:
        return squash(condition[2:-1])
    return f"!({condition})"


def _guarding_if(text: str, code: str, at: int) -> Optional[str]:
    """The condition of the ``if`` whose statement starts at ``at`` (a brace between them allowed), or None."""
    i = len(code[:at].rstrip()) - 1
    if i >= 0 and code[i] == "{":
        i = len(code[:i].rstrip()) - 1
    if i < 0 or code[i] != ")":
        return None
    start = src.open_of(code, i)
    return text[start + 1 : i] if re.search(r"\bif\s*(?:constexpr\s*)?$", code[:start]) else None


def _tvm_refusal(name: str, args: list[str], guard: Optional[str]) -> tuple[Optional[str], str]:
    """(the condition that must hold, the kind raised) of tvm-ffi's macro ``name`` used with ``args``."""
    if "THROW" in name:
        return (None if guard is None else _negated(guard)), (args[0] if args else "?")
    m = _TVM_CHECK.fullmatch(name)
    if not m or len(args) < (1 if m.group(1) else 2):
        return None, "?"  # a form this parse does not know: no row can expect its kind "?"
    operands, kind = (args, "InternalError") if m.group(1) else (args[:-1], args[-1])
    operands = [squash(o) for o in operands]
    if m.group(2) is None:
        return operands[0], kind
    if m.group(2) == "NOTNULL":
        return f"{operands[0]} != nullptr", kind
    return f"{operands[0]} {_OPERATORS[m.group(2)]} {operands[1]}", kind


def find_refusals(text: str, refusing: dict[str, Macro], depth: int = 0) -> list[tuple[int, Refusal]]:
    """(position, refusal) of every use of a refusing macro in ``text`` (comment-free, no directives)."""
    if depth > 16:
        raise ValueError(f"refusing macros nest too deep: {text[:200]!r}")
    code, found, i = src.masked(text), [], 0
    names = [_TVM_REFUSING.pattern] + [re.escape(n) for n in sorted(refusing, key=len, reverse=True)]
    pattern = re.compile(r"\b(" + "|".join(names) + r")\b")
    while (m := pattern.search(code, i)) is not None:
        name, i = m.group(1), m.end()
        macro = refusing.get(name)
        function_like = macro is None or macro.params is not None
        after = len(code) - len(code[m.end():].lstrip())
        if function_like and code[after : after + 1] != "(":
            continue  # the name alone: not a use
        end = src.close(code, after) if function_like else m.end() - 1
        args_text = text[after + 1 : end] if function_like else ""
        args = arguments(args_text)
        tail = text[end + 1 : src.statement_end(code, end + 1)]
        if macro is None:
            condition, kind = _tvm_refusal(name, args, _guarding_if(text, code, m.start()))
            kinds, messages = frozenset([kind]), (read_message(tail),)
            status = condition is not None and _STATUS.fullmatch(condition) is not None
        else:
            inner = [r for _, r in find_refusals(macro.expand(args) + tail, refusing, depth + 1)]
            kinds = frozenset().union(*(r.kinds for r in inner)) if inner else frozenset(["?"])
            messages = tuple(msg for r in inner for msg in r.messages)
            condition = inner[0].condition if len(inner) == 1 else None
            status = bool(inner) and all(r.status for r in inner)
        if condition is not None and (macro is None or args and condition == squash(args[0])):
            key = condition
        elif macro is not None:
            key = f"{name}({squash(args_text)})"
        else:
            key = f"throw {squash(text[m.start() : end + 1] + tail)}"
        found.append((m.start(), Refusal(key, condition, kinds, messages, status)))
        i = end + 1
    return found


# ------------------------------------------------------------------------------------------------ the rows


@dataclasses.dataclass(frozen=True)
class Row:
    """What a row's inputs must trigger: a refusal (``kind`` its exception) or a call (``kind`` "call") of
    ``callee``, which may raise any of ``kinds`` with any of ``messages``."""

    kind: str
    kinds: frozenset[str]
    messages: tuple[Message, ...]
    callee: Optional[str] = None

    def fits(self, pattern: str) -> bool:
        """Whether regex ``pattern`` is read off one of the row's messages (see :func:`pattern_fits`)."""
        return any(pattern_fits(pattern, m) for m in self.messages)

    def regexes(self) -> list[str]:
        return [message_regex(m) for m in self.messages]


@dataclasses.dataclass
class CxxChecks:
    rows: dict[str, Row]  # "Function: condition" / "Function: Callee(args)" -> what it raises
    kinds: dict[str, set[str]]  # refusing function -> the kinds it may raise, the functions it calls included
    unreached: list[str]  # functions with refusals no op's entry reaches
    stray: list[str]  # refusals outside any function definition: "file: key"
    missing_entries: list[str]  # ENTRIES not defined anywhere
    refusing_macros: dict[str, str]  # macro defined in csrc/ or include/ that refuses -> its file
    status_checks: int  # uses that test a CUDA call's status (no rows)
    functions: int  # function names read

    @property
    def refusal_rows(self) -> int:
        return sum(row.kind != "call" for row in self.rows.values())

    def summary(self) -> str:
        return (f"{len(self.rows)} rows: {self.refusal_rows} refusals and {len(self.rows) - self.refusal_rows} "
                f"calls of refusing functions, in {self.functions} functions read; {self.status_checks} CUDA status "
                f"checks apart; refusing macros of csrc/ and include/: {', '.join(sorted(self.refusing_macros))}")


def _calls(name: str, body: str, functions: dict) -> list[tuple[str, str, list[str]]]:
    """(callee, the call's text, its arguments) of every call in ``body`` of a function of ``functions``:
    ``Callee(args)``, and a constructor's ``Class variable(args)`` / ``Class variable{args}``."""
    code, found = src.masked(body), []
    for pattern in (r"\b(\w+)\s*\(", r"\b(\w+)\s+\w+\s*[({]"):
        for m in re.finditer(pattern, code):
            if m.group(1) != name and m.group(1) in functions:
                end = src.close(code, m.end() - 1)
                found.append((m.start(), m.group(1), squash(body[m.start() : end + 1]), arguments(body[m.end() : end])))
    return [call[1:] for call in sorted(found)]


def read_cxx_checks(sources: Optional[dict[str, str]] = None, macro_sources: Optional[dict[str, str]] = None,
                    entries: tuple[str, ...] = ENTRIES) -> CxxChecks:
    """Every refusal the ops' entries make, directly or in the functions they call. ``sources`` (path -> text) are
    read for functions, ``macro_sources`` for macro definitions as well (default: the checkout's, see
    :func:`tests.cxx_source.read_sources` and :func:`tests.cxx_source.read_macro_definitions`)."""
    sources = src.read_sources() if sources is None else sources
    macro_sources = src.read_macro_definitions() if macro_sources is None else macro_sources
    cleaned = {where: src.without_comments(text) for where, text in {**macro_sources, **sources}.items()}
    refusing = refusing_macros(src.read_macros(cleaned))
    bodies: dict[str, str] = {}
    params: dict[str, Optional[tuple[str, ...]]] = {}  # None where two definitions disagree
    refusals: dict[str, list[Refusal]] = {}
    stray: list[str] = []
    status = 0
    for where in sources:
        text = src.without_directives(cleaned[where])
        functions = src.find_functions(text)
        for f in functions:
            bodies[f.name] = bodies.get(f.name, "") + text[f.start : f.end + 1] + "\n"
            params[f.name] = f.params if params.get(f.name, f.params) == f.params else None
        for at, refusal in find_refusals(text, refusing):
            owner = next((f.name for f in functions if f.start <= at <= f.end), None)
            if owner is None:
                stray.append(f"{where}: {refusal.key}")
            elif refusal.status:
                status += 1
            else:
                refusals.setdefault(owner, []).append(refusal)
    calls = {name: _calls(name, body, bodies) for name, body in bodies.items()}
    kinds = {name: {k for r in refusals.get(name, ()) for k in r.kinds} for name in bodies}
    changed = True
    while changed:  # a function that calls a refusing function refuses too
        changed = False
        for name, callees in calls.items():
            for callee, _, _ in callees:
                if not kinds[callee] <= kinds[name]:
                    kinds[name] |= kinds[callee]
                    changed = True
    messages: dict[str, tuple[Message, ...]] = {}

    def messages_of(name: str, seen: frozenset = frozenset()) -> tuple[Message, ...]:
        """Every message ``name`` may refuse with, its callees' included (their holes filled from the call)."""
        if name not in messages:
            own = [m for r in refusals.get(name, ()) for m in r.messages]
            for callee, _, args in calls[name]:
                if kinds[callee] and callee not in seen:
                    own += [_specialized(m, params[callee] or (), args) for m in messages_of(callee, seen | {name})]
            messages[name] = tuple(dict.fromkeys(own))
        return messages[name]

    reached, todo = set(), [e for e in entries if e in bodies]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(callee for callee, _, _ in calls[name] if kinds[callee])
    rows: dict[str, Row] = {}

    def add(key: str, row: Row) -> None:  # the same check twice in one function: "key", "key #2"
        unique, n = key, 1
        while unique in rows:
            n += 1
            unique = f"{key} #{n}"
        rows[unique] = row

    for name in sorted(reached):
        for r in refusals.get(name, ()):
            add(f"{name}: {r.key}", Row(next(iter(r.kinds)) if len(r.kinds) == 1 else "?", r.kinds, r.messages))
        for callee, text, args in calls[name]:
            if kinds[callee]:
                add(f"{name}: {text}", Row("call", frozenset(kinds[callee]), tuple(
                    _specialized(m, params[callee] or (), args) for m in messages_of(callee)), callee))
    return CxxChecks(
        rows=rows, kinds={n: k for n, k in kinds.items() if k},
        unreached=sorted(n for n, found in refusals.items() if found and n not in reached), stray=stray,
        missing_entries=[e for e in entries if e not in bodies],
        refusing_macros={n: m.where for n, m in refusing.items()}, status_checks=status, functions=len(bodies))
