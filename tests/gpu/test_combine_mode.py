"""The combine mode on the GPU: a push the workspace or the placement cannot do is refused by the C++ entry with a
ValueError before any launch (the ranks stay in step: a pulled combine of the same dispatch is then bitwise right),
and a pulled combine with room for a push stays pulled."""

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.functional import empty_workspace
from flashinfer_a2a.testing.simulate import SimulatedRanks

HIDDEN, TOP_K, EXPERTS, TOKENS = 256, 4, 8, 32


def _round(combine_bytes, gen):
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=TOKENS, top_k=TOP_K, dispatch_bytes_per_token=HIDDEN * 2,
                                combine_bytes_per_token=combine_bytes)
    sim = SimulatedRanks(config, "cuda")
    tokens = [TOKENS, 17]
    ids = [torch.randint(0, EXPERTS, (n, TOP_K), generator=gen) for n in tokens]
    xs = [torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16) for n in tokens]
    results = sim.dispatch([i.cuda() for i in ids], [[x.cuda()] for x in xs], TOKENS, EXPERTS)
    want = ref.reference_dispatch(ids, [[x] for x in xs], EXPERTS, TOKENS)
    partials = [torch.randn(2, TOKENS, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(2)]
    return sim, tokens, [c for _, c in results], partials, ref.reference_combine(partials, want)


@pytest.mark.parametrize("combine_bytes, one_gpu_per_rank, message", [
    (4 * HIDDEN * 2, False, r"combine_mode=1 \(push\) needs one_gpu_per_rank"),
    (2 * HIDDEN * 2 - 16, True, r"combine_mode=1 \(push\) of hidden=256 needs combine_bytes_per_token >= 1024"),
])
def test_an_impossible_push_is_refused_before_launch(combine_bytes, one_gpu_per_rank, message):
    gen = torch.Generator().manual_seed(7)
    sim, tokens, counts, partials, want = _round(combine_bytes, gen)
    for rank in range(2):
        with pytest.raises(ValueError, match=message) as info:
            fa.combine(sim.workspace, rank, sim.config, counts[rank], tokens[rank], TOKENS, partials[rank].cuda(),
                       one_gpu_per_rank=one_gpu_per_rank, combine_mode="push", timeout_s=2.0)
        assert "Check failed" not in str(info.value)
    got = sim.combine(counts, tokens, TOKENS, [p.cuda() for p in partials], timeout_s=2.0)
    torch.cuda.synchronize()
    for rank in range(2):
        fa.check_error(sim.workspace, rank)
        assert ref.bitwise_equal(got[rank].cpu(), want[rank]), f"rank {rank}"


def test_room_for_a_push_still_pulls():
    """Room for the push, one GPU per rank promised, no mode named: pulled (the push flags stay clear)."""
    gen = torch.Generator().manual_seed(8)
    sim, tokens, counts, partials, want = _round(4 * HIDDEN * 2, gen)
    got = sim.combine(counts, tokens, TOKENS, [p.cuda() for p in partials], timeout_s=2.0, one_gpu_per_rank=True)
    torch.cuda.synchronize()
    meta = fa.initialize(empty_workspace(2, sim.config.bytes_per_rank, "cpu"), 0, sim.config)
    at = int(meta[fa.get_metainfo_index_pairs()["push_flags_offset"]])
    for rank in range(2):
        fa.check_error(sim.workspace, rank)
        assert ref.bitwise_equal(got[rank].cpu(), want[rank]), f"rank {rank}"
        assert not sim.workspace[rank, at:at + 2 * TOKENS * 4].any(), f"rank {rank} received pushes"
