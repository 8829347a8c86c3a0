"""Rank bodies for tests/test_comm.py and tests/test_fd_exchange.py, plus the launchers that run them.

Under torch.multiprocessing each rank joins a gloo group through a FileStore; under mpirun the module runs as a
script: ``mpirun -n 2 python -m tests.comm_workers fd_exchange`` (prints ``OK <check> rank <r>`` per rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

# Bounds every collective: a rank stuck in one raises instead of blocking the test until the runner's timeout.
COLLECTIVE_TIMEOUT = timedelta(seconds=20)


def spawn(check: str, world_size: int, tmp_path: Path, *, timeout_s: float = 120.0) -> None:
    """Runs ``CHECKS[check](rank, world_size, tmp_path)`` on ``world_size`` gloo ranks; re-raises a rank's error.

    Raises:
        TimeoutError: the ranks did not all finish within ``timeout_s`` (they are killed).
    """
    spawn_checks(__name__, check, world_size, tmp_path, timeout_s=timeout_s)


def spawn_checks(module: str, check: str, world_size: int, tmp_path: Path, *, timeout_s: float = 120.0,
                 destroy_group: bool = True) -> None:
    """Runs ``<module>.CHECKS[check](rank, world_size, tmp_path)`` on ``world_size`` spawned gloo ranks (a check
    module of tests/); ``destroy_group=False`` skips the process group's teardown, for checks that leave a peer
    gone."""
    launch(_entry, (world_size, str(tmp_path), module, check, destroy_group), world_size, check, timeout_s)


def launch(entry: Callable, args: tuple, world_size: int, what: str, timeout_s: float) -> None:
    """Runs ``entry(rank, *args)`` in ``world_size`` spawned processes; re-raises a rank's error, and kills them all
    and raises TimeoutError if they have not finished within ``timeout_s``."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(entry, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            raise TimeoutError(f"{what} on {world_size} ranks did not finish in {timeout_s} s")


def _entry(rank: int, world_size: int, tmp: str, module: str, check: str, destroy_group: bool) -> None:
    import importlib

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/filestore", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    importlib.import_module(module).CHECKS[check](rank, world_size, Path(tmp))
    if destroy_group:
        dist.destroy_process_group()
    # Skip interpreter finalization: there torch 2.13 (CPU, gloo) aborts a rank about 1 run in 10 with "terminate
    # called without an active exception" and no Python frame, after the check has passed. An error above still
    # propagates to spawn() as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def expect_raises(exc_type: type, match: str, fn: Callable, *args, **kwargs) -> BaseException:
    """Calls fn and returns the exception; fails unless it is ``exc_type`` and its message contains ``match``."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        assert match in str(exc), f"{match!r} not in {str(exc)!r}"
        return exc
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


def open_fds() -> int:
    """Number of descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))


# ----------------------------------------------------------------------------------------------- communicator


def check_collectives(rank: int, world_size: int, tmp: Path) -> None:
    """allgather/broadcast/barrier of the default group, including the errors every rank must see alike."""
    from flashinfer_a2a.comm import TorchDistributedCommunicator, as_communicator

    comm = as_communicator(None)
    assert isinstance(comm, TorchDistributedCommunicator)
    assert (comm.rank, comm.size) == (rank, world_size)

    # Lengths differ per rank (rank 0 sends nothing), so a padding or truncation bug shows.
    got = comm.allgather(b"r%d" % rank * rank)
    assert got == [b"r%d" % r * r for r in range(world_size)], got
    assert comm.allgather(bytearray(b"\x00\xff")) == [b"\x00\xff"] * world_size

    for root in range(world_size):
        # Non-roots pass data too: it must be ignored, not returned.
        data = f"root {root}".encode() if rank == root else b"ignored"
        assert comm.broadcast(data, root) == f"root {root}".encode()
    assert comm.broadcast(b"default" if rank == 0 else None) == b"default"

    # Ranks arrive late by different amounts; after the barrier every rank's marker must exist.
    time.sleep(0.3 * rank)
    (tmp / f"marker{rank}").touch()
    comm.barrier()
    assert all((tmp / f"marker{r}").exists() for r in range(world_size))

    # One rank's bad argument fails every rank, and the group stays in step afterwards.
    expect_raises(TypeError, "ranks [1]", comm.allgather, "text" if rank == 1 else b"ok")
    if rank == 0:
        expect_raises(TypeError, "data on the root (rank 0) must be bytes", comm.broadcast, None, 0)
    else:
        expect_raises(RuntimeError, "root (rank 0) passed no bytes", comm.broadcast, None, 0)
    expect_raises(ValueError, "root must be in", comm.broadcast, b"x", world_size)
    assert comm.allgather(b"%d" % rank) == [b"%d" % r for r in range(world_size)]


def check_subgroup(rank: int, world_size: int, tmp: Path) -> None:
    """Two EP groups, [1, 3] and [0, 2], inside a 4-rank world, used at the same time."""
    import torch.distributed as dist

    from flashinfer_a2a.comm import TorchDistributedCommunicator, as_communicator

    assert world_size == 4
    groups = {1: dist.new_group([1, 3]), 0: dist.new_group([0, 2])}  # new_group is collective over the world
    mine, other = groups[rank % 2], groups[1 - rank % 2]
    members = [1, 3] if rank % 2 else [0, 2]

    comm = as_communicator(mine)
    assert (comm.rank, comm.size) == (members.index(rank), 2)
    assert comm.allgather(b"%d" % rank) == [b"%d" % r for r in members]
    # Root 1 is group-local: global rank 3 (or 2), not global rank 1.
    assert comm.broadcast(b"from %d" % rank if comm.rank == 1 else None, root=1) == b"from %d" % members[1]
    comm.barrier()
    expect_raises(ValueError, "not a member", TorchDistributedCommunicator, other)

    world = as_communicator(None)
    assert world.allgather(b"%d" % rank) == [b"%d" % r for r in range(world_size)]


# --------------------------------------------------------------------------------------------------- fd exchange


def exchange_memfds(comm, *, timeout_s: float = 10.0) -> None:
    """Each rank shares a memfd holding ``rank <r>``; checks every rank reads every peer's, writes through to a
    peer's object, and that no descriptor or thread is left over."""
    from flashinfer_a2a.memory.fd_exchange import allgather_fds

    rank, size = comm.rank, comm.size

    def one_round(tag: int) -> None:
        fd = os.memfd_create(f"flashinfer_a2a_test_rank{rank}")
        try:
            os.write(fd, b"rank %d" % rank)
            fds = allgather_fds(comm, fd, timeout_s=timeout_s)
            try:
                assert len(fds) == size and fd not in fds and len(set(fds)) == size, (fd, fds)
                for r, peer_fd in enumerate(fds):
                    # Exact length: a fast peer may already have written at offset 32 (below), growing the file.
                    expected = b"rank %d" % r
                    assert os.pread(peer_fd, len(expected), 0) == expected, (r, os.pread(peer_fd, 16, 0))
                    assert not os.get_inheritable(peer_fd), f"fd of rank {r} would leak into subprocesses"
                # The fds name the peers' objects, not copies: write into the next rank's memfd ...
                os.pwrite(fds[(rank + 1) % size], bytes([tag, rank]), 32)
                comm.barrier()
                # ... and find the previous rank's bytes in ours.
                assert os.pread(fd, 2, 32) == bytes([tag, (rank - 1) % size])
            finally:
                for peer_fd in fds:
                    os.close(peer_fd)
        finally:
            os.close(fd)

    one_round(1)  # the first round may open the communicator's own lazy connections
    fds_before, threads_before = open_fds(), threading.active_count()
    one_round(2)
    assert open_fds() == fds_before, f"rank {rank}: {open_fds() - fds_before} descriptors leaked"
    assert threading.active_count() == threads_before


def check_fd_exchange(rank: int, world_size: int, tmp: Path) -> None:
    from flashinfer_a2a.comm import as_communicator

    exchange_memfds(as_communicator(None))


def check_fd_hung_peer(rank: int, world_size: int, tmp: Path) -> None:
    """Rank 1 takes part in the collectives but never serves or connects: the others time out naming it."""
    from flashinfer_a2a.memory import fd_exchange
    from flashinfer_a2a.comm import as_communicator

    comm = as_communicator(None)
    fd = os.memfd_create("hung_peer_test")
    baseline = open_fds()
    if rank == 1:
        def hang(self, deadline):
            time.sleep(3.0)  # longer than the peers' timeout, so they see silence, not a closed socket
            raise RuntimeError("simulated hang")

        fd_exchange._Exchange.connect_all = hang
        expect_raises(RuntimeError, "simulated hang", fd_exchange.allgather_fds, comm, fd, timeout_s=1.0)
    else:
        start = time.monotonic()
        exc = expect_raises(TimeoutError, "rank(s) 1 did not send their fd", fd_exchange.allgather_fds, comm, fd,
                            timeout_s=1.0)
        # "rank(s) 1 did" names exactly rank 1: the other live rank must not be blamed.
        assert "rank(s) 1 did not send their fd;" in str(exc) and "rank(s) 1 did not ask" in str(exc), exc
        assert time.monotonic() - start < 2.5
    assert open_fds() == baseline, f"rank {rank}: {open_fds() - baseline} descriptors leaked on failure"
    os.close(fd)
    comm.barrier()  # still in step: the failure cost no collective


def check_fd_bad_fd(rank: int, world_size: int, tmp: Path) -> None:
    """Rank 1 passes a closed fd: it gets ValueError, the others RuntimeError naming it; no collective is lost."""
    from flashinfer_a2a.comm import as_communicator
    from flashinfer_a2a.memory.fd_exchange import allgather_fds

    comm = as_communicator(None)
    fd = os.memfd_create("bad_fd_test")
    # Not a freshly closed number: allgather_fds opens descriptors of its own, which could reuse it.
    closed = -1
    if rank == 1:
        expect_raises(ValueError, "fd must be an open file descriptor", allgather_fds, comm, closed)
    else:
        expect_raises(RuntimeError, "ranks [1] could not take part", allgather_fds, comm, fd)
    os.close(fd)
    exchange_memfds(comm)


def check_same_host(rank: int, world_size: int, tmp: Path) -> None:
    from flashinfer_a2a.comm import as_communicator
    from flashinfer_a2a.memory.fd_exchange import same_host

    assert same_host(as_communicator(None)) is True


CHECKS = {
    "collectives": check_collectives,
    "subgroup": check_subgroup,
    "fd_exchange": check_fd_exchange,
    "fd_hung_peer": check_fd_hung_peer,
    "fd_bad_fd": check_fd_bad_fd,
    "same_host": check_same_host,
}


# ---------------------------------------------------------------------------------------------------------- mpirun


def mpi_main(check: str) -> None:
    """One rank under mpirun: the communicator checks through MpiCommunicator, then the fd exchange."""
    from mpi4py import MPI

    from flashinfer_a2a.comm import MpiCommunicator, as_communicator
    from flashinfer_a2a.memory.fd_exchange import same_host

    comm = as_communicator(MPI.COMM_WORLD)
    assert isinstance(comm, MpiCommunicator)
    rank, size = comm.rank, comm.size
    assert comm.allgather(b"r%d" % rank * rank) == [b"r%d" % r * r for r in range(size)]
    assert comm.broadcast(b"hi" if rank == size - 1 else None, root=size - 1) == b"hi"
    expect_raises(TypeError, "ranks [0]", comm.allgather, "text" if rank == 0 else b"ok")
    comm.barrier()
    if check == "fd_exchange":
        assert same_host(comm)
        exchange_memfds(comm)
    print(f"OK {check} rank {rank}", flush=True)


def run_mpirun(mpirun: str, nprocs: int, check: str, *, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """``mpirun -n nprocs python -m tests.comm_workers check`` from the repository root; kills the whole job (its
    own session) if it outlives ``timeout_s``."""
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(nprocs), sys.executable, "-m",
           "tests.comm_workers", check]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session holds mpirun and every rank it started
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} did not finish in {timeout_s} s:\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def nccl_main() -> None:
    """One rank under ``torchrun --nproc-per-node N python -m tests.comm_workers nccl`` on N GPUs: the same
    checks over NCCL, whose object collectives stage through the current CUDA device."""
    import torch
    import torch.distributed as dist

    from flashinfer_a2a.comm import as_communicator

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT)
    rank, size = dist.get_rank(), dist.get_world_size()
    last = dist.new_group([size - 1])  # an EP group that excludes rank 0, so group and global roots differ
    comm = as_communicator(None)
    assert comm.allgather(b"r%d" % rank * rank) == [b"r%d" % r * r for r in range(size)]
    assert comm.broadcast(b"hi" if rank == size - 1 else None, root=size - 1) == b"hi"
    comm.barrier()
    if rank == size - 1:
        sub = as_communicator(last)
        assert (sub.rank, sub.size) == (0, 1) and sub.broadcast(b"x") == b"x" and sub.allgather(b"y") == [b"y"]
        sub.barrier()
    exchange_memfds(comm)
    comm.barrier()
    dist.destroy_process_group()
    print(f"OK nccl rank {rank}", flush=True)


if __name__ == "__main__":
    check = sys.argv[1] if len(sys.argv) > 1 else "fd_exchange"
    if check == "nccl":
        nccl_main()
    else:
        mpi_main(check)
