"""Lines a person must see during a test run: past pytest's output capture, and in the run's summary (a test
skipped for want of a launcher such as mpirun, whatever the verbosity)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

import pytest


@contextlib.contextmanager
def on_terminal(config: pytest.Config) -> Iterator[None]:
    """Lets what the block prints reach the terminal, on a line of its own, past pytest's output capture.

    For the compiles that hold up a first run: the library alone takes minutes on a 2-core machine, and the JIT's
    lines saying so (stderr) would otherwise be captured while the progress line sits still.
    """
    capture = config.pluginmanager.get_plugin("capturemanager")
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        if terminal is not None:
            terminal.write("\n")
        yield


MISSING_LAUNCHER = "launcher missing"


def skip_missing_launcher(launcher: str, how_to_get: str) -> NoReturn:
    """Skips the test for want of ``launcher``, with a reason the run's summary lists (:func:`missing_launchers`):
    a bare skip shows only under ``-rs``, and a GPU run without mpirun would pass its mpirun variants unseen."""
    pytest.skip(f"{MISSING_LAUNCHER}: {launcher} not found ({how_to_get})")


def missing_launchers(skipped: list) -> list[str]:
    """``"<reason>: <test id>"`` of each report in ``skipped`` (a terminal reporter's ``stats["skipped"]``) whose
    test was skipped for want of a launcher."""
    lines = []
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if MISSING_LAUNCHER in reason:
            lines.append(f"skipped, {reason.removeprefix('Skipped: ')}: {report.nodeid}")
    return lines
