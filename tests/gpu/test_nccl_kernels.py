"""The nccl transport's kernels on one GPU: ``nccl_pack``, ``nccl_select``, ``nccl_combine_wire`` and
``nccl_combine_sum`` bit for bit against their torch twins (:mod:`flashinfer_a2a.transports.nccl_torch`), and end to
end over simulated ranks (the collectives replaced by copies between their buffers) against
:mod:`flashinfer_a2a.reference`, eagerly, replayed from a CUDA graph and compiled."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from flashinfer_a2a import reference as ref
from flashinfer_a2a.library import ops
from flashinfer_a2a.library.nccl_wire import dispatch_wire
from flashinfer_a2a.library.wire_formats import WireFormat, fp8_wire_row_bytes, wire_format
from flashinfer_a2a.reference import quant as q
from flashinfer_a2a.transports import nccl_torch as local

from .cases import poison_, scramble_


@dataclasses.dataclass
class Group:
    ep_size: int
    tokens: tuple[int, ...]  # per rank
    runtime_max: int
    hidden: int = 224
    num_experts: int = 10
    top_k: int = 4
    id_dtype: torch.dtype = torch.int32
    dtype: torch.dtype = torch.bfloat16
    fmt: Optional[str] = None
    swizzled: bool = False
    misaligned: bool = False  # the hidden states 2 bytes off a 16-byte boundary
    invalid_ids: bool = False  # ids outside [-1, num_experts), which reach no rank (not for the reference)

    @property
    def wire_format(self) -> Optional[WireFormat]:
        return None if self.fmt is None else wire_format(self.fmt, "fmt")


GROUPS = {
    "ep1": Group(1, (7,), 9),
    "ep2-7168-nvfp4-swizzled": Group(2, (150, 97), 150, hidden=7168, num_experts=256, top_k=8, fmt="nvfp4",
                                     swizzled=True),
    "ep2-fp8-int64": Group(2, (40, 0), 40, id_dtype=torch.int64, fmt="fp8_block"),
    "ep3-odd-fp16-mxfp8": Group(3, (5, 0, 33), 40, hidden=1025, dtype=torch.float16, fmt="mxfp8"),
    "ep4-2880-mxfp8-swizzled": Group(4, (1, 64, 0, 17), 64, hidden=2880, num_experts=128, fmt="mxfp8",
                                     swizzled=True),
    "ep8-misaligned-invalid": Group(8, (31, 9, 0, 30, 31, 2, 31, 31), 31, hidden=1040, num_experts=64, top_k=6,
                                    misaligned=True, invalid_ids=True, fmt="nvfp4"),
    "ep9-plain": Group(9, (300,) * 9, 300, hidden=96, num_experts=27, top_k=8),
    "ep72-idle": Group(72, (3,) * 36 + (0,) * 36, 3, hidden=64, num_experts=256, top_k=8, id_dtype=torch.int64),
    "all-idle": Group(2, (0, 0), 0, fmt="nvfp4"),
}
GLOBAL_SCALE = 448.0 * 6.0 / 4.0


def rank_inputs(g: Group, seed: int):
    """Per rank: (topk_ids, payloads) on the GPU: hidden states, int32 ids, fp32 weights and 3-byte rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in g.tokens:
        ids = ref.random_topk_ids(n, g.top_k, g.num_experts, dtype=g.id_dtype, generator=gen, minus_one_frac=0.2)
        if g.invalid_ids and n:
            ids[0, 0], ids[n - 1, -1] = g.num_experts + 3, -5
        x = (torch.randn(n, g.hidden, generator=gen) * 4).to(g.dtype)
        if g.misaligned:
            flat = torch.empty(n * g.hidden + 1, dtype=g.dtype, device="cuda")
            hidden_states = flat[1:].view(n, g.hidden)
            hidden_states.copy_(x)
        else:
            hidden_states = x.cuda()
        payloads = [hidden_states, ids.to(torch.int32).cuda(), torch.rand(n, g.top_k, generator=gen).cuda(),
                    ref.random_payload(n, (3,), torch.uint8, generator=gen).cuda()]
        out.append((ids.cuda(), payloads))
    return out


def wire_of(g: Group, payloads):
    return dispatch_wire(g.ep_size, g.runtime_max, [local.row_width(p) for p in payloads], g.wire_format, g.hidden,
                         g.swizzled)


def global_scale(g: Group) -> Optional[torch.Tensor]:
    return torch.full((1,), GLOBAL_SCALE, device="cuda") if g.fmt == "nvfp4" else None


def kernel_pack(g: Group, ids, payloads, scramble: bool = True) -> torch.Tensor:
    """This rank's send buffer, by the kernel (into random bytes unless ``scramble`` is False: inside a capture)."""
    wire = wire_of(g, payloads)
    send = torch.empty(wire.total_bytes, dtype=torch.uint8, device="cuda")
    if scramble:
        scramble_(send)
    fmt = g.wire_format
    ops.nccl_pack(send, ids, payloads, g.ep_size, g.runtime_max, g.num_experts, 0 if fmt is None else fmt.code,
                  global_scale(g), g.swizzled)
    return send


def recv_like(g: Group, payloads) -> list:
    block = (g.ep_size, g.runtime_max)
    like = [(p.dtype, (*block, *p.shape[1:])) for p in payloads]
    fmt = g.wire_format
    if fmt is not None:
        scales = (g.ep_size, fmt.swizzled_scale_bytes(g.runtime_max, g.hidden)) if g.swizzled else \
            (*block, fmt.scale_cols(g.hidden))
        like[:1] = [(fmt.value_dtype, (*block, fmt.value_bytes(g.hidden))), (fmt.scale_dtype, scales)]
    return like


def kernel_select(g: Group, gathered: torch.Tensor, rank: int, like, scramble: bool = True):
    """``(recv, recv_counts)`` of ``rank``, by the kernel (into random bytes unless ``scramble`` is False)."""
    recv = [torch.empty(shape, dtype=dtype, device="cuda") for dtype, shape in like]
    counts = torch.empty(g.ep_size, dtype=torch.int32, device="cuda")
    for t in (*recv, counts) if scramble else ():
        scramble_(t)
    fmt = g.wire_format
    ops.nccl_select(gathered, recv, counts, rank, g.runtime_max, 0 if fmt is None else fmt.code,
                    g.hidden if fmt else 0, g.swizzled)
    return recv, counts


def unswizzled(g: Group, recv: list) -> list:
    """recv with swizzled scales as [ep_size, runtime_max, cols] rows (their padding columns checked to be 0)."""
    if not g.swizzled:
        return recv
    cols = g.wire_format.scale_cols(g.hidden)
    rows = q.unswizzle_scales_128x4(recv[1], -(-g.runtime_max // 128) * 128, -(-cols // 4) * 4)
    return [recv[0], rows[:, : g.runtime_max], *recv[2:]]


def same_rows(a: list, b: list, counts: torch.Tensor, g: Group) -> None:
    """Every valid row (below its source's count) of each receive buffer, byte for byte."""
    cols = g.wire_format.scale_cols(g.hidden) if g.swizzled else None
    for p, (x, y) in enumerate(zip(unswizzled(g, a), unswizzled(g, b))):
        for src, c in enumerate(counts.tolist()):
            got, want = x[src, :c], y[src, :c]
            if p == 1 and cols is not None:
                assert not got[:, cols:].view(torch.uint8).any(), "swizzled scale padding columns must be 0"
                got, want = got[:, :cols], want[:, :cols]
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                f"payload segment {p} from rank {src}: rows differ"


@pytest.mark.parametrize("name", list(GROUPS))
def test_pack_matches_torch(name):
    g = GROUPS[name]
    for rank, (ids, payloads) in enumerate(rank_inputs(g, 11)):
        wire = wire_of(g, payloads)
        got = kernel_pack(g, ids, payloads)
        want = local.pack(ids, payloads, wire, g.num_experts, g.wire_format, global_scale(g), g.swizzled)
        planes = wire.mask_planes * wire.plane_stride
        assert torch.equal(got[:planes], want[:planes]), f"rank {rank}: mask planes differ"
        n = ids.shape[0]
        for s in range(len(wire.row_bytes)):
            assert torch.equal(wire.segment(got, s)[:n], wire.segment(want, s)[:n]), f"rank {rank}: segment {s}"


@pytest.mark.parametrize("name", list(GROUPS))
def test_select_matches_torch(name):
    g = GROUPS[name]
    inputs = rank_inputs(g, 12)
    wire = wire_of(g, inputs[0][1])
    gathered = torch.stack([kernel_pack(g, ids, payloads) for ids, payloads in inputs])
    like = recv_like(g, inputs[0][1])
    for rank in range(g.ep_size):
        recv, counts = kernel_select(g, gathered, rank, like)
        want, want_counts = local.select(gathered, wire, rank, like, 1 if g.swizzled else None)
        assert torch.equal(counts, want_counts), (rank, counts, want_counts)
        same_rows(recv, want, counts, g)


def combine_case(g: Group, seed: int, dtype: torch.dtype):
    """Per rank: its partials [ep_size, runtime_max, hidden] and the counts it received (random, <= runtime_max)."""
    gen = torch.Generator().manual_seed(seed)
    partials = [(torch.randn(g.ep_size, g.runtime_max, g.hidden, generator=gen) * 3).to(dtype).cuda()
                for _ in range(g.ep_size)]
    counts = [torch.randint(0, g.runtime_max + 1, (g.ep_size,), generator=gen, dtype=torch.int32).cuda()
              for _ in range(g.ep_size)]
    return partials, counts


FP8_HIDDEN = [(224, torch.bfloat16), (7168, torch.bfloat16), (2880, torch.float16), (8, torch.bfloat16)]


@pytest.mark.parametrize("hidden, dtype", FP8_HIDDEN)
def test_combine_wire_matches_torch(hidden, dtype):
    g = Group(3, (20, 0, 7), 20, hidden=hidden)
    partials, counts = combine_case(g, hidden, dtype)
    cols = -(-hidden // 128)
    for rank in range(g.ep_size):
        wire = scramble_(torch.empty(g.ep_size * g.runtime_max, fp8_wire_row_bytes(hidden), dtype=torch.uint8,
                                     device="cuda"))
        ops.nccl_combine_wire(wire, partials[rank], counts[rank], rank)
        want = local.combine_wire(partials[rank])
        for src, c in enumerate(counts[rank].tolist()):
            if src == rank:
                continue  # never read: the owner sums its own rows from its partials
            rows = slice(src * g.runtime_max, src * g.runtime_max + c)
            assert torch.equal(wire[rows, : hidden + 4 * cols], want[rows, : hidden + 4 * cols]), (rank, src)


SUM_CASES = {
    "ep2-bf16": (Group(2, (150, 97), 150, hidden=7168), torch.bfloat16, False),
    "ep3-fp32-odd": (Group(3, (5, 0, 40), 40, hidden=7), torch.float32, False),
    "ep3-bf16-odd": (Group(3, (5, 0, 40), 40, hidden=7), torch.bfloat16, False),
    "ep4-fp16-fp8": (Group(4, (1, 64, 0, 17), 64, hidden=2880, num_experts=128), torch.float16, True),
    "ep9-bf16-fp8": (Group(9, (300,) * 9, 300, hidden=224, num_experts=27, top_k=8), torch.bfloat16, True),
    "ep72-fp32": (Group(72, (3,) * 36 + (0,) * 36, 3, hidden=64, num_experts=256, top_k=8), torch.float32, False),
    "ep2-many-tokens": (Group(2, (1000, 700), 1000, hidden=256, num_experts=64, top_k=8), torch.bfloat16, True),
}


def returned_rows(g: Group, partials: list, fp8_wire: bool, rank: int) -> torch.Tensor:
    """What the all-to-all hands ``rank``: block d is block ``rank`` of rank d's combine wire."""
    wires = [local.combine_wire(p) if fp8_wire else local.to_bytes(p.reshape(-1, g.hidden)) for p in partials]
    rows = slice(rank * g.runtime_max, (rank + 1) * g.runtime_max)
    return torch.cat([w[rows] for w in wires])


@pytest.mark.parametrize("name", list(SUM_CASES))
def test_ordered_sum_matches_torch(name):
    g, dtype, fp8_wire = SUM_CASES[name]
    inputs = rank_inputs(g, 13)
    partials, _ = combine_case(g, 14, dtype)
    for rank, (ids, payloads) in enumerate(inputs):
        send = kernel_pack(g, ids, payloads)
        wire = wire_of(g, payloads)
        returned = returned_rows(g, partials, fp8_wire, rank)
        out = poison_(torch.empty(ids.shape[0], g.hidden, dtype=dtype, device="cuda"))
        ops.nccl_combine_sum(out, returned, send, partials[rank], rank, fp8_wire)
        want = local.ordered_sum(returned, send, wire, partials[rank], rank, fp8_wire, ids.shape[0])
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"rank {rank}: sums differ"


class SimulatedGroup:
    """Every rank of a group on one GPU, its steps the transport's kernels and the collectives copies."""

    def __init__(self, g: Group, fp8_wire: bool, scramble: bool = True):
        self.g, self.fp8_wire, self.scramble = g, fp8_wire, scramble

    def dispatch(self, inputs):
        g = self.g
        sends = [kernel_pack(g, ids, payloads, self.scramble) for ids, payloads in inputs]
        gathered = torch.stack(sends)  # the all-gather
        like = recv_like(g, inputs[0][1])
        return sends, [kernel_select(g, gathered, rank, like, self.scramble) for rank in range(g.ep_size)]

    def combine(self, sends, counts, partials, tokens):
        g, rm = self.g, self.g.runtime_max
        wires = []
        for rank, p in enumerate(partials):
            if self.fp8_wire:
                wire = torch.empty(g.ep_size * rm, fp8_wire_row_bytes(g.hidden), dtype=torch.uint8, device="cuda")
                ops.nccl_combine_wire(wire, p, counts[rank], rank)
            else:
                wire = p.reshape(g.ep_size * rm, g.hidden).view(torch.uint8)
            wires.append(wire)
        outs = []
        for rank in range(g.ep_size):
            returned = torch.cat([w[rank * rm : (rank + 1) * rm] for w in wires])  # the all-to-all
            out = torch.empty(tokens[rank], g.hidden, dtype=partials[rank].dtype, device="cuda")
            ops.nccl_combine_sum(out, returned, sends[rank], partials[rank], rank, self.fp8_wire)
            outs.append(out)
        return outs


def reference_of(g: Group, inputs, partials, fp8_wire: bool):
    ids = [i.cpu() for i, _ in inputs]
    payloads = [[p.cpu() for p in ps] for _, ps in inputs]
    if g.fmt is not None:
        gs = GLOBAL_SCALE if g.fmt == "nvfp4" else None
        payloads = [[*q.quantize(ps[0], g.fmt, gs), *ps[1:]] for ps in payloads]
    dispatched = ref.reference_dispatch(ids, payloads, g.num_experts, g.runtime_max)
    combine = q.reference_combine_fp8 if fp8_wire else ref.reference_combine
    return dispatched, combine([p.cpu() for p in partials], dispatched)


def check_group(g: Group, inputs, recv_and_counts, outs, partials, fp8_wire: bool) -> None:
    want, want_out = reference_of(g, inputs, partials, fp8_wire)
    for rank, (recv, counts) in enumerate(recv_and_counts):
        assert torch.equal(counts.cpu(), want.recv_counts[rank]), (rank, counts, want.recv_counts[rank])
        same_rows([r.cpu() for r in recv], unswizzled_want(g, want.recv_payloads[rank]), counts.cpu(), g)
        assert torch.equal(outs[rank].cpu().view(torch.uint8), want_out[rank].view(torch.uint8)), f"rank {rank} out"


def unswizzled_want(g: Group, rows: list) -> list:
    """The reference's receive rows, with swizzled scales laid out as the kernels receive them."""
    if not g.swizzled:
        return rows
    cols = g.wire_format.scale_cols(g.hidden)
    padded = torch.nn.functional.pad(rows[1].view(torch.uint8), (0, -(-cols // 4) * 4 - cols))
    block = q.swizzle_scales_128x4(padded.view(rows[1].dtype))
    return [rows[0], block, *rows[2:]]


REFERENCE_GROUPS = [name for name, g in GROUPS.items() if not g.invalid_ids]


@pytest.mark.parametrize("name", REFERENCE_GROUPS)
@pytest.mark.parametrize("fp8_wire", [False, True])
def test_simulated_group_matches_reference(name, fp8_wire):
    g = GROUPS[name]
    if fp8_wire and g.hidden % 8:
        pytest.skip("the FP8 wire needs hidden % 8 == 0")
    group = SimulatedGroup(g, fp8_wire)
    inputs = rank_inputs(g, 15)
    sends, recv_and_counts = group.dispatch(inputs)
    partials, _ = combine_case(g, 16, torch.bfloat16)
    outs = group.combine(sends, [c for _, c in recv_and_counts], partials, g.tokens)
    check_group(g, inputs, recv_and_counts, outs, partials, fp8_wire)


@pytest.mark.parametrize("name", ["ep2-7168-nvfp4-swizzled", "ep4-2880-mxfp8-swizzled", "ep9-plain"])
def test_graph_replays_match_reference(name):
    """The four kernels of every rank captured once, replayed on fresh inputs copied into the captured tensors."""
    g = GROUPS[name]
    fp8_wire = g.fmt is not None
    group = SimulatedGroup(g, fp8_wire, scramble=False)
    static = rank_inputs(g, 17)
    partials, _ = combine_case(g, 18, torch.bfloat16)

    def step():
        sends, recv_and_counts = group.dispatch(static)
        return recv_and_counts, group.combine(sends, [c for _, c in recv_and_counts], partials, g.tokens)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # loads every kernel before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_and_counts, outs = step()
    for seed in (19, 20):
        fresh = rank_inputs(g, seed)
        for (ids, payloads), (new_ids, new_payloads) in zip(static, fresh):
            ids.copy_(new_ids)
            for dst, src in zip(payloads, new_payloads):
                dst.copy_(src)
        new_partials, _ = combine_case(g, seed + 100, torch.bfloat16)
        for dst, src in zip(partials, new_partials):
            dst.copy_(src)
        for recv, counts in recv_and_counts:
            for t in (*recv, counts):
                poison_(t)
        graph.replay()
        torch.cuda.synchronize()
        check_group(g, static, recv_and_counts, outs, partials, fp8_wire)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_ops_match_eager(backend):
    """The four ops traced whole (fakes, the mutated receive list functionalized), on fresh buffers."""
    g = GROUPS["ep4-2880-mxfp8-swizzled"]
    inputs = rank_inputs(g, 21)
    partials, _ = combine_case(g, 22, torch.bfloat16)
    like = recv_like(g, inputs[0][1])
    fmt = g.wire_format

    def layer(rank_ids, rank_payloads, rank_partials):
        sends = []
        for ids, payloads in zip(rank_ids, rank_payloads):
            send = torch.empty(wire_of(g, payloads).total_bytes, dtype=torch.uint8, device="cuda")
            ops.nccl_pack(send, ids, payloads, g.ep_size, g.runtime_max, g.num_experts, fmt.code, None, g.swizzled)
            sends.append(send)
        gathered = torch.stack(sends)
        results = []
        for rank in range(g.ep_size):
            recv = [torch.empty(shape, dtype=dtype, device="cuda") for dtype, shape in like]
            counts = torch.empty(g.ep_size, dtype=torch.int32, device="cuda")
            ops.nccl_select(gathered, recv, counts, rank, g.runtime_max, fmt.code, g.hidden, g.swizzled)
            wire = torch.empty(g.ep_size * g.runtime_max, fp8_wire_row_bytes(g.hidden), dtype=torch.uint8,
                               device="cuda")
            ops.nccl_combine_wire(wire, rank_partials[rank], counts, rank)
            results.append((recv, counts, wire))
        outs = []
        for rank in range(g.ep_size):
            rm = g.runtime_max
            returned = torch.cat([w[rank * rm : (rank + 1) * rm] for _, _, w in results])
            out = torch.empty(g.tokens[rank], g.hidden, dtype=torch.bfloat16, device="cuda")
            ops.nccl_combine_sum(out, returned, sends[rank], rank_partials[rank], rank, True)
            outs.append(out)
        return [(r, c) for r, c, _ in results], outs

    args = ([i for i, _ in inputs], [p for _, p in inputs], partials)
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True, backend=backend)(*args)
    check_group(g, inputs, *got, partials, True)
