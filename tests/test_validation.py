"""Misuse refused on the host: fakes that validate like the C++ entries, clean C++ messages, library-owned
constants, the error reader's own argument checks. Builds the library (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashinfer_a2a as fa
from flashinfer_a2a.library import constants, ops
from flashinfer_a2a.library.errors import A2AError, check_error, describe_call_layout
from flashinfer_a2a.functional import empty_workspace
from flashinfer_a2a.library.layout import metadata_offsets
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS

pytestmark = pytest.mark.usefixtures("a2a_env")

CONFIG = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, top_k=4, dispatch_bytes_per_token=4096,
                            combine_bytes_per_token=512)


def test_python_literals_are_pinned_to_the_library():
    lib = constants.library_constants()
    for literal, key in constants.PINNED.items():
        assert getattr(constants, literal) == lib[key], literal
    assert (fa.MAX_EP_SIZE, fa.MAX_TOP_K, fa.MAX_PAYLOADS) == (lib["max_ep_size"], lib["max_top_k"],
                                                              lib["max_payloads"])
    for name, fmt in WIRE_FORMATS.items():
        assert fmt.code == lib[f"quant_{name}"], name
    assert list(constants.QUANT_FORMAT_CODES) == sorted(lib[k] for k in lib if k.startswith("quant_"))


def test_call_layout_fields_tile_the_fingerprint_without_overlap():
    fields = constants.call_layout_fields()
    assert {"top_k", "topk_ids dtype", "payload dtypes", "payload row bytes", "quant_format"} <= set(fields)
    bits = 0
    for shift, width in fields.values():
        mask = ((1 << width) - 1) << shift
        assert bits & mask == 0
        bits |= mask
    assert bits < 1 << 64
    shift, _ = fields["topk_ids dtype"]
    assert describe_call_layout(1 << shift) == ["topk_ids dtype"]
    row_shift, _ = fields["payload row bytes"]
    assert describe_call_layout((1 << row_shift) | 3) == ["top_k", "payload row bytes"]


def test_cxx_errors_carry_only_the_message():
    with pytest.raises(ValueError) as info:
        ops.get_workspace_size(0, 1, 1, 0, 0)
    assert str(info.value) == "ep_size must be in [1, 72], got 0"
    with pytest.raises(ValueError) as info:
        ops.dispatch_layout(*CONFIG.sizes(), 16, [4096, 1])
    assert "Check failed" not in str(info.value) and "dispatch_bytes_per_token=4096" in str(info.value)
    frames = [f.filename for f in _frames(info.value.__traceback__)]
    assert not any(f.endswith((".h", ".cu", ".cuh")) for f in frames), frames


def _frames(tb):
    import traceback

    return traceback.extract_tb(tb)


def test_workspace_config_is_keyword_only_and_needs_top_k():
    with pytest.raises(TypeError):
        fa.WorkspaceConfig(2, 16, 4, 64)  # the positional order every op uses differs: never guessed
    with pytest.raises(TypeError, match="top_k"):
        fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=4, combine_bytes_per_token=64)
    with pytest.raises(ValueError, match="top_k must be in \\[1, 32\\], got 33"):
        fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, top_k=33, dispatch_bytes_per_token=4,
                           combine_bytes_per_token=64)
    with pytest.raises(TypeError, match="max_num_tokens must be an int, got float"):
        fa.WorkspaceConfig(ep_size=2, max_num_tokens=16.0, top_k=3, dispatch_bytes_per_token=4,
                           combine_bytes_per_token=64)


def test_none_inputs_raise_type_error_naming_the_argument():
    workspace = empty_workspace(2, CONFIG.bytes_per_rank, "cpu")
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    ids = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor, got NoneType"):
        fa.dispatch(workspace, 0, CONFIG, None, [x], 16, 8)
    with pytest.raises(TypeError, match=r"payloads\[1\] must be a torch.Tensor, got NoneType"):
        fa.dispatch(workspace, 0, CONFIG, ids, [x, None], 16, 8)
    with pytest.raises(TypeError, match="payloads must be a list or tuple of tensors, got Tensor"):
        fa.dispatch(workspace, 0, CONFIG, ids, x, 16, 8)


def test_check_error_refuses_a_rank_outside_the_workspace():
    workspace = empty_workspace(2, CONFIG.bytes_per_rank, "cpu")
    fa.initialize(workspace, 0, CONFIG)
    fa.initialize(workspace, 1, CONFIG)
    check_error(workspace, 1)  # a clean record
    with pytest.raises(ValueError, match=r"ep_rank must be in \[0, ep_size=2\) of this workspace, got 5"):
        check_error(workspace, 5)
    with pytest.raises(TypeError, match="workspace must be a \\[ep_size, bytes_per_rank\\] uint8 tensor"):
        check_error(workspace.view(torch.int32), 0)


@pytest.mark.parametrize("garbage", [-1, 77])
def test_uninitialized_workspace_is_reported_as_such(garbage):
    workspace = empty_workspace(2, CONFIG.bytes_per_rank, "cpu")
    fa.initialize(workspace, 0, CONFIG)
    off = metadata_offsets()["error_code_offset"]
    workspace[0, off : off + 4].view(torch.int32).fill_(garbage)
    with pytest.raises(A2AError, match=f"holds code {garbage}.*not initialized"):
        check_error(workspace, 0)


def test_call_layout_mismatch_message_names_peer_and_field():
    workspace = empty_workspace(2, CONFIG.bytes_per_rank, "cpu")
    fa.initialize(workspace, 1, CONFIG)
    off = metadata_offsets()
    lib = constants.library_constants()
    shift, _ = constants.call_layout_fields()["topk_ids dtype"]
    row = workspace[1]

    def put(name, dtype, value):
        row[off[name] : off[name] + dtype.itemsize].view(dtype).fill_(value)

    put("error_code_offset", torch.int32, lib["error_call_layout_mismatch"])
    put("error_phase_offset", torch.int32, lib["phase_dispatch"])
    put("error_peer_offset", torch.int32, 0)
    put("error_detail_offset", torch.int64, 1 << shift)
    with pytest.raises(A2AError) as info:
        check_error(workspace, 1)
    assert info.value.peer == 0 and info.value.phase == "dispatch"
    assert "rank 0 dispatched with another call layout" in str(info.value)
    assert "differing: topk_ids dtype" in str(info.value) and "recv_counts[0] = 0" in str(info.value)


def _fake_args(**change):
    """Arguments of ops.dispatch as fake CUDA tensors, valid unless ``change`` says otherwise."""
    args = dict(workspace=torch.empty(2, CONFIG.bytes_per_rank, dtype=torch.uint8, device="cuda"),
                topk_ids=torch.empty(5, 4, dtype=torch.int32, device="cuda"),
                payloads=[torch.empty(5, 256, dtype=torch.bfloat16, device="cuda")],
                recv_counts=torch.empty(2, dtype=torch.int32, device="cuda"), ep_rank=0)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, message", [
    (dict(ep_rank=2), ValueError, r"ep_rank must be in \[0, ep_size=2\), got 2"),
    (dict(topk_ids=("float32", (5, 4))), TypeError, "topk_ids must be int32 or int64"),
    (dict(topk_ids=("int64", (5,))), ValueError, "topk_ids must be \\[num_tokens, top_k\\]"),
    (dict(topk_ids=("int64", (5, 6))), ValueError, "top_k <= 4"),
    (dict(topk_ids=("int64", (17, 4))), ValueError, "more than runtime_max_tokens_per_rank=16"),
    (dict(recv_counts=("int64", (2,))), ValueError, "recv_counts must be int32 of shape \\[ep_size=2\\]"),
    (dict(payloads=[("bfloat16", (4, 256))]), ValueError, r"payloads\[0\] must have num_tokens=5 rows"),
    (dict(workspace=("uint8", (3, 64))), ValueError, "workspace must have shape \\[ep_size=2"),
])
def test_dispatch_fake_validates_like_the_cxx_entry(change, error, message):
    with FakeTensorMode(allow_non_fake_inputs=False):
        def make(spec):
            dtype, shape = spec
            return torch.empty(*shape, dtype=getattr(torch, dtype), device="cuda")

        resolved = {k: ([make(s) for s in v] if isinstance(v, list) else make(v) if isinstance(v, tuple) else v)
                    for k, v in change.items()}
        valid = _fake_args()
        torch.ops.flashinfer_a2a.dispatch(valid["workspace"], valid["topk_ids"], valid["payloads"],
                                          valid["recv_counts"], 0, *CONFIG.sizes(), 16, 8, 10.0)  # passes
        args = _fake_args(**resolved)
        with pytest.raises(error, match=message):
            torch.ops.flashinfer_a2a.dispatch(args["workspace"], args["topk_ids"], args["payloads"],
                                              args["recv_counts"], args["ep_rank"], *CONFIG.sizes(), 16, 8, 10.0)


def test_combine_fake_validates_like_the_cxx_entry():
    with FakeTensorMode():
        ws = torch.empty(2, CONFIG.bytes_per_rank, dtype=torch.uint8, device="cuda")
        counts = torch.empty(2, dtype=torch.int32, device="cuda")
        out = torch.empty(5, 256, dtype=torch.bfloat16, device="cuda")
        partials = torch.empty(2, 16, 256, dtype=torch.bfloat16, device="cuda")
        combine = torch.ops.flashinfer_a2a.combine
        combine(ws, partials, counts, out, 1, *CONFIG.sizes(), 16, 10.0, False)  # valid: passes
        with pytest.raises(TypeError, match="partials must have the dtype of out"):
            half = torch.empty(2, 16, 256, dtype=torch.float16, device="cuda")
            combine(ws, half, counts, out, 1, *CONFIG.sizes(), 16, 10.0, False)
        with pytest.raises(ValueError, match="partials must be \\[ep_size=2, runtime_max_tokens_per_rank=16"):
            short = torch.empty(2, 8, 256, dtype=torch.bfloat16, device="cuda")
            combine(ws, short, counts, out, 1, *CONFIG.sizes(), 16, 10.0, False)
        with pytest.raises(ValueError, match="combine_bytes_per_token=512"):
            combine(ws, None, counts, torch.empty(5, 512, dtype=torch.float16, device="cuda"), 1, *CONFIG.sizes(),
                    16, 10.0, False)
        with pytest.raises(ValueError, match=r"ep_rank must be in \[0, ep_size=2\), got -1"):
            combine(ws, partials, counts, out, -1, *CONFIG.sizes(), 16, 10.0, False)
        with pytest.raises(TypeError, match="FP8-wire combine needs bfloat16 or float16 out"):
            out32 = torch.empty(5, 64, dtype=torch.float32, device="cuda")
            combine(ws, None, counts, out32, 1, *CONFIG.sizes(), 16, 10.0, False, 1)


def test_importing_errors_first_needs_no_cycle():
    code = "import flashinfer_a2a.library.errors, flashinfer_a2a.functional; print('ok')"
    for first in ("flashinfer_a2a.library.errors", "flashinfer_a2a.library.layout", "flashinfer_a2a.library.constants"):
        done = subprocess.run([sys.executable, "-c", f"import {first}; " + code], capture_output=True, text=True,
                              check=False)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
