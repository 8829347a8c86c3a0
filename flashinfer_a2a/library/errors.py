"""Errors the device records, turned into Python exceptions that name the rank and the peer."""

from __future__ import annotations

import contextvars
from typing import Optional

import torch

from .. import config as _config
from .checks import check_topk_ids_on_host

from .constants import call_layout_fields, library_constants
from .layout import metadata_offsets


class A2AError(RuntimeError):
    """A failure recorded by the kernels of one rank. ``peer`` is the rank involved (-1 if none).

    After a timeout, a runtime_max or a call-layout mismatch the ranks are out of step: later calls on the workspace
    do nothing until it is initialized again on every rank.
    """

    def __init__(self, message: str, *, ep_rank: int, code: int, phase: str, peer: int, epoch: int, detail: int):
        super().__init__(message)
        self.ep_rank, self.code, self.phase, self.peer, self.epoch, self.detail = (
            ep_rank,
            code,
            phase,
            peer,
            epoch,
            detail,
        )


def _code_names() -> dict[int, str]:
    c = library_constants()
    return {c[f"error_{name}"]: name for name in ("none", "timeout", "invalid_expert_id", "runtime_max_mismatch",
                                                 "call_layout_mismatch")}


def _phase_names() -> dict[int, str]:
    c = library_constants()
    return {c[f"phase_{name}"]: name for name in ("none", "dispatch", "combine")}


def describe_call_layout(difference: int) -> list[str]:
    """The fields of a dispatch call's layout that differ, from the XOR of two ranks' fingerprints."""
    return [name for name, (shift, bits) in call_layout_fields().items() if (difference >> shift) & ((1 << bits) - 1)]


def _check_workspace_and_rank(workspace, ep_rank) -> None:
    if not isinstance(workspace, torch.Tensor) or workspace.dim() != 2 or workspace.dtype != torch.uint8:
        got = (f"{workspace.dtype} tensor of shape {tuple(workspace.shape)}" if isinstance(workspace, torch.Tensor)
               else type(workspace).__name__)
        raise TypeError(f"workspace must be a [ep_size, bytes_per_rank] uint8 tensor, got {got}")
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, int):
        raise TypeError(f"ep_rank must be an int, got {type(ep_rank).__name__} {ep_rank!r}")
    if not 0 <= ep_rank < workspace.shape[0]:
        raise ValueError(f"ep_rank must be in [0, ep_size={workspace.shape[0]}) of this workspace, got {ep_rank}")


def read_error(workspace: torch.Tensor, ep_rank: int) -> tuple[int, int, int, int, int]:
    """(code, phase, peer, epoch, detail) of rank ``ep_rank``'s error record; synchronizes with the device."""
    _check_workspace_and_rank(workspace, ep_rank)
    off = metadata_offsets()
    row = workspace[ep_rank]

    def field(name: str, dtype: torch.dtype) -> int:
        start = off[name]
        return int(row[start : start + dtype.itemsize].view(dtype).item())

    return (
        field("error_code_offset", torch.int32),
        field("error_phase_offset", torch.int32),
        field("error_peer_offset", torch.int32),
        field("error_epoch_offset", torch.int32) & 0xFFFFFFFF,
        field("error_detail_offset", torch.int64),
    )


def check_error(workspace: torch.Tensor, ep_rank: int) -> None:
    """Raises :class:`A2AError` (or ValueError for an invalid expert id) if rank ``ep_rank`` recorded an error.

    Synchronizes with the device. ``FLASHINFER_A2A_DEBUG=1`` runs it after every eager op. A record no kernel can
    have written (the workspace was never initialized, or was overwritten) raises :class:`A2AError` saying so.
    """
    code, phase_id, peer, epoch, detail = read_error(workspace, ep_rank)
    codes = _code_names()
    name = codes.get(code)
    if name == "none":
        return
    phase = _phase_names().get(phase_id)
    if name is None or phase is None or not -1 <= peer < workspace.shape[0]:
        message = (
            f"flashinfer_a2a rank {ep_rank}: the error record holds code {code}, phase {phase_id}, peer {peer}, "
            "which no kernel writes: this rank's workspace was not initialized (call initialize on every rank, "
            "then a barrier, before the first dispatch) or its metadata was overwritten"
        )
        raise A2AError(message, ep_rank=ep_rank, code=code, phase=str(phase_id), peer=peer, epoch=epoch,
                       detail=detail)
    where = f"flashinfer_a2a rank {ep_rank}, {phase} epoch {epoch}"
    if name == "invalid_expert_id":
        raise ValueError(
            f"{where}: topk_ids holds an expert id outside [-1, num_experts) at flat index {detail}; "
            "the id was skipped, not routed (re-initialize the workspace to clear this record)"
        )
    if name == "timeout":
        message = (
            f"{where}: timed out waiting for rank {peer}. Rank {peer} did not reach the same {phase} call "
            "(crashed, hung, or called dispatch/combine a different number of times). Re-initialize the workspace "
            "on every rank before the next call."
        )
    elif name == "runtime_max_mismatch":
        message = (
            f"{where}: rank {peer} dispatched with runtime_max_tokens_per_rank={detail}, this rank with another "
            "value; every rank must pass the same value to the same call. Re-initialize the workspace on every rank."
        )
    else:  # call_layout_mismatch
        fields = describe_call_layout(detail & 0xFFFFFFFFFFFFFFFF)
        message = (
            f"{where}: rank {peer} dispatched with another call layout than this rank (differing: "
            f"{', '.join(fields) or 'unknown'}); its rows were not received (recv_counts[{peer}] = 0). Every rank "
            "must dispatch the same payload row shapes and dtypes, topk_ids dtype and width, and quant_format. "
            "Re-initialize the workspace on every rank."
        )
    raise A2AError(message, ep_rank=ep_rank, code=code, phase=phase, peer=peer, epoch=epoch, detail=detail)


# Set while one process launches several ranks' calls (simulated ranks): a host sync after one rank's call would
# wait on kernels that wait on ranks not launched yet, so the debug check runs once all are launched.
DEFER_DEBUG_CHECKS = contextvars.ContextVar("flashinfer_a2a_defer_debug_checks", default=False)


def debug_enabled(debug: Optional[bool]) -> bool:
    """``debug``, or ``FLASHINFER_A2A_DEBUG`` when None."""
    return _config.debug() if debug is None else debug


def eager_call() -> bool:
    """Neither tracing nor capturing a CUDA graph (a torch without CUDA captures nothing)."""
    return not torch.compiler.is_compiling() and not (torch.cuda.is_available()
                                                      and torch.cuda.is_current_stream_capturing())


def debug_checks_due(debug: Optional[bool] = None) -> bool:
    """Whether the eager debug check should run now: ``debug`` (default ``FLASHINFER_A2A_DEBUG``) and an eager
    call that is neither deferred (simulated ranks) nor captured."""
    return debug_enabled(debug) and not DEFER_DEBUG_CHECKS.get() and eager_call()


def debug_check_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Debug mode, before a dispatch: its ids checked on the host, in eager calls (this waits on this rank's stream
    only, never on peers)."""
    if eager_call():
        check_topk_ids_on_host(topk_ids, num_experts)


def debug_check(workspace: torch.Tensor, ep_rank: int, debug: Optional[bool]) -> None:
    if debug_checks_due(debug):
        check_error(workspace, ep_rank)
