"""The example programs under docs/examples on CPU: their pure-torch parts (the GPU suite runs them whole)."""

import inspect

import torch

from flashinfer_a2a import reference as ref
from flashinfer_a2a.reference import quant as rq

from .examples import example

ex = example("ep_moe_layer")


def test_tiled_matmul_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    x = torch.randn(200, 96, generator=gen)
    w = torch.randn(96, 40, generator=gen)
    full = ex.tiled_matmul(x, w)
    assert full.shape == (200, 40) and ex.tiled_matmul(x[:0], w).shape == (0, 40)
    for start, stop in ((0, 1), (3, 70), (130, 200)):
        assert ref.bitwise_equal(ex.tiled_matmul(x[start:stop], w), full[start:stop])
    torch.testing.assert_close(full, x @ w, rtol=1e-5, atol=1e-4)


def test_dequantize_equals_the_reference():
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    x = (torch.randn(9, 256, generator=gen) * 3).to(torch.bfloat16)
    values, scales = rq.quantize(x, "fp8_block")
    got = ex.dequantize("fp8_block", values, scales, 256, None)
    assert ref.bitwise_equal(got, rq.dequantize_fp8_block(values, scales))
    gs = torch.full((1,), 448.0 * 6 / 12)
    values, scales = rq.quantize(x, "nvfp4", gs)
    got = ex.dequantize("nvfp4", values, scales, 256, gs, ex.e2m1_table("cpu"))
    assert ref.bitwise_equal(got, rq.dequantize_nvfp4(values, scales, gs, 256))


def test_dense_layer_is_the_sum_of_the_experts():
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    weights = ex.MoEWeights.random(64, 32, 8, gen, device="cpu")
    xs = [torch.randn(n, 64, generator=gen).to(torch.bfloat16) for n in (5, 0, 7)]
    out = ex.dense_moe(xs, weights, 2, 3)
    assert [o.shape for o in out] == [(5, 64), (0, 64), (7, 64)]
    x = torch.cat(xs)
    ids, w = ex.route(x, weights, 2)
    assert torch.allclose(w.sum(-1), torch.ones(12))
    want = torch.zeros(12, 64)
    for t in range(12):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (x[t].float() @ weights.gate_up[e].t()).chunk(2)
            want[t] += w[t, j] * ((torch.nn.functional.silu(gate) * up) @ weights.down[e].t())
    torch.testing.assert_close(torch.cat(out).float(), want, rtol=2e-2, atol=2e-2)


def test_adapters_have_the_engines_method_shapes():
    vllm = example("vllm_adapter").OneSidedPrepareAndFinalize
    assert list(inspect.signature(vllm.prepare).parameters)[1:8] == [
        "a1", "topk_weights", "topk_ids", "num_experts", "expert_map", "apply_router_weight_on_input",
        "quant_config"]
    assert list(inspect.signature(vllm.finalize).parameters)[1:5] == [
        "output", "fused_expert_output", "topk_weights", "topk_ids"]
    sglang = example("sglang_adapter").FlashinferStyleDispatcher
    assert callable(sglang.dispatch) and callable(sglang.combine)


def test_cuda_graph_recipe_on_cpu():
    """The recipe imports without a GPU; its router and experts are the closed forms its docstrings state (the GPU
    doc tests run it whole under torchrun)."""
    recipe = example("cuda_graphs")
    assert callable(recipe.main) and set(recipe.REPLAY_ORDER) == set(recipe.BATCH_SIZES)
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    x = torch.randn(6, recipe.HIDDEN, generator=gen).to(torch.bfloat16)
    weights, ids = recipe.route(x, 16)
    assert ids.shape == (6, recipe.TOP_K) and torch.equal(ids, x[:, :16].float().topk(recipe.TOP_K).indices)
    ids[0, 1] = -1  # a padded row's id after sanitizing
    out = recipe.toy_experts(x, ids, weights, 4, 12)
    mine = (ids >= 4) & (ids < 12)
    want = x.float() * (weights * (ids + 1).float() * mine).sum(-1, keepdim=True)
    assert torch.equal(out, want)
