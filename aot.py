"""Build every flashinfer_a2a library ahead of time, in one ninja run.

    python aot.py [--cuda-arch-list "9.0a 10.0a"] [--out-dir DIR] [--build-dir DIR]

writes DIR/<name>/<name>.so for every spec of flashinfer_a2a.jit.all_specs(). The default DIR is the package's
_aot/, so `python -m build --wheel` afterwards yields a wheel whose libraries load without nvcc. At run time a library
under FLASHINFER_A2A_AOT_DIR (default: that same _aot/) is loaded before any JIT build is tried.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flashinfer_a2a import config
from flashinfer_a2a.jit import all_specs, ninja_build

_ROOT = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda-arch-list", default="9.0a 10.0a", help="space or comma separated (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=config.PACKAGE_AOT_DIR, help="default: %(default)s")
    # Objects stay out of the out-dir, which a wheel ships; build/ is git-ignored.
    parser.add_argument("--build-dir", type=Path, default=_ROOT / "build" / "aot", help="default: %(default)s")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every command line")
    args = parser.parse_args(argv)

    try:
        archs = config.parse_arch_list(args.cuda_arch_list, source="--cuda-arch-list")
    except ValueError as e:
        parser.error(str(e))
    out_dir, build_dir = args.out_dir.absolute(), args.build_dir.absolute()
    targets = [
        spec.ninja_target(build_dir / spec.name, out_dir / spec.name / f"{spec.name}.so", archs)
        for spec in all_specs()
    ]
    start = time.monotonic()
    with ninja_build.file_lock(build_dir / ".lock"):
        ninja_build.write_if_changed(build_dir / "build.ninja", ninja_build.render(targets))
        if ninja_build.has_work(build_dir):
            # Said before nvcc starts: the two default architectures take minutes on a small machine.
            print(f"compiling {', '.join(t.name for t in targets)} for {' '.join(archs)} into {out_dir} "
                  f"(objects in {build_dir})", flush=True)
            ninja_build.run(build_dir, config.max_jobs(), args.verbose or config.jit_verbose())
            state = f"built in {time.monotonic() - start:.1f} s"
        else:
            state = "up to date"
    for t in targets:
        print(f"{t.library} ({' '.join(archs)}): {state}", flush=True)
    if out_dir == config.PACKAGE_AOT_DIR:
        # An AOT library wins over JIT, so in a checkout an edited .cu is not recompiled while these exist.
        print(f"note: this checkout now loads these libraries, not JIT builds; `rm -r {out_dir}` to go back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
