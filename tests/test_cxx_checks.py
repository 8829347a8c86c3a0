"""The table of C++ refusals against the sources, with no build and no nvcc: every way the ops' C++ entries refuse
an argument (tests/cxx_checks.py reads them) has a row in tests/fake_check_table.py, and every row a refusal; each
row expects an exception the C++ raises; each unreachable row names the earlier check that refuses its attempts.
Each form a refusal can take is also planted in a copy of the sources, where the parse must find it.
(tests/test_fake_checks.py runs the rows' inputs through the fakes and, on a GPU, through the library.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .cxx_checks import ENTRIES, CxxChecks, message_regex, read_cxx_checks, read_message
from .cxx_source import ROOT, read_macro_definitions, read_sources
from .fake_check_table import TABLE, Bad, Unreachable


def coverage_problems(checks: CxxChecks) -> list[str]:
    """Why ``checks`` and :data:`TABLE` disagree (empty when every refusal has its row and every row a refusal)."""
    problems = [f"refusal outside any function: {s}" for s in checks.stray]
    problems += [f"entry not defined in csrc/: {e}" for e in checks.missing_entries]
    problems += [f"functions with refusals no op reaches (give them an op, or say why): {checks.unreached}"] * bool(
        checks.unreached)
    problems += [f"C++ refusal without a row in TABLE (add inputs that fail it, and its fake check): {key}"
                 for key in checks.rows if key not in TABLE]
    problems += [f"TABLE row whose C++ refusal is gone: {key}" for key in TABLE if key not in checks.rows]
    return problems


@pytest.fixture(scope="module")
def checks() -> CxxChecks:
    return read_cxx_checks()


def test_every_cxx_refusal_has_a_row(checks, record_counts):
    assert coverage_problems(checks) == [], "\n".join(coverage_problems(checks))
    unreachable = sum(isinstance(row, Unreachable) for row in TABLE.values())
    record_counts(f"C++ refusals: {checks.summary()}; {unreachable} rows unreachable, each confirmed")


def pattern_problems(checks: CxxChecks, table: dict) -> list[str]:
    """Rows of ``table`` whose pattern is not read off the C++ messages behind the row (an unreachable row's
    attempts: off its earlier check's messages, and off none of its own)."""
    problems = []
    for key, row in table.items():
        if isinstance(row, Unreachable):
            problems += [f"{key}: attempt {a.match!r} is not refused by {row.earlier}" for a in row.attempts
                         if not checks.rows[row.earlier].fits(a.match)]
            problems += [f"{key}: attempt {a.match!r} fits its own message: it is reachable" for a in row.attempts
                         if checks.rows[key].fits(a.match)]
        else:
            cases = row if isinstance(row, tuple) else (row,)
            problems += [f"{key}: {case.match!r} is none of {checks.rows[key].regexes()}" for case in cases
                         if not checks.rows[key].fits(case.match)]
    return problems


def test_each_rows_pattern_is_read_off_its_cxx_message(checks):
    """A row's pattern must match the refusal of the fake (tests/test_fake_checks.py) and of the library (on a
    GPU): here, that it is part of a message of the C++ check it stands for, not of another's."""
    assert pattern_problems(checks, TABLE) == [], "\n".join(pattern_problems(checks, TABLE))


def test_a_pattern_of_another_checks_message_is_found(checks):
    key = "CheckRank: ep_rank >= 0 && ep_rank < ep_size"
    assert pattern_problems(checks, {key: Bad("dispatch", dict, ValueError, r"ep_rank must be in \[0, ep_size=2\)")}) \
        == []
    for wrong in ("ep_size must be in", r"ep_rank must be in \[1, ", "ep_rank must be >= 0"):
        assert pattern_problems(checks, {key: Bad("dispatch", dict, ValueError, wrong)}), wrong
    # the hole after "payload " holds the index, not "s[0]"
    empty = "PlanRecvRegions: row >= 1"
    assert pattern_problems(checks, {empty: Bad("dispatch", dict, ValueError, r"payloads\[0\] has empty rows")})
    # a call row's message takes the call's string literals: CheckRecvCounts names "workspace"
    counts_key = "SanitizeExpertIds: CheckRecvCounts(recv_counts, recv_topk_ids, ep_size)"
    assert pattern_problems(checks, {counts_key: Bad("sanitize_expert_ids", dict, ValueError,
                                                     "recv_counts must be on the same device as recv_topk_ids")})


def test_rows_expect_the_exception_the_cxx_raises(checks):
    for key, row in TABLE.items():
        inputs = row.attempts if isinstance(row, Unreachable) else row if isinstance(row, tuple) else (row,)
        kinds = checks.rows[row.earlier].kinds if isinstance(row, Unreachable) else checks.rows[key].kinds
        for case in inputs:
            assert case.error.__name__ in kinds, f"{key}: expects {case.error.__name__}, the C++ raises {kinds}"


def test_unreachable_rows_name_the_check_that_refuses_first(checks):
    """What confirms an unreachable row: attempts (run by tests/test_fake_checks.py) refused by an earlier check,
    whose row exists, whose messages differ from this check's."""
    for key, row in TABLE.items():
        if isinstance(row, Unreachable):
            assert row.earlier in checks.rows and row.earlier != key, f"{key}: earlier={row.earlier!r} is no row"
            assert row.attempts, f"{key}: give the inputs that would fail it (attempts)"
            assert not set(checks.rows[row.earlier].messages) & set(checks.rows[key].messages), key


def test_the_parse_needs_no_nvcc(tmp_path):
    """The coverage test on a machine without a toolkit: no nvcc on PATH, CUDA_HOME pointing nowhere, an empty
    JIT cache (a build would fail there)."""
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not os.path.exists(os.path.join(d, "nvcc")))
    env = dict(os.environ, PATH=path, CUDA_HOME=str(tmp_path / "no_cuda"), CUDA_PATH=str(tmp_path / "no_cuda"),
               FLASHINFER_A2A_CACHE_DIR=str(tmp_path / "cache"), FLASHINFER_A2A_AOT_DIR=str(tmp_path / "aot"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                           "every_cxx_refusal_has_a_row or rows_pattern or rows_expect", f"{__file__}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------ planted defects

_IN_DISPATCH = re.compile(r"\nvoid Dispatch\([^{]*\{\n")


def _planted(dispatch_lines: str, *, common_h: str = "", dispatch_cu: str = "", header: str = "") -> CxxChecks:
    """The parse of the checkout's sources with ``dispatch_lines`` at the top of Dispatch's body, ``common_h``
    appended to csrc/common.h, ``dispatch_cu`` put before Dispatch and ``header`` appended to
    include/flashinfer_a2a/dispatch.cuh."""
    sources, macros = read_sources(), read_macro_definitions()
    m = _IN_DISPATCH.search(sources["csrc/dispatch.cu"])
    assert m, "Dispatch's definition moved: update _IN_DISPATCH"
    text = sources["csrc/dispatch.cu"]
    sources["csrc/dispatch.cu"] = text[: m.start()] + "\n" + dispatch_cu + text[m.start() : m.end()] + \
        dispatch_lines + "\n" + text[m.end() :]
    for where, extra in (("csrc/common.h", common_h), ("include/flashinfer_a2a/dispatch.cuh", header)):
        sources[where] = sources[where] + "\n" + extra + "\n"
        macros[where] = sources[where]
    return read_cxx_checks(sources, macros)


# (lines planted in Dispatch, other text planted, the row the parse must add, its kind): each slipped past the
# parse that read only column-0 A2A_CHECKs of csrc/ and skipped a line ending in "\".
PLANTED = [
    pytest.param("TVM_FFI_ICHECK(top_k > 0) << \"top_k\";", {}, "Dispatch: top_k > 0", "InternalError",
                 id="TVM_FFI_ICHECK"),
    pytest.param("TVM_FFI_ICHECK_LE(top_k, 32);", {}, "Dispatch: top_k <= 32", "InternalError",
                 id="TVM_FFI_ICHECK_LE"),
    pytest.param("TVM_FFI_CHECK(num_experts != 7, ValueError) << \"seven\";", {}, "Dispatch: num_experts != 7",
                 "ValueError", id="TVM_FFI_CHECK"),
    pytest.param("if (ep_size == 3) TVM_FFI_THROW(ValueError) << \"three ranks\";", {}, "Dispatch: !(ep_size == 3)",
                 "ValueError", id="if-TVM_FFI_THROW"),
    pytest.param("if (!(top_k != 5)) {\n    TVM_FFI_THROW(TypeError) << \"five\";\n  }", {}, "Dispatch: top_k != 5",
                 "TypeError", id="if-block-TVM_FFI_THROW"),
    pytest.param("A2A_POSITIVE(max_num_tokens);",
                 {"common_h": "#define A2A_POSITIVE(x) \\\n  A2A_CHECK((x) > 0, ValueError) << #x \" must be > 0\""},
                 "Dispatch: A2A_POSITIVE(max_num_tokens)", "ValueError", id="two-line-macro-over-A2A_CHECK"),
    pytest.param("A2A_REFUSE_IF(top_k == 9) << \"nine\";",
                 {"common_h": "#define A2A_REFUSE_IF(c) \\\n  if (c) \\\n  TVM_FFI_THROW(ValueError)"},
                 "Dispatch: A2A_REFUSE_IF(top_k == 9)", "ValueError", id="three-line-macro-over-TVM_FFI_THROW"),
    pytest.param("A2A_CHECK(top_k != 7, \\\n            ValueError) << \"not seven\";", {}, "Dispatch: top_k != 7",
                 "ValueError", id="A2A_CHECK-on-a-line-ending-in-backslash"),
    pytest.param("Limits::Check(top_k);",
                 {"dispatch_cu": "struct Limits {\n  static void Check(int64_t v) {\n"
                                 "    A2A_CHECK(v < 64, ValueError) << \"v\";\n  }\n};\n"},
                 "Check: v < 64", "ValueError", id="A2A_CHECK-in-an-indented-member-function"),
    pytest.param("CheckPlan(top_k);",
                 {"header": "namespace flashinfer_a2a {\ninline void CheckPlan(int64_t n) {\n"
                            "  TVM_FFI_ICHECK_GE(n, 0);\n}\n}  // namespace flashinfer_a2a"},
                 "CheckPlan: n >= 0", "InternalError", id="TVM_FFI_ICHECK_GE-in-an-included-header"),
]


@pytest.mark.parametrize(("lines", "elsewhere", "key", "kind"), PLANTED)
def test_a_planted_refusal_is_found(lines, elsewhere, key, kind):
    checks = _planted(lines, **elsewhere)
    assert key in checks.rows, f"not found; Dispatch's rows: {[k for k in checks.rows if k.startswith('Dispatch')]}"
    assert checks.rows[key].kinds == {kind}
    assert any(key in p for p in coverage_problems(checks)), "the coverage test would pass"


def test_a_call_of_a_planted_refusing_function_is_a_row():
    checks = _planted("CheckPlan(top_k);", header="inline void CheckPlan(int64_t n) {\n  TVM_FFI_ICHECK(n);\n}")
    assert checks.rows["Dispatch: CheckPlan(top_k)"].kind == "call"


def test_a_refusal_outside_any_function_is_reported():
    checks = _planted("", header="auto kRefuse = [](int n) { TVM_FFI_ICHECK(n); };")
    assert checks.stray == ["include/flashinfer_a2a/dispatch.cuh: n"]
    assert coverage_problems(checks)


def test_a_cuda_status_check_makes_no_row():
    plain = read_cxx_checks()
    checks = _planted("A2A_CUDA_CHECK(cudaGetLastError());")
    assert checks.rows == plain.rows and checks.status_checks == plain.status_checks + 1


# ------------------------------------------------------------------------------------------ the pieces


@pytest.mark.parametrize(("stream", "message", "matches"), [
    ('<< "ep_rank must be in [0, ep_size=" << ep_size << "), got " << ep_rank', "ep_rank must be in [0, ep_size=2), "
     "got 5", True),
    ('<< "ep_rank must be in [0, ep_size=" << ep_size << "), got " << ep_rank', "ep_size must be in [1, 72], got 0",
     False),
    ('<< (nvfp4 ? "needs global_scale" : "global_scale is " "unused")', "global_scale is unused", True),
    ('<< (nvfp4 ? "needs global_scale" : "global_scale is unused")', "global_scale is used", False),
    ('<< name << " must be contiguous"', "recv_counts must be contiguous", True),
    ('<< "a \\"quoted\\" word"', 'a "quoted" word', True),
])
def test_messages_are_read_from_the_streamed_literals(stream, message, matches):
    assert bool(re.fullmatch(message_regex(read_message(stream)), message, re.S)) == matches


def test_the_entries_are_the_ops_with_fakes_that_refuse(checks):
    """ENTRIES: every exported function whose op has a fake (csrc/a2a_binding.cu, library/ops.py) and refuses."""
    from flashinfer_a2a.library import ops

    binding = (ROOT / "csrc" / "a2a_binding.cu").read_text()
    exported = dict(re.findall(r"TVM_FFI_DLL_EXPORT_TYPED_FUNC\((\w+),\s*[\w:]*?(\w+)\)", binding))
    with_fakes = {exported[name] for name in exported if hasattr(ops, f"_{name}_fake")}
    assert set(ENTRIES) <= with_fakes
    assert {f for f in with_fakes - set(ENTRIES) if f in checks.kinds} == set()
