"""The torch ops on CPU: sizes and metainfo against an independent computation, fakes under FakeTensorMode and
torch.compile(fullgraph=True). Builds the library (no GPU needed); the kernels themselves run in tests/gpu."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashinfer_a2a as fa
from flashinfer_a2a.library import ops
from flashinfer_a2a.functional import empty_workspace

pytestmark = pytest.mark.usefixtures("a2a_env")


def _align(x, a=128):
    return (x + a - 1) // a * a


# RankMetadata written out by hand: (field, bytes), each block 128-byte aligned, sized for 72 ranks.
_META_BLOCKS = [("epochs", 5 * 4 + 3 * 4), ("error", 4 * 4 + 8), ("dispatch_signal", 72 * 8), ("peer_runtime_max", 72 * 8),
                ("peer_call_layout", 72 * 16), ("combine_signal", 72 * 4)]


def _expected(ep_size, max_tokens, top_k, dispatch_bytes, combine_bytes):
    offsets, at = {}, 0
    for name, size in _META_BLOCKS:
        offsets[name] = at
        at += _align(size)
    eplb = at  # [ep_size, 1024] int32 after the metadata
    push_flags = _align(eplb + ep_size * 1024 * 4)
    routing = _align(push_flags + ep_size * max_tokens * 4)
    dispatch = _align(routing + max_tokens * top_k * 4)
    combine = _align(dispatch + ep_size * max_tokens * dispatch_bytes + 8 * 128)
    total = _align(combine + ep_size * max_tokens * combine_bytes)
    return offsets, {"metadata_bytes": at, "eplb_offset": eplb, "push_flags_offset": push_flags, "routing_offset": routing,
                     "dispatch_offset": dispatch, "combine_offset": combine, "bytes_per_rank": total}


SIZES = [(1, 1, 1, 0, 0), (2, 128, 8, 7168 * 2 + 8 * 4 + 8 * 4, 7168 * 2), (8, 4096, 8, 7168 + 56 * 4, 14336),
         (72, 16384, 32, 2880 * 2, 2880 * 2), (72, 1, 22, 1, 1), (5, 333, 9, 8193, 8194)]


@pytest.mark.parametrize("sizes", SIZES)
def test_workspace_size_and_metainfo(sizes):
    offsets, regions = _expected(*sizes)
    assert fa.get_workspace_size(*sizes) == regions["bytes_per_rank"]
    ep_size = sizes[0]
    if ep_size * regions["bytes_per_rank"] > 256 << 20:
        return  # the metainfo of the large shapes would need a workspace this machine cannot hold
    workspace = empty_workspace(ep_size, regions["bytes_per_rank"], "cpu").fill_(0x5A)
    config = fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=sizes[1], dispatch_bytes_per_token=sizes[3],
                                combine_bytes_per_token=sizes[4], top_k=sizes[2])
    metainfo = fa.initialize(workspace, ep_size - 1, config)
    index = fa.get_metainfo_index_pairs()
    got = {name: int(metainfo[i]) for name, i in index.items()}
    for name, value in regions.items():
        assert got[name] == value, name
    assert got["error_code_offset"] == offsets["error"]
    assert got["dispatch_signal_offset"] == offsets["dispatch_signal"]
    assert got["peer_runtime_max_offset"] == offsets["peer_runtime_max"]
    assert got["combine_signal_offset"] == offsets["combine_signal"]
    assert got["inactive_ranks_offset"] == offsets["epochs"] + 5 * 4  # after the five epoch and claim words
    # initialize cleared exactly this rank's metadata and push flags
    assert torch.all(workspace[ep_size - 1, : regions["routing_offset"]] == 0)
    assert torch.all(workspace[ep_size - 1, regions["routing_offset"] :] == 0x5A)
    assert torch.all(workspace[: ep_size - 1] == 0x5A)


def test_dispatch_layout_packs_payloads_inside_the_dispatch_region():
    config = fa.WorkspaceConfig(ep_size=4, max_num_tokens=64, dispatch_bytes_per_token=100 + 3 + 4096,
                                combine_bytes_per_token=512, top_k=8)
    offsets, combine = ops.dispatch_layout(*config.sizes(), 50, [100, 3, 4096])
    _, regions = _expected(*config.sizes())
    assert offsets[0] == regions["dispatch_offset"]
    assert offsets[1] == _align(offsets[0] + 4 * 50 * 100) and offsets[2] == _align(offsets[1] + 4 * 50 * 3)
    assert offsets[2] + 4 * 50 * 4096 <= regions["combine_offset"] == combine


@pytest.mark.parametrize(
    "args, message",
    [((0, 8, 8, 16, 16), "ep_size"), ((73, 8, 8, 16, 16), "ep_size"), ((2, 0, 8, 16, 16), "max_num_tokens"),
     ((2, 8, 33, 16, 16), "top_k"), ((2, 8, 8, -1, 16), "dispatch_bytes_per_token")],
)
def test_bad_sizes_name_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        ops.get_workspace_size(*args)


def test_dispatch_layout_rejects_oversized_payloads():
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64,
                                top_k=2)
    with pytest.raises(ValueError, match="dispatch_bytes_per_token=64"):
        ops.dispatch_layout(*config.sizes(), 8, [64, 1])
    with pytest.raises(ValueError, match="runtime_max_tokens_per_rank"):
        ops.dispatch_layout(*config.sizes(), 9, [64])


def test_ops_under_fake_tensor_mode():
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=64, combine_bytes_per_token=64,
                                top_k=4)
    with FakeTensorMode():
        workspace = torch.empty(2, config.bytes_per_rank, dtype=torch.uint8)
        metainfo = torch.empty(len(ops.METAINFO_NAMES), dtype=torch.int64)
        assert ops.initialize(workspace, metainfo, 0, *config.sizes()) is None
        index = ops.get_metainfo_index_pairs()
        assert index.shape == (len(ops.METAINFO_NAMES),) and index.dtype == torch.int64
        assert ops.get_workspace_size(*config.sizes()) == config.bytes_per_rank


def _graph_targets(captured):
    return {str(node.target) for gm in captured for node in gm.graph.nodes if node.op == "call_function"}


def _capturing_backend(captured):
    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    return backend


def test_initialize_compiles_fullgraph_on_cpu():
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=64, combine_bytes_per_token=64,
                                top_k=4)

    def setup(workspace, metainfo):
        ops.initialize(workspace, metainfo, 1, *config.sizes())
        return metainfo + fa.get_workspace_size(*config.sizes()) + ops.get_metainfo_index_pairs()

    captured = []
    workspace = empty_workspace(2, config.bytes_per_rank, "cpu").fill_(7)
    metainfo = torch.empty(len(ops.METAINFO_NAMES), dtype=torch.int64)
    got = torch.compile(setup, fullgraph=True, backend=_capturing_backend(captured))(workspace, metainfo)
    assert "flashinfer_a2a.initialize.default" in _graph_targets(captured)
    eager_metainfo = fa.initialize(empty_workspace(2, config.bytes_per_rank, "cpu"), 1, config)
    index = ops.get_metainfo_index_pairs()
    assert torch.equal(got, eager_metainfo + config.bytes_per_rank + index)
    assert torch.all(workspace[1, :2048] == 0) and torch.all(workspace[0] == 7)


def test_dispatch_sanitize_combine_fakes_trace_fullgraph():
    """The whole layer traced by dynamo with fake kernels (meta tensors: no GPU here)."""
    hidden, top_k, runtime_max = 256, 4, 16
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=hidden * 2 + top_k * 8,
                                combine_bytes_per_token=hidden * 2, top_k=top_k)

    def layer(workspace, ids, x):
        (recv_x, recv_ids), counts = fa.dispatch(workspace, 0, config, ids, [x, ids], runtime_max, 8)
        fa.sanitize_expert_ids(recv_ids, counts, -1)
        partial = (recv_x.float() * 2).to(torch.bfloat16)
        return fa.combine(workspace, 0, config, counts, ids.shape[0], runtime_max, partial), recv_ids

    workspace = torch.empty(2, config.bytes_per_rank, dtype=torch.uint8, device="meta")
    ids = torch.empty(10, top_k, dtype=torch.int64, device="meta")
    x = torch.empty(10, hidden, dtype=torch.bfloat16, device="meta")
    captured = []
    out, recv_ids = torch.compile(layer, fullgraph=True, backend=_capturing_backend(captured))(workspace, ids, x)
    assert out.shape == (10, hidden) and out.dtype == torch.bfloat16
    assert recv_ids.shape == (2, runtime_max, top_k) and recv_ids.dtype == torch.int64
    targets = _graph_targets(captured)
    for op in ("dispatch", "sanitize_expert_ids", "combine"):
        assert f"flashinfer_a2a.{op}.default" in targets


@pytest.mark.parametrize("fmt,swizzled", [("fp8_block", False), ("mxfp8", True), ("nvfp4", False),
                                          ("nvfp4", True)])
def test_quantizing_dispatch_and_fp8_combine_trace_fullgraph(fmt, swizzled):
    """The quantization arguments reach the ops in the traced graph; the receive views have the format's shapes."""
    from flashinfer_a2a.library.wire_formats import wire_format

    hidden, top_k, runtime_max = 1040, 4, 40
    wire = wire_format(fmt)
    dispatch_bytes = wire.dispatch_bytes_per_token(hidden, 40, swizzled) + top_k * 8
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=40, dispatch_bytes_per_token=dispatch_bytes,
                                combine_bytes_per_token=hidden * 2, top_k=top_k)

    def layer(workspace, ids, x, gs):
        (values, scales, recv_ids), counts = fa.dispatch(
            workspace, 0, config, ids, [x, ids], runtime_max, 8, quant_format=fmt,
            global_scale=gs if fmt == "nvfp4" else None, swizzled_scales=swizzled)
        partial = torch.zeros(2, runtime_max, hidden, dtype=torch.bfloat16, device=x.device) + values.float()[..., :1]
        out = fa.combine(workspace, 0, config, counts, ids.shape[0], runtime_max, partial.to(torch.bfloat16),
                         quant_format="fp8_block")
        return out, values, scales, recv_ids

    workspace = torch.empty(2, config.bytes_per_rank, dtype=torch.uint8, device="meta")
    ids = torch.empty(10, top_k, dtype=torch.int64, device="meta")
    x = torch.empty(10, hidden, dtype=torch.bfloat16, device="meta")
    gs = torch.empty(1, dtype=torch.float32, device="meta")
    captured = []
    torch._dynamo.reset()  # each parametrization compiles afresh (with static shapes)
    out, values, scales, recv_ids = torch.compile(layer, fullgraph=True, dynamic=False,
                                                  backend=_capturing_backend(captured))(workspace, ids, x, gs)
    assert out.shape == (10, hidden) and recv_ids.shape == (2, runtime_max, top_k)
    assert values.shape == (2, runtime_max, wire.value_bytes(hidden)) and values.dtype == wire.value_dtype
    cols = wire.scale_cols(hidden)
    want_scales = (2, 128 * (-(-cols // 4) * 4)) if swizzled else (2, runtime_max, cols)
    assert scales.shape == want_scales and scales.dtype == wire.scale_dtype
    calls = {str(n.target): n for gm in captured for n in gm.graph.nodes if n.op == "call_function"}
    dispatch_args = calls["flashinfer_a2a.dispatch.default"].args
    # phase 0: whole; num_sms 0: all; one_gpu_per_rank False: ranks may share a GPU
    assert dispatch_args[13:] == (wire.code, *dispatch_args[14:15], swizzled, 0, 0, False, None)
    # quant_format fp8_block, combine_mode pull, phase 0, num_sms 0
    assert calls["flashinfer_a2a.combine.default"].args[13:] == (1, 0, 0, 0)


def test_quantization_arguments_are_checked_before_any_launch():
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=4096,
                                combine_bytes_per_token=512, top_k=4)
    workspace = empty_workspace(2, config.bytes_per_rank, "cpu")
    ids = torch.zeros(4, 4, dtype=torch.int32)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="quant_format must be one of fp8_block, mxfp8, nvfp4, got 'fp4'"):
        fa.dispatch(workspace, 0, config, ids, [x], 16, 8, quant_format="fp4")
    with pytest.raises(ValueError, match="combine quant_format must be None or 'fp8_block'"):
        fa.combine(workspace, 0, config, torch.zeros(2, dtype=torch.int32), 4, 16, hidden=256, dtype=torch.bfloat16,
                   quant_format="nvfp4")
    with pytest.raises(ValueError, match="at most 7 tensors per dispatch that quantizes"):
        fa.dispatch(workspace, 0, config, ids, [x] * 8, 16, 8, quant_format="mxfp8")


def test_plain_eager_calls_skip_the_dispatcher_and_modes_do_not(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64,
                                top_k=4)
    workspace = empty_workspace(2, config.bytes_per_rank, "cpu")
    metainfo = torch.empty(len(ops.METAINFO_NAMES), dtype=torch.int64)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        ops.initialize(workspace, metainfo, 0, *config.sizes())
    assert "flashinfer_a2a.initialize.default" in seen.ops  # a dispatch mode sees the op

    def no_dispatcher(*args):
        raise AssertionError("plain eager call went through the dispatcher")

    monkeypatch.setattr(ops.initialize, "overload", no_dispatcher)
    metainfo.fill_(-1)
    ops.initialize(workspace, metainfo, 1, *config.sizes())  # the implementation, directly
    assert int(metainfo[ops.METAINFO_NAMES.index("bytes_per_rank")]) == config.bytes_per_rank


def test_debug_argument_overrides_the_environment(monkeypatch):
    """debug=True runs the host id check without FLASHINFER_A2A_DEBUG; debug=False skips it with the variable set
    (the C++ entry then refuses the CPU workspace instead: the check is the only step before it)."""
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=4096,
                                combine_bytes_per_token=512, top_k=4)
    workspace = empty_workspace(2, config.bytes_per_rank, "cpu")
    ids = torch.tensor([[0, 1, 2, 9]], dtype=torch.int32)  # 9: not one of the 8 experts
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    monkeypatch.delenv("FLASHINFER_A2A_DEBUG", raising=False)
    with pytest.raises(ValueError, match="expert id 9"):
        fa.dispatch(workspace, 0, config, ids, [x], 16, 8, debug=True)
    monkeypatch.setenv("FLASHINFER_A2A_DEBUG", "1")
    with pytest.raises(ValueError, match="expert id 9"):
        fa.dispatch(workspace, 0, config, ids, [x], 16, 8)  # debug=None: the variable
    with pytest.raises(ValueError, match="workspace must be a CUDA tensor"):
        fa.dispatch(workspace, 0, config, ids, [x], 16, 8, debug=False)
