"""The nccl transport on one GPU: a world of one rank over NCCL, eager (every check of the CPU suite), inside a
CUDA graph, under torch.compile(fullgraph=True), and bitwise against the nvlink transport (their quantizing kernels
share the device code). Its kernels alone, over simulated ranks: tests/gpu/test_nccl_kernels.py."""

import pytest
import torch

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import quant, reference_combine, reference_dispatch

from ..nccl_compile_workers import CASES, check_compiled, check_exact_refuses_compile
from ..nccl_workers import HIDDEN, NUM_EXPERTS, TOP_K, check_errors, check_transport, poison, rank_inputs


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("nccl_store") / "filestore"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("exact", [False, True])
def test_eager(nccl_world, exact):
    check_transport(0, 1, "cuda", exact=exact)


def test_errors(nccl_world):
    check_errors(0, 1, "cuda")


def test_auto_picks_nvlink_on_one_gpu(nccl_world):
    moe = MoeAlltoAll(nccl_world, max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64)
    try:
        assert moe.transport == "nvlink"
    finally:
        moe.destroy()


@pytest.mark.parametrize("fmt", [None, "fp8_block", "nvfp4"])
def test_cuda_graph_replays_match_reference(nccl_world, fmt):
    """Dispatch + combine captured once, replayed on fresh inputs copied into the captured tensors."""
    runtime_max = 48
    moe = MoeAlltoAll(nccl_world, max_num_tokens=runtime_max, top_k=TOP_K, num_experts=NUM_EXPERTS,
                      hidden_size=HIDDEN, transport="nccl")
    gs = torch.full((1,), 7.5, device="cuda") if fmt == "nvfp4" else None
    ids, payloads = rank_inputs(1, runtime_max, 1, torch.int64)
    static_ids = ids[0].cuda()
    static = [p.cuda() for p in payloads[0]]
    static_partials = torch.zeros(1, runtime_max, HIDDEN, dtype=torch.bfloat16, device="cuda")
    kw = dict(quant_format=fmt, global_scale=gs)
    combine_kw = dict(quant_format="fp8_block" if fmt else None)

    def step():
        recv, counts = moe.dispatch(static_ids, static, runtime_max, **kw)
        return recv, counts, moe.combine(static_partials, **combine_kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager first: buffers of these shapes and the NCCL communicator exist before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, counts, out = step()
    for seed in range(2, 5):
        ids, payloads = rank_inputs(1, runtime_max, seed, torch.int64)
        static_ids.copy_(ids[0].cuda())
        for dst, src in zip(static, payloads[0]):
            dst.copy_(src.cuda())
        partials = torch.randn(1, runtime_max, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()
        static_partials.copy_(partials.cuda())
        poison([*recv, out, counts])
        graph.replay()
        torch.cuda.synchronize()
        wire = payloads if fmt is None else [[*quant.quantize(p[0], fmt, None if gs is None else 7.5), *p[1:]]
                                             for p in payloads]
        want = reference_dispatch(ids, wire, NUM_EXPERTS, runtime_max)
        c = int(want.recv_counts[0][0])
        assert counts.tolist() == [c]
        for got, expected in zip(recv, want.recv_payloads[0]):
            assert torch.equal(got[0, :c].cpu().contiguous().view(torch.uint8),
                               expected[0, :c].contiguous().view(torch.uint8))
        combine = reference_combine if fmt is None else quant.reference_combine_fp8
        expected_out = combine([partials], want)[0]
        assert torch.equal(out.cpu().view(torch.uint8), expected_out.view(torch.uint8))
    moe.destroy()


@pytest.mark.parametrize("fmt", [None, "fp8_block", "mxfp8", "nvfp4"])
def test_equals_nvlink_transport(nccl_world, fmt):
    """The same calls on both transports give the same bytes: receive rows, counts and combine output."""
    runtime_max = 40
    kw = dict(max_num_tokens=runtime_max, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
              extra_dispatch_bytes_per_token=128)  # room for the ids, weights and odd bytes, each row padded
    results = {}
    for transport in ("nvlink", "nccl"):
        moe = MoeAlltoAll(nccl_world, transport=transport, device=0, **kw)
        ids, payloads = rank_inputs(1, runtime_max, 9, torch.int32)
        gs = torch.full((1,), 3.0, device="cuda") if fmt == "nvfp4" else None
        recv, counts = moe.dispatch(ids[0].cuda(), [p.cuda() for p in payloads[0]], runtime_max, quant_format=fmt,
                                    global_scale=gs)
        c = int(counts[0])
        rows = [r[0, :c].cpu().contiguous().view(torch.uint8) for r in recv]
        partials = torch.randn(1, runtime_max, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
        out = moe.combine(partials.cuda(), quant_format="fp8_block" if fmt else None)
        results[transport] = (counts.cpu(), rows, out.cpu())
        moe.destroy()
    (c1, rows1, out1), (c2, rows2, out2) = results["nvlink"], results["nccl"]
    assert torch.equal(c1, c2)
    assert all(torch.equal(a, b) for a, b in zip(rows1, rows2))
    assert torch.equal(out1.view(torch.uint8), out2.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "nvfp4"])
def test_reference_quantizers_run_alike_on_the_gpu(fmt):
    """The kernels' twins (nccl_torch, what tests/gpu/test_nccl_kernels.py compares them with) quantize on the device
    with the reference quantizers: they must give the CPU's bits (a host scalar divisor would not: CUDA multiplies by
    its reciprocal)."""
    x = (torch.randn(333, HIDDEN, generator=torch.Generator().manual_seed(5)) * 20).bfloat16()
    gs = 17.0 if fmt == "nvfp4" else None
    on_cpu = quant.quantize(x, fmt, gs)
    on_gpu = quant.quantize(x.cuda(), fmt, None if gs is None else torch.tensor(gs, device="cuda"))
    for a, b in zip(on_cpu, on_gpu):
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_matches_eager_and_reference(nccl_world, backend):
    """dispatch / combine_input / combine traced whole: the kernels are ops, so inductor compiles no quantizer and
    every case matches under both backends."""
    check_compiled(0, 1, "cuda", backend, CASES)
    check_exact_refuses_compile(0, 1, "cuda")
