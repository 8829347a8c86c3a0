"""Every setting flashinfer_a2a takes from the environment, in one place.

This is the only module of the package that reads environment variables. Each function reads its variable when it
is called, never at import, so a launcher or a test can change the environment after ``import flashinfer_a2a``.
:data:`ENV_VARS` lists every variable with its default; README.md and docs/environment.md carry the same table
(``tests/test_docs.py`` keeps them equal to :func:`env_table_markdown`). A malformed value raises
:class:`ValueError` naming the variable.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple, Optional

from ._version import __version__


class EnvVar(NamedTuple):
    """One environment variable: its name, its default (as shown in the docs) and what it does."""

    name: str
    default: str
    meaning: str


#: Every variable the package reads, in the order the docs list them.
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "FLASHINFER_A2A_CUDA_ARCH_LIST",
        "the visible GPUs' (`9.0a` for Hopper, `10.0a` for Blackwell)",
        "CUDA architectures to compile for, space or comma separated, e.g. `9.0a 10.0a`",
    ),
    EnvVar(
        "FLASHINFER_A2A_CACHE_DIR",
        "`~/.cache/flashinfer_a2a`",
        "root of the JIT cache; `<version>/<archs>/` is always appended",
    ),
    EnvVar(
        "FLASHINFER_A2A_AOT_DIR",
        "the package's `_aot/`",
        "where prebuilt libraries are looked up (as `<name>/<name>.so`) before JIT",
    ),
    EnvVar("FLASHINFER_A2A_DISABLE_JIT", "`0`", "never compile: a missing AOT library is an error"),
    EnvVar("FLASHINFER_A2A_JIT_VERBOSE", "`0`", "print ninja's full command lines and compiler output"),
    EnvVar("FLASHINFER_A2A_TIMEOUT_S", "`10.0`", "seconds any device spin-wait may last before it records a timeout"),
    EnvVar("FLASHINFER_A2A_DEBUG", "`0`", "check the device error record after every op (slow; for debugging)"),
    EnvVar("MAX_JOBS", "the CPU count", "parallel compile jobs (`ninja -j`)"),
    EnvVar(
        "CUDA_HOME",
        "`CUDA_PATH`, else the toolkit of `nvcc` on PATH, else `/usr/local/cuda`",
        "CUDA toolkit used by the JIT and `aot.py`",
    ),
    EnvVar("CXX", "`c++`", "host compiler that links the libraries"),
)

#: The package's ``_aot/``: where ``python aot.py`` writes by default, so a wheel built afterwards ships the
#: libraries, and where they are looked up unless ``FLASHINFER_A2A_AOT_DIR`` says otherwise.
PACKAGE_AOT_DIR = Path(__file__).resolve().parent / "_aot"


def env_table_markdown() -> str:
    """The Markdown table of :data:`ENV_VARS`, as README.md and docs/environment.md show it."""
    rows = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in ENV_VARS]
    return "\n".join(rows) + "\n"


#: What torchrun and mpirun set for each process: read (by the benchmark) to join the launched processes. They
#: belong to the launchers, not to this package, so they are not in :data:`ENV_VARS`.
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID")


def launcher_environment() -> dict[str, str]:
    """The :data:`LAUNCHER_VARS` that are set in this process."""
    return {name: os.environ[name] for name in LAUNCHER_VARS if name in os.environ}


def _get(name: str) -> str:
    # An empty value counts as unset: `FOO= cmd` is the usual way to clear a variable for one command.
    return os.environ.get(name, "").strip()


def _flag(name: str) -> bool:
    raw = _get(name).lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


# `9.0a`, `10.0a`, `12.0`, and the family-specific `10.0f` of CUDA 12.9+.
_ARCH_RE = re.compile(r"^(\d+)\.(\d)([af]?)$")
MIN_ARCH_MAJOR = 9  # Hopper: the oldest architecture the kernels are written for


def _arch_key(arch: str) -> tuple[int, int, str]:
    m = _ARCH_RE.match(arch)
    assert m is not None
    return int(m[1]), int(m[2]), m[3]


def parse_arch_list(text: str, source: str = "FLASHINFER_A2A_CUDA_ARCH_LIST") -> list[str]:
    """Parse ``"9.0a 10.0a"`` (space or comma separated) into a sorted list without duplicates.

    Sorting makes ``"10.0a 9.0a"`` and ``"9.0a 10.0a"`` the same build: same flags, same cache directory.
    ``source`` names the setting in the error message.
    """
    entries = [e for e in re.split(r"[\s,]+", text.strip()) if e]
    if not entries:
        raise ValueError(f"{source}={text!r}: expected CUDA architectures such as '9.0a 10.0a'")
    for entry in entries:
        if not _ARCH_RE.match(entry):
            raise ValueError(f"{source}: {entry!r} is not a CUDA architecture like '9.0a', '10.0a' or '9.0'")
    too_old = [e for e in entries if _arch_key(e)[0] < MIN_ARCH_MAJOR]
    if too_old:
        raise ValueError(f"{source}: {', '.join(too_old)} is older than sm_90: flashinfer_a2a's kernels need Hopper "
                         "(9.0a) or newer (they use sm_90 instructions and system-scope acquire/release)")
    return sorted(set(entries), key=_arch_key)


def _arch_of_capability(major: int, minor: int) -> str:
    # Hopper and Blackwell kernels use arch-specific instructions (wgmma, TMA multicast, tcgen05) that exist only
    # in the `a` targets; a JIT build for the GPUs in this box loses nothing by being that specific.
    return f"{major}.{minor}" + ("a" if major in (9, 10) else "")


def cuda_arch_list() -> list[str]:
    """``FLASHINFER_A2A_CUDA_ARCH_LIST``, else the architectures of the visible GPUs, sorted."""
    raw = _get("FLASHINFER_A2A_CUDA_ARCH_LIST")
    if raw:
        return parse_arch_list(raw)
    # torch is imported here, not at the top: the docs build and aot.py import this module with no GPU in sight.
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise RuntimeError(
            "no CUDA GPU is visible to take the architecture from: set FLASHINFER_A2A_CUDA_ARCH_LIST, "
            "e.g. FLASHINFER_A2A_CUDA_ARCH_LIST='9.0a 10.0a'"
        )
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    old = sorted({f"{major}.{minor}" for major, minor in caps if major < MIN_ARCH_MAJOR})
    if old:
        raise RuntimeError(f"the visible GPUs include compute capability {', '.join(old)}: flashinfer_a2a needs "
                           "sm_90 (Hopper) or newer; hide the older GPUs (CUDA_VISIBLE_DEVICES) or set "
                           "FLASHINFER_A2A_CUDA_ARCH_LIST for the GPUs that will run it")
    return sorted({_arch_of_capability(*cap) for cap in caps}, key=_arch_key)


def cache_dir() -> Path:
    """JIT build root: ``<FLASHINFER_A2A_CACHE_DIR or ~/.cache/flashinfer_a2a>/<version>/<archs>``.

    The version and the sorted arch list are appended even to a user-given root, so one root can be shared by
    several versions and GPU kinds without one build overwriting another.
    """
    raw = _get("FLASHINFER_A2A_CACHE_DIR")
    root = Path(raw).expanduser() if raw else Path.home() / ".cache" / "flashinfer_a2a"
    return (root / __version__ / "_".join(cuda_arch_list())).absolute()


def aot_dir() -> Path:
    """Where prebuilt libraries are looked up: ``FLASHINFER_A2A_AOT_DIR``, else the package's ``_aot/``."""
    raw = _get("FLASHINFER_A2A_AOT_DIR")
    return Path(raw).expanduser().absolute() if raw else PACKAGE_AOT_DIR


def disable_jit() -> bool:
    """``FLASHINFER_A2A_DISABLE_JIT``: never compile; only AOT libraries load."""
    return _flag("FLASHINFER_A2A_DISABLE_JIT")


def jit_verbose() -> bool:
    """``FLASHINFER_A2A_JIT_VERBOSE``: show ninja's command lines and the compiler output."""
    return _flag("FLASHINFER_A2A_JIT_VERBOSE")


def debug() -> bool:
    """``FLASHINFER_A2A_DEBUG``: check the device error record after every op."""
    return _flag("FLASHINFER_A2A_DEBUG")


def timeout_s() -> float:
    """``FLASHINFER_A2A_TIMEOUT_S`` (default 10.0): the bound on every device spin-wait, in seconds."""
    raw = _get("FLASHINFER_A2A_TIMEOUT_S")
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"FLASHINFER_A2A_TIMEOUT_S={raw!r}: expected a positive number of seconds")
    return value


def max_jobs() -> int:
    """``MAX_JOBS`` (default: the CPU count): parallel compile jobs."""
    raw = _get("MAX_JOBS")
    if not raw:
        return os.cpu_count() or 1
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"MAX_JOBS={raw!r}: expected a positive integer")
    return value


def cuda_home() -> Path:
    """The CUDA toolkit: ``CUDA_HOME``, ``CUDA_PATH``, the toolkit of ``nvcc`` on PATH, else ``/usr/local/cuda``.

    A set ``CUDA_HOME`` is taken as given, even if wrong, so that the error about a missing nvcc names it.
    """
    raw = _get("CUDA_HOME") or _get("CUDA_PATH")
    if raw:
        return Path(raw).expanduser().absolute()
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        # A wrapper script on PATH (say /usr/local/bin/nvcc exec'ing the real one) has no toolkit beside it.
        if (root / "include" / "cuda_runtime.h").is_file():
            return root
    return Path("/usr/local/cuda")


def cxx() -> str:
    """``CXX`` (default ``c++``): the host compiler that links the libraries; may carry arguments."""
    return _get("CXX") or "c++"


def timeout_or_default(seconds: Optional[float]) -> float:
    """``seconds`` as a float, or ``FLASHINFER_A2A_TIMEOUT_S`` when None."""
    return timeout_s() if seconds is None else float(seconds)
