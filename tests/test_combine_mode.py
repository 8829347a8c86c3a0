"""The combine mode is named, never inferred: its codes come from the library, the fake refuses what the C++ entry
refuses (a push without one GPU per rank or without landing room, an unknown code), the functional API refuses an
unknown name before any launch, and MoeAlltoAll pushes only where its construction asked for it. Builds the library
(no GPU needed)."""

from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashinfer_a2a as fa
from flashinfer_a2a.library import constants
from flashinfer_a2a.library.combine_mode import (COMBINE_MODES, combine_mode_code, default_push_combine,
                                                 push_min_tokens, pushed_wires)
from flashinfer_a2a.functional import empty_workspace
from flashinfer_a2a.moe_alltoall import MoeAlltoAll
from flashinfer_a2a.transports.nvlink import NvlinkTransport
from flashinfer_a2a.library.wire_formats import push_combine_bytes_per_token

pytestmark = pytest.mark.usefixtures("a2a_env")

HIDDEN = 256
PUSH_ROOM = push_combine_bytes_per_token(HIDDEN, torch.bfloat16)  # 1024: the partial and its landing row


def _config(combine_bytes: int) -> fa.WorkspaceConfig:
    return fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, top_k=4, dispatch_bytes_per_token=4096,
                              combine_bytes_per_token=combine_bytes)


def test_mode_codes_are_the_librarys():
    lib = constants.library_constants()
    assert COMBINE_MODES == {"pull": lib["combine_pull"], "push": lib["combine_push"]}
    assert len(set(COMBINE_MODES.values())) == 2
    assert combine_mode_code("push") == lib["combine_push"]
    with pytest.raises(ValueError, match="combine_mode must be one of 'pull', 'push', got 'auto'"):
        combine_mode_code("auto")


def _fake_combine(combine_bytes: int, *, mode: int, one_gpu_per_rank: bool, quant_format: int = 0,
                  hidden: int = HIDDEN):
    config = _config(combine_bytes)
    with FakeTensorMode():
        ws = torch.empty(2, config.bytes_per_rank, dtype=torch.uint8, device="cuda")
        counts = torch.empty(2, dtype=torch.int32, device="cuda")
        out = torch.empty(5, hidden, dtype=torch.bfloat16, device="cuda")
        torch.ops.flashinfer_a2a.combine(ws, None, counts, out, 1, *config.sizes(), 16, 10.0, one_gpu_per_rank,
                                         quant_format, mode)


def test_fake_accepts_what_the_mode_allows():
    push, pull = COMBINE_MODES["push"], COMBINE_MODES["pull"]
    _fake_combine(PUSH_ROOM, mode=push, one_gpu_per_rank=True)
    _fake_combine(push_combine_bytes_per_token(HIDDEN, torch.bfloat16, "fp8_block"), mode=push, one_gpu_per_rank=True,
                  quant_format=1)
    # A pulled combine stays pulled whatever room the rows have, with or without one GPU per rank.
    _fake_combine(4 * PUSH_ROOM, mode=pull, one_gpu_per_rank=True)
    _fake_combine(HIDDEN * 2, mode=pull, one_gpu_per_rank=False)


@pytest.mark.parametrize("combine_bytes, kwargs, message", [
    (PUSH_ROOM, dict(mode=2, one_gpu_per_rank=True), r"combine_mode must be 0 \(pull\) or 1 \(push\), got 2"),
    (PUSH_ROOM, dict(mode=1, one_gpu_per_rank=False), r"combine_mode=1 \(push\) needs one_gpu_per_rank"),
    (PUSH_ROOM - 16, dict(mode=1, one_gpu_per_rank=True),
     rf"push\) of hidden={HIDDEN} needs combine_bytes_per_token >= {PUSH_ROOM} .* sized for {PUSH_ROOM - 16}"),
    # Room for the FP8 landing row (256 + 16 bytes of a scale, padded) but not for a plain one.
    (HIDDEN * 2 + 272, dict(mode=1, one_gpu_per_rank=True), rf"needs combine_bytes_per_token >= {PUSH_ROOM}"),
    (HIDDEN * 2 + 256, dict(mode=1, one_gpu_per_rank=True, quant_format=1),
     r"over the FP8 wire needs combine_bytes_per_token >= 784"),
])
def test_fake_refuses_a_push_it_cannot_do(combine_bytes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _fake_combine(combine_bytes, **kwargs)


def test_functional_combine_refuses_an_unknown_mode_before_any_launch():
    config = _config(PUSH_ROOM)
    workspace = empty_workspace(2, config.bytes_per_rank, "cpu")  # a launch would fail differently on the CPU
    counts = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="combine_mode must be one of 'pull', 'push', got 'Push'"):
        fa.combine(workspace, 0, config, counts, 4, 16, hidden=HIDDEN, dtype=torch.bfloat16, combine_mode="Push")


@pytest.mark.parametrize("push_combine, combine_format, one_gpu_per_rank, want", [
    (False, None, True, {None: "pull", "fp8_block": "pull"}),
    (True, None, True, {None: "push", "fp8_block": "push"}),  # room for the plain landing row fits the FP8 one
    (False, "fp8_block", True, {None: "pull", "fp8_block": "push"}),
    (True, None, False, {None: "pull", "fp8_block": "pull"}),  # ranks sharing a GPU always pull
    (False, "fp8_block", False, {None: "pull", "fp8_block": "pull"}),
])
@pytest.mark.parametrize("ep_size", [2, 4])
def test_moe_alltoall_pushes_only_where_asked(push_combine, combine_format, one_gpu_per_rank, want, ep_size):
    a2a = MoeAlltoAll.__new__(MoeAlltoAll)  # the mode needs no workspace: only the construction's choices
    a2a._transport = NvlinkTransport.__new__(NvlinkTransport)
    a2a._transport.comm = types.SimpleNamespace(size=ep_size)
    a2a._transport.pushed_wires = pushed_wires(push_combine, combine_format)
    a2a._transport.shared = types.SimpleNamespace(allocation=types.SimpleNamespace(one_gpu_per_rank=one_gpu_per_rank),
                                                  pending=None, config=types.SimpleNamespace(max_num_tokens=8192))
    assert {wire: a2a.combine_mode(wire) for wire in want} == want
    # Either wire is pushed from push_min_tokens(ep_size, wire) tokens per rank only.
    small = {wire: a2a.combine_mode(wire, push_min_tokens(ep_size, wire) - 1) for wire in want}
    assert small == {None: "pull", "fp8_block": "pull"}
    assert {wire: a2a.combine_mode(wire, push_min_tokens(ep_size, wire)) for wire in want} == want
    a2a._transport.shared.pending = (10, 16, None)  # a pending dispatch of runtime_max 16: its size decides
    assert a2a.combine_mode() == "pull"
    with pytest.raises(ValueError, match="combine quant_format must be None or 'fp8_block', got 'nvfp4'"):
        a2a.combine_mode("nvfp4")


def test_push_threshold_by_ranks_and_wire():
    """Pushing plain partials pays from 4096 tokens per rank on two ranks and from 2048 on more (pulling from several
    peers at once is slower); over the FP8 wire from 2048 and 128. The default sizing (room for plain partials)
    follows the plain threshold, on the nvlink transport only."""
    assert [push_min_tokens(n) for n in (1, 2, 3, 4, 8, 72)] == [4096, 4096, 2048, 2048, 2048, 2048]
    assert [push_min_tokens(n, "fp8_block") for n in (1, 2, 3, 4, 8, 72)] == [2048, 2048, 128, 128, 128, 128]
    assert default_push_combine(2048, 4, "nvlink") and not default_push_combine(2047, 4, "nvlink")
    assert not default_push_combine(2048, 2, "nvlink") and default_push_combine(4096, 2, "nvlink")
    assert not default_push_combine(8192, 4, "nccl") and not default_push_combine(8192, 4, "hierarchical")


@pytest.mark.parametrize("combine_bytes, refused", [(PUSH_ROOM, False), (PUSH_ROOM - 16, True)])
def test_a_pushed_combine_traces_fullgraph_and_is_checked_at_trace_time(combine_bytes, refused):
    config = _config(combine_bytes)

    def layer(workspace, counts, partials):
        return fa.combine(workspace, 0, config, counts, 10, 16, partials, one_gpu_per_rank=True, combine_mode="push")

    workspace = torch.empty(2, config.bytes_per_rank, dtype=torch.uint8, device="meta")
    counts = torch.empty(2, dtype=torch.int32, device="meta")
    partials = torch.empty(2, 16, HIDDEN, dtype=torch.bfloat16, device="meta")
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    if refused:
        with pytest.raises(Exception, match=rf"needs combine_bytes_per_token >= {PUSH_ROOM}"):
            compiled(workspace, counts, partials)
    else:
        out = compiled(workspace, counts, partials)
        assert out.shape == (10, HIDDEN) and out.dtype == torch.bfloat16
