"""Only job: tag a wheel that carries AOT libraries (flashinfer_a2a/_aot/) for the platform those libraries need.

Everything else is in pyproject.toml. The libraries are machine code but call no Python C API (tvm-ffi's C ABI), so
such a wheel is `py3-none-manylinux_2_<N>_<arch>`, where 2.<N> is the newest glibc symbol version the libraries
import (PEP 600: the wheel then installs on any Linux with that glibc or newer). Built on glibc 2.34 or newer that
is 2.34: pthread and dl functions moved into libc there and the static CUDA runtime uses them. Their other
dependencies are libstdc++ and libgcc_s, within the manylinux policy; the tvm-ffi symbols bind at load time to the
libtvm_ffi.so that `import tvm_ffi` loaded (no DT_NEEDED entry, so `auditwheel show` agrees with the tag), the CUDA
runtime is linked statically and the driver is loaded at run time. A wheel without libraries stays `py3-none-any`.
"""

import os
import struct
from pathlib import Path

from setuptools import Distribution, setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 kept it in `wheel`; an offline --no-build-isolation install may meet one
    from wheel.bdist_wheel import bdist_wheel

_AOT_DIR = Path(__file__).resolve().parent / "flashinfer_a2a" / "_aot"

# PEP 600's floor: manylinux_2_17 is manylinux2014, the oldest tag installers still take.
_MIN_GLIBC = (2, 17)
_SHT_GNU_VERNEED = 0x6FFFFFFE


def glibc_versions_needed(path: Path) -> set[tuple[int, int]]:
    """The GLIBC_x.y symbol versions a 64-bit little-endian ELF file requires (its .gnu.version_r section)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: expected a 64-bit little-endian ELF shared library")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    versions = set()
    for _, sh_type, _, _, offset, _, link, count, _, _ in sections:
        if sh_type != _SHT_GNU_VERNEED:
            continue
        strtab = sections[link][4]
        entry = offset
        for _ in range(count):  # Elf64_Verneed: version, cnt, file, aux, next
            _, aux_count, _, aux, next_entry = struct.unpack_from("<HHIII", data, entry)
            item = entry + aux
            for _ in range(aux_count):  # Elf64_Vernaux: hash, flags, other, name, next
                _, _, _, name, next_item = struct.unpack_from("<IHHII", data, item)
                text = data[strtab + name : data.index(b"\0", strtab + name)].decode()
                if text.startswith("GLIBC_") and text[6:].replace(".", "").isdigit():
                    major, minor = text[6:].split(".")[:2]
                    versions.add((int(major), int(minor)))
                item += next_item
            entry += next_entry
    return versions


def manylinux_platform(plat: str, libraries: list[Path]) -> str:
    """``linux_x86_64`` -> ``manylinux_2_<N>_x86_64`` for the newest glibc version ``libraries`` need."""
    if not plat.startswith("linux_"):
        return plat
    glibc = max([_MIN_GLIBC, *(v for lib in libraries for v in glibc_versions_needed(lib))])
    return f"manylinux_{glibc[0]}_{glibc[1]}_{plat[len('linux_'):]}"


class AotDistribution(Distribution):
    # Read by bdist_wheel (pure or not) and by build/install (purelib or platlib layout).
    def has_ext_modules(self):
        return any(_AOT_DIR.glob("*/*.so"))


class BdistWheel(bdist_wheel):
    def run(self):
        # Reproducible bytes: every zip entry gets this time instead of a file's mtime or, for the generated
        # metadata, the clock. 1980-01-01, the earliest a zip can hold, unless the builder sets its own.
        os.environ.setdefault("SOURCE_DATE_EPOCH", "315532800")
        super().run()

    def get_tag(self):
        python, abi, plat = super().get_tag()
        if not self.root_is_pure:
            python, abi = "py3", "none"
            plat = manylinux_platform(plat, sorted(_AOT_DIR.glob("*/*.so")))
        return python, abi, plat


setup(distclass=AotDistribution, cmdclass={"bdist_wheel": BdistWheel})
