"""The nccl transport's kernels without a GPU: the wire's Python mirror pinned to the library's layout, the ops' fakes
(valid arguments pass, shapes traced under torch.compile on meta tensors). tests/gpu/test_nccl_kernels.py runs
them; tests/fake_check_table_nccl.py holds the inputs each check refuses."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flashinfer_a2a.library import ops
from flashinfer_a2a.library.nccl_wire import dispatch_wire
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS

from .fake_check_table import call_op, ids, rows
from .fake_check_table_nccl import quantizing, selecting

LAYOUTS = [
    # (ep_size, runtime_max, payload row bytes, quant_format, hidden, swizzled_scales)
    (2, 16, [512], 0, 0, False),
    (1, 0, [14, 3], 0, 0, False),
    (72, 1, [7168 * 2, 32, 32, 3, 1, 5, 7, 9], 0, 0, False),
    (9, 300, [7169 * 2, 16], 3, 7169, True),
    (8, 17, [448, 12], 1, 224, False),
    (3, 129, [2880 * 2], 2, 2880, True),
    (5, 40, [2 * 33], 3, 33, False),
]


@pytest.mark.usefixtures("a2a_env")
@pytest.mark.parametrize("ep_size, runtime_max, rows, code, hidden, swizzled", LAYOUTS)
def test_python_wire_is_the_library_layout(ep_size, runtime_max, rows, code, hidden, swizzled):
    fmt = {f.code: f for f in WIRE_FORMATS.values()}.get(code)
    wire = dispatch_wire(ep_size, runtime_max, rows, fmt, hidden, swizzled)
    assert ops.nccl_wire_layout(ep_size, runtime_max, rows, (code, hidden, swizzled)) == (
        wire.plane_stride, list(wire.offsets), wire.total_bytes)
    assert wire.plane_stride % 16 == 0 and all(o % 16 == 0 for o in wire.offsets) and wire.total_bytes % 16 == 0


# Made under FakeTensorMode (CUDA tensors without a GPU): functions of no argument.
VALID = {
    "nccl_pack": [dict, lambda: quantizing(1), lambda: quantizing(2, swizzled=True),
                  lambda: quantizing(3, hidden=7169),
                  lambda: quantizing(3, swizzled=True, topk_ids=ids(0, 4, dtype=torch.int64), payloads=[rows(0, 256)])],
    "nccl_select": [dict, lambda: selecting(1), lambda: selecting(2, swizzled=True),
                    lambda: selecting(3, hidden=7169, swizzled=True)],
    "nccl_combine_wire": [dict],
    "nccl_combine_sum": [dict, lambda: dict(fp8_wire=True),
                         lambda: dict(partials=rows(2, 16, 7, dtype=torch.float32), out=rows(3, 7, dtype=torch.float32))],
}


@pytest.mark.parametrize("op", list(VALID))
def test_the_valid_arguments_pass_the_fake(op):
    with FakeTensorMode():
        for change in VALID[op]:
            call_op(op, change())


def test_the_ops_trace_under_compile_on_meta_tensors():
    """One rank's four steps traced whole (the receive list and the counts mutated in place): shapes only."""
    fmt = WIRE_FORMATS["nvfp4"]
    ep_size, runtime_max, hidden = 2, 16, 256
    wire = dispatch_wire(ep_size, runtime_max, [2 * hidden, 16], fmt, hidden, True)

    def step(ids, x, weights, global_scale, partials):
        send = torch.empty(wire.total_bytes, dtype=torch.uint8, device=ids.device)
        ops.nccl_pack(send, ids, [x, weights], ep_size, runtime_max, 8, fmt.code, global_scale, True)
        gathered = torch.stack([send, send])
        recv = [torch.empty(ep_size, runtime_max, hidden // 2, dtype=torch.uint8, device=ids.device),
                torch.empty(ep_size, fmt.swizzled_scale_bytes(runtime_max, hidden), dtype=fmt.scale_dtype,
                            device=ids.device),
                torch.empty(ep_size, runtime_max, 4, dtype=torch.float32, device=ids.device)]
        counts = torch.empty(ep_size, dtype=torch.int32, device=ids.device)
        ops.nccl_select(gathered, recv, counts, 1, runtime_max, fmt.code, hidden, True)
        combine_wire = torch.empty(ep_size * runtime_max, hidden + 16, dtype=torch.uint8, device=ids.device)
        ops.nccl_combine_wire(combine_wire, partials, counts, 1)
        out = torch.empty(ids.shape[0], hidden, dtype=partials.dtype, device=ids.device)
        ops.nccl_combine_sum(out, combine_wire, send, partials, 1, True)
        return recv, counts, out

    meta = dict(device="meta")
    args = (torch.empty(5, 4, dtype=torch.int32, **meta), torch.empty(5, hidden, dtype=torch.bfloat16, **meta),
            torch.empty(5, 4, **meta), torch.empty(1, **meta),
            torch.empty(ep_size, runtime_max, hidden, dtype=torch.bfloat16, **meta))
    torch._dynamo.reset()
    recv, counts, out = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert [tuple(r.shape) for r in recv] == [(2, 16, 128), (2, 2048), (2, 16, 4)]
    assert tuple(counts.shape) == (2,) and tuple(out.shape) == (5, hidden) and out.dtype == torch.bfloat16
