"""The overlapped step of two micro-batches, its split halves on communication streams, on real ranks (a GPU each,
or processes sharing one): equal bit for bit to the serial step of whole calls, and to the reference, eagerly,
replayed from a CUDA graph with fresh inputs, and compiled by torch.compile (the halves run eagerly between the
compiled graphs). Run by worker.py as
check ``comm_stream``."""

from __future__ import annotations

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.moe_alltoall import MoeAlltoAll

from .common import make_inputs, shared_seed

HIDDEN, TOP_K, MAX_TOKENS = 1024, 4, 96


def _experts(recv: torch.Tensor, rank: int) -> torch.Tensor:
    """Exact in any order: a power-of-two scale per rank."""
    return (recv.float() * 2.0 ** -(rank + 1)).to(torch.bfloat16)


class _Step:
    def __init__(self, group, comm, stream_kinds):
        self.comm, self.rank = comm, comm.rank
        self.num_experts = 8 * comm.size
        # Micro-batch 0 on the package's stream, 1 on one this caller made (or both on the package's).
        self.a2a = [MoeAlltoAll(group, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=self.num_experts,
                                hidden_size=HIDDEN, namespace=f"comm-stream {m}", num_sms=8,
                                comm_stream=True if kind == "package" else torch.cuda.Stream())
                    for m, kind in enumerate(stream_kinds)]

    def inputs(self, seed, tokens):
        ids, _, _ = make_inputs(self.comm.size, [tokens] * self.comm.size, TOP_K, HIDDEN, self.num_experts, seed)
        # Finite normal values (not make_inputs' random bytes): the closed form of check is exact only for those.
        # Random bytes hold NaNs (the GPU's fp32 sum gives the canonical NaN, the CPU keeps the payload),
        # subnormals (each rank's partial rounded to bf16 on its own, the closed form rounded once) and infinities.
        gen = torch.Generator().manual_seed(seed)
        xs = [torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(self.comm.size)]
        return ids, [x.cuda() for x in xs]

    def serial(self, batches):
        outs = []
        for a2a, (ids, xs) in zip(self.a2a, batches):
            (recv,), _ = a2a.dispatch(ids[self.rank].cuda(), [xs[self.rank]])
            outs.append(a2a.combine(_experts(recv, self.rank)))
        return outs

    def overlapped(self, ids_a, x_a, ids_b, x_b, outs=None):
        a, b = self.a2a
        a.dispatch_send(ids_a, [x_a])
        b.dispatch_send(ids_b, [x_b])
        (recv,), _ = a.dispatch_recv()
        a.combine_input().copy_(_experts(recv, self.rank))  # zero copy
        a.combine_send(out=None if outs is None else outs[0])
        (recv,), _ = b.dispatch_recv()
        b.combine_send(_experts(recv, self.rank), out=None if outs is None else outs[1])
        return a.combine_recv(), b.combine_recv()

    def check(self, got, want, batches):
        for m, (g, w, (ids, xs)) in enumerate(zip(got, want, batches)):
            fa.check_error(self.a2a[m].workspace, self.rank)
            assert ref.bitwise_equal(g.cpu(), w.cpu()), f"micro-batch {m}: overlapped != serial"
            # The identity-like experts: each token back, scaled per rank it went to.
            ranks = ref.token_rank_mask(ids[self.rank], self.num_experts, self.comm.size)
            scale = (ranks.float() * torch.tensor([2.0 ** -(r + 1) for r in range(self.comm.size)])).sum(1)
            expected = (xs[self.rank].cpu().float() * scale[:, None] + 0.0).to(torch.bfloat16)
            assert ref.bitwise_equal(g.cpu(), expected), f"micro-batch {m}: differs from the reference"

    def destroy(self):
        for a in self.a2a:
            a.destroy()


def check_comm_stream(group, comm):
    seed = shared_seed(comm)
    for kinds in (("package", "package"), ("package", "caller")):
        step = _Step(group, comm, kinds)
        rank = comm.rank
        # Eager, with a different token count each round.
        for i, tokens in enumerate((MAX_TOKENS, 1, 57)):
            batches = [step.inputs(seed + 10 * i, tokens), step.inputs(seed + 10 * i + 5, tokens)]
            want = [o.clone() for o in step.serial(batches)]
            got = step.overlapped(batches[0][0][rank].cuda(), batches[0][1][rank], batches[1][0][rank].cuda(),
                                  batches[1][1][rank])
            torch.cuda.synchronize()
            step.check(got, want, batches)
        # A CUDA graph of the overlapped step (the communication streams forked and joined inside), replayed.
        static = [step.inputs(seed + 100, MAX_TOKENS), step.inputs(seed + 101, MAX_TOKENS)]
        args = [static[0][0][rank].cuda(), static[0][1][rank], static[1][0][rank].cuda(), static[1][1][rank]]
        outs = [torch.empty(MAX_TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            step.overlapped(*args, outs=outs)
        for i in range(5):
            fresh = [step.inputs(seed + 200 + 2 * i, MAX_TOKENS), step.inputs(seed + 201 + 2 * i, MAX_TOKENS)]
            for dst, src in zip(args, (fresh[0][0][rank], fresh[0][1][rank], fresh[1][0][rank], fresh[1][1][rank])):
                dst.copy_(src)
            want = [o.clone() for o in step.serial(fresh)]
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            step.check(outs, want, fresh)
        del graph
        if kinds == ("package", "package"):  # compiled: the halves are graph breaks, the experts compiled
            torch._dynamo.reset()
            compiled = torch.compile(step.overlapped)
            for i in range(2):
                batches = [step.inputs(seed + 300 + i, MAX_TOKENS), step.inputs(seed + 400 + i, MAX_TOKENS)]
                want = [o.clone() for o in step.serial(batches)]
                got = compiled(batches[0][0][rank].cuda(), batches[0][1][rank], batches[1][0][rank].cuda(),
                               batches[1][1][rank])
                torch.cuda.synchronize()
                step.check(got, want, batches)
        step.destroy()
