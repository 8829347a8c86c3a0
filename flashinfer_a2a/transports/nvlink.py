"""The one-sided NVLink transport: dispatch pushes rows into the peers' workspaces, combine pulls (or pushes) the
partials, through symmetric memory shared by every layer of a group and namespace
(:mod:`flashinfer_a2a.memory.shared_workspace`).

Each step runs eagerly through C++ functions bound once per instance (:mod:`.nvlink_eager`: one counts tensor, receive
views made once per shape), or, while ``torch.compile`` traces, through the registered ops with fresh tensors (a
traced view or counts tensor must not be kept). A step after a dispatch follows the path that dispatch took.

With a communication stream (:mod:`.overlap`) a send half queues both kernels of its call there and the receive half
joins them back; whole calls stay on the caller's stream.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Optional, Sequence

import torch

from .. import functional as F
from .. import split_phase
from ..comm import Communicator
from ..library import active_ranks
from ..library.combine_mode import COMBINE_MODES, chosen_mode
from ..library.constants import SPLIT_RECV, SPLIT_SEND
from ..library.errors import debug_checks_due
from ..library.wire_formats import check_combine_format
from ..memory import shared_workspace
from ..memory.lifecycle import barrier_within
from . import overlap
from .nvlink_eager import EagerCalls

_INSTANCES = itertools.count()  # names each instance's eager calls in its shared workspace


class NvlinkTransport:
    """One :class:`flashinfer_a2a.MoeAlltoAll`'s share of a symmetric workspace (see :class:`.base.Transport`).

    Args:
        comm, group, namespace, device: which shared workspace (acquired here, collectively).
        requested: the sizes this layer needs; the shared workspace is grown to fit them.
        num_experts, num_sms: as the constructor's.
        pushed_wires: the combine wires this layer pushes when every rank has a GPU of its own.
        timeout_s, debug: the constructor's defaults (``FLASHINFER_A2A_TIMEOUT_S``, ``FLASHINFER_A2A_DEBUG``).
        comm_stream: where the split halves' transfers run (:func:`.overlap.resolve`; True: the stream this rank of
            the group owns on its device, shared by every namespace).
    """

    def __init__(self, comm: Communicator, group: Any, namespace: str, requested: F.WorkspaceConfig,
                 device: Optional[int | str], *, num_experts: int, num_sms: int, pushed_wires: frozenset,
                 timeout_s: float, debug: bool, comm_stream: Any = None) -> None:
        self.comm, self.num_experts, self.num_sms = comm, num_experts, num_sms
        self.pushed_wires, self.timeout_s, self.debug = pushed_wires, timeout_s, debug
        self.shared: Optional[shared_workspace.SharedWorkspace] = shared_workspace.acquire(
            comm, group, namespace, requested, device, timeout_s)
        self.device = self.shared.tensor.device
        self.recv_counts = torch.empty(comm.size, dtype=torch.int32, device=self.device)
        self.calls = 0
        self.instance = next(_INSTANCES)
        self.comm_stream: Optional[overlap.CommStream] = None
        try:
            self.comm_stream = overlap.resolve(comm_stream, (shared_workspace.group_key(group, comm), comm.size,
                                                             comm.rank), self.device)
        except BaseException:
            self.destroy()  # a refused stream keeps nothing
            raise

    # The workspace, its layout and the pending dispatch belong to the shared workspace (read at each call: a later
    # layer may have grown it).
    config = property(lambda self: self.shared.config)
    workspace = property(lambda self: None if self.shared is None else self.shared.tensor)
    metainfo = property(lambda self: self.shared.metainfo)
    allocation = property(lambda self: None if self.shared is None else self.shared.allocation)

    def dispatch(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int, timeout_s: float,
                 quant_format: Optional[str], global_scale: Optional[torch.Tensor | float],
                 swizzled_scales: bool, eplb_local_stats: Optional[torch.Tensor] = None,
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        return self._dispatch("dispatch", topk_ids, payloads, runtime_max, timeout_s, quant_format, global_scale,
                              swizzled_scales, eplb_local_stats)

    def dispatch_send(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int,
                      timeout_s: float, quant_format: Optional[str], global_scale: Optional[torch.Tensor | float],
                      swizzled_scales: bool, eplb_local_stats: Optional[torch.Tensor] = None) -> None:
        views, _ = self._dispatch("dispatch_send", topk_ids, payloads, runtime_max, timeout_s, quant_format,
                                  global_scale, swizzled_scales, eplb_local_stats)
        self.shared.sent = (views, timeout_s)

    def _dispatch(self, call: str, topk_ids, payloads, runtime_max, timeout_s, quant_format, global_scale,
                  swizzled_scales, eplb_local_stats) -> tuple[list[torch.Tensor], torch.Tensor]:
        """A whole dispatch (``call`` "dispatch") or its send half ("dispatch_send")."""
        shared = self._begin(call)
        shared.traced_input = None
        # Shapes of topk_ids and payloads: checked by F.dispatch_counts (and the C++ entry) before any launch.
        if self.debug and debug_checks_due(True):
            self._check_same_call(runtime_max)
        phase = SPLIT_SEND if call == "dispatch_send" else 0
        on_stream = self.comm_stream if phase else None
        if torch.compiler.is_compiling():
            launch, extra = ((split_phase.dispatch_send, {"comm_stream": on_stream}) if phase else
                             (F.dispatch, {"one_gpu_per_rank": self.allocation.one_gpu_per_rank}))
            recv, counts = launch(self.workspace, self.comm.rank, self.config, topk_ids, payloads, runtime_max,
                                  self.num_experts, timeout_s=timeout_s, quant_format=quant_format,
                                  global_scale=global_scale, swizzled_scales=swizzled_scales, debug=self.debug,
                                  num_sms=self.num_sms, eplb_local_stats=eplb_local_stats, **extra)
        else:  # one counts tensor and cached views, valid (like the views always were) until the next dispatch
            eager = self.eager()

            def launch() -> list[torch.Tensor]:
                views = eager.dispatch(topk_ids, payloads, runtime_max, timeout_s, quant_format, global_scale,
                                       swizzled_scales, phase=phase, eplb_local_stats=eplb_local_stats)
                if on_stream is not None:  # the receive follows the send on the communication stream
                    eager.dispatch_recv(runtime_max, timeout_s)
                return views

            recv = launch() if on_stream is None else on_stream.run(self.workspace, launch,
                                                                    (topk_ids, payloads, global_scale,
                                                                     eplb_local_stats))
            counts = self.recv_counts
        shared.pending = (topk_ids.shape[0], runtime_max, counts)
        self.calls += 1
        shared.order.advance(call)
        return recv, counts

    def dispatch_recv(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        shared = self._begin("dispatch_recv")
        _, runtime_max, counts = shared.pending
        views, timeout_s = shared.sent
        if self.comm_stream is None and self._eager_step(counts):
            self.eager().dispatch_recv(runtime_max, timeout_s)
        else:  # traced, or the join of the transfer on the communication stream
            split_phase.dispatch_recv(self.workspace, self.comm.rank, self.config, counts, runtime_max,
                                      timeout_s=timeout_s, debug=self.debug, comm_stream=self.comm_stream)
        shared.sent = None
        shared.order.advance("dispatch_recv")
        return views, counts

    def combine_input(self, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        _, runtime_max, _ = self.require_pending("combine_input")
        if torch.compiler.is_compiling():
            # A compiled graph cannot write into a view of the workspace in place: functionalization turns the write
            # into a copy of the whole workspace, which the kernels would then read and publish instead of the shared
            # memory. The expert side writes a buffer of the graph's own, which the combine takes as its partials
            # (a copy into the workspace at the combine's publish, the same bits).
            shared = self.shared
            held = shared.traced_input
            if held is None or held.shape[1:] != (runtime_max, hidden) or held.dtype != dtype:
                held = shared.traced_input = torch.empty(self.comm.size, runtime_max, hidden, dtype=dtype,
                                                         device=self.device)
            return held
        return self.eager().combine_input(runtime_max, hidden, dtype)  # eager calls get the same view each time

    def combine_mode(self, quant_format: Optional[str] = None, runtime_max: Optional[int] = None) -> str:
        check_combine_format(quant_format, "combine quant_format")
        if runtime_max is None:  # the pending dispatch's, else the largest
            pending = self.shared.pending if self.shared is not None else None
            runtime_max = pending[1] if pending is not None else self.config.max_num_tokens
        return self._mode(quant_format, runtime_max)

    def combine(self, partials: Optional[torch.Tensor], out: Optional[torch.Tensor], hidden: int, dtype: torch.dtype,
                timeout_s: float, quant_format: Optional[str]) -> torch.Tensor:
        shared = self._begin("combine")
        num_tokens, runtime_max, counts = shared.pending
        partials = self._written_input(shared, partials)
        if self._eager_step(counts):
            result = self.eager().combine(partials, out, num_tokens, hidden, dtype, runtime_max, timeout_s,
                                          quant_format)
        else:
            result = F.combine(self.workspace, self.comm.rank, self.config, counts, num_tokens, runtime_max, partials,
                               out=out, hidden=hidden, dtype=dtype, timeout_s=timeout_s,
                               one_gpu_per_rank=self.allocation.one_gpu_per_rank, quant_format=quant_format,
                               combine_mode=self.combine_mode(quant_format, runtime_max), debug=self.debug,
                               num_sms=self.num_sms)
        shared.pending = None
        shared.order.advance("combine")
        return result

    def combine_send(self, partials: Optional[torch.Tensor], hidden: int, dtype: torch.dtype, timeout_s: float,
                     quant_format: Optional[str], out: Optional[torch.Tensor] = None) -> None:
        shared = self._begin("combine_send")
        num_tokens, runtime_max, counts = shared.pending
        partials = self._written_input(shared, partials)
        if out is not None or self.comm_stream is not None:  # made (or checked) on the caller's stream
            out = F.combine_output(self.workspace, num_tokens, partials, out, hidden, dtype)
        on_stream = self.comm_stream
        if self._eager_step(counts):
            eager = self.eager()

            def launch() -> None:
                eager.combine(partials, None, 0, hidden, dtype, runtime_max, timeout_s, quant_format, SPLIT_SEND)
                if on_stream is not None:  # the receive pulls on the communication stream too
                    eager.combine(partials, out, num_tokens, hidden, dtype, runtime_max, timeout_s, quant_format,
                                  SPLIT_RECV)

            if on_stream is None:
                launch()
            else:
                on_stream.run(self.workspace, launch, (partials, out))
        else:  # without a communication stream the receive half takes out
            split_phase.combine_send(self.workspace, self.comm.rank, self.config, counts, runtime_max, partials,
                                     hidden=hidden, dtype=dtype, timeout_s=timeout_s, quant_format=quant_format,
                                     debug=self.debug, num_sms=self.num_sms, out=None if on_stream is None else out,
                                     comm_stream=on_stream)
        shared.sent = (partials, timeout_s, quant_format, out)
        shared.order.advance("combine_send")

    def combine_recv(self, out: Optional[torch.Tensor], hidden: int, dtype: torch.dtype) -> torch.Tensor:
        shared = self._begin("combine_recv")
        num_tokens, runtime_max, counts = shared.pending
        partials, timeout_s, quant_format, sent_out = shared.sent
        if out is not None and self.comm_stream is not None:
            raise ValueError("combine_recv: with a communication stream the combine runs at combine_send, which "
                             "writes its output: pass out to combine_send")
        if out is not None and sent_out is not None:
            raise ValueError("combine_recv: out was given to combine_send already")
        out = sent_out if out is None else out
        if self.comm_stream is not None:  # the join of the transfer, which wrote out
            result = split_phase.combine_recv(self.workspace, self.comm.rank, self.config, counts, num_tokens,
                                              runtime_max, out=out, comm_stream=self.comm_stream)
        elif self._eager_step(counts):
            result = self.eager().combine(partials, out, num_tokens, hidden, dtype, runtime_max, timeout_s,
                                          quant_format, SPLIT_RECV)
        else:
            result = split_phase.combine_recv(self.workspace, self.comm.rank, self.config, counts, num_tokens,
                                              runtime_max, partials, out=out, hidden=hidden, dtype=dtype,
                                              timeout_s=timeout_s, quant_format=quant_format, debug=self.debug,
                                              num_sms=self.num_sms)
        shared.pending = shared.sent = None
        shared.order.advance("combine_recv")
        return result

    @staticmethod
    def _written_input(shared: Any, partials: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The partials of a combine: those given, else the buffer a traced combine_input handed out (taken once),
        else None (the expert side wrote the workspace's combine region)."""
        if partials is None:
            partials, shared.traced_input = shared.traced_input, None
        return partials

    def eager(self) -> EagerCalls:
        """This instance's eager calls on the shared workspace as it is now (made again when it moved)."""
        calls = self.shared.eager_calls.get(self.instance)
        if calls is None:
            shared = self.shared
            calls = shared.eager_calls[self.instance] = EagerCalls(
                shared.tensor, self.recv_counts, self.comm.rank, shared.config, self.num_experts, self.num_sms,
                shared.one_gpu_per_rank, self._combine_code, self.debug)
        return calls

    def _mode(self, quant_format: Optional[str], runtime_max: int) -> str:
        """:func:`chosen_mode` for this layer: its pushed wires, GPUs and ranks (``quant_format`` already checked)."""
        return chosen_mode(quant_format, self.pushed_wires, self.allocation.one_gpu_per_rank, self.comm.size,
                           runtime_max)

    def _combine_code(self, quant_format: Optional[str], runtime_max: int) -> int:
        """The op's code of :meth:`combine_mode`, for an eager combine (which has checked ``quant_format``)."""
        return COMBINE_MODES[self._mode(quant_format, runtime_max)]

    def _eager_step(self, counts: torch.Tensor) -> bool:
        """Whether a step after the dispatch that wrote ``counts`` runs eagerly: that dispatch was eager (it wrote
        this instance's counts tensor) and nothing is being traced."""
        return counts is self.recv_counts and not torch.compiler.is_compiling()

    def workspace_breakdown(self) -> str:
        index = F.get_metainfo_index_pairs()
        at = {name: int(self.metainfo[i]) for name, i in index.items()}
        config, ep_size, mib = self.config, self.comm.size, 1 << 20
        parts = [
            ("metadata (epochs, signals, error record, active set)", at["eplb_offset"]),
            (f"EPLB statistics [{ep_size}, {F.MAX_EPLB_EXPERTS}] int32", at["push_flags_offset"] - at["eplb_offset"]),
            (f"push flags [{ep_size}, {config.max_num_tokens}] uint32",
             at["routing_offset"] - at["push_flags_offset"]),
            (f"routing record [{config.max_num_tokens}, {config.top_k}] int32",
             at["dispatch_offset"] - at["routing_offset"]),
            (f"dispatch region {ep_size} x {config.max_num_tokens} x {config.dispatch_bytes_per_token} B",
             at["combine_offset"] - at["dispatch_offset"]),
            (f"combine region {ep_size} x {config.max_num_tokens} x {config.combine_bytes_per_token} B",
             at["bytes_per_rank"] - at["combine_offset"]),
        ]
        lines = [f"{name}: {size / mib:.2f} MiB" for name, size in parts]
        lines.append(f"total per rank: {at['bytes_per_rank'] / mib:.2f} MiB (mapped: "
                     f"{self.allocation.bytes_per_rank / mib:.2f} MiB, allocation granularity)")
        lines.append(f"mapped in this process: {ep_size * self.allocation.bytes_per_rank / mib:.2f} MiB "
                     f"({ep_size} ranks)")
        return "\n".join(lines)

    @property
    def active_ranks(self) -> tuple[int, ...]:
        return active_ranks.ranks_of(self.shared.inactive, self.comm.size)

    def set_active_ranks(self, ranks: Optional[Iterable[int]], restore: bool = False) -> None:
        """Makes ``ranks`` (None: every rank) the active set of the shared workspace from the next dispatch on
        (:mod:`flashinfer_a2a.library.active_ranks`). ``restore``: the whole group's collective return to every
        rank, which a returning rank cannot tell from its own state (it made no calls while out): every rank
        synchronises, and a rank that missed steps takes the epoch of the ranks that stayed. Without it a set may
        only drop ranks."""
        inactive = active_ranks.inactive_bits(ranks, self.comm.size, self.comm.rank)
        self.check_alive()
        shared = self.shared
        wanted = list(active_ranks.ranks_of(inactive, self.comm.size))
        if restore and inactive:
            raise ValueError(f"active ranks {wanted}: ranks come back to every rank of the group at once (None)")
        back = active_ranks.ranks_of(shared.inactive & ~inactive, self.comm.size, invert=True)
        if back and not restore:
            raise ValueError(f"active ranks {wanted} take back ranks {list(back)}: ranks come back collectively, "
                             "by MoeAlltoAll.set_active_ranks(None) on every rank at one step")
        if inactive == shared.inactive and not restore:
            return
        if shared.pending is not None:
            raise ValueError(f"active ranks {wanted} differ from the pending dispatch's "
                             f"{list(self.active_ranks)}: the set changes between a combine and the next dispatch")
        if torch.cuda.is_current_stream_capturing():
            raise ValueError("the active ranks cannot change while a CUDA graph is captured: set them before the "
                             "capture or before a replay (replays follow the set in force)")
        shared.stream.order()
        if restore:
            torch.cuda.synchronize(self.device)
            mine = active_ranks.read_epoch(shared.tensor, self.comm.rank)
            epochs = [int(blob) for blob in self.comm.allgather(str(mine).encode())]
            latest = active_ranks.latest_epoch(epochs)
            if latest != mine:
                active_ranks.write_epoch(shared.tensor, self.comm.rank, latest)
        active_ranks.write_inactive(shared.tensor, self.comm.rank, inactive)
        shared.inactive = inactive

    def bind_stream(self, stream: Optional[torch.cuda.Stream]) -> None:
        self.check_alive()
        self.shared.stream.rebind(stream)

    def destroy(self) -> None:
        if self.shared is None:
            return
        shared, self.shared = self.shared, None
        shared.eager_calls.pop(self.instance, None)
        if self.comm_stream is not None and shared.users == 1:  # its memory goes: nothing of it is kept
            self.comm_stream.forget(shared.tensor)
        shared_workspace.release(shared)

    def check_alive(self) -> None:
        if self.allocation is None:
            raise RuntimeError("this MoeAlltoAll was destroyed: build a new one (its workspace is freed)")

    def _begin(self, call: str) -> shared_workspace.SharedWorkspace:
        """Before a step launches: the instance lives, the steps come in order, its stream waits for the previous
        step's. Returns the shared workspace."""
        shared = self.shared
        if shared is None or shared.allocation is None:
            self.check_alive()  # raises, saying why
        shared.order.check(call)
        shared.stream.order()
        return shared

    def require_pending(self, what: str) -> tuple[int, int, torch.Tensor]:
        """The received dispatch that a step named ``what`` works on (it needs what combine_input needs)."""
        self.check_alive()
        self.shared.order.check("combine_input", what)
        return self.shared.pending

    def _check_same_call(self, runtime_max: int) -> None:
        """Debug mode: every rank makes the same call with the same runtime_max (a host round trip)."""
        mine = f"{self.calls}:{runtime_max}".encode()
        passed, reason = barrier_within(self.comm, self.timeout_s)  # FLASHINFER_A2A_TIMEOUT_S, not the group's
        if not passed:
            raise RuntimeError(f"debug check of dispatch call {self.calls}: rank {self.comm.rank} waited "
                               f"{self.timeout_s:g} s for the other ranks ({reason}); a rank that did not arrive "
                               "crashed, hung, or makes fewer dispatch calls")
        seen = [s.decode() for s in self.comm.allgather(mine)]
        if len(set(seen)) != 1:
            detail = ", ".join(f"rank {r}: call {s.split(':')[0]} runtime_max {s.split(':')[1]}"
                               for r, s in enumerate(seen))
            raise RuntimeError(f"ranks disagree on the dispatch call sequence ({detail}); every rank must call "
                               "dispatch/combine the same number of times with the same runtime_max_tokens_per_rank")
