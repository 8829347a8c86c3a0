"""Host time of eager calls, layer by layer, on one GPU: a one-rank MoeAlltoAll (DeepSeek-V3 rows, int32 ids and fp32
weights), median over 3000 calls after 200 untimed steps.

    taskset -c 3 python docs/measurements/eager_host_time.py     # one GPU; pinning steadies the numbers

Prints, at 1 and 128 tokens: MoeAlltoAll.dispatch, .combine_input and .combine per call and a back-to-back eager
step of the three; the same for a step of split halves (dispatch_send, dispatch_recv, combine_input, combine_send,
combine_recv); then the layers under dispatch (flashinfer_a2a.transports.nvlink_eager, the bound tvm-ffi call), and, for
scale, the functional call, the tvm-ffi call with every argument, a trivial tvm-ffi call and a trivial torch op
(docs/benchmarks.md); last, the ordering of steps across streams that every step makes (docs/semantics.md), when
the stream is unchanged and when it changes each call.
"""

import statistics
import time

import torch
import torch.distributed as dist

import flashinfer_a2a.functional as F
from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.jit import get_a2a_module
from flashinfer_a2a.reference import random_topk_ids

CALLS = 3000
HIDDEN, TOP_K, EXPERTS, MAX_TOKENS = 7168, 8, 256, 8192


def per_call_us(fn, calls: int = CALLS) -> float:
    """Median host time of fn() in us (the device is synchronized every 200 calls so its queue never fills)."""
    times = []
    for i in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
        if i % 200 == 199:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times[calls // 5 :]) / 1e3


def step_us(calls: dict) -> tuple[str, float]:
    """Median host time of each call of an eager step (the experts would write the combine input between them),
    and the wall time of a step back to back."""
    host = {name: [] for name in calls}

    def step():
        for name, call in calls.items():
            start = time.perf_counter_ns()
            call()
            host[name].append(time.perf_counter_ns() - start)

    for _ in range(200):
        step()
    torch.cuda.synchronize()
    host = {name: [] for name in calls}
    start = time.perf_counter()
    for _ in range(CALLS):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / CALLS * 1e6
    return ", ".join(f"{name} {statistics.median(times) / 1e3:.2f} us" for name, times in host.items()), wall


def alternate(a2a, other=[]) -> None:
    """The ordering before a step on a side stream, then before one on the current stream: each waits for the
    other stream (the cost of a step whose stream changed, twice, with a stream switch)."""
    if not other:
        other.append(torch.cuda.Stream())
    with torch.cuda.stream(other[0]):
        a2a._transport.shared.stream.order()
    a2a._transport.shared.stream.order()


def main() -> None:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    a2a = MoeAlltoAll(max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN)
    module = get_a2a_module()
    config, workspace, counts = a2a.config, a2a.workspace, torch.empty(1, dtype=torch.int32, device="cuda")
    for tokens in (1, 128):
        ids = random_topk_ids(tokens, TOP_K, EXPERTS).cuda()
        payloads = [torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16), ids,
                    torch.rand(tokens, TOP_K, device="cuda")]
        whole = {"dispatch": lambda: a2a.dispatch(ids, payloads), "combine_input": a2a.combine_input,
                 "combine": a2a.combine}  # as an engine's zero-copy step makes the calls
        split = {"dispatch_send": lambda: a2a.dispatch_send(ids, payloads), "dispatch_recv": a2a.dispatch_recv,
                 "combine_input": a2a.combine_input, "combine_send": a2a.combine_send,
                 "combine_recv": a2a.combine_recv}
        for label, calls in (("MoeAlltoAll", whole), ("MoeAlltoAll split halves", split)):
            per_call, wall = step_us(calls)
            print(f"{tokens} tokens: {label} {per_call}; eager step back to back {wall:.2f} us")
        # The layers under dispatch, each call a dispatch of its own (as MoeAlltoAll makes it), and for scale the
        # functional call and the tvm-ffi call with every argument, which an eager MoeAlltoAll no longer makes.
        calls = a2a._transport.eager()
        bound = (ids, payloads, MAX_TOKENS, 10.0, 0, None, False, 0)
        args = (workspace, ids, payloads, counts, 0, *config.sizes(), MAX_TOKENS, EXPERTS, 10.0, 0, None, False, 0, 0,
                False)
        layers = {
            "EagerCalls.dispatch": lambda: calls.dispatch(ids, payloads, MAX_TOKENS, 10.0),
            "bound tvm-ffi dispatch": lambda: calls._dispatch(*bound),
            "functional.dispatch_counts": lambda: F.dispatch_counts(workspace, 0, config, ids, payloads, MAX_TOKENS,
                                                                    EXPERTS, recv_counts=counts, timeout_s=10.0,
                                                                    debug=False),
            "tvm-ffi dispatch, every argument": lambda: module.dispatch(*args),
            "tvm-ffi get_workspace_size": lambda: module.get_workspace_size(*config.sizes()),
            "torch x.add_(0)": lambda: payloads[0].add_(0),
            "stream order, the step's stream unchanged": a2a._transport.shared.stream.order,
            "stream order, two streams in turn (a wait each call) + torch.cuda.stream": lambda: alternate(a2a),
        }
        for name, fn in layers.items():
            print(f"  {name} {per_call_us(fn):.2f} us")
    a2a.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
