"""build.ninja rendering, writing, locking and running, without nvcc (commands here are plain shell)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashinfer_a2a.jit import ninja_build


def target(tmp_path: Path, sources: list[str], name: str = "demo") -> ninja_build.NinjaTarget:
    return ninja_build.NinjaTarget(
        name=name,
        sources=tuple(tmp_path / s for s in sources),
        obj_dir=tmp_path / "obj dir",
        library=tmp_path / "lib" / f"{name}.so",
        cflags=("-O3", "-DX=$HOME"),
        ldflags=("-Wl,-rpath,$ORIGIN/lib",),
    )


def test_render_one_object_per_source_with_depfiles(tmp_path):
    text = ninja_build.render([target(tmp_path, ["a.cu", "b.cu"]), target(tmp_path, ["c.cu"], name="other")])
    assert "--generate-dependencies-with-compile --dependency-output $out.d" in text
    assert "depfile = $out.d" in text and "deps = gcc" in text
    obj_dir = str(tmp_path / "obj$ dir")
    for stem in ("a", "b", "c"):
        assert f"build {obj_dir}/{stem}.o: nvcc {tmp_path}/{stem}.cu" in text
    assert f"build {tmp_path}/lib/demo.so: link {obj_dir}/a.o {obj_dir}/b.o" in text
    assert "  cflags = $other_cflags" in text
    # `$` in a flag reaches the shell literally, inside single quotes.
    assert "'-DX=$$HOME'" in text and "'-Wl,-rpath,$$ORIGIN/lib'" in text


def test_render_gives_each_source_its_own_flags(tmp_path):
    t = target(tmp_path, ["a.cu", "b.cu"])
    t = ninja_build.NinjaTarget(**{**t.__dict__, "source_cflags": (("-DA=1",), ())})
    text = ninja_build.render([t])
    assert "$cflags $srcflags -c $in" in text
    a, b = text.split(f"build {tmp_path}/obj$ dir/a.o")[1], text.split(f"build {tmp_path}/obj$ dir/b.o")[1]
    assert a.splitlines()[1:3] == ["  cflags = $demo_cflags", "  srcflags = -DA=1"]
    assert "srcflags" not in b.split("build ")[0], "a source without flags of its own gets no srcflags line"


def test_sources_sharing_a_stem_are_refused(tmp_path):
    with pytest.raises(ValueError, match="stem"):
        target(tmp_path, ["x/a.cu", "y/a.cu"]).objects()


def test_write_if_changed(tmp_path):
    path = tmp_path / "sub" / "build.ninja"
    assert ninja_build.write_if_changed(path, "one\n") is True
    mtime = path.stat().st_mtime_ns
    assert ninja_build.write_if_changed(path, "one\n") is False
    assert path.stat().st_mtime_ns == mtime
    assert ninja_build.write_if_changed(path, "two\n") is True
    assert path.read_text() == "two\n"
    assert [p.name for p in path.parent.iterdir()] == ["build.ninja"]


def _other_process_can_lock(path: Path) -> bool:
    code = (
        "import fcntl, sys\n"
        f"f = open({str(path)!r}, 'a')\n"
        "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(1)\n"
    )
    return subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_file_lock_excludes_other_processes(tmp_path):
    lock = tmp_path / "dir" / ".lock"
    with ninja_build.file_lock(lock):
        assert not _other_process_can_lock(lock)
    assert _other_process_can_lock(lock)


def test_file_lock_says_when_it_waits_for_another_process(tmp_path, monkeypatch):
    lock = tmp_path / ".lock"
    lock.touch()
    # Another process holds the lock for a second, as a rank compiling the library holds it for minutes.
    code = ("import fcntl, sys, time\n"
            f"f = open({str(lock)!r}, 'a')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(1.0)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    monkeypatch.setattr(ninja_build, "QUIET_WAIT_S", 0.2)
    waits = []
    start = time.monotonic()
    with ninja_build.file_lock(lock, on_wait=lambda: waits.append(1)):
        assert time.monotonic() - start > 0.5, "the lock was taken only once the holder let go"
    assert waits == [1]
    holder.wait()
    # A free lock, or one freed within QUIET_WAIT_S (a process that found the library built), says nothing.
    with ninja_build.file_lock(lock, on_wait=lambda: waits.append(1)):
        pass
    assert waits == [1]


def test_run_reports_whether_ninja_had_work(tmp_path):
    (tmp_path / "build.ninja").write_text("rule touch\n  command = touch $out\nbuild out.txt: touch\n")
    assert ninja_build.run(tmp_path, jobs=1, verbose=False) is True
    assert ninja_build.run(tmp_path, jobs=1, verbose=False) is False


def test_run_failure_shows_the_output(tmp_path):
    (tmp_path / "build.ninja").write_text("rule fail\n  command = echo broken-step >&2; false\nbuild out.txt: fail\n")
    with pytest.raises(RuntimeError, match="broken-step"):
        ninja_build.run(tmp_path, jobs=1, verbose=False)

