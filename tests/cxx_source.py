"""C++ source as tests/cxx_checks.py reads it, without a compiler: the files (csrc/ and the headers it includes),
their comments, literals and brackets, their macros, and their function definitions."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

_INCLUDE = re.compile(r'#\s*include\s*[<"]([^>"]+)[>"]')
_DEFINE = re.compile(r"#\s*define\s+(\w+)(?:\(([^)]*)\))?(.*)", re.S)
_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"|(?<!\w)\'(?:[^\'\\\n]|\\.)*\'')
_OPENING, _CLOSING = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}, {")": 1, "]": 1, "}": 1, "(": -1, "[": -1,
                                                                          "{": -1}
# A name and "(": where a definition may start. operator() and friends first.
_NAME_CALL = re.compile(r"(\boperator\s*(?:\(\)|[^\w\s(]+)|~?\b[A-Za-z_]\w*)\s*\(")
_NOT_FUNCTIONS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "alignas", "decltype",
                  "static_assert", "defined", "operator", "noexcept", "throw", "new", "delete", "__attribute__",
                  "__launch_bounds__", "__declspec", "else", "do", "case"}
_QUALIFIERS = {"const", "noexcept", "override", "final", "mutable", "volatile", "&", "&&"}


# ------------------------------------------------------------------------------------------------- files


def read_sources(root: Path = ROOT) -> dict[str, str]:
    """csrc/'s files and the headers under include/ they include, to any depth: path relative to ``root`` ->
    text."""
    texts: dict[str, str] = {}
    todo = sorted((root / "csrc").glob("*.*"))
    while todo:
        path = todo.pop()
        where = str(path.relative_to(root))
        if where in texts or not path.is_file():
            continue
        texts[where] = path.read_text()
        for name in _INCLUDE.findall(texts[where]):
            for candidate in (path.parent / name, root / "include" / name):
                if candidate.is_file() and root in candidate.resolve().parents:
                    todo.append(candidate.resolve())
    return texts


def read_macro_definitions(root: Path = ROOT) -> dict[str, str]:
    """Every file under csrc/ and include/, where a refusing macro may be defined: path -> text."""
    return {str(p.relative_to(root)): p.read_text() for d in ("csrc", "include") for p in sorted((root / d).rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------------------------------------ lexing


def without_comments(text: str) -> str:
    """``text`` with its line splices joined and its comments blanked (newlines kept); literals untouched."""
    text = text.replace("\\\n", "")
    out, i = [], 0
    while i < len(text):
        if text[i] in "\"'" and not (text[i] == "'" and i and text[i - 1].isalnum()):  # not 1'000
            end = i + 1
            while end < len(text) and text[end] not in (text[i], "\n"):
                end += 2 if text[end] == "\\" else 1
            end += 1
        elif text.startswith("//", i):
            end = text.find("\n", i) % (len(text) + 1)
            out.append(" " * (end - i))
            i = end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2) % (len(text) + 1) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
            continue
        else:
            end = i + 1
        out.append(text[i:end])
        i = end
    return "".join(out)


def without_directives(text: str) -> str:
    """``text`` (splices joined) with its preprocessor lines blanked."""
    return "\n".join("" if line.lstrip().startswith("#") else line for line in text.split("\n"))


def masked(text: str) -> str:
    """``text`` with the insides of its string and character literals blanked (same length): every bracket left is
    code."""
    return _LITERAL.sub(lambda m: m.group(0)[0] + " " * (len(m.group(0)) - 2) + m.group(0)[-1], text)


def close(code: str, start: int) -> int:
    """Index of the bracket closing the one at ``start`` (``code`` masked)."""
    depth = 0
    for i in range(start, len(code)):
        depth += _OPENING.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced brackets after {code[start:start + 60]!r}")


def open_of(code: str, end: int) -> int:
    """Index of the bracket opening the one closed at ``end`` (``code`` masked)."""
    depth = 0
    for i in range(end, -1, -1):
        depth += _CLOSING.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced brackets before {code[max(0, end - 60):end + 1]!r}")


def split_top(text: str, separator: str) -> list[str]:
    """``text`` split at each ``separator`` outside brackets and literals."""
    code, pieces, depth, start, i = masked(text), [], 0, 0, 0
    while i < len(text):
        depth += _OPENING.get(code[i], 0)
        if depth == 0 and code.startswith(separator, i):
            pieces.append(text[start:i])
            i = start = i + len(separator)
            continue
        i += 1
    return pieces + [text[start:]]


def statement_end(code: str, start: int) -> int:
    """Index of the ``;`` ending the statement that continues at ``start``, or of the bracket closing around it."""
    depth = 0
    for i in range(start, len(code)):
        if code[i] in "([{":
            depth += 1
        elif code[i] in ")]}":
            if depth == 0:
                return i
            depth -= 1
        elif code[i] == ";" and depth == 0:
            return i
    return len(code)


def squash(text: str) -> str:
    return " ".join(text.split())


def unquote(literals: str) -> str:
    """The characters of adjacent C string literals."""
    escapes = {"n": "\n", "t": "\t", "0": "\0"}
    return "".join(re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(1)), body)
                   for body in re.findall(r'"((?:[^"\\]|\\.)*)"', literals))


def arguments(text: str) -> list[str]:
    """The arguments of a parenthesized (or braced) list's inside."""
    return [a.strip() for a in split_top(text, ",")] if text.strip() else []


# ------------------------------------------------------------------------------------------------ macros


@dataclasses.dataclass(frozen=True)
class Macro:
    name: str
    params: Optional[tuple[str, ...]]  # None: an object-like macro
    body: str
    where: str

    def expand(self, args: list[str]) -> str:
        """The body with ``args`` in place of the parameters (``#p`` as a string literal, ``##`` pasting)."""
        values = dict(zip(self.params or (), args))
        if self.params and self.params[-1] == "...":
            values["__VA_ARGS__"] = ", ".join(args[len(self.params) - 1 :])

        def substitute(m: re.Match) -> str:
            if m.group(1) is not None:  # a literal of the body
                return m.group(1)
            if m.group(2) is not None:
                value = values.get(m.group(2))
                return m.group(0) if value is None else '"' + squash(value).replace("\\", "\\\\").replace('"', '\\"') \
                    + '"'
            return values.get(m.group(3), m.group(3))

        text = re.sub(r'("(?:[^"\\]|\\.)*")|(?<!#)#\s*(\w+)|\b(\w+)\b', substitute, self.body)
        return re.sub(r"\s*##\s*", "", text)


def read_macros(texts: dict[str, str]) -> dict[str, Macro]:
    """Every ``#define`` of ``texts`` (comment-free, splices joined): name -> macro."""
    macros = {}
    for where, text in texts.items():
        for line in text.split("\n"):
            m = _DEFINE.fullmatch(line.strip())
            if m:
                params = None if m.group(2) is None else tuple(p.strip() for p in m.group(2).split(",") if p.strip())
                macros[m.group(1)] = Macro(m.group(1), params, m.group(3).strip(), where)
    return macros


# ------------------------------------------------------------------------------------------------ functions


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    params: tuple[str, ...]  # the parameters' names
    start: int  # the body's "{"
    end: int  # its "}"


def _body_start(code: str, i: int) -> Optional[int]:
    """Where the body of a function whose parameter list ends before ``i`` opens, or None (a declaration, a call):
    qualifiers, a trailing return type and member initializers may come first."""
    while True:
        i = len(code) - len(code[i:].lstrip())
        word = re.match(r"&&|&|[A-Za-z_]\w*", code[i:])
        if code.startswith("{", i):
            return i
        if word and word.group(0) in _QUALIFIERS:
            i += len(word.group(0))
            if word.group(0) == "noexcept" and code[i:].lstrip().startswith("("):
                i = close(code, code.index("(", i)) + 1
        elif code.startswith("->", i):
            stop = re.compile(r"[{;=]").search(code, i)
            return stop.start() if stop and code[stop.start()] == "{" else None
        elif code.startswith(":", i) and not code.startswith("::", i):
            i += 1
            while True:  # member initializers: name(...) or name{...}, separated by commas
                m = re.compile(r"\s*[\w:<>,\s]*?[({]").match(code, i)
                if not m:
                    return None
                i = close(code, m.end() - 1) + 1
                rest = code[i:].lstrip()
                if rest.startswith("{"):
                    return len(code) - len(rest)
                if not rest.startswith(","):
                    return None
                i = len(code) - len(rest) + 1
        else:
            return None


def _param_name(param: str) -> str:
    words = re.findall(r"[A-Za-z_]\w*", split_top(param, "=")[0])
    return words[-1] if words else ""


def find_functions(text: str) -> list[Function]:
    """Every function definition in ``text`` (comment-free, no directives), at any indentation: a name, its
    parameters, optional qualifiers, trailing return type or member initializers, then a body. Those nested in
    another's body (lambdas, local classes) belong to the function around them."""
    code, found, i = masked(text), [], 0
    while True:
        m = _NAME_CALL.search(code, i)
        if m is None:
            return found
        name = re.sub(r"\s+", "", m.group(1)).lstrip("~")
        i = m.end()
        if name in _NOT_FUNCTIONS:
            continue
        params_end = close(code, m.end() - 1)
        body = _body_start(code, params_end + 1)
        if body is not None:
            params = tuple(_param_name(p) for p in arguments(text[m.end() : params_end]))
            found.append(Function(name, params, body, close(code, body)))
            i = found[-1].end + 1
