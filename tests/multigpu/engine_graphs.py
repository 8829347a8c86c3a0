"""The engines' CUDA-graph flows, one process per rank (``python -m tests.multigpu.engine_graphs API`` under
torchrun; tests/multigpu/test_engine_graphs.py launches it on one shared GPU and on one GPU per rank).

As vLLM and SGLang run a decode step: every MoE layer is built first (two layers of different dispatch formats,
NVFP4 then bf16, sharing one workspace, and a draft model's layer with a workspace of its own), then warmed up
eagerly on the default stream, then one CUDA graph is captured per batch size (1, 8, 32): some with
``torch.cuda.graph(g)`` on its own stream, others on a side stream the engine made, warmed up once more eagerly there
and passed as ``torch.cuda.graph(g, stream=s)``. The graphs are replayed in any order, the draft model's between
the target's, each with fresh inputs, and every output is compared bit for bit with an eager step on the same
inputs. ``API`` is ``native`` (MoeAlltoAll), ``sglang`` or ``vllm`` (the FlashInfer-compatible layer through the
adapters of docs/examples); ``many_workspaces`` makes, captures, replays and destroys workspaces one after another.
"""

from __future__ import annotations

import sys

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.compat import flashinfer as fi

from ..examples import example
from .common import bootstrap, shared_seed

HIDDEN, TOP_K, EXPERTS_PER_RANK, MAX_TOKENS = 1024, 4, 4, 32
BATCH_SIZES = (1, 8, 32)
BF16 = torch.bfloat16


def _expert(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A stand-in expert stage, ``[ep, runtime_max, HIDDEN]`` bf16 from the received rows (bf16 hidden states, or
    NVFP4 bytes read as numbers and repeated to ``HIDDEN``) and their weights: anything deterministic that depends on
    every received byte."""
    rows = rows.float() if rows.dtype != torch.uint8 else rows.float().repeat(1, 1, HIDDEN // rows.shape[-1])
    return (rows * weights.sum(-1, keepdim=True)).to(BF16)


class NativeLayer:
    def __init__(self, group, ep, fmt, namespace):
        self.fmt = fmt
        self.a2a = fa.MoeAlltoAll(group, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS_PER_RANK * ep,
                                  hidden_size=HIDDEN, dispatch_format=fmt, namespace=namespace)
        self.global_scale = torch.full((1,), 448.0 * 6.0 / 8.0, device="cuda")

    def __call__(self, x, ids, w, runtime_max):
        if self.fmt is None:
            (rx, _, rw), _ = self.a2a.dispatch(ids, [x, ids, w], runtime_max)
        else:
            (rx, _, _, rw), _ = self.a2a.dispatch(ids, [x, ids, w], runtime_max, quant_format=self.fmt,
                                                  global_scale=self.global_scale)
        self.a2a.combine_input().copy_(_expert(rx, rw))
        return self.a2a.combine()


def _compat(ep, rank, size):
    mapping = fi.Mapping(rank=rank, tp_size=ep, moe_ep_size=ep, world_size=ep, gpus_per_node=8, pp_size=1,
                         cp_size=1)
    return fi.MoeAlltoAll(mapping, MAX_TOKENS, TOP_K, EXPERTS_PER_RANK * ep, size)


def _compat_size(ep, fmt, extra=0):
    """FlashInfer's sizing of a layer whose hidden states travel as ``fmt`` (NVFP4: values and one scale byte per
    16), with int32 ids and fp32 weights."""
    hidden = HIDDEN * 2 if fmt is None else HIDDEN // 2 + HIDDEN // 16
    return fi.moe_a2a_get_workspace_size_per_rank(ep, MAX_TOKENS, hidden + TOP_K * 8, HIDDEN * 2) + extra


class SglangLayer:
    """SGLang's dispatcher (zero-copy combine); an NVFP4 layer's hidden states are quantized by the engine before
    the dispatch (here: bytes standing for them), as FlashInfer moves payloads unchanged, and its experts write bf16
    rows into the combine region."""

    def __init__(self, ep, rank, fmt, size):
        self.fmt = fmt
        self.moe = _compat(ep, rank, size)
        self.dispatcher = example("sglang_adapter").FlashinferStyleDispatcher(
            self.moe, ep, HIDDEN, EXPERTS_PER_RANK * ep, payload_in_workspace=fmt is None)

    def __call__(self, x, ids, w, runtime_max):
        ep = self.moe.ep_size
        if self.fmt is None:
            d = self.dispatcher.dispatch(x, ids, w, runtime_max)
            d.moe_output.copy_(_expert(d.hidden_states.view(ep, runtime_max, -1),
                                       d.topk_weights.view(ep, runtime_max, TOP_K)).view(-1, HIDDEN))
            return self.dispatcher.combine(d.moe_output)
        packed = x.view(torch.uint8)[:, :HIDDEN // 2 + HIDDEN // 16].contiguous()  # values then scales, as bytes
        d = self.dispatcher.dispatch(packed, ids, w, runtime_max)
        region = self.moe.get_combine_payload_tensor_in_workspace(runtime_max, HIDDEN, BF16)
        region.copy_(_expert(d.hidden_states[:, :HIDDEN // 2].view(ep, runtime_max, -1),
                             d.topk_weights.view(ep, runtime_max, TOP_K)))
        return self.moe.combine(region, runtime_max, payload_in_workspace=True)


class VllmLayer:
    """vLLM's prepare/finalize (combine into its output); NVFP4 values and scales as two payloads."""

    def __init__(self, ep, rank, fmt, size):
        self.fmt, self.ep = fmt, ep
        self.moe = _compat(ep, rank, size)
        self.runtime_max = 0
        self.pf = example("vllm_adapter").OneSidedPrepareAndFinalize(self.moe, lambda: self.runtime_max)

    def __call__(self, x, ids, w, runtime_max):
        self.runtime_max = runtime_max
        if self.fmt is None:
            a1, scale = x, None
        else:
            raw = x.view(torch.uint8)
            a1, scale = raw[:, :HIDDEN // 2].contiguous(), raw[:, HIDDEN // 2:HIDDEN // 2 + HIDDEN // 16].contiguous()
        a1q, _, _, rids, rw = self.pf.prepare(a1, w, ids.to(torch.int32), EXPERTS_PER_RANK * self.ep, a1_scale=scale)
        fused = _expert(a1q.view(self.ep, runtime_max, -1), rw.view(self.ep, runtime_max, TOP_K))
        out = torch.empty(x.shape[0], HIDDEN, dtype=BF16, device="cuda")
        self.pf.finalize(out, fused.view(-1, HIDDEN), w, ids)
        return out


def build(api, group, comm):
    """(target model's layers [NVFP4, bf16], draft model's layer): every layer built before any step."""
    ep, rank = comm.size, comm.rank
    if api == "native":
        return [NativeLayer(group, ep, "nvfp4", "default"), NativeLayer(group, ep, None, "default")], \
            NativeLayer(group, ep, None, "draft")
    layer = SglangLayer if api == "sglang" else VllmLayer
    size = max(_compat_size(ep, "nvfp4"), _compat_size(ep, None))  # one size for every layer, as the engines do
    return [layer(ep, rank, "nvfp4", size), layer(ep, rank, None, size)], layer(ep, rank, None, size + 128)


class Inputs:
    """Static input tensors of one batch size, refilled with fresh values before each step."""

    def __init__(self, batch, ep, seed):
        self.batch, self.ep = batch, ep
        self.gen = torch.Generator().manual_seed(seed)
        self.x = torch.empty(batch, HIDDEN, dtype=BF16, device="cuda")
        self.ids = torch.empty(batch, TOP_K, dtype=torch.int64, device="cuda")
        self.w = torch.empty(batch, TOP_K, dtype=torch.float32, device="cuda")

    def refill(self):
        self.x.copy_(torch.randn(self.batch, HIDDEN, generator=self.gen).to(BF16))
        self.ids.copy_(ref.random_topk_ids(self.batch, TOP_K, EXPERTS_PER_RANK * self.ep, generator=self.gen,
                                           dtype=torch.int64, minus_one_frac=0.1))
        self.w.copy_(torch.rand(self.batch, TOP_K, generator=self.gen))


def model_step(layers, inputs):
    """The target model's MoE layers back to back (the NVFP4 one then the bf16 one on its output)."""
    h = inputs.x
    for layer in layers:
        h = layer(h, inputs.ids, inputs.w, inputs.batch)
    return h


def run(api, group, comm):
    seed = shared_seed(comm)
    layers, draft = build(api, group, comm)
    inputs = {b: Inputs(b, comm.size, seed + b) for b in BATCH_SIZES}
    draft_inputs = Inputs(8, comm.size, seed + 1000)
    for b in BATCH_SIZES:  # eager warm-up of every layer and size on the default stream
        inputs[b].refill()
        model_step(layers, inputs[b])
    draft_inputs.refill()
    draft(draft_inputs.x, draft_inputs.ids, draft_inputs.w, 8)
    torch.cuda.synchronize()

    side = torch.cuda.Stream()  # the engine's capture stream
    graphs, outs = {}, {}
    for b in BATCH_SIZES:
        graphs[b] = torch.cuda.CUDAGraph()
        if b == 1:  # torch.cuda.graph's own stream, no further warm-up
            with torch.cuda.graph(graphs[b]):
                outs[b] = model_step(layers, inputs[b])
        else:  # the engines' way: an eager warm-up on the capture stream, then the capture there
            with torch.cuda.stream(side):
                model_step(layers, inputs[b])
                with torch.cuda.graph(graphs[b], stream=side):
                    outs[b] = model_step(layers, inputs[b])
    draft_graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        draft(draft_inputs.x, draft_inputs.ids, draft_inputs.w, 8)
        with torch.cuda.graph(draft_graph, stream=side):
            draft_out = draft(draft_inputs.x, draft_inputs.ids, draft_inputs.w, 8)

    replays = 0
    for b in (32, "draft", 1, 8, "draft", 32, 1, 8, 8, "draft", 1, 32):
        if b == "draft":
            draft_inputs.refill()
            draft_out.fill_(float("nan"))
            draft_graph.replay()
            eager = draft(draft_inputs.x, draft_inputs.ids, draft_inputs.w, 8)
            got = draft_out
        else:
            inputs[b].refill()
            outs[b].fill_(float("nan"))
            graphs[b].replay()
            eager = model_step(layers, inputs[b])
            got = outs[b]
        torch.cuda.synchronize()
        assert ref.bitwise_equal(got.cpu(), eager.cpu()), f"{api}: replay of graph {b} differs from the eager step"
        assert not torch.isnan(got.float()).any(), f"{api}: graph {b} left rows unwritten"
        replays += 1
    for layer in [*layers, draft]:
        a2a = layer.a2a if api == "native" else layer.moe
        fa.check_error(a2a.workspace, comm.rank)
    comm.barrier()
    for layer in [*layers, draft]:
        (layer.a2a if api == "native" else layer.moe).destroy()
    print(f"CHECK engine_graphs {api} rank {comm.rank} ok ({replays} replays)", flush=True)


def many_workspaces(group, comm, count=24):
    """The pattern of tests/gpu/graph_first_replay.py on real ranks: workspaces of random shapes made, captured,
    replayed three times with fresh inputs (each compared bit for bit with an eager step) and destroyed, one after
    another in this process."""
    seed = shared_seed(comm)
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
        max_tokens, top_k, hidden = pick([1, 5, 17, 64, 128, 200]), pick([1, 4, 8, 12, 18]), pick([64, 1024, 4096])
        num_experts = max(top_k, pick([comm.size, 3 * comm.size + 1, 64, 256]))  # top_k distinct experts
        a2a = fa.MoeAlltoAll(group, max_num_tokens=max_tokens, top_k=top_k, num_experts=num_experts,
                             hidden_size=hidden, namespace=f"many-{i}")
        ids = torch.empty(max_tokens, top_k, dtype=torch.int64, device="cuda")
        x = torch.empty(max_tokens, hidden, dtype=BF16, device="cuda")
        w = torch.empty(max_tokens, top_k, device="cuda")

        def refill():
            ids.copy_(ref.random_topk_ids(max_tokens, top_k, num_experts, generator=gen, minus_one_frac=0.1,
                                          dtype=torch.int64))
            x.copy_(torch.randn(max_tokens, hidden, generator=gen).to(BF16))
            w.copy_(torch.rand(max_tokens, top_k, generator=gen))

        def step():
            (rx, _, rw), _ = a2a.dispatch(ids, [x, ids, w])
            a2a.combine_input().copy_(_expert(rx, rw))
            return a2a.combine()

        refill()
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            refill()
            out.fill_(float("nan"))
            graph.replay()
            eager = step()
            torch.cuda.synchronize()
            assert ref.bitwise_equal(out.cpu(), eager.cpu()), f"workspace {i}: replay differs from the eager step"
        fa.check_error(a2a.workspace, comm.rank)
        del graph
        a2a.destroy()
    print(f"CHECK engine_graphs many_workspaces rank {comm.rank} ok ({count} workspaces)", flush=True)


def main(argv: list[str]) -> None:
    group, comm, _ = bootstrap()
    for api in argv or ["native", "sglang", "vllm", "many_workspaces"]:
        if api == "many_workspaces":
            many_workspaces(group, comm)
        else:
            run(api, group, comm)
    comm.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
