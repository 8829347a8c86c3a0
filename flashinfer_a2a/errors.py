"""Errors the device records, turned into Python exceptions that name the rank and the peer."""

from __future__ import annotations

import functools

import torch

from . import ops

# ErrorCode and Phase in include/flashinfer_a2a/workspace_layout.cuh.
_TIMEOUT, _INVALID_EXPERT_ID, _RUNTIME_MAX_MISMATCH = 1, 2, 3
_PHASES = {0: "none", 1: "dispatch", 2: "combine"}


class A2AError(RuntimeError):
    """A failure recorded by the kernels of one rank. ``peer`` is the rank involved (-1 if none).

    After a timeout or a runtime_max mismatch the ranks are out of step: later calls on the workspace do nothing
    until it is initialized again on every rank.
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


@functools.cache
def metadata_offsets() -> dict[str, int]:
    """Byte offsets of the metadata fields (they do not depend on the workspace sizes).

    Read from the C++ layout by initializing a minimal workspace on the CPU: Python never re-derives offsets.
    """
    sizes = (1, 1, 1, 0, 0)
    from .functional import empty_workspace

    workspace = empty_workspace(1, ops.get_workspace_size(*sizes), "cpu")
    metainfo = torch.empty(len(ops.METAINFO_NAMES), dtype=torch.int64)
    ops.initialize(workspace, metainfo, 0, *sizes)
    index = ops.get_metainfo_index_pairs()
    return {name: int(metainfo[int(index[i])]) for i, name in enumerate(ops.METAINFO_NAMES)}


def read_error(workspace: torch.Tensor, ep_rank: int) -> tuple[int, int, int, int, int]:
    """(code, phase, peer, epoch, detail) of rank ``ep_rank``'s error record; synchronizes with the device."""
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

    Synchronizes with the device. ``FLASHINFER_A2A_DEBUG=1`` runs it after every eager op.
    """
    code, phase_id, peer, epoch, detail = read_error(workspace, ep_rank)
    if code == 0:
        return
    phase = _PHASES.get(phase_id, str(phase_id))
    where = f"flashinfer_a2a rank {ep_rank}, {phase} epoch {epoch}"
    if code == _INVALID_EXPERT_ID:
        raise ValueError(
            f"{where}: topk_ids holds an expert id outside [-1, num_experts) at flat index {detail}; "
            "the id was skipped, not routed (re-initialize the workspace to clear this record)"
        )
    if code == _TIMEOUT:
        message = (
            f"{where}: timed out waiting for rank {peer}. Rank {peer} did not reach the same {phase} call "
            "(crashed, hung, or called dispatch/combine a different number of times). Re-initialize the workspace "
            "on every rank before the next call."
        )
    elif code == _RUNTIME_MAX_MISMATCH:
        message = (
            f"{where}: rank {peer} dispatched with runtime_max_tokens_per_rank={detail}, this rank with another "
            "value; every rank must pass the same value to the same call. Re-initialize the workspace on every rank."
        )
    else:
        message = f"{where}: unknown error code {code} (peer {peer}, detail {detail})"
    raise A2AError(message, ep_rank=ep_rank, code=code, phase=phase, peer=peer, epoch=epoch, detail=detail)
