"""Sources, include dirs and flags shared by every module."""

from __future__ import annotations

from pathlib import Path

import pytest
import tvm_ffi.libinfo

from flashinfer_a2a.jit import toolchain
from .jit_testing import REPO


def test_checkout_sources_win_over_the_packaged_copy():
    assert toolchain.source_root() == REPO
    assert toolchain.csrc_dir() == REPO / "csrc"
    assert (toolchain.include_dir() / "flashinfer_a2a" / "workspace_layout.cuh").is_file()


def test_gencode_per_arch():
    assert toolchain.gencode_flags(["9.0a", "10.0a", "12.0"]) == [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100a,code=sm_100a",
        "-gencode=arch=compute_120,code=sm_120",
    ]


def test_cuda_cflags(tmp_path):
    flags = toolchain.cuda_cflags(["9.0a", "10.0a"], [tmp_path], ["-DEXTRA"])
    for flag in ("-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG", "--threads=2", "-DEXTRA"):
        assert flag in flags
    assert flags[flags.index("-Xcompiler") + 1] == "-fPIC"
    includes = [Path(f[2:]) for f in flags if f.startswith("-I")]
    # Extra dirs first (they may shadow package headers), then the package's, tvm-ffi's and CUTLASS's, once each.
    assert includes[:3] == [tmp_path, REPO / "include", REPO / "csrc"]
    assert Path(tvm_ffi.libinfo.find_include_path()) in includes
    assert Path(tvm_ffi.libinfo.find_dlpack_include_path()) in includes
    assert includes[-1] == toolchain.cutlass_include_dir()
    assert len(includes) == len(set(includes))


def test_each_source_names_itself_by_its_mapped_path(tmp_path):
    # cudafe++ hashes this name into the internal symbol names, so it must not hold where the checkout lies.
    assert toolchain.source_cflags(REPO / "csrc" / "combine.cu") == ["-Xcudafe", "--orig_src_path_name=csrc/combine.cu"]
    assert toolchain.mapped_path(tmp_path / "x.cu") == str(tmp_path / "x.cu"), "outside every mapped tree: as is"


def test_cutlass_headers_are_found():
    assert (toolchain.cutlass_include_dir() / "cutlass" / "cutlass.h").is_file()


def test_ldflags_link_cudart_statically_and_name_no_tvm_ffi_library():
    flags = toolchain.ldflags(["-lextra"])
    assert "-lcudart_static" in flags and "-lcudart" not in flags
    # libtvm_ffi.so is bound at load time (tvm_ffi loads it RTLD_GLOBAL first): no DT_NEEDED entry that auditwheel
    # would take for a library outside the manylinux policy, and no run path of the build machine.
    assert not [f for f in flags if "tvm_ffi" in f or "rpath" in f]
    assert "-Wl,--discard-all" in flags, "nvcc's temporary file names stay out of the library"
    assert flags[-1] == "-lextra"


def test_cflags_map_every_source_tree_to_a_relative_name():
    flags = toolchain.cuda_cflags(["9.0a"], [], [])
    maps = [f.split("=", 2)[2] for f in flags if f.startswith("-Xcompiler=-ffile-prefix-map=")]
    pairs = dict(m.rsplit("=", 1) for m in maps)
    assert pairs[f"{REPO}/"] == ""
    assert pairs[f"{Path(tvm_ffi.libinfo.find_include_path()).parents[1]}/"] == ""
    assert pairs[f"{toolchain.cutlass_include_dir().parents[2]}/"] == ""
    assert pairs[f"{toolchain.config.cuda_home()}/"] == "cuda/"
    # The last matching option wins in GCC and clang: a longer directory (a wheel's _data/ inside site-packages)
    # must come after the shorter one that contains it.
    assert [len(m.rsplit("=", 1)[0]) for m in maps] == sorted(len(m.rsplit("=", 1)[0]) for m in maps)


def test_missing_nvcc_says_how_to_point_at_one(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="CUDA_HOME.*PATH"):
        toolchain.nvcc()


def test_ninja_is_found():
    assert Path(toolchain.ninja()).is_file()
