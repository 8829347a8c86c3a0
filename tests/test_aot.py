"""aot.py: every library built ahead of time in one ninja run, then loaded with no CUDA toolkit in sight."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from flashinfer_a2a.jit import all_specs

from .progress import on_terminal

REPO = Path(__file__).resolve().parents[1]


class AotDirs(NamedTuple):
    out: Path
    build: Path


def _aot(*args: str) -> str:
    return subprocess.run(
        [sys.executable, str(REPO / "aot.py"), *args], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def aot_out(request, tmp_path_factory, checkout_cache) -> AotDirs:
    """aot.py for sm_90a only (the two-arch build is covered by tests/jit): half the compile time.

    The libraries go to a fresh directory; the objects stay in the checkout's test cache, so a later session only
    links them again (a second `pytest` compiles nothing). When aot.py compiles, its lines reach the terminal as
    they come (a minute or more on a small machine); when it finds everything built, nothing is shown.
    """
    dirs = AotDirs(out=tmp_path_factory.mktemp("aot") / "out", build=checkout_cache / "aot_build")
    cmd = [sys.executable, str(REPO / "aot.py"), "--cuda-arch-list", "9.0a", "--out-dir", str(dirs.out),
           "--build-dir", str(dirs.build)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [proc.stdout.readline()]
    compiling = lines[0].startswith("compiling")
    with on_terminal(request.config) if compiling else contextlib.nullcontext():
        if compiling:
            print(f"aot.py: {lines[0]}", end="", flush=True)
        for line in proc.stdout:
            lines.append(line)
            if compiling:
                print(f"aot.py: {line}", end="", flush=True)
    assert proc.wait() == 0, "".join(lines)
    return dirs


def test_layout_is_name_slash_name_so(aot_out):
    for spec in all_specs():
        assert (aot_out.out / spec.name / f"{spec.name}.so").is_file()
    assert not list(aot_out.out.rglob("*.o")), "objects stay in the build dir, out of the wheel"


def test_one_ninja_run_builds_every_spec(aot_out):
    build_ninja = (aot_out.build / "build.ninja").read_text()
    for spec in all_specs():
        assert f"{spec.name}_cflags = " in build_ninja
    out = _aot("--cuda-arch-list", "9.0a", "--out-dir", str(aot_out.out), "--build-dir", str(aot_out.build))
    assert "up to date" in out


def test_aot_library_loads_without_nvcc(aot_out, tmp_path):
    # No nvcc on PATH, a bogus CUDA_HOME, no arch list and no GPU: only the AOT path can succeed.
    path = os.pathsep.join(
        d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nvcc").exists()
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_A2A_")}
    env.update(
        PATH=path,
        CUDA_HOME=str(tmp_path / "no_cuda"),
        FLASHINFER_A2A_AOT_DIR=str(aot_out.out),
        FLASHINFER_A2A_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    code = "from flashinfer_a2a.jit import get_a2a_module; print(get_a2a_module().get_workspace_size(2, 64, 4, 512, 512))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0
    assert not (tmp_path / "cache").exists()


def test_bad_arch_list_names_the_option(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "aot.py"), "--cuda-arch-list", "sm_90a", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "--cuda-arch-list" in proc.stderr
