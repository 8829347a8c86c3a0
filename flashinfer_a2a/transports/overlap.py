"""Communication beside compute: split-phase calls whose transfer runs on a communication stream.

Queued on the caller's stream, a split call overlaps nothing on real GPUs: the send kernel stores the rows itself,
so a GEMM queued after it starts once the bytes have moved, and the receive then holds the stream until the peers'
rows land. With a communication stream (``MoeAlltoAll(..., comm_stream=True)``, or ``comm_stream=`` of
:mod:`flashinfer_a2a.split_phase`) the send half instead queues the whole transfer there, both kernels (send, then
receive), after the work already queued on the caller's stream (an event), and returns; the receive half makes the
caller's stream wait for the transfer's end (a second event) and returns its results. What the caller queues in
between (the other micro-batch's experts) runs beside the transfer, on the multiprocessors its SM budget leaves.

Why both kernels at the send: the receive kernels move the bytes a combine pulls, and a receive queued at the receive
half would start only after everything the caller queued before that (the GEMM it should overlap). Why the two
kernels rather than the one-kernel calls: every rank's send comes before any rank's receive, so no kernel waits for a
peer kernel that has to run beside it (simulated ranks captured in one graph depend on that), and the combine is
the pulled one, as every split combine is. The results are those of the whole calls, bit for bit.

Memory: the tensors a transfer reads or writes (ids, payloads, scales, partials, ``out``) are held here until the
receive half has made the caller's stream wait, and only then let go: the caching allocator then hands their memory
to the caller's stream after the transfer, never during it. A tensor made on a third stream is the caller's to keep
(``Tensor.record_stream``), as for any work queued on another stream than the tensor's.

CUDA graphs: the send records the fork and the receive joins it, so both halves of a call must be captured in the
same graph (CUDA refuses to end a capture with the stream's transfer not joined back); a receive captured apart from
its send is refused here with a message naming both. ``torch.compile``: a half on a communication stream is a graph
break and runs eagerly (:mod:`flashinfer_a2a.split_phase`), through the ops ``flashinfer_a2a::<op>_on_stream`` and
``flashinfer_a2a::join_stream``; their fake implementations are the base ops'.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch

from ..library import ops

#: A communication stream the package owns has a higher priority than the compute streams (-1 in torch's scale,
#: where lower is more urgent): when a multiprocessor frees up, the block scheduler starts the transfer's blocks
#: before a GEMM's next ones, so a transfer under an SM budget does not queue behind a whole GEMM wave.
PRIORITY = -1

_STREAMS: list["CommStream"] = []  # the ops name a communication stream by its index here
_BY_HANDLE: dict[tuple[int, int], "CommStream"] = {}  # (device index, cudaStream_t) -> its CommStream
_PACKAGE: dict[Hashable, "CommStream"] = {}  # the package's own streams, one per rank of a group on a device


class _Transfer:
    """What is in flight for one workspace on one communication stream: the events of the fork (``ready``, on the
    caller's stream) and of the transfer's end (``done``), the tensors held until the join, and whether it was
    queued while a CUDA graph was being captured."""

    __slots__ = ("ready", "done", "held", "captured")

    def __init__(self) -> None:
        self.ready, self.done = torch.cuda.Event(), torch.cuda.Event()
        self.held: Optional[list[Any]] = None  # None: nothing in flight
        self.captured = False


class CommStream:
    """A CUDA stream the transfers of split calls run on; get one with :func:`resolve` (or :func:`for_stream`).

    ``run`` queues a transfer of a workspace, ``wait`` makes the caller's stream wait for it; the ops of
    :data:`ON_STREAM` and :func:`join_stream` call them. One transfer per workspace may be in
    flight on one stream (each workspace holds one dispatch at a time), every rank needs a stream of its own (ranks
    sharing one would queue one rank's receive before its peer's send), and workspaces may share one.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.device = stream.device
        self.index = len(_STREAMS)
        _STREAMS.append(self)
        self._transfers: dict[int, _Transfer] = {}  # by the workspace's address

    def run(self, workspace: torch.Tensor, launch: Callable[[], Any], held: Any = None) -> Any:
        """Queues ``launch()`` (kernel launches on the current stream) on this stream after the work queued on the
        caller's current stream so far; holds ``held`` until :meth:`wait`. Returns what ``launch`` returns."""
        caller = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        transfer = self._transfers.get(workspace.data_ptr())
        if transfer is None:
            transfer = self._transfers[workspace.data_ptr()] = _Transfer()
        elif transfer.held is not None and transfer.captured != capturing:
            raise RuntimeError(_apart(transfer.captured, capturing, "next send"))
        transfer.ready.record(caller)
        self.stream.wait_event(transfer.ready)
        with torch.cuda.stream(self.stream):
            result = launch()
        transfer.done.record(self.stream)
        if transfer.held is None:
            transfer.held = []
        transfer.held.append(held)
        transfer.captured = capturing
        return result

    def wait(self, workspace: torch.Tensor) -> None:
        """Makes the caller's current stream wait for the transfer of ``workspace`` queued by :meth:`run`, and lets
        go of the tensors it held."""
        transfer = self._transfers.get(workspace.data_ptr())
        if transfer is None or transfer.held is None:
            raise RuntimeError("no transfer of this workspace is in flight on the communication stream: the receive "
                               "half needs its send half first")
        capturing = torch.cuda.is_current_stream_capturing()
        if transfer.captured != capturing:
            raise RuntimeError(_apart(transfer.captured, capturing, "receive"))
        torch.cuda.current_stream(self.device).wait_event(transfer.done)
        transfer.held = None

    def in_flight(self, workspace: torch.Tensor) -> bool:
        """Whether a transfer of ``workspace`` waits for its :meth:`wait`."""
        transfer = self._transfers.get(workspace.data_ptr())
        return transfer is not None and transfer.held is not None

    def forget(self, workspace: Optional[torch.Tensor]) -> None:
        """Drops what is kept for ``workspace`` (its memory is being freed)."""
        if workspace is not None:
            self._transfers.pop(workspace.data_ptr(), None)

    def op(self, base: ops.Op) -> Callable[..., None]:
        """``base`` (:func:`~flashinfer_a2a.library.ops.dispatch`, ``dispatch_recv`` or ``combine``) launched on
        this stream: a callable taking ``base``'s arguments."""
        on_stream = ON_STREAM[base.name]
        return lambda workspace, *args: on_stream(workspace, self.index, *args)

    def join(self, workspace: torch.Tensor, result: torch.Tensor) -> None:
        """:meth:`wait` as an op: ``result`` (the counts, or the combine's output) and the workspace are declared
        written, so that what reads them comes after."""
        join_stream(workspace, self.index, result)


def _apart(queued: bool, now: bool, half: str) -> str:
    def where(capturing: bool) -> str:
        return "inside a CUDA graph capture" if capturing else "outside any capture"

    return (f"split call on a communication stream: a send half was queued {where(queued)} and the {half} half "
            f"after it comes {where(now)}; both halves of a call must be captured in the same graph, since a capture "
            "cannot end with the communication stream not joined back (CUDA refuses it: "
            "cudaErrorStreamCaptureUnjoined). After a capture that failed so, build the MoeAlltoAll (or the "
            "workspace of the split calls) again")


def for_stream(stream: torch.cuda.Stream) -> CommStream:
    """The :class:`CommStream` of ``stream`` (one per stream, kept for the life of the process)."""
    key = (stream.device.index, stream.cuda_stream)
    comm = _BY_HANDLE.get(key)
    if comm is None:
        comm = _BY_HANDLE[key] = CommStream(stream)
    return comm


def check_comm_stream(comm_stream: Any) -> None:
    """TypeError unless ``comm_stream`` is None, a bool or a ``torch.cuda.Stream``."""
    if comm_stream is None or isinstance(comm_stream, (bool, torch.cuda.Stream)):
        return
    raise TypeError(f"comm_stream must be None, True (the package's stream) or a torch.cuda.Stream, got "
                    f"{type(comm_stream).__name__}")


def resolve(comm_stream: Any, key: Hashable, device: torch.device) -> Optional[CommStream]:
    """The communication stream ``comm_stream`` asks for: None or False, none (the split calls stay on the
    caller's stream); True, the package's stream for ``key`` (a group's rank on ``device``; made on first use, with
    priority :data:`PRIORITY`); a ``torch.cuda.Stream`` on ``device``, that one."""
    check_comm_stream(comm_stream)
    if comm_stream is None or comm_stream is False:
        return None
    if comm_stream is True:
        comm = _PACKAGE.get(key)
        if comm is None:
            comm = _PACKAGE[key] = for_stream(torch.cuda.Stream(device, priority=PRIORITY))
        return comm
    if comm_stream.device != device:
        raise ValueError(f"comm_stream is a stream of {comm_stream.device}, the workspace is on {device}")
    return for_stream(comm_stream)


def registered(index: int) -> CommStream:
    """The communication stream an op names by ``index``."""
    if not isinstance(index, int) or not 0 <= index < len(_STREAMS):
        raise ValueError(f"comm_stream={index!r} names no communication stream of this process "
                         f"({len(_STREAMS)} made)")
    return _STREAMS[index]


def _on_stream(base: ops.Op) -> ops.Op:
    """Registers ``flashinfer_a2a::<base>_on_stream(workspace, int comm_stream, <base's other arguments>)``: the
    base op queued on a communication stream by :meth:`CommStream.run`, the tensors it takes held until the join.
    Its schema is the base op's (the same writes declared); its fake is the base op's."""
    schema = str(base.overload._schema)
    arguments = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    first, rest = arguments.split(", ", 1)
    if first != "Tensor(a!) workspace":  # the workspace names the transfer
        raise RuntimeError(f"{base.name} does not take the workspace first: {schema}")

    def launch(workspace: torch.Tensor, comm_stream: int, *args: Any) -> None:
        registered(comm_stream).run(workspace, lambda: base.impl(workspace, *args), args)

    launch.__name__ = f"{base.name}_on_stream"
    op = ops.register(f"{base.name}_on_stream({first}, int comm_stream, {rest}) -> ()", dispatch_key="CUDA")(launch)
    op.register_fake(lambda workspace, comm_stream, *args: base.overload(workspace, *args))
    return op


#: ``flashinfer_a2a::dispatch_on_stream``, ``dispatch_recv_on_stream`` and ``combine_on_stream`` by base name.
ON_STREAM = {base.name: _on_stream(base) for base in (ops.dispatch, ops.dispatch_recv, ops.combine)}


# The receive half's join. ``result`` is not read: declared written, it orders what reads the transfer's results
# (the counts, the combine's output; the receive views through the workspace) after the join in a traced graph.
@ops.register("join_stream(Tensor(a!) workspace, int comm_stream, Tensor(b!) result) -> ()", dispatch_key="CUDA")
def join_stream(workspace, comm_stream, result):
    registered(comm_stream).wait(workspace)


@join_stream.register_fake
def _join_stream_fake(workspace, comm_stream, result):
    registered(comm_stream)
