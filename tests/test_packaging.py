"""The wheel: every subpackage, sources and headers ship; a manylinux tag; lean requirements; it installs into a
fresh venv and loads its prebuilt library with no nvcc and no `jit` extra."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
LIBRARY = "flashinfer_a2a/_aot/flashinfer_a2a_ops/flashinfer_a2a_ops.so"


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "flashinfer_a2a").rglob("__init__.py")
    }
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages in pyproject.toml"


@pytest.fixture(scope="module")
def built(tmp_path_factory, a2a_build) -> tuple[Path, str]:
    """(wheel, build log) from a copy of the checkout whose _aot/ holds the session's JIT build.

    That library is what `python aot.py --cuda-arch-list "9.0a 10.0a"` makes (same flags; aot.py only puts it
    under _aot/), so the wheel is the README's without a second two-arch compile on a small machine.
    """
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "_aot", "*.egg-info")
    for name in ("flashinfer_a2a", "csrc", "include"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    (src / LIBRARY).parent.mkdir(parents=True)
    shutil.copy(a2a_build.library, src / LIBRARY)
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(root / "dist"), str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (root / "dist").glob("*.whl")
    return wheel, proc.stdout + proc.stderr


def glibc_needed(library: Path) -> tuple[int, int]:
    """The newest GLIBC_x.y symbol version ``library`` requires, read by readelf (not by setup.py's parser)."""
    listing = subprocess.run(["readelf", "-V", str(library)], capture_output=True, text=True, check=True).stdout
    versions = {(int(a), int(b)) for a, b in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", listing)}
    return max(versions | {(2, 17)})


def test_build_prints_no_package_warnings(built):
    _, log = built
    assert "Package would be ignored" not in log
    assert "is absent from the `packages` configuration" not in log


def test_wheel_carries_sources_headers_and_aot_libraries(built):
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (REPO / "csrc").iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            assert f"flashinfer_a2a/_data/csrc/{path.name}" in names
    for path in (REPO / "include").rglob("*.cuh"):
        assert f"flashinfer_a2a/_data/include/{path.relative_to(REPO / 'include').as_posix()}" in names
    assert LIBRARY in names
    assert "flashinfer_a2a/jit/spec.py" in names
    assert not [n for n in names if n.endswith((".o", ".ninja", ".ninja_log", ".lock"))]


def test_wheel_is_manylinux_for_the_glibc_its_library_needs(built, a2a_build):
    # Machine code, no Python C API: py3-none-manylinux_2_<N>_x86_64, N the newest glibc symbol version it uses.
    wheel, _ = built
    major, minor = glibc_needed(a2a_build.library)
    assert wheel.name == f"flashinfer_a2a-0.1.0-py3-none-manylinux_{major}_{minor}_x86_64.whl"
    wheel_info = zipfile.ZipFile(wheel).read("flashinfer_a2a-0.1.0.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in wheel_info
    assert f"Tag: py3-none-manylinux_{major}_{minor}_x86_64" in wheel_info


def test_requirements_are_torch_and_tvm_ffi_and_the_jit_tools_are_an_extra(built):
    wheel, _ = built
    metadata = Parser().parsestr(zipfile.ZipFile(wheel).read("flashinfer_a2a-0.1.0.dist-info/METADATA").decode())
    requires = metadata.get_all("Requires-Dist")
    unconditional = sorted(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requires if ";" not in r)
    assert unconditional == ["apache-tvm-ffi", "torch"]
    for tool in ("ninja", "nvidia-cutlass"):
        assert any(r.startswith(tool) and 'extra == "jit"' in r for r in requires), requires
    assert "jit" in metadata.get_all("Provides-Extra")


def test_installed_wheel_loads_its_library_without_nvcc_or_the_jit_extra(built, tmp_path):
    wheel, _ = built
    # --system-site-packages lends the venv torch and tvm-ffi; the wheel itself is installed without
    # dependencies, and below the JIT's tools are hidden (no nvcc or ninja on PATH, no ninja or cutlass module).
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_A2A_") and k != "PYTHONPATH"}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation", str(wheel)],
        env=clean, capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    tools = ("nvcc", "ninja")
    path = os.pathsep.join(
        d for d in clean.get("PATH", "").split(os.pathsep) if d and not any((Path(d) / t).exists() for t in tools)
    )
    env = {
        **clean,
        "PATH": path,
        "CUDA_HOME": str(tmp_path / "no_cuda"),
        "FLASHINFER_A2A_DISABLE_JIT": "1",
        "FLASHINFER_A2A_CACHE_DIR": str(tmp_path / "cache"),
    }
    code = (
        "import sys\n"
        "sys.modules['ninja'] = sys.modules['cutlass_library'] = None\n"
        "import flashinfer_a2a\n"
        "from flashinfer_a2a.jit import gen_a2a_module, get_a2a_module\n"
        "print(flashinfer_a2a.__file__)\n"
        "print(gen_a2a_module().aot_library_path)\n"
        "print(get_a2a_module().get_workspace_size(2, 64, 4, 512, 512))\n"
    )
    # cwd away from the checkout, so `import flashinfer_a2a` cannot pick up the source tree.
    proc = subprocess.run([str(python), "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    package_file, library, size = proc.stdout.split()
    site = Path(package_file).parent.parent
    assert site.is_relative_to(env_dir), f"imported {package_file}, not the wheel installed in {env_dir}"
    assert Path(library) == site / LIBRARY
    assert int(size) > 0
    assert proc.stderr == "", "loading a prebuilt library prints nothing"
    assert not (tmp_path / "cache").exists(), "nothing was compiled"

    dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    run_paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r\w*path: \[(.*)\]", dynamic)
    assert run_paths == ["$ORIGIN/../../../tvm_ffi/lib"], "no absolute run path from the build machine"
    assert "libcudart.so" not in dynamic, "the CUDA runtime is linked statically"


def test_installed_wheel_compiles_from_its_packaged_sources(built, tmp_path):
    wheel, _ = built
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
