"""Active-rank sets on the host: the checks, the bitmask in the metadata the kernels read, the epoch a returning rank
takes, and the reference semantics (a set drops exactly what routing those experts to no rank would drop)."""

from __future__ import annotations

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import functional as F
from flashinfer_a2a import reference as ref
from flashinfer_a2a.library import active_ranks as act
from flashinfer_a2a.library.errors import metadata_offsets

pytestmark = pytest.mark.usefixtures("a2a_env")  # the built library: the metadata offsets are read from it


@pytest.mark.parametrize("ranks, error, match", [
    ([0, 5], ValueError, r"rank 5, outside \[0, ep_size=4\)"),
    ([1, 2], ValueError, "must include the calling rank 0"),
    ([0, True], TypeError, "must hold rank ints"),
    (torch.tensor([0, 1]), TypeError, "iterable of rank ints"),
    ([], ValueError, "must include the calling rank 0"),
])
def test_a_bad_set_is_refused_naming_it(ranks, error, match):
    with pytest.raises(error, match=match):
        act.inactive_bits(ranks, 4, 0)


def test_the_bitmask_holds_the_complement():
    assert act.inactive_bits(None, 4, 2) == 0
    assert act.inactive_bits([0, 2, 3], 4, 2) == 0b0010
    assert act.inactive_bits(range(72), 72, 71) == 0
    bits = act.inactive_bits([70, 3], 72, 3)
    assert act.ranks_of(bits, 72) == (3, 70)
    assert bin(bits).count("1") == 70


@pytest.mark.parametrize("epochs, latest", [([5, 5, 2, 5], 5), ([0, 0xFFFFFFFE, 0], 0), ([7], 7),
                                            ([0xFFFFFFFF, 3, 3], 3)])
def test_a_returning_rank_takes_the_latest_epoch(epochs, latest):
    assert act.latest_epoch(epochs) == latest


def test_the_set_and_the_epoch_land_in_the_metadata():
    config = F.WorkspaceConfig(ep_size=72, max_num_tokens=4, top_k=2, dispatch_bytes_per_token=16,
                               combine_bytes_per_token=16)
    ws = F.empty_workspace(72, config.bytes_per_rank, "cpu")
    for r in (0, 40):
        F.initialize(ws, r, config)
    F.set_active_ranks(ws, 40, 72, [r for r in range(72) if r not in (1, 33, 71)])
    off = metadata_offsets()["inactive_ranks_offset"]
    words = ws[40, off: off + 12].view(torch.int32).tolist()
    assert [w & 0xFFFFFFFF for w in words] == [1 << 1, 1 << 1, 1 << 7]
    assert ws[0, off: off + 12].view(torch.int32).tolist() == [0, 0, 0]  # another rank's is its own
    act.write_epoch(ws, 40, 0xFFFFFFF0)
    assert act.read_epoch(ws, 40) == 0xFFFFFFF0
    assert act.read_epoch(ws, 0) == 0


def test_the_eplb_view_is_the_region_after_the_metadata():
    config = F.WorkspaceConfig(ep_size=3, max_num_tokens=4, top_k=2, dispatch_bytes_per_token=16,
                               combine_bytes_per_token=16)
    ws = F.empty_workspace(3, config.bytes_per_rank, "cpu")
    index = F.get_metainfo_index_pairs()
    meta = F.initialize(ws, 1, config)
    view = F.eplb_gathered_stats(ws, 1, config, 5)
    assert view.shape == (3, 5) and view.dtype == torch.int32
    base = ws[1].data_ptr() + int(meta[index["eplb_offset"]])
    assert view.data_ptr() == base and view.stride() == (fa.MAX_EPLB_EXPERTS, 1)
    assert int(meta[index["push_flags_offset"]]) >= int(meta[index["eplb_offset"]]) + 3 * fa.MAX_EPLB_EXPERTS * 4


def _dropped(ids: torch.Tensor, inactive: set[int], num_experts: int, ep_size: int) -> torch.Tensor:
    """The ids with every expert of an inactive rank replaced by -1 ("no expert")."""
    owner = ref.expert_to_rank(ids, num_experts, ep_size)
    gone = torch.zeros_like(owner, dtype=torch.bool)
    for r in inactive:
        gone |= owner == r
    return torch.where(gone, torch.full_like(ids, -1), ids)


@pytest.mark.parametrize("ep_size, active", [(4, [0, 1, 3]), (5, [2]), (3, [0, 1, 2]), (8, [1, 2, 5, 7])])
def test_the_reference_drops_what_routing_to_no_rank_drops(ep_size, active):
    gen = torch.Generator().manual_seed(ep_size * 100 + len(active))
    num_experts, top_k, runtime_max = 3 * ep_size + 1, 4, 24
    ids = [ref.random_topk_ids(int(torch.randint(0, runtime_max + 1, (1,), generator=gen)), top_k, num_experts,
                               generator=gen, minus_one_frac=0.1) for _ in range(ep_size)]
    payloads = [[ref.random_payload(i.shape[0], (8,), torch.bfloat16, generator=gen), i] for i in ids]
    inactive = set(range(ep_size)) - set(active)
    got = ref.reference_dispatch(ids, payloads, num_experts, runtime_max, active_ranks=active)
    # An inactive source sends nothing: as if all its ids were -1.
    dropped = [torch.full_like(i, -1) if r in inactive else _dropped(i, inactive, num_experts, ep_size)
               for r, i in enumerate(ids)]
    want = ref.reference_dispatch(dropped, payloads, num_experts, runtime_max)
    for r in active:
        assert torch.equal(got.recv_counts[r], want.recv_counts[r])
        valid = ref.valid_row_mask(want.recv_counts[r], runtime_max)
        for p in range(2):
            assert ref.bitwise_equal(got.recv_payloads[r][p][valid], want.recv_payloads[r][p][valid])
        assert all(int(got.recv_counts[r][s]) == 0 for s in inactive)
    partials = [ref.random_payload(ep_size * runtime_max, (8,), torch.float32, generator=gen)
                .view(ep_size, runtime_max, 8) for _ in range(ep_size)]
    masked = ref.reference_combine(partials, ids, num_experts, active_ranks=active)
    for r in active:
        assert ref.bitwise_equal(masked[r], ref.reference_combine(partials, dropped, num_experts)[r])
        assert ref.bitwise_equal(masked[r], ref.reference_combine(partials, got)[r])


def test_the_reference_refuses_a_set_beside_a_dispatch_result():
    ids = [torch.zeros(1, 1, dtype=torch.int32)] * 2
    got = ref.reference_dispatch(ids, [[i] for i in ids], 2, 1)
    with pytest.raises(ValueError, match="DispatchResult carries"):
        ref.reference_combine([torch.zeros(2, 1, 4)] * 2, got, active_ranks=[0])
