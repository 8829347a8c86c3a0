"""torch.compile(dynamic=True) of dispatch, sanitize and combine on CPU (meta tensors, fake kernels): the receive
views are built from symbolic sizes, land where the eager layout puts them, and one graph serves every size."""

import random

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import functional as F
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS
from flashinfer_a2a.library import layout

pytestmark = pytest.mark.usefixtures("a2a_env")


def test_traced_layout_equals_the_cpp_layout():
    """The one copy of the receive-region arithmetic (needed for symbolic sizes) against the C++ it repeats."""
    gen = random.Random(torch.seed())
    for _ in range(300):
        ep, max_tokens, top_k = gen.randint(1, 72), gen.randint(1, 4096), gen.randint(1, 32)
        fmt = gen.choice([None, *WIRE_FORMATS.values()])
        swizzled = int(fmt is not None and fmt.name != "fp8_block" and gen.random() < 0.5)
        hidden = gen.randrange(16, 8192, 16)
        rows = [2 * hidden if fmt is not None else gen.randint(1, 9000)]
        rows += [gen.randint(1, 600) for _ in range(gen.randint(0, 6))]
        runtime_max = gen.randint(0, max_tokens)
        quant = (fmt.code, hidden, swizzled) if fmt is not None else ()
        need = (fmt.dispatch_bytes_per_token(hidden, max_tokens, bool(swizzled)) if fmt is not None else rows[0])
        config = fa.WorkspaceConfig(ep_size=ep, max_num_tokens=max_tokens, dispatch_bytes_per_token=need + sum(rows[1:]),
                                    combine_bytes_per_token=gen.randint(1, 9000), top_k=top_k)
        want = layout.layout_offsets(config.sizes(), runtime_max, tuple(rows), *quant)
        traced = layout.traced_layout_offsets(config.sizes(), runtime_max, tuple(rows), *quant)
        assert traced == want, (config, rows, quant)


def _capturing(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


@pytest.mark.parametrize("quant", [None, "fp8_block", "nvfp4"])
def test_compile_dynamic_true_builds_views_from_symbolic_sizes(quant):
    top_k, max_tokens = 4, 64
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=max_tokens, dispatch_bytes_per_token=4096 * 2 + top_k * 12,
                                combine_bytes_per_token=4096 * 2, top_k=top_k)
    kwargs = {} if quant is None else dict(quant_format=quant)

    def layer(workspace, ids, x, w, gs, runtime_max):
        extra = dict(global_scale=gs) if quant == "nvfp4" else {}
        recv, counts = fa.dispatch(workspace, 1, config, ids, [x, ids, w], runtime_max, 8, **kwargs, **extra)
        fa.sanitize_expert_ids(recv[-2], counts, -1)
        hidden = x.shape[-1]
        partial = torch.zeros(2, runtime_max, hidden, dtype=torch.bfloat16, device=x.device)
        partial = partial + recv[0][..., :1].to(torch.bfloat16)
        out = fa.combine(workspace, 1, config, counts, ids.shape[0], runtime_max, partial)
        zero_copy = fa.combine_input(workspace, 1, config, runtime_max, hidden, torch.bfloat16)
        return out, zero_copy, *recv

    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=_capturing(graphs))
    workspace = torch.empty(2, config.bytes_per_rank, dtype=torch.uint8, device="meta")
    gs = torch.empty(1, dtype=torch.float32, device="meta")
    for tokens, runtime_max, hidden in ((10, 16, 1024), (7, 12, 2048), (3, 5, 4096), (0, 9, 512), (64, 64, 1536)):
        ids = torch.empty(tokens, top_k, dtype=torch.int64, device="meta")
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
        w = torch.empty(tokens, top_k, dtype=torch.float32, device="meta")
        out, zero_copy, *recv = compiled(workspace, ids, x, w, gs, runtime_max)
        want = F.recv_views(workspace, 1, config, runtime_max, [x, ids, w], **kwargs)
        assert len(recv) == len(want)
        for got, ref in zip(recv, want):
            assert (got.shape, got.dtype, got.storage_offset()) == (ref.shape, ref.dtype, ref.storage_offset())
        ref_input = F.combine_input(workspace, 1, config, runtime_max, hidden, torch.bfloat16)
        assert (zero_copy.shape, zero_copy.storage_offset()) == (ref_input.shape, ref_input.storage_offset())
        assert out.shape == (tokens, hidden)
    # the first call may compile static shapes; after that one symbolic graph serves every size
    assert len(graphs) <= 2
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert {"flashinfer_a2a.dispatch.default", "flashinfer_a2a.combine.default"} <= targets
