"""What the multi-GPU checks share: the launcher bootstrap, the shared seed, inputs every rank can draw for every
rank, and a combine of fresh partials checked against the reference."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.comm import as_communicator

# Every rank on GPU 0, each in its own process (tests/multigpu/test_shared_gpu.py): the contexts time-slice, so a
# spinning kernel cannot starve a peer's, and the checks that want it may take the one-GPU-per-rank paths.
SHARED_GPU = os.environ.get("FLASHINFER_A2A_TEST_SHARED_GPU") == "1"


def bootstrap():
    """(group for MoeAlltoAll, communicator, launcher name)."""
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        from mpi4py import MPI

        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", "0")))
        torch.cuda.set_device(0 if SHARED_GPU else local)
        return MPI.COMM_WORLD, as_communicator(MPI.COMM_WORLD), "mpirun"
    torch.cuda.set_device(0 if SHARED_GPU else int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("gloo")
    return None, as_communicator(None), "torchrun"


def shared_seed(comm) -> int:
    seed = str(torch.seed() % (1 << 31)).encode() if comm.rank == 0 else None
    return int(comm.broadcast(seed, 0))


def make_inputs(ep_size, tokens, top_k, hidden, num_experts, seed, skew=None, id_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    ids = [ref.random_topk_ids(n, top_k, num_experts, generator=gen, skew=skew, dtype=id_dtype,
                               minus_one_frac=0.1) for n in tokens]
    hidden_states = [ref.random_payload(n, (hidden,), torch.bfloat16, generator=gen) for n in tokens]
    weights = [torch.rand(n, top_k, generator=gen) for n in tokens]
    return ids, hidden_states, weights


def combine_partials(a2a, comm, want, runtime_max, hidden, dtype, seed, *, zero_copy,
                     quant_format: Optional[str] = None, misaligned=False):
    """A combine of fresh random partials after the dispatch `want` describes (written into the zero-copy input, or
    passed as a tensor, starting one element past a 16-byte boundary if `misaligned`), checked bit for bit against
    the reference on this rank. Returns every rank's partials."""
    from flashinfer_a2a.reference import quant as q

    rank, n = comm.rank, comm.size
    gen = torch.Generator().manual_seed(seed)
    partials = [torch.randn(n, runtime_max, hidden, generator=gen).to(dtype) for _ in range(n)]
    if zero_copy:
        a2a.combine_input().copy_(partials[rank].cuda())
        mine = None
    elif misaligned:
        mine = torch.empty(partials[rank].numel() + 1, dtype=dtype, device="cuda")[1:].view(partials[rank].shape)
        mine.copy_(partials[rank])
    else:
        mine = partials[rank].cuda()
    out = a2a.combine(mine, quant_format=quant_format)
    torch.cuda.synchronize()
    fa.check_error(a2a.workspace, rank)
    expected = (ref.reference_combine(partials, want) if quant_format is None
                else q.reference_combine_fp8(partials, want))[rank]
    assert ref.bitwise_equal(out.cpu(), expected), f"combine ({quant_format}, {dtype}) differs from the reference"
    return partials


def expect_timeout(a2a, comm, peer: int, call: Callable[[], object]) -> None:
    """Runs `call`, which must end within 10 s, and checks that this rank recorded the timeout naming `peer`."""
    start = time.monotonic()
    call()
    torch.cuda.synchronize()
    assert time.monotonic() - start < 10
    try:
        fa.check_error(a2a.workspace, comm.rank)
    except fa.A2AError as exc:
        assert exc.peer == peer and f"rank {peer}" in str(exc), exc
    else:
        raise AssertionError("no timeout recorded")
