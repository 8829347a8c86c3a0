"""flashinfer_a2a.compat.flashinfer on CPU: FlashInfer's signatures, Mapping, the sizes the engines pass, the
CommBackend adapter over gloo ranks, and every argument we refuse (before any launch). Construction runs on
simulated ranks (threads over one CPU tensor); the GPU suite runs the engines' call sequences."""

import inspect

import pytest
import torch

from flashinfer_a2a import functional as F
from flashinfer_a2a.memory import shared_workspace
from flashinfer_a2a.compat import checkpoint
from flashinfer_a2a.compat import flashinfer as fi
from flashinfer_a2a.testing.simulated_group import SimulatedGroup

from .compat_workers import spawn

pytestmark = pytest.mark.usefixtures("a2a_env")


@pytest.fixture(autouse=True)
def _fresh_sizes(monkeypatch):
    monkeypatch.setattr(fi, "_SPLITS", {})
    yield
    assert shared_workspace.live_workspaces() == []
    assert checkpoint._DETACHED == {}


def _params(fn):
    return [p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_signatures_are_flashinfers():
    assert _params(fi.MoeAlltoAll.__init__) == [
        "mapping", "max_num_tokens", "top_k", "num_experts", "workspace_size_per_rank", "hidden_size",
        "mnnvl_config", "eplb_stats_num_experts", "enable_rank_mask", "backend"]
    assert _params(fi.MoeAlltoAll.dispatch) == [
        "token_selected_experts", "input_payloads", "runtime_max_tokens_per_rank", "invalid_token_expert_id",
        "expert_id_payload_index", "eplb_local_stats", "active_rank_mask"]
    assert inspect.signature(fi.MoeAlltoAll.__init__).parameters["backend"].kind == inspect.Parameter.KEYWORD_ONLY
    # FlashInfer 0.7.2's order: the fourth positional is output_dtype, output the eighth; the last two keyword-only
    combine = inspect.signature(fi.MoeAlltoAll.combine).parameters
    assert _params(fi.MoeAlltoAll.combine) == [
        "payload", "runtime_max_tokens_per_rank", "payload_in_workspace", "output_dtype", "output_scales",
        "output_scalar_scale", "sf_layout", "output", "use_low_precision", "active_rank_mask"]
    assert [p.name for p in combine.values() if p.kind == inspect.Parameter.KEYWORD_ONLY] == [
        "use_low_precision", "active_rank_mask"]
    assert combine["sf_layout"].default == fi.SF_LAYOUT_LINEAR == 2  # FlashInfer's SfLayout.layout_linear
    assert _params(fi.MoeAlltoAll.checkpoint_prepare) == []
    assert _params(fi.MoeAlltoAll.checkpoint_restore) == ["comm_backend"]
    assert _params(fi.MoeAlltoAll.get_combine_payload_tensor_in_workspace) == [
        "runtime_max_tokens_per_rank", "hidden_size", "dtype"]
    assert _params(fi.moe_a2a_get_workspace_size_per_rank) == [
        "ep_size", "max_num_tokens", "total_dispatch_payload_size_per_token", "combine_payload_size_per_token",
        "eplb_stats_num_experts", "backend"]
    assert _params(fi.Mapping.__init__)[:3] == ["world_size", "rank", "gpus_per_node"]


def test_mapping_as_the_engines_build_it():
    vllm = fi.Mapping(8, 3, 8, tp_size=8, moe_ep_size=8)  # vLLM: positional world_size, rank, gpus_per_node
    assert (vllm.moe_ep_rank, vllm.moe_ep_size, vllm.tp_rank, vllm.pp_rank, vllm.cp_rank) == (3, 8, 3, 0, 0)
    sglang = fi.Mapping(rank=5, tp_size=6, moe_ep_size=6, world_size=6, gpus_per_node=8, pp_size=1, cp_size=1)
    assert (sglang.moe_ep_rank, sglang.moe_ep_size, sglang.moe_tp_size) == (5, 6, 1)
    assert (fi.Mapping().moe_ep_size, fi.Mapping().moe_ep_rank) == (1, 0)
    mixed = fi.Mapping(8, 6, 8, tp_size=8, moe_tp_size=2)  # moe_ep_size derived: 8 / 2
    assert (mixed.moe_ep_size, mixed.moe_ep_rank, mixed.moe_tp_rank) == (4, 2, 1)
    staged = fi.Mapping(8, 5, 8, tp_size=4, pp_size=2, moe_ep_size=4)
    assert (staged.tp_rank, staged.pp_rank, staged.moe_ep_rank) == (1, 1, 1)
    with pytest.raises(ValueError, match="world_size=8 must equal tp_size"):
        fi.Mapping(8, 0, 8, tp_size=4)
    with pytest.raises(ValueError, match="tp_size=8 must equal moe_tp_size"):
        fi.Mapping(8, 0, 8, tp_size=8, moe_tp_size=2, moe_ep_size=2)
    with pytest.raises(ValueError, match="rank must be an int"):
        fi.Mapping(4, 4, 8, tp_size=4)


def _sglang_sizes(hidden, top_k, ep, max_tokens):
    """SGLang's arithmetic: the same size for bf16, mxfp8 and nvfp4 (the maximum with bf16)."""
    ids_weights = top_k * 8
    bf16 = hidden * 2 + ids_weights
    sizes = {}
    for fmt, quantized in (("bf16", bf16), ("mxfp8", hidden + hidden // 32 + ids_weights),
                           ("nvfp4", hidden // 2 + hidden // 16 + ids_weights)):
        sizes[fmt] = fi.moe_a2a_get_workspace_size_per_rank(ep_size=ep, max_num_tokens=max_tokens,
                                                            total_dispatch_payload_size_per_token=max(quantized, bf16),
                                                            combine_payload_size_per_token=hidden * 2)
    return sizes, bf16


def _compat_layers(group, mapping_of, specs):
    def build(rank, comm):
        cfg = fi.MnnvlConfig(comm_backend=comm.comm_backend())
        return [fi.MoeAlltoAll(mapping_of(rank), *args, mnnvl_config=cfg) for args in specs]

    return group.run(build)


def _destroy(group, layers):
    group.run(lambda rank, comm: [layer.destroy() for layer in layers[rank]])


def test_sglang_sizes_share_one_workspace_and_the_draft_gets_its_own():
    ep, hidden, top_k, max_tokens = 2, 1024, 8, 64
    sizes, bf16 = _sglang_sizes(hidden, top_k, ep, max_tokens)
    assert len(set(sizes.values())) == 1  # one size for every format, as SGLang computes it
    size = sizes["bf16"]
    group = SimulatedGroup(ep, "cpu")
    mapping = lambda r: fi.Mapping(rank=r, tp_size=ep, moe_ep_size=ep, world_size=ep, gpus_per_node=8)  # noqa: E731
    target = (max_tokens, top_k, 16, size)
    draft = (max_tokens, top_k, 16, size + 128)  # SGLang's namespace for a draft model's graphs
    layers = _compat_layers(group, mapping, [target] * 40 + [draft] * 3)
    assert group.allocations == 2
    ptrs = {layer.workspace.data_ptr() for layer in layers[0]}
    assert len(ptrs) == 2
    # FlashInfer's cache key holds max_num_tokens and the backend too: either change gets a workspace of its own
    more = group.run(lambda rank, comm: [
        fi.MoeAlltoAll(mapping(rank), max_tokens // 2, top_k, 16, size,
                       mnnvl_config=fi.MnnvlConfig(comm_backend=comm.comm_backend())),
        fi.MoeAlltoAll(mapping(rank), max_tokens, top_k, 16, size, backend="cake",
                       mnnvl_config=fi.MnnvlConfig(comm_backend=comm.comm_backend()))])
    assert group.allocations == 4
    for rank in range(ep):
        layers[rank] += more[rank]
    for layer in layers[0][:43]:
        assert layer._a2a.config.dispatch_bytes_per_token == bf16
        assert layer._a2a.config.combine_bytes_per_token == hidden * 2
        assert layer._a2a.config.max_num_tokens == max_tokens
    _destroy(group, layers)


def test_vllm_grown_size_fits_every_layers_split():
    """vLLM grows one size to the maximum over its layers: that total matches no single layer's split."""
    ep, max_tokens = 2, 32
    a = fi.moe_a2a_get_workspace_size_per_rank(ep, max_tokens, 1000, 4096)  # small dispatch, wide combine
    b = fi.moe_a2a_get_workspace_size_per_rank(ep, max_tokens, 6000, 2048)  # wide dispatch, narrower combine
    assert b > a
    assert fi.split_workspace_size(max(a, b), ep, max_tokens) == (6000, 4096)
    assert fi.split_workspace_size(a, ep, max_tokens) == (1000, 4096)
    group = SimulatedGroup(ep, "cpu")
    mapping = lambda r: fi.Mapping(ep, r, 8, tp_size=ep, moe_ep_size=ep)  # noqa: E731
    layers = _compat_layers(group, mapping, [(max_tokens, 4, 8, max(a, b))])
    cfg = layers[0][0]._a2a.config
    assert (cfg.dispatch_bytes_per_token, cfg.combine_bytes_per_token, cfg.top_k) == (6000, 4096, 4)
    _destroy(group, layers)


def test_sizes_computed_by_hand():
    size = 2 * 64 * (3000 + 2048)  # FlashInfer's arithmetic without its metadata
    assert fi.split_workspace_size(size, 2, 64, hidden_size=1024) == (3000, 2048)
    assert fi.split_workspace_size(size, 2, 64) == (5048, 5048)  # no hidden size: any split of the bytes fits
    with pytest.raises(ValueError, match="less than a bf16 combine row"):
        fi.split_workspace_size(2 * 64 * 100, 2, 64, hidden_size=1024)
    with pytest.raises(ValueError, match="must be positive"):
        fi.split_workspace_size(0, 2, 64)
    # hidden_size alone sizes it as FlashInfer does: bf16 hidden states, int32 ids, fp32 weights
    default = fi.MoeAlltoAll.get_moe_workspace_size_per_rank(2, 8, 64, 1024)
    assert fi.split_workspace_size(default, 2, 64) == (1024 * 2 + 8 * 8, 1024 * 2)


def test_refused_constructor_arguments():
    with pytest.raises(ValueError, match="backend must be one of"):
        fi.MoeAlltoAll(fi.Mapping(), 16, 2, 4, hidden_size=256, backend="nccl")
    with pytest.raises(ValueError, match=r"eplb_stats_num_experts must be an int in \[0, 1024\]"):
        fi.MoeAlltoAll(fi.Mapping(), 16, 2, 4, hidden_size=256, eplb_stats_num_experts=-1)
    # every workspace has room for the EPLB statistics: the size does not grow with them
    assert fi.moe_a2a_get_workspace_size_per_rank(2, 16, 64, 64, eplb_stats_num_experts=4) == \
        fi.moe_a2a_get_workspace_size_per_rank(2, 16, 64, 64)


@pytest.fixture
def one_rank():
    group = SimulatedGroup(1, "cpu")
    layers = _compat_layers(group, lambda r: fi.Mapping(), [(16, 2, 4, None, 256)])
    yield layers[0][0]
    layers[0][0]._a2a._transport.shared.pending = None
    layers[0][0]._a2a._transport.shared.order.reset()
    _destroy(group, layers)


def test_unsupported_call_arguments_and_misuse_raise_before_any_launch(one_rank):
    a2a = one_rank
    ids = torch.zeros(4, 2, dtype=torch.int32)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    for kwargs, match in ((dict(eplb_local_stats=torch.zeros(4, dtype=torch.int32)), "eplb_stats_num_experts=0"),
                          (dict(active_rank_mask=torch.zeros(1, dtype=torch.int64)), "requires enable_rank_mask")):
        with pytest.raises(ValueError, match=match):  # the layer was built without them
            a2a.dispatch(ids, [x, ids], 16, **kwargs)
    with pytest.raises(ValueError, match="expert_id_payload_index is required"):
        a2a.dispatch(ids, [x, ids], 16, invalid_token_expert_id=-1)
    with pytest.raises(ValueError, match="expert_id_payload_index=2 is not an index"):
        a2a.dispatch(ids, [x, ids], 16, -1, 2)
    payload = torch.zeros(1, 16, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="without a pending dispatch"):
        a2a.combine(payload, 16)
    with pytest.raises(RuntimeError, match="without a pending dispatch"):
        a2a.get_combine_payload_tensor_in_workspace(16, 256, torch.bfloat16)
    a2a._a2a._transport.shared.pending = (4, 16, torch.zeros(1, dtype=torch.int32))  # what a dispatch leaves (GPU only)
    a2a._a2a._transport.shared.order.advance("dispatch")
    for kwargs, argument in ((dict(output_dtype=torch.float8_e4m3fn), "output_dtype"),
                             (dict(output_scales=torch.zeros(4, dtype=torch.uint8)), "output_scales"),
                             (dict(output_scalar_scale=0.5), "output_scalar_scale"),
                             (dict(sf_layout=1), "sf_layout")):
        with pytest.raises(NotImplementedError, match=argument):
            a2a.combine(payload, 16, **kwargs)
    with pytest.raises(ValueError, match="requires enable_rank_mask"):
        a2a.combine(payload, 16, active_rank_mask=fi.moe_a2a_active_rank_mask([0], 1))
    with pytest.raises(TypeError, match="output_dtype must be a torch.dtype or None, got Tensor"):
        a2a.combine(payload, 16, False, torch.empty(4, 256, dtype=torch.bfloat16))  # output passed fourth
    with pytest.raises(ValueError, match="runtime_max_tokens_per_rank=8 differs from the pending dispatch's 16"):
        a2a.combine(payload, 8)
    with pytest.raises(ValueError, match=r"payload must be \[ep_size=1, runtime_max_tokens_per_rank=16, hidden\]"):
        a2a.combine(torch.zeros(16, 256, dtype=torch.bfloat16), 16)
    with pytest.raises(ValueError, match="payload_in_workspace=True but payload is not"):
        a2a.combine(payload, 16, payload_in_workspace=True)
    view = a2a.get_combine_payload_tensor_in_workspace(16, 256, torch.bfloat16)
    assert view.shape == (1, 16, 256) and view.view(-1, 256).shape == (16, 256)
    assert view.data_ptr() == a2a._a2a.combine_input(256, torch.bfloat16).data_ptr()
    with pytest.raises(RuntimeError, match="dispatch called twice"):
        a2a.dispatch(ids, [x, ids], 16)
    assert a2a._a2a._transport.shared.pending[1] == 16  # the pending dispatch is untouched


def test_communicator_must_be_the_ep_group():
    group = SimulatedGroup(2, "cpu")
    with pytest.raises(ValueError, match="moe_ep_rank/moe_ep_size are .* but the communicator"):
        _compat_layers(group, lambda r: fi.Mapping(4, r, 8, tp_size=4, moe_ep_size=4), [(16, 2, 8, None, 256)])


def test_comm_backend_adapter_over_engine_shaped_backends(tmp_path):
    spawn("adapter", 3, tmp_path)


def test_torch_dist_backend_split(tmp_path):
    spawn("split", 4, tmp_path)


class _OtherRank:
    """A CommBackend of the right size whose ranks are numbered differently."""

    def __init__(self, backend):
        self.backend = backend

    def Get_rank(self):
        return (self.backend.Get_rank() + 1) % self.backend.Get_size()

    def Get_size(self):
        return self.backend.Get_size()

    def allgather(self, data):
        return self.backend.allgather(data)


def test_checkpoint_on_simulated_ranks():
    """Through any layer of a workspace, on every rank: prepare releases that workspace only (here: this rank's rows
    poisoned, the simulated memory being one tensor), calls until restore raise, restore re-initializes it as a
    fresh workspace at the same address over the new communicator; repeated calls are no-ops."""
    ep, max_tokens, top_k = 2, 16, 4
    size = fi.moe_a2a_get_workspace_size_per_rank(ep, max_tokens, 256 * 2 + top_k * 8, 256 * 2)
    group = SimulatedGroup(ep, "cpu")
    mapping = lambda r: fi.Mapping(ep, r, 8, tp_size=ep, moe_ep_size=ep)  # noqa: E731
    layers = _compat_layers(group, mapping, [(max_tokens, top_k, 8, size)] * 3 + [(max_tokens, top_k, 8, size + 128)])
    shared = [rank[0]._a2a._transport.shared for rank in layers]
    workspace, draft = layers[0][0].workspace, layers[0][3].workspace
    address = workspace.data_ptr()
    end = int(shared[0].metainfo[F.get_metainfo_index_pairs()["routing_offset"]])
    fresh = F.empty_workspace(ep, workspace.shape[1], "cpu")
    for rank in range(ep):
        F.initialize(fresh, rank, shared[rank].config)
    workspace.fill_(7)  # the epochs, signals and rows of steps run before
    draft_before = draft.clone()

    group.run(lambda rank, comm: layers[rank][1].checkpoint_prepare())
    group.run(lambda rank, comm: layers[rank][2].checkpoint_prepare())  # released already: a no-op
    assert bool((workspace == checkpoint.POISON_BYTE).all())
    assert torch.equal(draft, draft_before)  # another workspace (SGLang's draft model's) is untouched
    a2a = layers[0][0]
    ids = torch.zeros(4, top_k, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"dispatch: the workspace was released by checkpoint_prepare\(\)"):
        a2a.dispatch(ids, [torch.zeros(4, 256, dtype=torch.bfloat16), ids], max_tokens)
    with pytest.raises(RuntimeError, match="get_combine_payload_tensor_in_workspace: the workspace was released"):
        a2a.get_combine_payload_tensor_in_workspace(max_tokens, 256, torch.bfloat16)
    with pytest.raises(RuntimeError, match="combine: the workspace was released"):
        a2a.combine(torch.zeros(ep, max_tokens, 256, dtype=torch.bfloat16), max_tokens)
    with pytest.raises(RuntimeError, match="would share was released by checkpoint_prepare"):
        _compat_layers(group, mapping, [(max_tokens, top_k, 8, size)])
    with pytest.raises(RuntimeError, match="comm_backend is rank 1 of 2, but the workspace was built by rank 0"):
        a2a.checkpoint_restore(_OtherRank(SimulatedGroup(ep, "cpu").communicator(0).comm_backend()))

    old_comms = [s.comm for s in shared]
    backends = group.run(lambda rank, comm: comm.comm_backend())
    group.run(lambda rank, comm: layers[rank][2].checkpoint_restore(backends[rank]))
    group.run(lambda rank, comm: layers[rank][0].checkpoint_restore(comm.comm_backend()))  # restored: a no-op
    assert workspace.data_ptr() == address
    assert torch.equal(workspace[:, :end], fresh[:, :end])  # the contract of a fresh workspace
    for rank in range(ep):
        assert shared[rank].comm is not old_comms[rank] and shared[rank].comm.backend is backends[rank]
        assert all(layer._a2a.comm is shared[rank].comm for layer in layers[rank][:3])
        assert shared[rank].order.state == "idle" and shared[rank].pending is None
    _destroy(group, layers)


def test_checkpoint_refused_while_a_dispatch_is_pending_and_destroy_between():
    group = SimulatedGroup(1, "cpu")
    (a2a,), = _compat_layers(group, lambda r: fi.Mapping(), [(16, 2, 4, None, 256)])
    shared = a2a._a2a._transport.shared
    shared.pending = (4, 16, torch.zeros(1, dtype=torch.int32))  # what a dispatch leaves (GPU only)
    shared.order.advance("dispatch")
    with pytest.raises(RuntimeError, match=r"checkpoint_prepare failed on ranks \[0\].*dispatched step pending"):
        a2a.checkpoint_prepare()
    assert not checkpoint.is_detached(shared)
    shared.pending = None
    shared.order.reset()
    a2a.checkpoint_prepare()
    assert checkpoint.is_detached(shared)
    a2a.destroy()  # between prepare and restore: frees it, and forgets it was released
    assert not checkpoint.is_detached(shared) and shared.allocation is None
    with pytest.raises(RuntimeError, match="checkpoint_prepare: this MoeAlltoAll was destroyed"):
        a2a.checkpoint_prepare()


def test_checkpoint_over_gloo_ranks_with_a_new_communicator(tmp_path):
    spawn("checkpoint", 2, tmp_path)


def test_checkpoint_remaps_virtual_memory_at_the_same_addresses(tmp_path):
    spawn("checkpoint_vmm", 3, tmp_path)
