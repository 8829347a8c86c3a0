"""MoeAlltoAll's argument checks, which run before any GPU work (the class itself is exercised in tests/multigpu)."""

import pytest

from flashinfer_a2a import MoeAlltoAll


class _OneRank:
    """A communicator of one rank; the checks below must fail before it is ever used."""

    rank, size = 0, 1

    def allgather(self, data):
        raise AssertionError("argument checks must come before any collective")

    broadcast = barrier = allgather


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
        (dict(max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, combine_format="mxfp8"),
         "combine_format must be None or 'fp8_block', got 'mxfp8'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoeAlltoAll(_OneRank(), **kwargs)


def test_group_must_be_a_communicator():
    with pytest.raises(TypeError, match="group"):
        MoeAlltoAll(object(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64)
