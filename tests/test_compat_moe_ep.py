"""flashinfer_a2a.compat.moe_ep on CPU: FlashInfer 0.7.4's params, configs and registry; layers built on simulated
ranks (workspace sharing, EPLB, every refusal before a launch); and the calls end to end on spawned gloo ranks over
the nccl transport (tests/moe_ep_workers.py), bitwise against the reference. The GPU flows (the nvlink transport,
CUDA graphs, EPLB statistics and masks in action) are in tests/multigpu/moe_ep_engine.py."""

import enum
import logging

import pytest
import torch

from flashinfer_a2a import functional as F
from flashinfer_a2a.compat import flashinfer as fi
from flashinfer_a2a.compat import moe_ep
from flashinfer_a2a.compat.moe_ep import communication, nvlink_one_sided
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS
from flashinfer_a2a.memory import shared_workspace
from flashinfer_a2a.testing.simulated_group import SimulatedGroup

from .comm_workers import spawn_checks

QF = moe_ep.QuantFormat


@pytest.fixture(autouse=True)
def _nothing_left():
    yield
    assert shared_workspace.live_workspaces() == []


# ------------------------------------------------------------------------------------------------- params


@pytest.mark.parametrize("fmt, hidden, expected", [
    (None, 7168, 7168 * 2), (QF.BF16, 7168, 14336), (QF.FP16, 4096, 8192), (QF.FP8PerTensor, 7168, 7168),
    (QF.DeepSeekFp8, 7168, 7168 + 4 * 56), (QF.DeepSeekFp8, 2880, 2880 + 4 * 23), (QF.MXFP8, 2880, 2880 + 90),
    (QF.MXFP8, 100, 100 + 4), (QF.NVFP4, 7168, 3584 + 448), (QF.NVFP4, 2881, 1441 + 181),
    (QF.MXFP4, 2880, 1440 + 90), (QF.MXFP4, 33, 17 + 2)])
def test_dispatch_bytes_per_token_per_format(fmt, hidden, expected):
    params = moe_ep.MoEEpCommParams(256, 8, 64, hidden, dispatch_format=fmt)
    assert params.dispatch_bytes_per_token == expected
    values, scales, dtype = params.wire_rows()
    assert values + scales == expected
    assert dtype == {None: torch.bfloat16, QF.BF16: torch.bfloat16, QF.FP16: torch.float16}.get(fmt)


def test_dispatch_bytes_follow_dtype_and_equal_our_wire_formats():
    assert moe_ep.MoEEpCommParams(8, 2, 4, 1000, dtype=torch.float32).dispatch_bytes_per_token == 4000
    assert moe_ep.MoEEpCommParams(8, 2, 4, 1000).token_dtype == torch.bfloat16
    # the formats our dispatch quantizes into carry exactly FlashInfer's bytes
    for name, ours in communication.QUANTIZING_FORMATS.items():
        for hidden in (16, 100, 2880, 7168):
            params = moe_ep.MoEEpCommParams(8, 2, 4, hidden, dispatch_format=QF[name])
            assert params.dispatch_bytes_per_token == WIRE_FORMATS[ours].row_bytes(hidden), (name, hidden)


def test_params_defaults_and_refusals():
    params = moe_ep.MoEEpCommParams(64, 8, 128, 2048)
    assert (params.dtype, params.dispatch_format, params.invalid_expert_id) == (None, None, -1)
    for kwargs, match in ((dict(num_experts=0), "num_experts must be a positive int"),
                          (dict(top_k=2.0), "top_k must be a positive int"),
                          (dict(hidden_size=True), "hidden_size must be a positive int"),
                          (dict(top_k=65), "top_k=65 exceeds num_experts=64"),
                          (dict(invalid_expert_id=3), "invalid_expert_id=3 must lie outside"),
                          (dict(dispatch_format=QF.MXINT4), r"dispatch_format must be None or one of"),
                          (dict(dispatch_format="MXFP8"), r"dispatch_format must be None or one of")):
        with pytest.raises(ValueError, match=match):
            moe_ep.MoEEpCommParams(**{**dict(num_experts=64, top_k=8, max_tokens_per_rank=128, hidden_size=2048),
                                      **kwargs})
    with pytest.raises(AttributeError):
        params.top_k = 4  # frozen, as FlashInfer's


def test_flashinfers_own_quant_format_is_taken_by_name():
    class QuantFormat(enum.Enum):  # what flashinfer.fused_moe.QuantFormat looks like to us
        NVFP4 = 5
        INT4 = 8

    assert moe_ep.MoEEpCommParams(8, 2, 4, 64, dispatch_format=QuantFormat.NVFP4).dispatch_bytes_per_token == 36
    with pytest.raises(ValueError, match="dispatch_format"):
        moe_ep.MoEEpCommParams(8, 2, 4, 64, dispatch_format=QuantFormat.INT4)
    assert [(m.name, m.value) for m in QF] == [("BF16", 0), ("FP16", 1), ("FP8PerTensor", 2), ("DeepSeekFp8", 3),
                                               ("MXFP8", 4), ("NVFP4", 5), ("MXFP4", 6), ("MXINT4", 7), ("INT4", 8)]
    assert repr(QF.MXFP8) == "QuantFormat.MXFP8"


def test_dispatch_result_fields():
    rows = torch.zeros(4, 2)
    result = moe_ep.MoEEpDispatchResult(rows, rows, None, 2)
    assert (result.hidden_states_scale, result.eplb_gathered_stats, result.tokens_per_rank) == (None, None, 2)


# ------------------------------------------------------------------------------------------------- configs


def test_config_defaults_are_flashinfers():
    config = moe_ep.NVLinkOneSidedConfig()
    assert vars(config) == dict(
        backend_name="nvlink_one_sided", extra_payload_bytes_per_token=0, eplb_stats_num_experts=0,
        enable_rank_mask=False, use_low_precision_combine=False, comm_backend=None, cft=None,
        cft_max_tokens_for_dispatch=128, cft_max_tokens_for_combine=128, lamport=None, lamport_max_tokens=None,
        timeout_sec=300, enable_pdl=None)
    boot = moe_ep.BootstrapConfig(4, 3)
    assert (boot.stream, boot.auto_bootstrap, boot.device, boot.nccl_comm, boot.process_group, boot.tcp_store) == (
        0, True, None, None, None, None)
    assert moe_ep.BootstrapConfig(4, 3, process_group=object()) == boot  # the group is left out of comparisons
    assert moe_ep.BootstrapConfig(4, 3, 0, True, 2).nccl_comm == 2  # the fifth positional: device is keyword-only
    with pytest.raises(TypeError):
        moe_ep.BootstrapConfig(4, 3, 0, True, None, None, None, 1)
    for kwargs, match in ((dict(world_size=0, rank=0), "world_size must be positive"),
                          (dict(world_size=2, rank=2), r"rank=2 is outside \[0, world_size=2\)"),
                          (dict(world_size=2, rank=0, device=-1), "device must be")):
        with pytest.raises(ValueError, match=match):
            moe_ep.BootstrapConfig(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lamport=True, cft=True), ValueError, "lamport=True and cft=True"),
    (dict(extra_payload_bytes_per_token=-1), ValueError, "extra_payload_bytes_per_token must be an int >= 0"),
    (dict(eplb_stats_num_experts=65), ValueError, r"eplb_stats_num_experts must be in \[0, num_experts=64\]"),
    (dict(timeout_sec=2.5), TypeError, "timeout_sec must be an int"),
    (dict(timeout_sec=True), TypeError, "timeout_sec must be an int"),
    (dict(timeout_sec=0), ValueError, r"timeout_sec must be in \[1, 86400\]"),
    (dict(timeout_sec=86401), ValueError, r"timeout_sec must be in \[1, 86400\]"),
    (dict(cft_max_tokens_for_combine=-1), ValueError, "cft_max_tokens_for_combine must be an int >= 0"),
    (dict(lamport_max_tokens=0), ValueError, "lamport_max_tokens must be a positive int or None"),
    (dict(enable_pdl="yes"), ValueError, "enable_pdl must be None, True or False")])
def test_config_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        moe_ep.config.check_config(moe_ep.NVLinkOneSidedConfig(**kwargs), 64)


def test_blackwell_transport_switches_are_accepted(caplog, monkeypatch):
    monkeypatch.setattr(moe_ep.config, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="flashinfer_a2a.compat.moe_ep.config"):
        for _ in range(3):  # an engine builds one layer per MoE layer: said once
            moe_ep.config.check_config(moe_ep.NVLinkOneSidedConfig(lamport=True, lamport_max_tokens=159,
                                                                   cft=False, enable_pdl=False), 64)
        moe_ep.config.check_config(moe_ep.NVLinkOneSidedConfig(cft=True, cft_max_tokens_for_dispatch=0), 64)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "no Lamport transport" in said[0] and "no CFT counted-write transport" in said[1]


# ------------------------------------------------------------------------------------------------- registry


def test_registry(monkeypatch):
    monkeypatch.setattr(communication, "_BACKENDS", dict(communication._BACKENDS))
    assert moe_ep.NVLinkOneSidedAlltoAll.backend_name == "nvlink_one_sided"
    assert moe_ep.is_communication_backend("nvlink_one_sided")
    assert moe_ep.is_communication_backend(moe_ep.NVLinkOneSidedConfig())
    assert not moe_ep.is_communication_backend(3) and not moe_ep.is_communication_backend("cake")
    assert moe_ep.communication_backend_name(moe_ep.NVLinkOneSidedConfig()) == "nvlink_one_sided"
    with pytest.raises(TypeError, match="backend must be a name or a config"):
        moe_ep.communication_backend_name(object())
    # no GPU here: the one-sided backend's default transport cannot run
    assert moe_ep.available_communication_backends() == (["nvlink_one_sided"] if torch.cuda.is_available() else [])

    made = []

    @moe_ep.register_communication("recording")
    class Recording(moe_ep.MoEEpCommunication):
        @classmethod
        def is_platform_supported(cls):
            return True

        def __init__(self, bootstrap, params, config=None, **options):
            super().__init__(bootstrap, params)
            made.append((config, options))

        def dispatch(self, *args, **kwargs):
            raise NotImplementedError

        def combine(self, *args, **kwargs):
            raise NotImplementedError

    class RecordingConfig:
        backend_name = "recording"

    boot, params = moe_ep.BootstrapConfig(2, 1), moe_ep.MoEEpCommParams(8, 2, 4, 64)
    assert Recording.backend_name == "recording" and "recording" in moe_ep.available_communication_backends()
    layer = moe_ep.create_communication(boot, params, "recording", knob=3)
    assert made[-1] == (None, {"knob": 3}) and layer.num_local_experts == 4 and layer.ep_rank == 1
    config = RecordingConfig()
    moe_ep.create_communication(boot, params, config)
    assert made[-1] == (config, {})
    assert layer.get_combine_input_buffer(torch.bfloat16) is None
    layer.destroy()
    with pytest.raises(KeyError, match="unknown communication backend 'cake'"):
        moe_ep.create_communication(boot, params, "cake")
    with pytest.raises(ValueError, match="num_experts=9 divisible by the EP size 2"):
        moe_ep.create_communication(boot, moe_ep.MoEEpCommParams(9, 2, 4, 64), "recording")
    assert layer._resolve_runtime_max_tokens_per_rank(None) == 4
    with pytest.raises(ValueError, match=r"must be an int in \(0, max_tokens_per_rank=4\]"):
        layer._resolve_runtime_max_tokens_per_rank(5)


def test_no_gpu_refuses_the_nvlink_transport_before_anything_collective(monkeypatch):
    monkeypatch.setattr(nvlink_one_sided.NVLinkOneSidedAlltoAll, "is_platform_supported", classmethod(lambda c: False))
    boot, params = moe_ep.BootstrapConfig(2, 0), moe_ep.MoEEpCommParams(8, 2, 4, 64)
    with pytest.raises(RuntimeError, match="NVLinkOneSidedAlltoAll is not supported on this platform"):
        moe_ep.create_communication(boot, params, "nvlink_one_sided")
    with pytest.raises(TypeError, match=r"unexpected options \['max_num_tokens'\]"):
        moe_ep.create_communication(boot, params, "nvlink_one_sided", max_num_tokens=8)
    with pytest.raises(TypeError, match="config must be an NVLinkOneSidedConfig"):
        moe_ep.NVLinkOneSidedAlltoAll(boot, params, config=object())
    with pytest.raises(ValueError, match="quantize_dispatch=True needs dispatch_format"):
        moe_ep.create_communication(boot, params, "nvlink_one_sided", quantize_dispatch=True)
    nvfp4 = moe_ep.MoEEpCommParams(8, 2, 4, 64, dispatch_format=QF.NVFP4)
    with pytest.raises(ValueError, match="global_scale is required with dispatch_format=QuantFormat.NVFP4"):
        moe_ep.create_communication(boot, nvfp4, "nvlink_one_sided", quantize_dispatch=True)
    with pytest.raises(ValueError, match="global_scale is for quantize_dispatch=True"):
        moe_ep.create_communication(boot, nvfp4, "nvlink_one_sided", global_scale=1.0)
    fp32 = moe_ep.MoEEpCommParams(8, 2, 4, 64, dtype=torch.float32, dispatch_format=QF.MXFP8)
    with pytest.raises(ValueError, match="quantizes bf16|fp16 rows"):
        moe_ep.create_communication(boot, fp32, "nvlink_one_sided", quantize_dispatch=True)


# ------------------------------------------------------------------------------------------------- rank masks


def test_rank_masks_as_flashinfer_lays_them_out():
    mask = fi.rank_mask([0, 3, 65, 71], 72, 4)
    assert mask.dtype == torch.uint64 and mask.device.type == "cpu"
    assert mask.tolist() == [0b1001, (1 << 1) | (1 << 7), 0, 0]
    assert fi.mask_ranks(mask, 72, 65, 4) == (0, 3, 65, 71)
    assert fi.moe_a2a_active_rank_mask(torch.tensor([2, 0]), 4).tolist() == [0b101]  # 0.7.2: one word
    assert fi.rank_mask(range(64), 64, 1).tolist() == [(1 << 64) - 1]
    with pytest.raises(ValueError, match=r"rank 4 is outside \[0, ep_size=4\)"):
        fi.moe_a2a_active_rank_mask([4], 4)
    with pytest.raises(ValueError, match="past the 64 ranks of 1 mask words"):
        fi.moe_a2a_active_rank_mask([64], 72)
    everyone = fi.rank_mask(range(4), 4, 4)
    for mask, error, match in (
            ([15, 0, 0, 0], TypeError, "must be a CPU uint64 tensor of 4 words, got list"),
            (everyone.to(torch.int64), TypeError, "active_rank_mask must be uint64"),
            (everyone[:1], ValueError, r"active_rank_mask must have shape \[4\]"),
            (everyone.view(2, 2), ValueError, r"must have shape \[4\] \(4 uint64 words\), got \[2, 2\]"),
            (everyone.to("meta"), ValueError, "must be a CPU tensor"),
            (fi.rank_mask([0, 1, 2, 5], 8, 4), ValueError, r"sets ranks \[5\], outside \[0, ep_size=4\)"),
            (fi.rank_mask([0, 1, 3], 4, 4), ValueError, "leaves out the calling rank 2")):
        with pytest.raises(error, match=match):
            fi.mask_ranks(mask, 4, 2, 4)
    with pytest.raises(ValueError, match="1 uint64 words hold 64 ranks, fewer than ep_size=72"):
        fi.mask_ranks(fi.rank_mask([0], 64, 1), 72, 0, 1)


def test_requested_ranks_read_a_missing_mask_as_flashinfer_does():
    assert fi.requested_ranks(None, False, 4, 1, 4) is None  # no rank mask: the set in force
    assert fi.requested_ranks(None, True, 4, 1, 4) == (0, 1, 2, 3)  # enable_rank_mask: no mask means every rank
    assert fi.requested_ranks(fi.rank_mask([1, 2], 4, 4), True, 4, 1, 4) == (1, 2)
    with pytest.raises(ValueError, match="requires enable_rank_mask=True"):
        fi.requested_ranks(fi.rank_mask([1], 4, 4), False, 4, 1, 4)


# ------------------------------------------------------------------------------------------------- simulated ranks

HIDDEN, EXPERTS, TOP_K, TOKENS = 256, 8, 4, 16


@pytest.fixture
def simulated(a2a_env):
    """Layers on 2 simulated ranks (threads; one CPU workspace tensor): construction as on GPUs, no launches."""
    group = SimulatedGroup(2, "cpu")
    built = []

    def make(specs):
        def body(rank, comm):
            boot = moe_ep.BootstrapConfig(2, rank, process_group=comm)
            return [moe_ep.create_communication(boot, params, config or moe_ep.NVLinkOneSidedConfig(), **options)
                    for params, config, options in specs]

        layers = group.run(body)
        built.append(layers)
        return layers

    yield group, make
    for layers in built:
        group.run(lambda rank, comm: [layer.destroy() for layer in layers[rank]])


def _params(**kwargs):
    return moe_ep.MoEEpCommParams(**{**dict(num_experts=EXPERTS, top_k=TOP_K, max_tokens_per_rank=TOKENS,
                                            hidden_size=HIDDEN), **kwargs})


def test_layers_share_a_workspace_as_flashinfers_layouts_do(simulated):
    group, make = simulated
    same = (_params(), None, {})
    layers = make([same] * 30 + [(_params(max_tokens_per_rank=8), None, {}),
                                 (_params(dispatch_format=QF.DeepSeekFp8), None, {}),
                                 (_params(), moe_ep.NVLinkOneSidedConfig(eplb_stats_num_experts=EXPERTS), {}),
                                 (_params(), None, dict(namespace="draft"))])
    assert group.allocations == 5  # one for the 30 layers of one layout, one per other layout
    mine = layers[0]
    assert len({layer.workspace.data_ptr() for layer in mine[:30]}) == 1
    assert len({layer.workspace.data_ptr() for layer in mine}) == 5
    assert mine[0].native.transport == "nvlink" and mine[0].native.requested.dispatch_bytes_per_token == (
        HIDDEN * 2 + 2 * TOP_K * 4)
    assert mine[31].native.requested.dispatch_bytes_per_token == HIDDEN + 4 * 2 + 2 * TOP_K * 4
    assert mine[32].native.eplb_stats_num_experts == EXPERTS
    assert not mine[0].lamport_enabled and mine[0].lamport_max_tokens == 0 and mine[0].metainfo is not None


def test_every_refusal_comes_before_a_launch(simulated):
    """On the nvlink transport (a CPU workspace: any launch would fail here), every bad call is refused by a check
    naming its argument, and leaves nothing behind: no dispatch pending, the active set unchanged."""
    group, make = simulated
    (layer, eplb, fp8, quantizing), _ = make([
        (_params(), moe_ep.NVLinkOneSidedConfig(enable_rank_mask=True), {}),
        (_params(), moe_ep.NVLinkOneSidedConfig(eplb_stats_num_experts=6), {}),
        (_params(dispatch_format=QF.DeepSeekFp8), None, {}),
        (_params(dispatch_format=QF.NVFP4), None, dict(quantize_dispatch=True, global_scale=2.0))])
    x = torch.zeros(5, HIDDEN, dtype=torch.bfloat16)
    ids, w = torch.zeros(5, TOP_K, dtype=torch.int64), torch.zeros(5, TOP_K)
    full = layer.active_rank_mask([0, 1])
    refusals = [
        (layer, dict(active_rank_mask=full.long()), TypeError, "active_rank_mask must be uint64"),
        (layer, dict(active_rank_mask=full[:2]), ValueError, r"active_rank_mask must have shape \[4\]"),
        (layer, dict(active_rank_mask=full.to("meta")), ValueError, "active_rank_mask must be a CPU tensor"),
        (layer, dict(active_rank_mask=layer.active_rank_mask([1])), ValueError, "leaves out the calling rank 0"),
        (eplb, dict(active_rank_mask=full), ValueError, "requires enable_rank_mask=True"),
        (layer, dict(runtime_max_tokens_per_rank=TOKENS + 1), ValueError, f"runtime_max_tokens_per_rank={TOKENS + 1}"),
        (layer, dict(runtime_max_tokens_per_rank=4), ValueError, "5 tokens, more than runtime_max_tokens_per_rank=4"),
        (eplb, dict(eplb_local_stats=torch.zeros(7, dtype=torch.int32)), ValueError, "eplb_stats_num_experts=6"),
        (eplb, dict(eplb_local_stats=torch.zeros(6, dtype=torch.int64)), TypeError, "eplb_local_stats must be int32"),
        (eplb, dict(eplb_local_stats=torch.zeros(6, dtype=torch.int32, device="meta")), ValueError,
         "eplb_local_stats must be on the same device"),
        (layer, dict(eplb_local_stats=torch.zeros(6, dtype=torch.int32)), ValueError, "eplb_stats_num_experts=0"),
        (fp8, dict(), ValueError, r"hidden_states: dispatch_format=QuantFormat.DeepSeekFp8 carries 256 bytes a token"),
        (quantizing, dict(hidden_states_scale=torch.zeros(5, 16, dtype=torch.uint8)), ValueError,
         "quantize_dispatch makes the scales"),
    ]
    for target, kwargs, error, match in refusals:
        with pytest.raises(error, match=match):
            target.dispatch(x, ids, w, **kwargs)
    values = torch.zeros(5, HIDDEN, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="hidden_states_scale is required: .* carries 8 bytes of scales"):
        fp8.dispatch(values, ids, w)
    with pytest.raises(ValueError, match="hidden_states_scale: .* carries 8 bytes of scales a token"):
        fp8.dispatch(values, ids, w, hidden_states_scale=torch.zeros(5, 4))
    with pytest.raises(ValueError, match=r"hidden_states_scale must be \[num_tokens=5, ...\]"):
        fp8.dispatch(values, ids, w, hidden_states_scale=torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"hidden_states must be \[num_tokens=5"):
        layer.dispatch(x[:3], ids, w)
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
        layer.dispatch(x, ids.short(), w)
    with pytest.raises(ValueError, match="quantize_dispatch quantizes"):
        quantizing.dispatch(x.float(), ids, w)
    for target in (layer, eplb, fp8, quantizing):
        assert target._round is None and target.native.active_ranks == (0, 1)
        with pytest.raises(RuntimeError, match="combine called before dispatch"):
            target.combine(torch.zeros(2 * TOKENS, HIDDEN, dtype=torch.bfloat16))
    assert shared_workspace.live_workspaces()[0].order.state == "idle"


def test_checkpoint_and_destroy_through_any_layer(simulated):
    group, make = simulated
    layers = make([(_params(), None, {})] * 3)
    workspace = layers[0][0].workspace
    address = workspace.data_ptr()
    group.run(lambda rank, comm: layers[rank][1].checkpoint_prepare())
    with pytest.raises(RuntimeError, match="dispatch: the workspace was released by checkpoint_prepare"):
        layers[0][2].dispatch(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), torch.zeros(1, TOP_K, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="would share was released by checkpoint_prepare"):
        make([(_params(), None, {})])
    group.run(lambda rank, comm: layers[rank][0].checkpoint_restore(comm.comm_backend()))
    assert workspace.data_ptr() == address
    group.run(lambda rank, comm: layers[rank][2].destroy())
    with pytest.raises(RuntimeError, match="has been destroyed"):
        layers[0][2].checkpoint_prepare()


def test_communicator_must_be_the_bootstrap_group(a2a_env):
    group = SimulatedGroup(2, "cpu")
    with pytest.raises(ValueError, match="the communicator is rank 0 of 2, but bootstrap says rank 0 of world_size=4"):
        group.run(lambda rank, comm: moe_ep.create_communication(
            moe_ep.BootstrapConfig(4, rank), _params(),
            moe_ep.NVLinkOneSidedConfig(comm_backend=comm.comm_backend())) if rank == 0 else None)
    # a FlashInfer CommBackend in the config sets the workspace up instead of the process group
    layers = group.run(lambda rank, comm: moe_ep.create_communication(
        moe_ep.BootstrapConfig(2, rank), _params(), moe_ep.NVLinkOneSidedConfig(comm_backend=comm.comm_backend())))
    assert group.allocations == 1
    group.run(lambda rank, comm: layers[rank].destroy())


# ------------------------------------------------------------------------------------------------- gloo ranks


@pytest.mark.usefixtures("a2a_env")
@pytest.mark.parametrize("world_size", [2, 4])
def test_flows_on_gloo_ranks(tmp_path, world_size):
    spawn_checks("tests.moe_ep_workers", "flows", world_size, tmp_path, timeout_s=300.0)


@pytest.mark.usefixtures("a2a_env")
def test_refusals_leave_every_rank_usable_on_gloo_ranks(tmp_path):
    spawn_checks("tests.moe_ep_workers", "errors", 2, tmp_path, timeout_s=300.0)


def test_max_eplb_experts_is_the_native_bound():
    assert F.MAX_EPLB_EXPERTS == 1024
    with pytest.raises(ValueError, match=r"eplb_stats_num_experts must be an int in \[0, 1024\]"):
        fi.moe_a2a_get_workspace_size_per_rank(2, 16, 64, 64, eplb_stats_num_experts=1025)
