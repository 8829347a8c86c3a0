"""Shared and growable workspaces on CPU: simulated ranks (threads, one CPU tensor) build real MoeAlltoAll objects,
so the sharing, growth, namespaces, pending state and release run as on GPUs; only dispatch/combine need one."""

import random

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a.memory import shared_workspace
from flashinfer_a2a.testing.simulated_group import SimulatedGroup
from flashinfer_a2a.library.sizing import workspace_config

pytestmark = pytest.mark.usefixtures("a2a_env")


def _layer(comm, **kw):
    args = dict(max_num_tokens=64, top_k=8, num_experts=16, hidden_size=512, device=None)
    args.update(kw)
    return fa.MoeAlltoAll(comm, **args)


@pytest.fixture(autouse=True)
def _no_leftover_workspaces():
    yield
    assert shared_workspace.live_workspaces() == []


def test_sixty_layers_share_one_workspace():
    group = SimulatedGroup(2, "cpu")

    def build(rank, comm):
        return [_layer(comm) for _ in range(60)]

    layers = group.run(build)
    assert group.allocations == 1
    one = layers[0][0].requested.bytes_per_rank
    assert group.live_bytes() == 2 * one  # [ep_size, bytes_per_rank]: one workspace, not sixty
    assert len({layer.workspace.data_ptr() for rank in layers for layer in rank}) == 1
    assert len(shared_workspace.live_workspaces()) == 2  # one per rank
    group.run(lambda rank, comm: [layer.destroy() for layer in layers[rank]])
    assert group.live_bytes() == 0


def test_a_layer_needing_more_grows_the_workspace_collectively():
    group = SimulatedGroup(3, "cpu")
    gen = random.Random(torch.seed())
    shapes = [dict(hidden_size=gen.choice([256, 512, 1024]), max_num_tokens=gen.choice([16, 64, 128]),
                   top_k=gen.choice([2, 4, 8])) for _ in range(12)]

    layers = group.run(lambda rank, comm: [_layer(comm, **s) for s in shapes])
    want = fa.WorkspaceConfig(ep_size=3, max_num_tokens=max(s["max_num_tokens"] for s in shapes),
                              dispatch_bytes_per_token=max(s["hidden_size"] * 2 + s["top_k"] * 12 for s in shapes),
                              combine_bytes_per_token=max(s["hidden_size"] * 2 for s in shapes),
                              top_k=max(s["top_k"] for s in shapes))
    for rank in layers:
        for layer in rank:
            assert layer.config == want  # every layer, also those built before the growth, sees the union
            assert layer.workspace.shape[0] == 3 and layer.workspace.shape[1] >= want.bytes_per_rank
    assert group.live_bytes() == layers[0][0].workspace.numel()
    # every rank's copy of the metadata was re-initialized for the final layout
    index = fa.get_metainfo_index_pairs()
    assert int(layers[0][0].metainfo[index["bytes_per_rank"]]) == want.bytes_per_rank
    group.run(lambda rank, comm: [layer.destroy() for layer in layers[rank]])


def test_namespaces_get_their_own_workspace_and_the_last_user_frees_it():
    group = SimulatedGroup(2, "cpu")

    def build(rank, comm):
        return [_layer(comm), _layer(comm, namespace="draft"), _layer(comm)]

    layers = group.run(build)
    assert group.allocations == 2
    target, draft, target2 = layers[0]
    assert target.workspace.data_ptr() == target2.workspace.data_ptr() != draft.workspace.data_ptr()
    group.run(lambda rank, comm: layers[rank][0].destroy())
    assert group.allocations == 2 and layers[0][2].workspace is not None  # still one user of "default"
    assert group.live_bytes() == 2 * 2 * target2.config.bytes_per_rank
    group.run(lambda rank, comm: (layers[rank][2].destroy(), layers[rank][1].destroy()))
    assert group.live_bytes() == 0
    with pytest.raises(RuntimeError, match="destroyed"):
        target.dispatch(torch.zeros(1, 8, dtype=torch.int32), [torch.zeros(1, 512, dtype=torch.bfloat16)])


def test_pending_dispatch_is_per_shared_workspace():
    group = SimulatedGroup(1, "cpu")
    a, b, draft = group.run(lambda rank, comm: [_layer(comm), _layer(comm), _layer(comm, namespace="draft")])[0]
    with pytest.raises(RuntimeError, match="without a pending dispatch"):
        b.combine_input()
    a._transport.shared.pending = (4, 16, torch.zeros(1, dtype=torch.int32))  # what a dispatch leaves (the kernel needs a GPU)
    a._transport.shared.order.advance("dispatch")
    with pytest.raises(RuntimeError, match="dispatch called twice"):
        b.dispatch(torch.zeros(4, 8, dtype=torch.int32), [torch.zeros(4, 512, dtype=torch.bfloat16)], 16)
    assert b._transport.shared.pending[0] == 4  # the pending dispatch is left usable
    assert draft._transport.shared.pending is None
    with pytest.raises(RuntimeError, match="while a dispatch is pending"):
        group.run(lambda rank, comm: _layer(comm, hidden_size=4096))
    a._transport.shared.pending = None
    a._transport.shared.order.reset()
    group.run(lambda rank, comm: [x.destroy() for x in (a, b, draft)])


def test_construction_error_registers_nothing():
    group = SimulatedGroup(2, "cpu")
    with pytest.raises(ValueError, match="namespace must be a non-empty str"):
        group.run(lambda rank, comm: _layer(comm, namespace=""))
    with pytest.raises(ValueError, match="top_k must be in"):
        group.run(lambda rank, comm: _layer(comm, top_k=33))
    assert group.allocations == 0


def test_sizing_helper_matches_the_payload_arithmetic():
    cfg = workspace_config(8, 4096, 7168, 8, wire="fp8_block")
    assert cfg.dispatch_bytes_per_token == 7168 + 7168 // 128 * 4 + 8 * 4 + 8 * 4
    assert cfg.combine_bytes_per_token == 7168 * 2
    bf16 = workspace_config(4, 256, 4096, 8, ids_dtype=torch.int64)
    assert bf16.dispatch_bytes_per_token == 4096 * 2 + 8 * 8 + 8 * 4
    nvfp4 = workspace_config(4, 256, 2880, 4, wire="nvfp4")
    assert nvfp4.dispatch_bytes_per_token == 2880 // 2 + 2880 // 16 + 4 * 4 + 4 * 4
    push = workspace_config(2, 16, 1024, 2, push_combine=True)
    assert push.combine_bytes_per_token == 2 * 1024 * 2
    assert cfg.bytes_per_rank >= 8 * 4096 * (cfg.dispatch_bytes_per_token + cfg.combine_bytes_per_token)
    # a MoeAlltoAll built for the same model asks for exactly this config
    group = SimulatedGroup(2, "cpu")
    layers = group.run(lambda rank, comm: _layer(comm, hidden_size=1024, top_k=4, max_num_tokens=32,
                                                 extra_dispatch_bytes_per_token=4 * 4 + 4 * 4))
    assert layers[0].requested == workspace_config(2, 32, 1024, 4)
    group.run(lambda rank, comm: layers[rank].destroy())


@pytest.mark.parametrize("kwargs, message", [
    (dict(ep_size=0), "ep_size must be a positive int"),
    (dict(top_k=0), r"top_k must be in \[1, 32\]"),
    (dict(hidden_size=-1), "hidden_size must be a positive int"),
    (dict(wire="fp4"), "wire must be one of"),
    (dict(ids_dtype=torch.int16), "ids_dtype must be torch.int32 or torch.int64"),
    (dict(combine_format="nvfp4"), "combine_format must be None or 'fp8_block'"),
])
def test_sizing_helper_names_bad_arguments(kwargs, message):
    args = dict(ep_size=2, max_num_tokens=16, hidden_size=256, top_k=4)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        workspace_config(**args)
