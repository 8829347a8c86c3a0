"""The order of one shared workspace's steps: on the host, which call may come next (:class:`CallOrder`); on the
device, the CUDA streams they run on (:class:`StreamOrder`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch


class CallOrder:
    """The order of one workspace's calls, checked on the host before any launch: a dispatch (whole, or send then
    receive), then its combine (whole, or send then receive), then the next dispatch.

    ``check(call)`` raises RuntimeError for a call out of order; ``advance(call)`` records it once launched.
    """

    IDLE, DISPATCH_SENT, DISPATCHED, COMBINE_SENT = "idle", "dispatch_sent", "dispatched", "combine_sent"
    # call -> (state it needs, state it leaves)
    _MOVES = {
        "dispatch": (IDLE, DISPATCHED),
        "dispatch_send": (IDLE, DISPATCH_SENT),
        "dispatch_recv": (DISPATCH_SENT, DISPATCHED),
        "combine_input": (DISPATCHED, DISPATCHED),
        "combine": (DISPATCHED, IDLE),
        "combine_send": (DISPATCHED, COMBINE_SENT),
        "combine_recv": (COMBINE_SENT, IDLE),
    }
    # What to call instead, by the state a call found.
    _HINTS = {
        IDLE: "called without a pending dispatch: call dispatch (or dispatch_send) first",
        DISPATCH_SENT: "called while a dispatch_send is pending: call dispatch_recv first",
        DISPATCHED: "called while a dispatch is pending (dispatch called twice?): call combine (or combine_send) "
                    "for it first",
        COMBINE_SENT: "called while a combine_send is pending: call combine_recv first",
    }

    def __init__(self, owner: str = "MoeAlltoAll") -> None:
        self.owner = owner
        self.state = self.IDLE

    def check(self, call: str, name: Optional[str] = None) -> None:
        """``name``: what the error calls the step (default ``call``), for steps that need what ``call`` needs."""
        if self.state != self._MOVES[call][0]:
            raise RuntimeError(f"{self.owner}.{name or call} {self._HINTS[self.state]}")

    def advance(self, call: str) -> None:
        self.check(call)
        self.state = self._MOVES[call][1]

    def reset(self) -> None:
        self.state = self.IDLE


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
