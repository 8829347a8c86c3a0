"""flashinfer_a2a.config: parsing, defaults and errors of every environment variable."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from flashinfer_a2a import config
from flashinfer_a2a._version import __version__

PACKAGE = Path(config.__file__).parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FLASHINFER_A2A_") or name in ("MAX_JOBS", "CUDA_HOME", "CUDA_PATH", "CXX"):
            monkeypatch.delenv(name)


def fake_gpus(monkeypatch, capabilities):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(capabilities))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capabilities[i])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("9.0a 10.0a", ["9.0a", "10.0a"]),
        ("10.0a,9.0a", ["9.0a", "10.0a"]),
        (" 9.0a , 9.0a  12.0 ", ["9.0a", "12.0"]),
        ("10.0f", ["10.0f"]),
    ],
)
def test_arch_list_from_env(monkeypatch, text, expected):
    monkeypatch.setenv("FLASHINFER_A2A_CUDA_ARCH_LIST", text)
    assert config.cuda_arch_list() == expected


@pytest.mark.parametrize("bad", ["sm_90a", "90a", "9.0x", "9", "9.0a;10.0a", ","])
def test_bad_arch_list_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv("FLASHINFER_A2A_CUDA_ARCH_LIST", bad)
    with pytest.raises(ValueError, match="FLASHINFER_A2A_CUDA_ARCH_LIST"):
        config.cuda_arch_list()


def test_arch_list_defaults_to_the_visible_gpus(monkeypatch):
    fake_gpus(monkeypatch, [(10, 0), (9, 0), (9, 0)])
    assert config.cuda_arch_list() == ["9.0a", "10.0a"]
    fake_gpus(monkeypatch, [(12, 0), (9, 0)])
    assert config.cuda_arch_list() == ["9.0a", "12.0"]


def test_gpus_older_than_hopper_are_refused_before_nvcc(monkeypatch):
    fake_gpus(monkeypatch, [(8, 0), (9, 0)])
    with pytest.raises(RuntimeError, match="compute capability 8.0: flashinfer_a2a needs sm_90"):
        config.cuda_arch_list()


@pytest.mark.parametrize("text", ["8.0", "9.0a 8.6", "7.5,10.0a"])
def test_arch_list_older_than_hopper_names_the_variable(monkeypatch, text):
    monkeypatch.setenv("FLASHINFER_A2A_CUDA_ARCH_LIST", text)
    with pytest.raises(ValueError, match=r"FLASHINFER_A2A_CUDA_ARCH_LIST: .* is older than sm_90"):
        config.cuda_arch_list()


def test_no_gpu_and_no_arch_list_tells_what_to_set(monkeypatch):
    fake_gpus(monkeypatch, [])
    with pytest.raises(RuntimeError, match="set FLASHINFER_A2A_CUDA_ARCH_LIST"):
        config.cuda_arch_list()


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHINFER_A2A_CUDA_ARCH_LIST", "10.0a 9.0a")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config.cache_dir() == tmp_path / "home" / ".cache" / "flashinfer_a2a" / __version__ / "9.0a_10.0a"
    monkeypatch.setenv("FLASHINFER_A2A_CACHE_DIR", str(tmp_path / "root"))
    assert config.cache_dir() == tmp_path / "root" / __version__ / "9.0a_10.0a"


def test_aot_dir(monkeypatch, tmp_path):
    assert config.aot_dir() == PACKAGE / "_aot"
    monkeypatch.setenv("FLASHINFER_A2A_AOT_DIR", str(tmp_path))
    assert config.aot_dir() == tmp_path


@pytest.mark.parametrize(
    "getter, name",
    [
        (config.disable_jit, "FLASHINFER_A2A_DISABLE_JIT"),
        (config.jit_verbose, "FLASHINFER_A2A_JIT_VERBOSE"),
        (config.debug, "FLASHINFER_A2A_DEBUG"),
    ],
)
def test_flags(monkeypatch, getter, name):
    assert getter() is False
    for value, expected in [("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False), ("", False)]:
        monkeypatch.setenv(name, value)
        assert getter() is expected
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=name):
        getter()


def test_timeout_s(monkeypatch):
    assert config.timeout_s() == 10.0
    monkeypatch.setenv("FLASHINFER_A2A_TIMEOUT_S", "2.5")
    assert config.timeout_s() == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv("FLASHINFER_A2A_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="FLASHINFER_A2A_TIMEOUT_S"):
            config.timeout_s()


def test_max_jobs(monkeypatch):
    assert config.max_jobs() == (os.cpu_count() or 1)
    monkeypatch.setenv("MAX_JOBS", "3")
    assert config.max_jobs() == 3
    for bad in ("0", "-2", "many", "1.5"):
        monkeypatch.setenv("MAX_JOBS", bad)
        with pytest.raises(ValueError, match="MAX_JOBS"):
            config.max_jobs()


def _toolkit(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").touch()
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (root / "bin" / "nvcc").chmod(0o755)
    return root


def test_cuda_home(monkeypatch, tmp_path):
    toolkit = _toolkit(tmp_path / "cuda-13.0")
    wrapper_dir = tmp_path / "wrappers"
    wrapper_dir.mkdir()
    (wrapper_dir / "nvcc").write_text(f"#!/bin/sh\nexec {toolkit}/bin/nvcc \"$@\"\n")
    (wrapper_dir / "nvcc").chmod(0o755)

    monkeypatch.setenv("PATH", str(toolkit / "bin"))
    assert config.cuda_home() == toolkit
    # A wrapper script has no toolkit beside it: fall back rather than guess its parent.
    monkeypatch.setenv("PATH", str(wrapper_dir))
    assert config.cuda_home() == Path("/usr/local/cuda")
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "by_cuda_path"))
    assert config.cuda_home() == tmp_path / "by_cuda_path"
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "by_cuda_home"))
    assert config.cuda_home() == tmp_path / "by_cuda_home"


def test_cxx(monkeypatch):
    assert config.cxx() == "c++"
    monkeypatch.setenv("CXX", "g++-12")
    assert config.cxx() == "g++-12"


def test_every_variable_read_is_in_the_table():
    read = set(re.findall(r'_(?:get|flag)\("(\w+)"\)', Path(config.__file__).read_text()))
    # CUDA_PATH is CUDA_HOME's fallback and shares its row.
    assert read == {v.name for v in config.ENV_VARS} | {"CUDA_PATH"}


def test_only_config_reads_the_environment():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name != "config.py" and re.search(r"os\.environ|os\.getenv|getenv\(", path.read_text()):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == [], "read environment variables in flashinfer_a2a/config.py only"
