"""MoeAlltoAll's argument checks, which run before any GPU work (the class itself is exercised in tests/multigpu)."""

import pytest

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.library.combine_mode import push_min_tokens


class _OneRank:
    """A communicator of one rank. Its only collective may be the construction agreement, which comes before the
    argument checks (so that a bad argument on one rank fails every rank, tests/test_reliability.py); nothing after
    it may be reached."""

    rank, size = 0, 1

    def __init__(self):
        self.gathers = 0

    def allgather(self, data):
        self.gathers += 1
        assert self.gathers == 1, "argument checks must come right after the agreement, before any other collective"
        return [bytes(data)]

    def broadcast(self, data, root=0):
        raise AssertionError("argument checks must come before any other collective")

    barrier = broadcast


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_tokens=8, top_k=2, num_experts=4), "hidden_size"),
        (dict(max_num_tokens=8, top_k=0, num_experts=4, hidden_size=64), "top_k"),
        (dict(max_num_tokens=8, top_k=33, num_experts=4, hidden_size=64), "top_k"),
        (dict(max_num_tokens=8, top_k=2, num_experts=0, hidden_size=64), "num_experts"),
        (dict(max_num_tokens=8, top_k=2, num_experts=4, dispatch_bytes_per_token=64), "hidden_size"),
        (dict(max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, dispatch_format="fp4"),
         "dispatch_format must be one of fp8_block, mxfp8, nvfp4, got 'fp4'"),
        (dict(max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, push_combine=True,
              combine_bytes_per_token=100),
         "combine_bytes_per_token=100 is too small for the pushed combine .* needs >= 256"),
        (dict(max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, combine_format="fp8_block",
              combine_bytes_per_token=200),
         "combine_bytes_per_token=200 is too small .* needs >= 208"),
        (dict(max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, combine_format="mxfp8"),
         "combine_format must be None or 'fp8_block', got 'mxfp8'"),
        (dict(max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, push_combine="yes"),
         "push_combine must be None .* True or False, got 'yes'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoeAlltoAll(_OneRank(), **kwargs)


def test_group_must_be_a_communicator():
    with pytest.raises(TypeError, match="group"):
        MoeAlltoAll(object(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64)


@pytest.mark.parametrize(
    "kwargs, combine_bytes",
    [
        (dict(), 64 * 2),
        (dict(push_combine=True), 2 * 64 * 2),  # the partial and its landing row
        (dict(combine_format="fp8_block"), 64 * 2 + 80),  # FP8 landing row: 64 values + 1 fp32 scale -> 80
        (dict(combine_format="fp8_block", push_combine=True), 2 * 64 * 2),  # room for both wires
        (dict(push_combine=True, combine_bytes_per_token=300), 300),  # explicit sizes win, if the push fits
        (dict(combine_bytes_per_token=1000), 1000),  # room for a push nobody asked for: still pulled
    ],
)
def test_combine_row_sizing(monkeypatch, kwargs, combine_bytes):
    assert _combine_bytes(monkeypatch, 8, "nvlink", kwargs) == combine_bytes


PUSH_AT = push_min_tokens(1)  # _OneRank's layers: the threshold of plain partials on one (or two) ranks


@pytest.mark.parametrize(
    "max_tokens, transport, kwargs, combine_bytes",
    [
        (PUSH_AT, "nvlink", dict(), 2 * 64 * 2),  # the push is the faster combine from there: room for it
        (PUSH_AT - 1, "nvlink", dict(), 64 * 2),  # it would never push
        (PUSH_AT, "nccl", dict(), 64 * 2),  # no pushed combine over these
        (PUSH_AT, "hierarchical", dict(), 64 * 2),
        (PUSH_AT, "nvlink", dict(push_combine=False), 64 * 2),  # the smaller workspace, always pulled
        (PUSH_AT, "nvlink", dict(combine_format="fp8_block"), 2 * 64 * 2),  # room for both wires
        (PUSH_AT, "nvlink", dict(combine_bytes_per_token=130), 130),  # explicit sizes: pulled
    ],
)
def test_default_push_combine_sizing(monkeypatch, max_tokens, transport, kwargs, combine_bytes):
    assert _combine_bytes(monkeypatch, max_tokens, transport, kwargs) == combine_bytes


def _combine_bytes(monkeypatch, max_tokens, transport, kwargs):
    """The combine bytes per token MoeAlltoAll asks for, with `transport` as what "auto" resolved to."""
    from flashinfer_a2a import moe_alltoall

    class Sized(Exception):
        pass

    def config(ep_size, max_num_tokens, dispatch_bytes_per_token, combine_bytes_per_token, top_k):
        raise Sized(combine_bytes_per_token)

    monkeypatch.setattr(moe_alltoall.F, "WorkspaceConfig", config)
    monkeypatch.setattr(moe_alltoall, "resolve_transport", lambda comm, chosen, device: transport)
    with pytest.raises(Sized) as sized:
        MoeAlltoAll(_OneRank(), max_num_tokens=max_tokens, top_k=2, num_experts=4, hidden_size=64, **kwargs)
    return sized.value.args[0]
