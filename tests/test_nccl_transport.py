"""The nccl transport on CPU: its local steps against the reference, and MoeAlltoAll(transport="nccl") on 2 and 4
spawned gloo ranks, bitwise against flashinfer_a2a.reference (quantized formats against the reference quantizers)."""

import warnings

import pytest
import torch

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.library.nccl_wire import make_wire
from flashinfer_a2a.transports.nccl import check_transport, process_group_of, resolve_transport
from flashinfer_a2a.transports.nccl_torch import mask_planes, rank_mask, unpack_mask
from flashinfer_a2a.reference import random_topk_ids, token_rank_mask

from .nccl_workers import spawn_gloo, unswizzled_scales


@pytest.mark.parametrize("world_size", [2, 4])
def test_padded_on_gloo(tmp_path, world_size):
    spawn_gloo(["padded", "errors"], world_size, tmp_path)


@pytest.mark.parametrize("world_size", [2, 4])
def test_exact_on_gloo(tmp_path, world_size):
    spawn_gloo(["exact"], world_size, tmp_path)


def test_swizzled_scale_check_reads_valid_rows_only():
    """The receive check of swizzled scales (nccl_workers.run_quantized) holds the transport to the contract: padding
    columns of valid rows are 0, rows past recv_counts are unspecified. The GPU select kernel writes only the rows it
    receives, so a grid's other rows keep what its buffer held (poison, or a freed tensor's bytes)."""
    from flashinfer_a2a.reference import quant

    ep_size, runtime_max, cols, counts = 2, 40, 7, torch.tensor([5, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    scales = torch.randint(1, 255, (ep_size, runtime_max, 8), generator=gen, dtype=torch.uint8)
    scales[:, :, cols:] = 0
    grid = quant.swizzle_scales_128x4(scales)
    # What the kernel leaves: every row past the counts as the buffer held it (0xFF), padding columns included.
    rows_128 = torch.arange(128).view(1, -1, 1)
    past = (rows_128 >= counts.view(-1, 1, 1).long()).expand(ep_size, 128, 8)
    index = quant._swizzled_index(128, 8)
    flat = grid.clone()
    for src in range(ep_size):
        flat[src, index[past[src]]] = 0xFF
    got = unswizzled_scales(flat, counts, runtime_max, cols)
    assert torch.equal(got[0, :5], scales[0, :5, :cols])
    flat[0, index[4, cols]] = 1  # a padding column of a valid row
    with pytest.raises(AssertionError, match="padding columns from rank 0"):
        unswizzled_scales(flat, counts, runtime_max, cols)


@pytest.mark.parametrize("num_experts, ep_size", [(256, 8), (10, 4), (3, 5), (72, 72), (7, 1)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_rank_mask_matches_reference(num_experts, ep_size, id_dtype):
    gen = torch.Generator().manual_seed(num_experts * 100 + ep_size)
    ids = random_topk_ids(300, min(8, num_experts), num_experts, dtype=id_dtype, generator=gen, minus_one_frac=0.3)
    assert torch.equal(rank_mask(ids, num_experts, ep_size), token_rank_mask(ids, num_experts, ep_size))


def test_rank_mask_skips_out_of_range_ids():
    ids = torch.tensor([[0, 9], [-2, 5], [10, -1]])
    want = torch.tensor([[True, True], [False, True], [False, False]])  # 9 is valid (rank 1); -2 and 10 are not
    assert torch.equal(rank_mask(ids, 10, 2), want)


@pytest.mark.parametrize("ep_size", [1, 7, 8, 9, 72])
def test_mask_planes(ep_size):
    """Rank r of token t at bit r % 8 of byte t of plane r // 8; bytes past the tokens 0; unpacked back."""
    mask = torch.rand(50, ep_size, generator=torch.Generator().manual_seed(ep_size)) < 0.5
    wire = make_wire(ep_size, 57, [])
    planes = mask_planes(mask, wire.plane_stride)
    assert planes.shape == (-(-ep_size // 8), 64) and planes.dtype == torch.uint8
    for r in range(ep_size):
        assert torch.equal(((planes[r // 8, :50] >> (r % 8)) & 1).bool(), mask[:, r])
    assert not planes[:, 50:].any()
    assert torch.equal(unpack_mask(planes.flatten(), wire, 50), mask)
    assert mask_planes(mask[:0], 0).shape == (-(-ep_size // 8), 0)


def test_transport_argument():
    check_transport("nccl", exact=True)
    with pytest.raises(ValueError, match="transport must be one of auto, nvlink, nccl, got 'rdma'"):
        check_transport("rdma")
    with pytest.raises(ValueError, match="exact=True needs transport='nccl', got transport='auto'"):
        check_transport("auto", exact=True)


class _NoGroup:
    """A one-rank communicator that is no process group; it counts its collectives."""

    rank, size = 0, 1

    def __init__(self):
        self.calls = 0

    def allgather(self, data):
        self.calls += 1
        return [bytes(data)]

    def broadcast(self, data, root=0):
        self.calls += 1
        return bytes(data)

    def barrier(self):
        self.calls += 1


def test_auto_on_cpu_is_nccl_and_needs_a_process_group():
    group = _NoGroup()
    assert resolve_transport(group, "auto", "cpu") == "nccl"
    assert resolve_transport(group, "nvlink", "cpu") == "nvlink"
    assert group.calls == 0  # a CPU device decides alone, without a collective
    with pytest.raises(TypeError, match="torch.distributed process group"):
        process_group_of(_NoGroup())
    with pytest.raises(TypeError, match="torch.distributed process group"):
        MoeAlltoAll(_NoGroup(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, device="cpu")
    with pytest.raises(ValueError, match="transport must be one of"):
        MoeAlltoAll(_NoGroup(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, transport="ib")


def test_bench_transport_flag():
    from flashinfer_a2a.bench import args as bench_args
    from flashinfer_a2a.bench.impls import variants

    assert bench_args.parse_args([]).transport == "nvlink"
    nccl = bench_args.parse_args(["--transport", "nccl", "--quant", "fp8_block"])
    assert nccl.transport == "nccl"
    names = [v.name for v in variants(nccl, torch.bfloat16)]
    assert names == ["a2a", "fp8-fused", "fp8-pre"]  # no pushed combine over NCCL
    assert "a2a-pull" in [v.name for v in variants(bench_args.parse_args(["--quant", "none"]), torch.bfloat16)]
    with pytest.raises(SystemExit):
        bench_args.parse_args(["--transport", "rdma"])


def test_fp8_block_scale_is_a_true_division():
    """The reference divides by 448 (what the kernels do), not multiplies by its reciprocal (what torch does on CUDA
    for a host scalar divisor, and which differs for about half of all inputs)."""
    import numpy as np

    from flashinfer_a2a.reference import quant

    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * 3
    _, scales = quant.quantize_fp8_block(x)
    amax = x.abs().view(64, 8, 128).amax(-1).numpy()
    assert np.array_equal(scales.numpy(), amax / np.float32(448.0))
    assert not np.array_equal(scales.numpy(), amax * (np.float32(1.0) / np.float32(448.0)))


class _GpuRanks:
    """A communicator of two GPU ranks, seen from ``rank``, whose GPUs share no memory handle type."""

    size = 2

    def __init__(self, rank):
        self.rank = rank

    def allgather(self, data):
        return [bytes(data)] * self.size


def test_auto_says_once_on_rank_0_when_gpus_fall_back_to_nccl(monkeypatch):
    from flashinfer_a2a.transports import nccl as nccl_transport
    from flashinfer_a2a.memory import symm_mem

    no_vmm = {"host": "h", "gpu": "g", "vmm": False, "fd": False, "fabric": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(symm_mem, "_capabilities", lambda index: no_vmm)
    monkeypatch.setattr(nccl_transport, "_fallback_said", False)
    with pytest.warns(UserWarning, match=r"transport='auto' runs over NCCL .*no CUDA virtual memory management.*"
                                         r"Pass transport='nccl'") as said:
        assert resolve_transport(_GpuRanks(0), "auto") == "nccl"
    assert len(said) == 1 and symm_mem.NCCL_HINT not in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second layer, and any other rank: not a word
        assert resolve_transport(_GpuRanks(0), "auto") == "nccl"
        monkeypatch.setattr(nccl_transport, "_fallback_said", False)
        assert resolve_transport(_GpuRanks(1), "auto") == "nccl"
        assert resolve_transport(_GpuRanks(0), "nccl") == "nccl"


def test_the_no_peer_access_hint_names_the_nccl_transport():
    from flashinfer_a2a.memory import symm_mem

    assert "transport='nccl'" in symm_mem.NCCL_HINT and "transport='auto'" in symm_mem.NCCL_HINT
    with pytest.raises(RuntimeError, match="transport='nccl'"):
        symm_mem.choose_handle_type([{"host": "h", "gpu": "g", "vmm": False, "fd": False, "fabric": False}])


def test_nccl_memory_falls_back_to_the_caching_allocator():
    """Without NCCL's allocator (a CPU device, a group with no NCCL backend) the peer exchange's buffers come from
    torch's own allocator: nccl_pool gives None and allocating_from(None) changes nothing."""
    from flashinfer_a2a.memory.nccl_memory import allocating_from, nccl_pool

    class NoBackend:
        def _get_backend(self, device):
            raise RuntimeError("no backend for cuda")

    assert nccl_pool(NoBackend(), torch.device("cpu")) is None
    assert nccl_pool(NoBackend(), torch.device("cuda", 0)) is None
    assert nccl_pool(object(), torch.device("cuda", 0)) is None
    with allocating_from(None, torch.device("cpu")):
        t = torch.arange(6)
    assert t.tolist() == list(range(6))


def test_peer_exchange_only_in_the_padded_mode_on_gpus(monkeypatch):
    """The peer exchange (and so NCCL's memory) from PEER_EXCHANGE_MIN_TOKENS on, padded mode, CUDA only."""
    from flashinfer_a2a.transports import nccl

    transport = object.__new__(nccl.NcclTransport)
    for exact, device, rm, expected in [(False, "cuda", nccl.PEER_EXCHANGE_MIN_TOKENS, True),
                                        (False, "cuda", nccl.PEER_EXCHANGE_MIN_TOKENS - 1, False),
                                        (True, "cuda", nccl.PEER_EXCHANGE_MIN_TOKENS, False),
                                        (False, "cpu", nccl.PEER_EXCHANGE_MIN_TOKENS, False)]:
        transport.exact, transport.device = exact, torch.device(device)
        assert transport._peer_exchange(rm) is expected, (exact, device, rm)
