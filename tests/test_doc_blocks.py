"""Every code block of the quickstarts and of docs/integration.md runs in a test: the quickstart is
docs/examples/quickstart.py verbatim (run under torchrun by tests/gpu/test_quickstart.py), integration.md's Python
blocks run here on CPU, and its included files are the examples the GPU suite runs."""

import re
from pathlib import Path

import pytest

from flashinfer_a2a import shared_workspace

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = (REPO / "docs" / "examples" / "quickstart.py").read_text()


def _blocks(text: str, lang: str = "python") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_quickstart_is_the_tested_example(page):
    text = (REPO / page).read_text()
    section = text[text.index("## Quickstart"):]
    block = _blocks(section)[0]
    assert block == QUICKSTART, f"{page}'s quickstart differs from docs/examples/quickstart.py"
    assert len(block.splitlines()) <= 30


def test_integration_page_includes_only_tested_examples():
    text = (REPO / "docs" / "integration.md").read_text()
    included = re.findall(r"```\{literalinclude\} (\S+)", text)
    assert included, "integration.md shows the example layer and adapters"
    for path in included:
        target = (REPO / "docs" / path).resolve()
        assert target.parent == REPO / "docs" / "examples" and target.exists(), path


@pytest.mark.usefixtures("a2a_env")
def test_integration_page_python_blocks_run_on_cpu():
    blocks = _blocks((REPO / "docs" / "integration.md").read_text())
    assert blocks
    namespace = {"__name__": "__doc_block__"}  # one page, read top to bottom: later blocks use earlier imports
    for block in blocks:
        exec(compile(block, "docs/integration.md", "exec"), namespace)
    assert shared_workspace.live_workspaces() == []
