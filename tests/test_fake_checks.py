"""Every check of the C++ entry points has its counterpart in the ops' fake implementations.

The C++ checks are read from csrc/ (:mod:`tests.cxx_checks`); :data:`tests.fake_check_table.TABLE` holds, for each,
inputs the C++ refuses. Each is run through the op under ``FakeTensorMode`` (fake CUDA tensors, no GPU needed) and
must be refused with the exception type the C++ raises, by a message naming the argument. A C++ check without a row
fails :func:`test_every_cxx_check_has_a_row`. With a GPU, :func:`test_the_library_refuses_what_the_fake_refuses`
hands the same inputs to the real op.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flashinfer_a2a import functional as F
from flashinfer_a2a.jit import get_a2a_module

from .cxx_checks import read_cxx_checks
from .fake_check_table import (SIZES, TABLE, Unreachable, call_op, cases, counts, fp8_combine, ids, push_combine,
                               quantizing, rows, ws_bytes)

pytestmark = pytest.mark.usefixtures("a2a_env")


def test_every_cxx_check_has_a_row():
    checks = read_cxx_checks()
    assert checks.unreached == [], f"functions with checks no op reaches (give them an op, or say why): " \
                                   f"{checks.unreached}"
    missing = [key for key in checks.rows if key not in TABLE]
    stale = [key for key in TABLE if key not in checks.rows]
    assert not missing, "C++ checks without a row in TABLE (add inputs that fail them, and their fake checks):\n" + \
        "\n".join(missing)
    assert not stale, "TABLE rows whose C++ check is gone:\n" + "\n".join(stale)


def test_rows_expect_the_exception_the_cxx_raises():
    checks = read_cxx_checks()
    for key, kind in checks.rows.items():
        row = TABLE[key]
        if isinstance(row, Unreachable):
            continue
        if kind == "call":  # a helper's checks: one of the kinds it raises
            kinds = checks.kinds[key.split(": ", 1)[1].split("(", 1)[0]]
        else:
            kinds = {kind}
        for case in row if isinstance(row, tuple) else (row,):
            assert case.error.__name__ in kinds, f"{key}: expects {case.error.__name__}, the C++ raises {kinds}"


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


@pytest.mark.parametrize("case", cases())
def test_the_fake_refuses(case):
    with FakeTensorMode():
        with pytest.raises(case.error, match=case.match) as info:
            case.run()
    assert "Check failed" not in str(info.value)


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
                                  counts(device="cpu"), 0, *SIZES.values(), 16, 8, 10.0, 0, None, False, 0, 0, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", [c for c in cases() if c.values[0].real])
def test_the_library_refuses_what_the_fake_refuses(case):
    """The same inputs on a GPU, through the op's real implementation: the C++ refuses each alike, before any
    launch (a launch would wait for rank 1, which never comes, and fail the test by its timeout)."""
    with pytest.raises(case.error) as info:
        case.run_real()
    assert "Check failed" not in str(info.value)
    torch.cuda.synchronize()
