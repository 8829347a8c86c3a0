"""Fixtures shared by the CPU tests: one JIT build of the real module per session."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from flashinfer_a2a.jit import JitSpec, gen_a2a_module

from .jit.jit_testing import set_jit_env
from .progress import missing_launchers, on_terminal


@dataclass
class SharedBuild:
    spec: JitSpec
    env: dict[str, str]
    library: Path
    build_dir: Path
    seconds: float


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def checkout_cache() -> Path:
    """``~/.cache/flashinfer_a2a_tests/<hash of the checkout's path>``: builds that outlive the session.

    One per checkout, so a second ``pytest`` on an unchanged tree rebuilds nothing (ninja compares sources, headers
    and flags) and two checkouts never rebuild each other's objects.
    """
    return Path.home() / ".cache" / "flashinfer_a2a_tests" / hashlib.sha256(str(REPO).encode()).hexdigest()[:12]


@pytest.fixture(scope="session")
def a2a_build(request, tmp_path_factory, checkout_cache) -> SharedBuild:
    """The real flashinfer_a2a_ops, JIT-built for sm_90a and sm_100a in :func:`checkout_cache`.

    A build prints the JIT's start and end lines on the terminal; a session that finds it built prints nothing.
    """
    env = {
        "FLASHINFER_A2A_CUDA_ARCH_LIST": "9.0a 10.0a",
        "FLASHINFER_A2A_CACHE_DIR": str(checkout_cache),
        # Empty on purpose: a library left in the package's _aot/ by `python aot.py` must not stand in for JIT.
        "FLASHINFER_A2A_AOT_DIR": str(tmp_path_factory.mktemp("no_aot")),
    }
    with pytest.MonkeyPatch.context() as mp:
        set_jit_env(mp, env)
        spec = gen_a2a_module()
        start = time.monotonic()
        if spec.needs_build():
            with on_terminal(request.config):
                spec.build()
        else:
            spec.build()
        seconds = time.monotonic() - start
        return SharedBuild(spec, env, spec.jit_library_path, spec.build_dir, seconds)


@pytest.fixture
def a2a_env(monkeypatch, a2a_build) -> SharedBuild:
    """The environment of the shared build, set for one test."""
    set_jit_env(monkeypatch, a2a_build.env)
    return a2a_build


_SUMMARY = pytest.StashKey[list]()


@pytest.fixture
def record_counts(request) -> Callable[[str], None]:
    """Adds a line to the run's summary, shown whatever the verbosity: what a test counted (the C++ refusals and
    their rows, the random cases a layout ran). Tests skipped for want of a launcher are listed there too."""
    return request.config.stash.setdefault(_SUMMARY, []).append


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(_SUMMARY, []) + missing_launchers(terminalreporter.stats.get("skipped", []))
    if lines:
        terminalreporter.section("flashinfer_a2a: counts and skipped launchers")
        for line in lines:
            terminalreporter.write_line(line)
