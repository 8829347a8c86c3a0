"""Where the sources, headers and tools are, and the compile and link flags every module shares."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import tvm_ffi.libinfo

from .. import config

_PACKAGE_DIR = Path(__file__).resolve().parents[1]

#: What a user without the JIT's build tools is told to run: the ``jit`` extra carries ninja and nvidia-cutlass, which
#: a wheel with prebuilt libraries does not need (about 250 MB with what they pull in).
JIT_EXTRA_INSTALL = "pip install 'flashinfer_a2a[jit]'"


def _missing_jit_tool(what: str) -> RuntimeError:
    return RuntimeError(
        f"compiling flashinfer_a2a's CUDA library needs {what}, which is not installed: {JIT_EXTRA_INSTALL} "
        "(or use prebuilt libraries: a wheel built after `python aot.py`, or FLASHINFER_A2A_AOT_DIR)"
    )


def source_root() -> Path:
    """The directory holding ``csrc/`` and ``include/``.

    A checkout (editable install, or the repo on PYTHONPATH) has them beside the package, and they win so that an
    edit to a .cu file is what the next JIT build compiles; an installed wheel carries a copy in ``_data/``.
    """
    checkout = _PACKAGE_DIR.parent
    if (checkout / "csrc").is_dir() and (checkout / "include" / "flashinfer_a2a").is_dir():
        return checkout
    return _PACKAGE_DIR / "_data"


def csrc_dir() -> Path:
    return source_root() / "csrc"


def include_dir() -> Path:
    return source_root() / "include"


def cutlass_include_dir() -> Path:
    # Found without importing cutlass_library: importing it pulls in its Python generator, which we do not use.
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise _missing_jit_tool("the CUTLASS headers (package nvidia-cutlass)")
    return Path(next(iter(spec.submodule_search_locations))) / "source" / "include"


def tvm_ffi_lib_dir() -> Path:
    return Path(tvm_ffi.libinfo.find_libtvm_ffi()).resolve().parent


def default_include_dirs() -> list[Path]:
    return [
        include_dir(),
        csrc_dir(),
        Path(tvm_ffi.libinfo.find_include_path()),
        Path(tvm_ffi.libinfo.find_dlpack_include_path()),
        cutlass_include_dir(),
    ]


def nvcc() -> Path:
    """The nvcc of :func:`flashinfer_a2a.config.cuda_home`, or a RuntimeError saying how to point at one."""
    path = config.cuda_home() / "bin" / "nvcc"
    if not path.is_file():
        raise RuntimeError(
            f"nvcc not found at {path}: set CUDA_HOME to the CUDA toolkit root (the directory holding bin/nvcc), "
            "or put nvcc on PATH; without a toolkit, use prebuilt libraries (FLASHINFER_A2A_AOT_DIR)"
        )
    return path


def ninja() -> str:
    """The ninja binary: on PATH, else the one the ``ninja`` package installs next to the interpreter."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja as ninja_package
    except ImportError:
        raise _missing_jit_tool("ninja (package ninja)") from None
    return str(Path(ninja_package.BIN_DIR) / "ninja")


def gencode_flags(archs: list[str]) -> list[str]:
    """``9.0a`` -> ``-gencode=arch=compute_90a,code=sm_90a``: SASS only, since `a` targets have no forward PTX."""
    flags = []
    for arch in archs:
        sm = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{sm},code=sm_{sm}")
    return flags


def cuda_cflags(archs: list[str], extra_include_dirs: list[Path], extra_cflags: list[str]) -> list[str]:
    """nvcc flags for one translation unit. Extra include dirs come first so a spec can shadow package headers."""
    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-DNDEBUG"]
    # nvcc runs the per-arch device compiles of one .cu in parallel; with few .cu files this is where the
    # parallelism is.
    flags.append(f"--threads={len(archs)}")
    flags += gencode_flags(archs)
    # dict.fromkeys: drop repeats (tvm-ffi ships dlpack in its own include dir) and keep the search order.
    flags += [f"-I{d}" for d in dict.fromkeys([*extra_include_dirs, *default_include_dirs()])]
    flags += extra_cflags
    return flags


def ldflags(extra_ldflags: list[str]) -> list[str]:
    tvm_lib = tvm_ffi_lib_dir()
    return [
        # A source missing from a spec fails here, naming the symbol, rather than later at dlopen.
        "-Wl,--no-undefined",
        f"-L{tvm_lib}",
        "-ltvm_ffi",
        f"-L{config.cuda_home() / 'lib64'}",
        # Static cudart: the library then loads on a GPU box whatever libcudart (or none) is installed there.
        "-lcudart_static",
        "-ldl",
        "-lrt",
        "-lpthread",
        # No absolute run path: a wheel must not carry the build machine's paths. None is needed in-process either:
        # the libraries are only loaded by tvm_ffi.load_module, after `import tvm_ffi` loaded libtvm_ffi.so, and
        # the dynamic loader matches our DT_NEEDED entry to that already loaded SONAME. The relative entry lets
        # `ldd` of a library installed from a wheel (site-packages/flashinfer_a2a/_aot/<name>/<name>.so) find
        # site-packages/tvm_ffi/lib wherever the environment lives.
        "-Wl,-rpath,$ORIGIN/../../../tvm_ffi/lib",
        *extra_ldflags,
    ]
