"""Every code block of the docs runs in a test.

- ```python blocks run as written: the README / docs index quickstart is docs/examples/quickstart.py verbatim (run
  under torchrun by tests/gpu/test_quickstart.py; what it says without a GPU is checked here); integration.md's and
  jit_aot.md's blocks run here on CPU; semantics.md's block needs a GPU and runs in tests/gpu/test_doc_blocks_gpu.py.
  ``PYTHON_BLOCKS`` says, per page, how many blocks it has and which test runs them: a page that gains a block fails
  test_every_python_block_has_a_runner until the block gets one.
- {literalinclude} blocks show files under docs/examples (whole, or the part between two marker comments); each file
  is a complete program run by the test ``INCLUDED`` names: on CPU under torchrun over gloo where the example runs
  there (transports.py), in the GPU suite otherwise.
- ```bash blocks are commands a user types: installing, building wheels, launching multi-GPU jobs and benchmarks
  that run for minutes. They are not run; what can rot in them is checked instead: every script they name exists
  and every benchmark command line parses with the benchmark's own argument parser. ```text blocks are output and
  diagrams, {eval-rst} the API reference (built by sphinx -W).
"""

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer_a2a.memory import shared_workspace

from .examples import run_on_cpu_under_torchrun

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = (REPO / "docs" / "examples" / "quickstart.py").read_text()
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# page -> (number of ```python blocks, the test that runs them)
PYTHON_BLOCKS = {
    "README.md": (1, "tests/test_doc_blocks.py::test_quickstart_is_the_tested_example"),
    "docs/index.md": (1, "tests/test_doc_blocks.py::test_quickstart_is_the_tested_example"),
    "docs/integration.md": (5, "tests/test_doc_blocks.py::test_integration_page_python_blocks_run_on_cpu"),
    "docs/jit_aot.md": (1, "tests/test_doc_blocks.py::test_jit_aot_block_runs_on_cpu"),
    "docs/semantics.md": (1, "tests/gpu/test_doc_blocks_gpu.py::test_semantics_block_runs"),
}
# docs/examples file a page includes -> the test that runs it
INCLUDED = {
    "torchrun_example.py": "tests/gpu/test_doc_blocks_gpu.py::test_example_runs_under_torchrun_on_one_gpu",
    "mpirun_example.py": "tests/gpu/test_doc_blocks_gpu.py::test_mpirun_example_runs_on_one_gpu",
    "ep_subgroups.py": "tests/gpu/test_doc_blocks_gpu.py::test_example_runs_under_torchrun_on_one_gpu",
    "quantized.py": "tests/gpu/test_doc_blocks_gpu.py::test_example_runs_under_torchrun_on_one_gpu",
    "overlap.py": "tests/gpu/test_doc_blocks_gpu.py::test_example_runs_under_torchrun_on_one_gpu",
    "transports.py": "tests/test_doc_blocks.py::test_transports_example_runs_on_cpu_under_torchrun",
    "hierarchical.py": "tests/test_hierarchical_transport.py::test_example_runs_on_cpu_under_torchrun",
    "ep_moe_layer.py": "tests/gpu/test_ep_moe_layer.py::test_eager_layer_equals_the_dense_layer",
    "vllm_adapter.py": "tests/gpu/test_compat_engines.py::test_vllm_prepare_finalize_sequence",
    "sglang_adapter.py": "tests/gpu/test_compat_engines.py::test_sglang_dispatcher_sequence",
    "cuda_graphs.py": "tests/gpu/test_doc_blocks_gpu.py::test_example_runs_under_torchrun_on_one_gpu",
}


def _blocks(text: str, lang: str = "python") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return _blocks(page.read_text())


def _includes(text: str) -> list[tuple[str, dict[str, str]]]:
    """(path, options) of each {literalinclude} block."""
    found = []
    for path, body in re.findall(r"^```\{literalinclude\} (\S+)\n(.*?)^```$", text, re.S | re.M):
        found.append((path, dict(re.findall(r"^:([\w-]+): ?(.*)$", body, re.M))))
    return found


def _test_exists(ref: str) -> bool:
    path, name = ref.split("::")
    tree = ast.parse((REPO / path).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_python_block_has_a_runner():
    found = {str(page.relative_to(REPO)): len(python_blocks(page)) for page in PAGES}
    found = {page: n for page, n in found.items() if n}
    counts = {page: n for page, (n, _) in PYTHON_BLOCKS.items()}
    assert found == counts, ("a page's ```python blocks differ from PYTHON_BLOCKS: give each new block a test "
                             f"(pages: {found}, registered: {counts})")
    for page, (_, ref) in PYTHON_BLOCKS.items():
        assert _test_exists(ref), f"{page}: {ref} does not exist"


def test_every_included_file_has_a_runner():
    shown = set()
    for page in PAGES:
        for path, options in _includes(page.read_text()):
            target = (page.parent / path).resolve()
            assert target.parent == REPO / "docs" / "examples" and target.exists(), f"{page.name}: {path}"
            assert target.name in INCLUDED, f"{page.name} includes {path}, which no test in INCLUDED runs"
            text = target.read_text()
            for key in ("start-after", "end-before"):
                if key in options:
                    assert text.count(options[key]) == 1, f"{path}: marker {options[key]!r} must occur once"
            shown.add(target.name)
    assert shown == set(INCLUDED), f"INCLUDED names files no page shows: {set(INCLUDED) - shown}"
    for name, ref in INCLUDED.items():
        assert _test_exists(ref), ref
        assert name.removesuffix(".py") in (REPO / ref.split("::")[0]).read_text(), f"{ref} does not run {name}"


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_quickstart_is_the_tested_example(page):
    text = (REPO / page).read_text()
    section = text[text.index("## Quickstart"):]
    block = _blocks(section)[0]
    assert block == QUICKSTART, f"{page}'s quickstart differs from docs/examples/quickstart.py"
    assert len(block.splitlines()) <= 31
    # The prose around it names the example a machine without a GPU can run.
    assert "examples/transports.py" in section[:section.index("```python")]


def test_quickstart_without_a_gpu_says_what_it_needs_in_one_line():
    # What a new user on a CPU machine sees: one line naming the example that runs there, not a traceback per rank
    # and then torchrun's own.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(27500 + os.getpid() % 1000), str(REPO / "docs" / "examples" / "quickstart.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "quickstart.py needs NVIDIA GPUs (Hopper or Blackwell); docs/examples/transports.py runs on CPU"
    ], proc.stdout
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


@pytest.mark.usefixtures("a2a_env")
def test_integration_page_python_blocks_run_on_cpu():
    blocks = python_blocks(REPO / "docs" / "integration.md")
    assert blocks
    namespace = {"__name__": "__doc_block__"}  # one page, read top to bottom: later blocks use earlier imports
    for block in blocks:
        exec(compile(block, "docs/integration.md", "exec"), namespace)
    assert shared_workspace.live_workspaces() == []


@pytest.mark.usefixtures("a2a_env")
def test_jit_aot_block_runs_on_cpu(capsys):
    (block,) = python_blocks(REPO / "docs" / "jit_aot.md")
    namespace = {"__name__": "__doc_block__"}
    exec(compile(block, "docs/jit_aot.md", "exec"), namespace)
    printed = capsys.readouterr().out.split()
    # 8 ranks of 256 tokens, top-8, bf16 rows of 7168 both ways: at least the two regions' rows.
    assert len(printed) == 1 and int(printed[0]) >= 2 * 8 * 256 * 7168 * 2, printed
    assert namespace["module"] is not None


def test_transports_example_runs_on_cpu_under_torchrun():
    out = run_on_cpu_under_torchrun("transports", 2, 26500)  # no GPU: gloo, and the nccl transport over it
    for rank in range(2):
        assert f"rank {rank}: MoeAlltoAll over the nccl transport ok" in out, out[-6000:]
        assert f"rank {rank}: NcclTransport ok" in out, out[-6000:]
        assert f"rank {rank}: compiled step over the nccl transport ok" in out, out[-6000:]


def _commands(page: Path) -> list[str]:
    """The command lines of a page's ```bash blocks: continuations joined, comments dropped."""
    lines = []
    for block in _blocks(page.read_text(), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_bash_blocks_name_existing_scripts_and_valid_bench_flags():
    from flashinfer_a2a.bench.args import build_parser

    commands = [c for page in PAGES for c in _commands(page)]
    assert commands
    bench_lines = 0
    for command in commands:
        words = shlex.split(command)
        for word in words:
            if word.endswith(".py") and "/" in word or word in ("aot.py",):
                assert (REPO / word).exists(), f"{command!r} names {word}, which does not exist"
        if "flashinfer_a2a.bench" in words:
            args = words[words.index("flashinfer_a2a.bench") + 1:]
            try:
                build_parser().parse_args(args)
            except SystemExit as exc:
                pytest.fail(f"{command!r}: the benchmark rejects {args} (exit {exc.code})")
            bench_lines += 1
    assert bench_lines >= 5
