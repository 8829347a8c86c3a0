"""Teardown that survives dead peers.

A barrier with a dead peer never returns (or returns after the process group's timeout, 30 minutes with gloo's
default), so teardown bounds it: the barrier runs in a helper thread and, if it has not returned within the
timeout, this rank frees its own mappings alone. That is safe: CUDA virtual memory keeps a rank's physical memory
alive while any process still maps it, so a live peer still reading this rank's workspace keeps reading valid
memory until it unmaps it too.
"""

from __future__ import annotations

import datetime
import threading
import warnings
from typing import Any, Callable

import torch

from ..comm import Communicator


def bounded(call: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Runs ``call`` in a daemon thread; ``(True, result)`` if it returned within ``timeout_s``, else
    ``(False, reason)`` (the exception it raised, or a timeout). A call that never returns is left to its thread,
    which does not keep the process alive."""
    box: dict[str, Any] = {}
    # The current CUDA device is per thread: NCCL's object collectives and barrier stage through it, so the helper
    # thread must use the caller's GPU, not device 0.
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            box["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="flashinfer_a2a_bounded", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, f"no answer within {timeout_s:g} s"
    if "error" in box:
        return False, f"{type(box['error']).__name__}: {box['error']}"
    return True, box.get("result")


def barrier_within(comm: Communicator, timeout_s: float) -> tuple[bool, str]:
    """A barrier bounded by ``timeout_s``: ``(True, "")``, or ``(False, reason)``. Over a gloo process group the
    reason names the ranks that did not arrive (``monitored_barrier``); otherwise it says only that some did not."""
    group = getattr(comm, "group", None)
    dist = getattr(comm, "_dist", None)
    if dist is not None and "gloo" in str(dist.get_backend(group)):
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
            return True, ""
        except RuntimeError as exc:
            return False, str(exc).splitlines()[0]
    passed, reason = bounded(comm.barrier, timeout_s)
    return passed, "" if passed else str(reason)


def release_workspace(free: Callable[[], None], comm: Communicator, device: torch.device, timeout_s: float,
                      what: str = "MoeAlltoAll.destroy") -> bool:
    """Waits for this rank's kernels, lines the ranks up with a barrier bounded by ``timeout_s``, then calls
    ``free`` (this rank's unmapping) whatever happened. Returns whether the barrier passed; warns if not."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)  # kernels are bounded by their own timeout: this returns
        except RuntimeError as exc:  # a dead context: freeing is still worth trying
            warnings.warn(f"{what}: synchronizing {device} failed ({exc}); freeing anyway", RuntimeWarning,
                          stacklevel=3)
    passed, reason = barrier_within(comm, timeout_s)
    if not passed:
        warnings.warn(f"{what}: rank {comm.rank} could not reach every peer ({reason}); freeing this rank's "
                      "mappings without them (the peers' memory stays valid for as long as they map it)",
                      RuntimeWarning, stacklevel=3)
    free()
    return passed
