"""One dispatch -> combine -> sanitize round on simulated ranks, checked against the reference."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.library.errors import metadata_offsets
from flashinfer_a2a.functional import WorkspaceConfig, row_bytes
from flashinfer_a2a.testing.simulate import SimulatedRanks


@dataclasses.dataclass
class Case:
    ep_size: int
    top_k: int
    hidden: int
    num_experts: int
    tokens: Sequence[int]  # per rank
    runtime_max: int
    id_dtype: torch.dtype = torch.int32
    extra_payloads: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()  # (trailing shape, dtype)
    combine_dtype: torch.dtype = torch.bfloat16
    minus_one_frac: float = 0.0
    skew: Optional[float] = None
    distinct: bool = True
    zero_copy: bool = False
    caller_out: bool = False
    with_ids: bool = True  # also dispatch topk_ids as a payload (then sanitize is checked on it)
    # The one-kernel combine (zero copy only). On simulated ranks it is safe only while every rank's blocks fit on
    # the GPU at once: small cases.
    one_gpu_per_rank: bool = False


def poison_(t: torch.Tensor) -> torch.Tensor:
    t.view(torch.uint8).fill_(ref.POISON_BYTE)
    return t


def scramble_(t: torch.Tensor) -> torch.Tensor:
    """Random bytes: unlike a fixed poison, stale routing entries or counts look like valid ones."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=t.device))
    return t


def make_inputs(case: Case, device, gen: torch.Generator):
    topk_ids, payloads = [], []
    for r in range(case.ep_size):
        n = case.tokens[r]
        ids = ref.random_topk_ids(n, case.top_k, case.num_experts, dtype=case.id_dtype, generator=gen,
                                  distinct=case.distinct, minus_one_frac=case.minus_one_frac, skew=case.skew)
        hidden = ref.random_payload(n, (case.hidden,), torch.bfloat16, generator=gen)
        ps = [hidden, ids.clone()] if case.with_ids else [hidden]
        for shape, dtype in case.extra_payloads:
            ps.append(ref.random_payload(n, shape, dtype, generator=gen))
        topk_ids.append(ids.to(device))
        payloads.append([p.to(device) for p in ps])
    return topk_ids, payloads


def run_case(case: Case, device="cuda", seed: Optional[int] = None, sim: Optional[SimulatedRanks] = None,
             timeout_s: float = 10.0):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    topk_ids, payloads = make_inputs(case, device, gen)
    if sim is None:
        dispatch_bytes = sum(row_bytes(p) for p in payloads[0])
        config = WorkspaceConfig(ep_size=case.ep_size, max_num_tokens=case.runtime_max,
                                 dispatch_bytes_per_token=dispatch_bytes,
                                 combine_bytes_per_token=case.hidden * case.combine_dtype.itemsize,
                                 top_k=max(case.top_k, 1))
        sim = SimulatedRanks(config, device)
    # Poison everything the kernels write: receive regions and counts must be fully overwritten where valid.
    scramble_(sim.workspace[:, metadata_offsets()["metadata_bytes"] :])  # all but the metadata
    results = sim.dispatch(topk_ids, payloads, case.runtime_max, case.num_experts, timeout_s=timeout_s)
    torch.cuda.synchronize()
    expected = ref.reference_dispatch([t.cpu() for t in topk_ids], [[p.cpu() for p in ps] for ps in payloads],
                                      case.num_experts, case.runtime_max)
    valid = []
    for d, (recv, counts) in enumerate(results):
        assert torch.equal(counts.cpu(), expected.recv_counts[d]), f"recv_counts of rank {d}"
        mask = ref.valid_row_mask(expected.recv_counts[d], case.runtime_max)
        valid.append(mask)
        for p, (got, want) in enumerate(zip(recv, expected.recv_payloads[d])):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert ref.bitwise_equal(got.cpu()[mask], want[mask]), f"payload {p} on rank {d}"

    # Sanitize the received top-k ids (payload 1).
    for d, (recv, counts) in enumerate(results if case.with_ids else ()):
        ids = recv[1]
        want = ref.reference_sanitize(ids.cpu(), counts.cpu(), case.num_experts + 7)
        fa.sanitize_expert_ids(ids, counts, case.num_experts + 7)
        torch.cuda.synchronize()
        assert torch.equal(ids.cpu(), want), f"sanitize on rank {d}"

    # Combine: fresh partials, the rows beyond the counts poisoned (NaN) so reading one would show.
    partials = []
    for d in range(case.ep_size):
        part = torch.randn(case.ep_size, case.runtime_max, case.hidden, generator=gen).to(case.combine_dtype)
        part[~valid[d]] = float("nan")
        partials.append(part.to(device))
    want = ref.reference_combine([p.cpu() for p in partials], expected)
    if case.zero_copy:
        for d in range(case.ep_size):
            view = sim.combine_input(d, case.runtime_max, case.hidden, case.combine_dtype)
            view.copy_(partials[d])
        inputs = None
    else:
        inputs = partials
    outs = None
    if case.caller_out:
        outs = [poison_(torch.empty(case.tokens[r], case.hidden, dtype=case.combine_dtype, device=device))
                for r in range(case.ep_size)]
    got = sim.run(lambda r: fa.combine(
        sim.workspace, r, sim.config, results[r][1], case.tokens[r], case.runtime_max,
        None if inputs is None else inputs[r], out=None if outs is None else outs[r],
        hidden=case.hidden, dtype=case.combine_dtype, timeout_s=timeout_s, one_gpu_per_rank=case.one_gpu_per_rank))
    torch.cuda.synchronize()
    for r in range(case.ep_size):
        if outs is not None:
            assert got[r].data_ptr() == outs[r].data_ptr()
        assert ref.bitwise_equal(got[r].cpu(), want[r]), f"combine on rank {r}"
    for r in range(case.ep_size):
        fa.check_error(sim.workspace, r)
    return sim
