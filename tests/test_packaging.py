"""The wheel: every subpackage, sources and headers ship; a manylinux tag auditwheel agrees with; lean requirements;
the same bytes from two builds; it installs into a fresh venv and loads its prebuilt library with no nvcc and no
`jit` extra."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
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
    return build_wheel(src, root / "dist")


def build_wheel(src: Path, out_dir: Path) -> tuple[Path, str]:
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}  # setup.py's own default, as a user's
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out_dir), str(src)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out_dir.glob("*.whl")
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


def test_auditwheel_agrees_with_the_tag(built):
    # What PyPI-bound wheels are checked with: every library the wheel needs is within the manylinux policy of its
    # tag (libtvm_ffi.so is bound at load time, not named), so `auditwheel show` asks for no repair.
    pytest.importorskip("auditwheel")
    wheel, _ = built
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    tag = wheel.name.removesuffix(".whl").split("-")[-1]
    assert report["external_libs"] == {}, report["external_libs"]
    assert report["overall_tag"] == tag, (report["overall_tag"], tag)


def test_two_builds_of_one_checkout_give_the_same_bytes(built, tmp_path):
    # setup.py pins the zip timestamps (SOURCE_DATE_EPOCH) and the library carries no build path or nvcc temporary
    # name (tests/jit/test_modules.py): rebuilding the same tree, anywhere, reproduces the wheel.
    wheel, _ = built
    again, _ = build_wheel(wheel.parents[1] / "src", tmp_path / "dist")
    assert again.name == wheel.name
    assert again.read_bytes() == wheel.read_bytes()


def test_requirements_are_torch_and_tvm_ffi_and_the_jit_tools_are_an_extra(built):
    wheel, _ = built
    metadata = Parser().parsestr(zipfile.ZipFile(wheel).read("flashinfer_a2a-0.1.0.dist-info/METADATA").decode())
    requires = metadata.get_all("Requires-Dist")
    unconditional = sorted(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requires if ";" not in r)
    assert unconditional == ["apache-tvm-ffi", "torch"]
    for tool in ("ninja", "nvidia-cutlass"):
        assert any(r.startswith(tool) and 'extra == "jit"' in r for r in requires), requires
    assert "jit" in metadata.get_all("Provides-Extra")


def running_environment() -> list[str]:
    """The site directories of the interpreter running pytest: a venv's, a conda prefix's or a system Python's."""
    dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def fresh_venv(env_dir: Path) -> Path:
    """A venv that sees this environment's packages (torch, tvm-ffi), not the base interpreter's.

    ``system_site_packages=True`` would lend the base interpreter's site-packages, which in a venv or a conda
    environment is not where torch was installed. A .pth file lists this environment's site directories instead;
    they come after the venv's own, so what is installed in the venv wins, and their .pth files are not run, so
    the checkout's editable install stays out. No pip in the venv (ensurepip is missing from some system Pythons):
    this interpreter's pip installs into it with --python.
    """
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "running_environment.pth").write_text("".join(f"{d}\n" for d in running_environment()))
    return python


def test_installed_wheel_loads_its_library_without_nvcc_or_the_jit_extra(built, tmp_path):
    wheel, _ = built
    # The venv borrows torch and tvm-ffi from the environment running the tests; the wheel itself is installed
    # without dependencies, and below the JIT's tools are hidden (no nvcc or ninja on PATH, no ninja or cutlass
    # module).
    env_dir = tmp_path / "venv"
    python = fresh_venv(env_dir)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_A2A_") and k != "PYTHONPATH"}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--no-build-isolation", str(wheel)],
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
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, "no run path from the build machine"
    assert "libtvm_ffi.so" not in dynamic, "bound to the libtvm_ffi.so that import tvm_ffi loaded"
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
