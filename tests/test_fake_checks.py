"""Every C++ refusal of the ops' entries has its counterpart in the ops' fake implementations, refusing for the same
reason.

The C++ refusals are read from the sources (:mod:`tests.cxx_checks`; tests/test_cxx_checks.py checks, with no build,
that :data:`tests.fake_check_table.TABLE` has a row for each, and that each row's message pattern is part of the
message of the C++ check it stands for). Each row's inputs are run through the op under ``FakeTensorMode`` (fake
CUDA tensors, no GPU needed) and must be refused with the exception type the C++ raises and a message matching the
row's pattern: a refusal by another check fails. The attempts of an unreachable row must be refused by the earlier
check it names. With a GPU, :func:`test_the_library_refuses_what_the_fake_refuses` hands the same inputs to the real
op, held to the same patterns.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flashinfer_a2a import functional as F
from flashinfer_a2a.jit import get_a2a_module

from .fake_check_table import (SIZES, Bad, call_op, cases, counts, fp8_combine, ids, push_combine, quantizing,
                               rows, ws_bytes)

pytestmark = pytest.mark.usefixtures("a2a_env")


def assert_refused_for(case: Bad, run: Callable[[], None]) -> None:
    """Runs ``run`` (``case``'s input through the fake or the library): it must raise ``case.error`` with a message
    matching ``case.match``, a pattern read off the C++ check's message (tests/test_cxx_checks.py)."""
    with pytest.raises(case.error, match=case.match) as info:
        run()
    assert "Check failed" not in str(info.value)


@pytest.mark.parametrize("op", ["get_workspace_size", "initialize", "dispatch", "dispatch_recv", "combine",
                                "sanitize_expert_ids"])
def test_the_valid_arguments_pass_the_fake(op):
    """What the rows change starts valid: a refusal comes from the one mistake each makes."""
    with FakeTensorMode():
        call_op(op, {})
        if op == "dispatch":
            for fmt in (1, 2, 3):
                call_op(op, quantizing(fmt))
            call_op(op, quantizing(2, swizzled_scales=True))
        if op == "combine":
            call_op(op, fp8_combine())
            call_op(op, push_combine())


@pytest.mark.parametrize(("key", "case"), cases())
def test_the_fake_refuses(key, case):
    with FakeTensorMode():
        assert_refused_for(case, case.run)


@pytest.mark.parametrize(("key", "case"), cases(unreachable=True))
def test_the_fake_refuses_an_unreachable_rows_attempts_earlier(key, case):
    """Each attempt breaks the unreachable check's condition; its pattern is the earlier check's message."""
    with FakeTensorMode():
        assert_refused_for(case, case.run)


def test_a_refusal_for_another_reason_fails_the_row():
    """What the GPU test once let pass: the right exception type with another check's message."""
    case = Bad("dispatch", dict, ValueError, r"ep_rank must be in \[0, ep_size=2\)")

    def refuse(message):
        def run():
            raise ValueError(message)
        return run

    assert_refused_for(case, refuse("ep_rank must be in [0, ep_size=2), got 2"))
    with pytest.raises(AssertionError, match="Regex pattern did not match"):
        assert_refused_for(case, refuse("ep_size must be in [1, 72], got 0"))


def test_a_traced_dispatch_with_rows_too_wide_fails_at_trace_time():
    """Issue #43: the workspace's dispatch bytes per token bound the payload rows under torch.compile too."""
    config = F.WorkspaceConfig(**SIZES)

    def layer(workspace_, topk_ids, x):
        (recv,), _ = F.dispatch(workspace_, 0, config, topk_ids, [x], 16, 8)
        return recv

    args = (torch.empty(2, config.bytes_per_rank, dtype=torch.uint8, device="meta"),
            torch.empty(5, 4, dtype=torch.int32, device="meta"), torch.empty(5, 2049, dtype=torch.bfloat16,
                                                                             device="meta"))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError) as info:
        torch.compile(layer, fullgraph=True, backend="eager")(*args)
    assert "flashinfer_a2a.dispatch" in str(info.value)
    assert "ValueError('payloads need 4098 bytes per token" in str(info.value)


def test_the_library_names_a_none_payload():
    """The C++ entry refuses a None in the payload list itself (before the workspace: no GPU needed)."""
    workspace_ = F.empty_workspace(2, ws_bytes(), "cpu")
    with pytest.raises(TypeError, match=r"^payloads\[1\] must be a tensor, got None$"):
        get_a2a_module().dispatch(workspace_, ids(5, 4, device="cpu"), [rows(5, 8, device="cpu"), None],
                                  counts(device="cpu"), 0, *SIZES.values(), 16, 8, 10.0, 0, None, False, 0, 0, False, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("key", "case"), [p for p in cases() + cases(unreachable=True) if p.values[1].real])
def test_the_library_refuses_what_the_fake_refuses(key, case):
    """The same inputs on a GPU, through the op's real implementation: the C++ refuses each alike, with the row's
    message, before any launch (a launch would wait for rank 1, which never comes, and fail the test by its
    timeout). An unreachable row's attempts are refused by the earlier check its row names."""
    assert_refused_for(case, case.run_real)
    torch.cuda.synchronize()
