"""Where the sources, headers and tools are, and the compile and link flags every module shares."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import tvm_ffi.libinfo

from .. import config

_PACKAGE_DIR = Path(__file__).resolve().parents[1]

#: What a user without the JIT's build tools is told to run. It names the packages of the ``jit`` extra rather than
#: the extra itself: ``pip install 'flashinfer_a2a[jit]'`` only works where an index serves flashinfer_a2a, and this
#: command works alike for a checkout, an installed wheel and any other install. A wheel with prebuilt libraries
#: needs neither package (about 250 MB with what they pull in).
JIT_TOOLS_INSTALL = "pip install ninja nvidia-cutlass"


def _missing_jit_tool(what: str) -> RuntimeError:
    return RuntimeError(
        f"compiling flashinfer_a2a's CUDA library needs {what}, which is not installed: {JIT_TOOLS_INSTALL} "
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
    flags += [f"-Xcompiler=-ffile-prefix-map={old}={new}" for old, new in file_prefix_map()]
    flags += extra_cflags
    return flags


def source_cflags(source: Path) -> list[str]:
    """nvcc flags of one source: the name cudafe++ derives the module's internal symbol names from.

    nvcc names what has internal linkage in a .cu file ``_INTERNAL_<hash>_..._<file>_...``, the hash taken from the
    source's path, and those names reach the library's symbol tables and its device code. The mapped name
    (``csrc/combine.cu``) makes them, and so the library, the same wherever the checkout lies.
    """
    return ["-Xcudafe", f"--orig_src_path_name={mapped_path(source)}"]


def mapped_path(path: Path) -> str:
    """``path`` as :func:`file_prefix_map` rewrites it (the last matching entry wins, as in the compilers)."""
    text = str(path)
    for old, new in reversed(file_prefix_map()):
        if text.startswith(old):
            return new + text[len(old):]
    return text


def file_prefix_map() -> list[tuple[str, str]]:
    """(directory + "/", what it becomes) for every tree the sources and headers come from.

    ``__FILE__`` in our error checks and in tvm-ffi's headers would otherwise put the build machine's paths into the
    library (14 of them, e.g. /home/<user>/flashinfer_a2a/csrc/combine.cu): a wheel built in another directory would
    differ in those bytes, and it would show where it was built. Mapped, they read ``csrc/combine.cu`` and
    ``tvm_ffi/include/tvm/ffi/any.h``. GCC and clang try the last matching option first, so the longest directory
    (the checkout may sit inside site-packages, as an installed wheel's ``_data/`` does) comes last.
    """
    trees = [(Path(tvm_ffi.__file__).parent.parent, ""), (config.cuda_home(), "cuda/"), (source_root(), "")]
    cutlass = importlib.util.find_spec("cutlass_library")
    if cutlass is not None and cutlass.submodule_search_locations:
        trees.append((Path(next(iter(cutlass.submodule_search_locations))).parent, ""))
    # Both spellings: a header's path is the include dir's as given, which may run through a symlink.
    pairs = {f"{path}/": new for tree, new in trees for path in (tree.absolute(), tree.resolve())}
    return sorted(pairs.items(), key=lambda pair: len(pair[0]))


def ldflags(extra_ldflags: list[str]) -> list[str]:
    return [
        # No DT_NEEDED entry for libtvm_ffi.so and no run path: the libraries are only loaded by
        # tvm_ffi.load_module, after `import tvm_ffi` loaded libtvm_ffi.so with RTLD_GLOBAL, and their tvm-ffi symbols
        # bind to it (as a Python extension module's bind to the interpreter without linking libpython). A wheel then
        # names only glibc, libstdc++ and libgcc_s, all within the manylinux policy, so `auditwheel show` accepts it
        # as it is; with the entry auditwheel calls it linux_x86_64. The price is that the linker no longer reports
        # an undefined symbol (a source missing from a spec): tests/jit/test_modules.py checks that every undefined
        # symbol is libtvm_ffi's or versioned by a system library, and dlopen names any other.
        f"-L{config.cuda_home() / 'lib64'}",
        # Static cudart: the library then loads on a GPU box whatever libcudart (or none) is installed there.
        "-lcudart_static",
        "-ldl",
        "-lrt",
        "-lpthread",
        # Drop local symbols: nvcc names each object's static initializer after its temporary file, whose name holds
        # nvcc's process id, so two builds of one checkout would differ in those bytes.
        "-Wl,--discard-all",
        *extra_ldflags,
    ]
