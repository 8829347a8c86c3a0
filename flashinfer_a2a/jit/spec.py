"""JitSpec: what one shared library is built from, where it lives, and how it is loaded."""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tvm_ffi

from .. import config
from . import ninja_build, toolchain

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class JitSpec:
    """One tvm-ffi library: ``sources`` (absolute paths) compiled by nvcc and linked into ``<name>.so``.

    ``extra_include_dirs`` are searched before the package's own include dirs; ``extra_cuda_cflags`` and
    ``extra_ldflags`` are appended to the shared flags of :mod:`flashinfer_a2a.jit.toolchain`.
    """

    name: str
    sources: tuple[Path, ...]
    extra_include_dirs: tuple[Path, ...] = field(default=())
    extra_cuda_cflags: tuple[str, ...] = field(default=())
    extra_ldflags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # The name is a file name and a ninja variable prefix: keep it to identifier characters.
        if not _NAME_RE.match(self.name):
            raise ValueError(f"JitSpec name {self.name!r}: expected letters, digits and '_'")
        sources = tuple(Path(s) for s in self.sources)
        if not sources or not all(s.is_absolute() for s in sources):
            raise ValueError(f"JitSpec {self.name}: sources must be a non-empty list of absolute paths, got {sources}")
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "extra_include_dirs", tuple(Path(d) for d in self.extra_include_dirs))
        object.__setattr__(self, "extra_cuda_cflags", tuple(self.extra_cuda_cflags))
        object.__setattr__(self, "extra_ldflags", tuple(self.extra_ldflags))

    @property
    def build_dir(self) -> Path:
        """``cache_dir()/<name>``: objects, build.ninja, the lock and the JIT library."""
        return config.cache_dir() / self.name

    @property
    def jit_library_path(self) -> Path:
        """``build_dir/<name>.so``: what a JIT build produces."""
        return self.build_dir / f"{self.name}.so"

    @property
    def aot_library_path(self) -> Path:
        """``aot_dir()/<name>/<name>.so``: a prebuilt library, loaded in preference to JIT when it exists."""
        return config.aot_dir() / self.name / f"{self.name}.so"

    def ninja_target(self, obj_dir: Path, library: Path, archs: list[str]) -> ninja_build.NinjaTarget:
        """This library as one target of a build.ninja (aot.py puts every spec's target in one file)."""
        return ninja_build.NinjaTarget(
            name=self.name,
            sources=self.sources,
            obj_dir=obj_dir,
            library=library,
            cflags=tuple(toolchain.cuda_cflags(archs, list(self.extra_include_dirs), list(self.extra_cuda_cflags))),
            source_cflags=tuple(tuple(toolchain.source_cflags(s)) for s in self.sources),
            ldflags=tuple(toolchain.ldflags(list(self.extra_ldflags))),
        )

    def write_ninja(self) -> bool:
        """Write ``build_dir/build.ninja`` for :func:`~flashinfer_a2a.config.cuda_arch_list`; True if it changed."""
        target = self.ninja_target(self.build_dir, self.jit_library_path, config.cuda_arch_list())
        return ninja_build.write_if_changed(self.build_dir / "build.ninja", ninja_build.render([target]))

    def needs_build(self) -> bool:
        """Whether :meth:`build` would compile or link anything now (ninja's dry run; writes build.ninja)."""
        with ninja_build.file_lock(self.build_dir / ".lock"):
            self.write_ninja()
            return ninja_build.has_work(self.build_dir)

    def build(self) -> bool:
        """Bring the JIT library up to date; True if anything was compiled or linked.

        Holds a file lock in the build dir, so when several processes ask for the same library at once one
        compiles and the others find it built.
        """
        build_dir = self.build_dir

        def waiting() -> None:
            # One rank compiles while the others of a job wait here; without this line they would stall unexplained.
            _say(f"flashinfer_a2a: waiting for another process to finish building {self.name} in {build_dir}")

        with ninja_build.file_lock(build_dir / ".lock", on_wait=waiting):
            self.write_ninja()
            # Asked under the lock, so a process that waited while another compiled says nothing.
            if not ninja_build.has_work(build_dir):
                return False
            archs = " ".join(config.cuda_arch_list())
            # stderr, not logging: with no handler configured (the usual case) an INFO record is dropped, and a
            # first call that stalls for a minute with no word is what this line is for.
            _say(f"flashinfer_a2a: compiling {self.name} for {archs} in {build_dir} (once; later runs reuse it)")
            start = time.monotonic()
            ran = ninja_build.run(build_dir, config.max_jobs(), config.jit_verbose())
            _say(f"flashinfer_a2a: built {self.name} in {time.monotonic() - start:.1f} s")
        return ran

    def load(self) -> tvm_ffi.Module:
        """The AOT library if there is one, else the JIT library (built first if needed)."""
        aot = self.aot_library_path
        if aot.is_file():
            return tvm_ffi.load_module(str(aot))
        if config.disable_jit():
            raise RuntimeError(
                f"FLASHINFER_A2A_DISABLE_JIT is set and there is no prebuilt {self.name} at {aot}. Build it with "
                f"`python aot.py --out-dir {aot.parent.parent}` (from a flashinfer_a2a checkout, on a machine with "
                "nvcc), point FLASHINFER_A2A_AOT_DIR at a directory that has it, or unset FLASHINFER_A2A_DISABLE_JIT."
            )
        self.build()
        return tvm_ffi.load_module(str(self.jit_library_path))
