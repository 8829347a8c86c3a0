"""pyproject.toml: every subpackage ships, csrc/ and include/ ride inside the wheel, AOT libraries too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "flashinfer_a2a").rglob("__init__.py")
    }
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages in pyproject.toml"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout holding a stand-in AOT library (no compile needed)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "_aot", "*.egg-info")
    for name in ("flashinfer_a2a", "csrc", "include"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    fake = src / "flashinfer_a2a" / "_aot" / "flashinfer_a2a_ops" / "flashinfer_a2a_ops.so"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"stand-in")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(root / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    (built,) = (root / "dist").glob("*.whl")
    return built


def test_wheel_carries_sources_headers_and_aot_libraries(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (REPO / "csrc").iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            assert f"flashinfer_a2a/_data/csrc/{path.name}" in names
    for path in (REPO / "include").rglob("*.cuh"):
        assert f"flashinfer_a2a/_data/include/{path.relative_to(REPO / 'include').as_posix()}" in names
    assert "flashinfer_a2a/_aot/flashinfer_a2a_ops/flashinfer_a2a_ops.so" in names
    assert "flashinfer_a2a/jit/spec.py" in names


def test_wheel_with_aot_libraries_is_platform_tagged(wheel):
    # Machine code for one platform, no Python C API: py3-none-<platform>, never -any.
    assert wheel.name.startswith("flashinfer_a2a-0.1.0-py3-none-")
    assert not wheel.name.endswith("-any.whl")


def test_installed_wheel_compiles_from_its_packaged_sources(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "from flashinfer_a2a.jit import gen_a2a_module, toolchain\n"
        "print(toolchain.source_root())\n"
        "print(all(s.is_file() for s in gen_a2a_module().sources))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(site / "flashinfer_a2a" / "_data"), "True"]
