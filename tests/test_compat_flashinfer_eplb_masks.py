"""flashinfer_a2a.compat.flashinfer's EPLB statistics and rank masks (FlashInfer 0.7.2's ``eplb_stats_num_experts``,
``eplb_local_stats``, ``eplb_gathered_stats``, ``enable_rank_mask``, ``active_rank_mask``,
``moe_a2a_active_rank_mask``) on simulated ranks on the CPU: construction, FlashInfer's workspace key, and every
refusal before a launch. They run on GPUs in tests/multigpu/moe_ep_engine.py (``flashinfer_072``)."""

import pytest
import torch

from flashinfer_a2a.compat import flashinfer as fi
from flashinfer_a2a.memory import shared_workspace
from flashinfer_a2a.testing.simulated_group import SimulatedGroup

pytestmark = pytest.mark.usefixtures("a2a_env")
EP, TOKENS, TOP_K, EXPERTS, HIDDEN = 2, 16, 4, 8, 256


@pytest.fixture
def layers():
    """Per rank: [a layer with EPLB statistics and rank masks, one without, one with statistics only], all of one
    workspace_size_per_rank."""
    group = SimulatedGroup(EP, "cpu")
    size = fi.MoeAlltoAll.get_moe_workspace_size_per_rank(EP, TOP_K, TOKENS, HIDDEN)

    def build(rank, comm):
        mapping = fi.Mapping(EP, rank, 8, tp_size=EP, moe_ep_size=EP)
        config = fi.MnnvlConfig(comm_backend=comm.comm_backend())
        return [fi.MoeAlltoAll(mapping, TOKENS, TOP_K, EXPERTS, size, mnnvl_config=config, **kwargs)
                for kwargs in (dict(eplb_stats_num_experts=EXPERTS, enable_rank_mask=True), {},
                               dict(eplb_stats_num_experts=EXPERTS))]

    built = group.run(build)
    yield group, built
    group.run(lambda rank, comm: [layer.destroy() for layer in built[rank]])
    assert shared_workspace.live_workspaces() == []


def test_eplb_layers_get_flashinfers_workspace_key(layers):
    group, built = layers
    masked, plain, stats = built[0]
    assert (masked.eplb_stats_num_experts, masked.enable_rank_mask) == (EXPERTS, True)
    assert (plain.eplb_stats_num_experts, plain.enable_rank_mask) == (0, False)
    assert masked.native.eplb_stats_num_experts == EXPERTS and masked.native.active_ranks == (0, 1)
    # FlashInfer's cache key holds eplb_stats_num_experts: the layers with 8 share, the one with 0 has its own
    assert group.allocations == 2
    assert masked.workspace.data_ptr() == stats.workspace.data_ptr() != plain.workspace.data_ptr()
    assert masked.eplb_gathered_stats is None  # no dispatch yet


def test_refusals_before_any_launch(layers):
    _, built = layers
    masked, plain, stats = built[0]
    ids = torch.zeros(4, TOP_K, dtype=torch.int32)
    payloads = [torch.zeros(4, HIDDEN, dtype=torch.bfloat16), ids]
    good = fi.moe_a2a_active_rank_mask([0, 1], EP)
    assert good.tolist() == [3] and good.dtype == torch.uint64
    for layer, kwargs, error, match in (
            (masked, dict(active_rank_mask=good.long()), TypeError, "active_rank_mask must be uint64"),
            (masked, dict(active_rank_mask=torch.zeros(4, dtype=torch.uint64)), ValueError,
             r"active_rank_mask must have shape \[1\]"),
            (masked, dict(active_rank_mask=good.to("meta")), ValueError, "active_rank_mask must be a CPU tensor"),
            (masked, dict(active_rank_mask=fi.moe_a2a_active_rank_mask([1], EP)), ValueError,
             "leaves out the calling rank 0"),
            (stats, dict(active_rank_mask=good), ValueError, "requires enable_rank_mask=True"),
            (masked, dict(eplb_local_stats=torch.zeros(EXPERTS + 1, dtype=torch.int32)), ValueError,
             f"eplb_stats_num_experts={EXPERTS}"),
            (masked, dict(eplb_local_stats=torch.zeros(EXPERTS, dtype=torch.float32)), TypeError,
             "eplb_local_stats must be int32"),
            (stats, dict(eplb_local_stats=torch.zeros(EXPERTS, dtype=torch.int32, device="meta")), ValueError,
             "eplb_local_stats must be on the same device"),
            (plain, dict(eplb_local_stats=torch.zeros(EXPERTS, dtype=torch.int32)), ValueError,
             "eplb_stats_num_experts=0")):
        with pytest.raises(error, match=match):
            layer.dispatch(ids, payloads, TOKENS, **kwargs)
    for layer in (masked, plain, stats):
        assert layer.native.active_ranks == (0, 1) and layer.eplb_gathered_stats is None
    assert all(shared.order.state == "idle" for shared in shared_workspace.live_workspaces())


def test_combine_takes_its_dispatchs_mask(layers):
    _, built = layers
    masked = built[0][0]
    shared = masked._workspace.shared
    shared.pending = (4, TOKENS, torch.zeros(EP, dtype=torch.int32))  # what a dispatch leaves (a GPU launch)
    shared.order.advance("dispatch")
    payload = torch.zeros(EP, TOKENS, HIDDEN, dtype=torch.bfloat16)
    try:
        with pytest.raises(ValueError, match=r"active_rank_mask of combine selects ranks \[0\], its dispatch ran "
                                             r"with ranks \[0, 1\]"):
            masked.combine(payload, TOKENS, active_rank_mask=fi.moe_a2a_active_rank_mask([0], EP))
        with pytest.raises(TypeError, match="active_rank_mask must be uint64"):
            masked.combine(payload, TOKENS, active_rank_mask=torch.ones(1, dtype=torch.int32))
    finally:
        shared.pending = None
        shared.order.reset()
