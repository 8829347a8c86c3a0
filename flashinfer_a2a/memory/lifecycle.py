"""Teardown that survives dead peers, and the order of one workspace's steps across CUDA streams.

A barrier with a dead peer never returns (or returns after the process group's timeout, 30 minutes with gloo's
default), so teardown bounds it: the barrier runs in a helper thread and, if it has not returned within the
timeout, this rank frees its own mappings alone. That is safe: CUDA virtual memory keeps a rank's physical memory
alive while any process still maps it, so a live peer still reading this rank's workspace keeps reading valid
memory until it unmaps it too.
"""

from __future__ import annotations

import datetime
import functools
import threading
import warnings
from typing import Any, Callable, Optional

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


def _stream_getter(device: torch.device) -> Optional[Callable[[], int]]:
    """A function returning the current stream's cudaStream_t on ``device`` (None off CUDA). The raw getter costs
    about 0.1 us; torch.cuda.current_stream builds a Stream object (about 1 us), which every eager dispatch and
    combine would pay."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return functools.partial(raw, index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


class StreamOrder:
    """Orders one shared workspace's steps across CUDA streams, as torch orders its own ops' inputs.

    The steps of every instance on one workspace share state in device memory (the epochs, the pending dispatch's
    counts and receive region) that only stream order protects: a combine on another stream than its dispatch could
    read counts the dispatch has not written. So when an eager step is issued on another stream than the previous
    eager step, that stream first waits for everything issued so far on the previous one (an event recorded there
    now, so the previous step and whatever followed it). The steady state, every step on one stream, costs one
    comparison. Steps captured into a CUDA graph follow the graph's order: one capturing stream after another of the
    same capture waits the same way (an edge of the graph), and a capture after eager work relies on the caller's
    ordering as any captured op does (``torch.cuda.graph`` synchronizes before it captures). Steps traced by
    ``torch.compile`` run on whatever stream runs the compiled code, ordered by it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: the raw handle of the stream of the last eager step, and that stream
        self.stream: Optional[int] = None
        self._stream_obj: Optional[torch.cuda.Stream] = None
        #: the same for the last captured step (only ever waited on while it is still capturing)
        self._captured: Optional[torch.cuda.Stream] = None
        self._current = _stream_getter(device)

    def order(self) -> None:
        """Called before every step launches: makes the current stream wait for the previous step's stream when
        they differ (see the class docstring)."""
        if self._current is None or torch.compiler.is_compiling():  # dynamo folds the second, tracing nothing
            return
        current = self._current()
        if current == self.stream:  # the eager steady state: one comparison
            return
        stream = torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            previous, self._captured = self._captured, stream
            if previous is not None and previous.cuda_stream != current and _capturing(previous):
                stream.wait_stream(previous)  # an edge of the graph being captured
            return
        if self._stream_obj is not None:
            stream.wait_stream(self._stream_obj)
        self.stream, self._stream_obj = current, stream

    def rebind(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Takes ``stream`` (default: the current one) as the stream of the last step, without waiting: for a caller
        that ordered the streams itself."""
        if self._current is None:  # off CUDA nothing is ordered
            return
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        self.stream, self._stream_obj = stream.cuda_stream, stream


def _capturing(stream: torch.cuda.Stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()
