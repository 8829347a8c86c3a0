"""The eager path of :class:`flashinfer_a2a.MoeAlltoAll`: dispatch and combine with the arguments that stay fixed
for one instance (workspace, counts tensor, rank, sizes, experts, SM budget) bound once in C++.

An engine's decode loop calls dispatch and combine eagerly, and every argument that crosses into C++ costs host time
(about half a microsecond a tensor). Bound, a call passes only what changes: the ids, the payloads or the output,
and a few numbers. The C++ still checks every call before it launches; when it refuses one, the host checks of
:mod:`flashinfer_a2a.functional` run to name the mistake in the caller's terms. The receive views and the zero-copy
combine input are made once per shape. Calls that torch.compile traces go through the registered ops
(:mod:`flashinfer_a2a.library.ops`) instead.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import functional as F
from ..library import ops
from ..library.checks import check_dispatch_call, global_scale_tensor
from ..library.constants import COMBINE_PULL, SPLIT_SEND
from ..library.errors import debug_check, debug_check_ids
from ..library.wire_formats import check_combine_format, wire_format

_MAX_VIEW_SHAPES = 64  # distinct receive-view shapes kept (runtime_max may vary per step): past it, start over


class EagerCalls:
    """One MoeAlltoAll's eager launches on one workspace allocation (made again when the workspace moves).

    Args:
        combine_mode: the ``combine`` op's mode code for a combine ``quant_format`` (None, ``"fp8_block"``) after a
            dispatch of ``runtime_max`` tokens per rank: ``combine_mode(quant_format, runtime_max)``.
        debug: check the ids on the host before a dispatch and the error record after each call (slow).
    """

    def __init__(self, workspace: torch.Tensor, recv_counts: torch.Tensor, ep_rank: int, config: F.WorkspaceConfig,
                 num_experts: int, num_sms: int, one_gpu_per_rank: bool, combine_mode: Callable[[Optional[str], int], int],
                 debug: bool) -> None:
        self.workspace, self.config, self.ep_rank, self.num_experts = workspace, config, ep_rank, num_experts
        self.device, self.combine_mode, self.debug = workspace.device, combine_mode, debug
        self.recv_counts = recv_counts  # passed to each receive: tvm-ffi takes torch's current stream from a tensor
        self._dispatch, self._dispatch_recv, self._combine = ops.bind_eager_calls(
            workspace, recv_counts, ep_rank, config.sizes(), num_experts, num_sms, one_gpu_per_rank)
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self._inputs: dict[tuple, torch.Tensor] = {}
        self._rowless: dict[tuple, torch.Tensor] = {}  # a combine send's out: its row shape only

    def dispatch(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int, timeout_s: float,
                 quant_format: Optional[str] = None, global_scale: Optional[torch.Tensor | float] = None,
                 swizzled_scales: bool = False, phase: int = 0,
                 eplb_local_stats: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Launches a dispatch (``phase`` 1: its send half) into the bound counts tensor; returns the receive views,
        made once per call shape (the C++ names the payloads' row shapes by an id, so they are not read here)."""
        code = 0 if quant_format is None else wire_format(quant_format, "quant_format").code
        if global_scale is not None and not isinstance(global_scale, torch.Tensor):
            global_scale = global_scale_tensor(global_scale, self.workspace)
        if self.debug:  # the host checks first, as the functional call makes them
            check_dispatch_call(topk_ids, payloads, runtime_max, quant_format)
            debug_check_ids(topk_ids, self.num_experts)
        try:
            shape_id = self._dispatch(topk_ids, payloads, runtime_max, timeout_s, code, global_scale,
                                      swizzled_scales, phase, eplb_local_stats)
        except (TypeError, ValueError) as exc:  # refused before any launch
            check_dispatch_call(topk_ids, payloads, runtime_max, quant_format)  # a clearer message, if it has one
            raise type(exc)(str(exc)) from None
        if self.debug:
            debug_check(self.workspace, self.ep_rank, True)
        key = (shape_id, runtime_max, quant_format, swizzled_scales)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_VIEW_SHAPES:
                self._views.clear()
            views = self._views[key] = F.recv_views(self.workspace, self.ep_rank, self.config, runtime_max, payloads,
                                                    quant_format=quant_format, swizzled_scales=swizzled_scales)
        return list(views)

    def dispatch_recv(self, runtime_max: int, timeout_s: float) -> None:
        """The receive half of a dispatch sent with ``phase`` 1: waits for the peers and writes the bound counts."""
        try:
            self._dispatch_recv(self.recv_counts, runtime_max, timeout_s)
        except (TypeError, ValueError) as exc:  # refused before any launch
            raise type(exc)(str(exc)) from None
        if self.debug:
            debug_check(self.workspace, self.ep_rank, True)

    def combine_input(self, runtime_max: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """The zero-copy combine input (:func:`flashinfer_a2a.functional.combine_input`), made once per shape."""
        key = (runtime_max, hidden, dtype)
        view = self._inputs.get(key)
        if view is None:
            if len(self._inputs) >= _MAX_VIEW_SHAPES:
                self._inputs.clear()
            view = self._inputs[key] = F.combine_input(self.workspace, self.ep_rank, self.config, runtime_max,
                                                       hidden, dtype)
        return view

    def combine(self, partials: Optional[torch.Tensor], out: Optional[torch.Tensor], num_tokens: int, hidden: int,
                dtype: torch.dtype, runtime_max: int, timeout_s: float, quant_format: Optional[str] = None,
                phase: int = 0) -> torch.Tensor:
        """Launches the combine of the dispatch that wrote the bound counts tensor (``phase`` 0), its send half (1,
        ``out`` and ``num_tokens`` unused) or its receive half (2); returns ``out`` (made when None). A split combine
        is pulled."""
        if phase == SPLIT_SEND:  # writes no output: a row-less out carries the row shape and dtype
            if partials is not None:
                hidden, dtype = partials.shape[-1], partials.dtype
            out = self._rowless.get((hidden, dtype))
            if out is None:
                out = self._rowless[(hidden, dtype)] = torch.empty(0, hidden, dtype=dtype, device=self.device)
        elif partials is None and out is None:
            out = torch.empty(num_tokens, hidden, dtype=dtype, device=self.device)
        else:
            out = F.combine_output(self.workspace, num_tokens, partials, out, hidden, dtype)
        if quant_format is not None:
            check_combine_format(quant_format, "combine quant_format")
        mode = COMBINE_PULL if phase else self.combine_mode(quant_format, runtime_max)
        try:
            self._combine(partials, out, runtime_max, timeout_s, 0 if quant_format is None else 1, mode, phase)
        except (TypeError, ValueError) as exc:  # refused before any launch
            raise type(exc)(str(exc)) from None
        if self.debug:
            debug_check(self.workspace, self.ep_rank, True)
        return out
