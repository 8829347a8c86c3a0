"""Lines a person must see during a test run, past pytest's output capture."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
