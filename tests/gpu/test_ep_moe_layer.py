"""The example expert-parallel MoE layer (docs/examples/ep_moe_layer.py) on simulated ranks: equal bit for bit to
the dense layer computed on one GPU, eager (bf16, FP8 block and NVFP4 wires, idle ranks included), under CUDA-graph
capture and replay with changing inputs (two graphs per rank sharing the workspace, replayed in any order), and
under torch.compile(fullgraph=True), static and dynamic shapes."""

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.reference import quant as rq
from flashinfer_a2a.testing.simulated_group import SimulatedGroup

from ..examples import example
from .simulated import on_streams, rel_err, warm_up

ex = example("ep_moe_layer")

EP, HIDDEN, INTER, EXPERTS, TOP_K, MAX_TOKENS = 4, 512, 128, 16, 4, 96
GLOBAL_SCALE = 448.0 * 6.0 / 5.0  # NVFP4's per-tensor scale for activations of |x| up to about 5
# Relative error of the quantized wires against the bf16 layer, bounds well above what they measured
# (docs/integration.md quotes the measurement).
BOUND = {"fp8_block": 0.06, "nvfp4": 0.3}


class Rig:
    def __init__(self, wire=None, namespace="default"):
        self.gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
        self.weights = ex.MoEWeights.random(HIDDEN, INTER, EXPERTS, self.gen)
        self.group = SimulatedGroup(EP)
        self.a2as = self.group.run(lambda r, comm: fa.MoeAlltoAll(
            comm, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
            dispatch_format=wire, namespace=namespace))
        self.wire = wire
        self.gs = torch.full((1,), GLOBAL_SCALE, device="cuda") if wire == "nvfp4" else None
        self.layers = [ex.EPMoELayer(a, self.weights, TOP_K, wire, self.gs) for a in self.a2as]
        self.streams = [torch.cuda.Stream() for _ in range(EP)]
        self.table = ex.e2m1_table("cuda")
        warm_up(self.streams, lambda: self.dense(self.inputs([3, 0, 70, 1])))  # every kernel the experts use

    def inputs(self, counts):
        return [torch.randn(n, HIDDEN, generator=self.gen).to(torch.bfloat16).cuda() for n in counts]

    def dense(self, xs):
        """The dense layer fed what the experts see (the wire's quantized-dequantized activations)."""
        if self.wire is None:
            return ex.dense_moe(xs, self.weights, TOP_K, EP)
        seen = []
        for x in xs:
            values, scales = rq.quantize(x.cpu(), self.wire, GLOBAL_SCALE if self.wire == "nvfp4" else None)
            rows = ex.dequantize(self.wire, values.cuda(), scales.cuda(), HIDDEN, self.gs, self.table)
            want = (rq.dequantize_fp8_block(values, scales) if self.wire == "fp8_block"
                    else rq.dequantize_nvfp4(values, scales, GLOBAL_SCALE, HIDDEN))
            assert ref.bitwise_equal(rows.cpu(), want)  # the example's dequantizer is the reference's
            seen.append(rows)
        return ex.dense_moe(xs, self.weights, TOP_K, EP, dequantized=seen)

    def check(self, outs, xs):
        want = self.dense(xs)
        for r in range(EP):
            fa.check_error(self.a2as[r].workspace, r)  # first: a timeout explains wrong rows
            assert outs[r].shape == (xs[r].shape[0], HIDDEN) and outs[r].dtype == torch.bfloat16
            assert ref.bitwise_equal(outs[r].cpu(), want[r].cpu()), f"rank {r}"
        if self.wire is not None and sum(x.shape[0] for x in xs):
            plain = torch.cat(ex.dense_moe(xs, self.weights, TOP_K, EP))
            err = rel_err(torch.cat(outs), plain)
            print(f"{self.wire}: relative error against the bf16 layer {err:.4f}")
            assert err < BOUND[self.wire]

    def forward_in_steps(self, xs, runtime_max):
        """The layer's forward, each step on every rank before the next: one thread drives all ranks, so a rank's
        host work must never wait (as loading a kernel the first time may) while a peer's kernel waits for a rank
        not launched yet."""
        routes = on_streams(self.streams, lambda r: self.layers[r].route(xs[r]))
        recv = on_streams(self.streams, lambda r: self.layers[r].send(xs[r], *routes[r], runtime_max))
        on_streams(self.streams, lambda r: self.layers[r].run_experts(recv[r], HIDDEN))
        return on_streams(self.streams, lambda r: self.a2as[r].combine())

    def close(self):
        self.group.run(lambda r, comm: self.a2as[r].destroy())


@pytest.mark.parametrize("wire", [None, "fp8_block", "nvfp4"])
def test_eager_layer_equals_the_dense_layer(wire):
    rig = Rig(wire)
    try:
        for counts in ([37, 96, 0, 5], [96, 96, 96, 96], [0, 0, 1, 0]):
            xs = rig.inputs(counts)
            outs = rig.forward_in_steps(xs, max(counts))
            torch.cuda.synchronize()
            rig.check(outs, xs)
    finally:
        rig.close()


@pytest.mark.parametrize("wire", [None, "nvfp4"])
def test_cuda_graphs_replay_with_changing_inputs(wire):
    """Two graphs per rank (two batch shapes) on one shared workspace, replayed in any order."""
    rig = Rig(wire)
    shapes = {"a": [40, 64, 0, 17], "b": [5, 2, 8, 8]}
    static = {k: rig.inputs(c) for k, c in shapes.items()}
    try:
        for k, counts in shapes.items():  # eager first: modules load, views are cached
            on_streams(rig.streams, lambda r: rig.layers[r](static[k][r], max(counts)))
        torch.cuda.synchronize()
        graphs, outs = {}, {}
        for k, counts in shapes.items():
            graphs[k] = [torch.cuda.CUDAGraph() for _ in range(EP)]
            outs[k] = []
            for r in range(EP):
                with torch.cuda.graph(graphs[k][r], stream=rig.streams[r]):
                    outs[k].append(rig.layers[r](static[k][r], max(counts)))
        torch.cuda.synchronize()
        for k in ("a", "b", "b", "a", "b"):
            xs = rig.inputs(shapes[k])
            for r in range(EP):
                static[k][r].copy_(xs[r])
                outs[k][r].fill_(float("nan"))
            on_streams(rig.streams, lambda r: graphs[k][r].replay())
            torch.cuda.synchronize()
            rig.check(outs[k], xs)
    finally:
        rig.close()


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_layer_equals_the_dense_layer(dynamic, monkeypatch):
    """fullgraph=True: dynamo traces the whole layer (the ops through their fakes) into one graph, which the
    "eager" backend runs op by op, so the experts round as the dense layer does (inductor would fuse their
    arithmetic; aot_eager would run the ops on functionalized copies of the workspace, see docs/integration.md)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)
    # One thread traces every rank's call in turn while the ranks launched before it wait for it on the device (the
    # "eager" backend loads no kernel, so nothing synchronizes the device meanwhile): the wait must outlast a few
    # traces on a slow host, which ten seconds did not once.
    monkeypatch.setenv("FLASHINFER_A2A_TIMEOUT_S", "120")
    torch._dynamo.reset()
    rig = Rig()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda layer, x, runtime_max: layer(x, runtime_max), fullgraph=True, dynamic=dynamic,
                             backend=counter)
    try:
        for counts in ([40, 64, 3, 17], [12, 3, 30, 30], [64, 64, 64, 64], [33, 9, 21, 7]):
            xs = rig.inputs(counts)
            outs = on_streams(rig.streams, lambda r: compiled(rig.layers[r], xs[r], max(counts)))
            torch.cuda.synchronize()
            rig.check(outs, xs)
        targets = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
        assert {"flashinfer_a2a.dispatch.default", "flashinfer_a2a.combine.default"} <= targets
        # The example's experts loop over fixed tiles, so a new tile count recompiles even with dynamic=True.
        print(f"dynamic={dynamic}: {counter.frame_count} graphs for {EP} ranks x 4 shapes")
    finally:
        rig.close()
