"""README, docs and CI agree: CI runs the README's own commands; the env table matches config.ENV_VARS."""

from __future__ import annotations

import os
import re
from pathlib import Path

from flashinfer_a2a.config import env_table_markdown

REPO = Path(__file__).resolve().parents[1]


def readme_setup_commands() -> list[str]:
    """The lines of the first ```bash block under the README's "Set up" heading."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("\n## Set up") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Set up section has no ```bash block"
    return [line for line in block[1].splitlines() if line.strip()]


def test_ci_runs_the_readme_commands_verbatim():
    commands = readme_setup_commands()
    assert len(commands) == 2 and commands[0].startswith("pip install") and commands[1].startswith("pytest")
    ci = REPO / ".ci" / "run"
    assert os.access(ci, os.X_OK)
    ci_lines = ci.read_text().splitlines()
    assert "set -euo pipefail" in ci_lines
    for command in commands:
        assert command in ci_lines, f"{command!r} is in README.md but not in .ci/run"
    assert "sphinx-build -W -b html docs docs/_build/html" in ci_lines
    # In a fresh venv of its own, as a user runs them: nothing borrowed from the CI machine's Python.
    venv = next(i for i, line in enumerate(ci_lines) if re.match(r'python3 -m venv "\$venv"$', line))
    activate = ci_lines.index('export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"')
    assert venv < activate < ci_lines.index(commands[0])


def test_env_table_matches_config():
    table = env_table_markdown()
    for page in ("README.md", "docs/environment.md"):
        assert table in (REPO / page).read_text(), (
            f"{page}: paste the table printed by "
            "`python -c 'from flashinfer_a2a.config import env_table_markdown as t; print(t())'`"
        )
