"""A CUDA graph capture holding a send half on a communication stream and not its receive: CUDA refuses to end it
(the fork onto the communication stream is not joined back, cudaErrorStreamCaptureUnjoined) and torch raises
RuntimeError from the capture's end, with CUDA's message for that error (:data:`CAPTURE_REFUSED`: any other error
during the capture fails); the receive half called after it, outside any capture, is refused by the package with a
message naming both.

Run in a process of its own by tests/gpu/test_comm_stream.py: torch's CUDAGraph.capture_end throws before it takes
its CUDA generators out of capture mode, so every later random op of the process fails ("Offset increment outside
graph capture encountered unexpectedly"), whatever test it belongs to.

    python -m tests.gpu.unjoined_capture      # prints one line per step, exits 1 if one went otherwise
"""

from __future__ import annotations

import re
import sys

import torch

import flashinfer_a2a as fa

from .test_moe_alltoall_one_rank import OneRank
from .test_split_phase import EXPERTS, HIDDEN, TOP_K

RECEIVE_REFUSED = "queued inside a CUDA graph capture and the receive half after it comes outside any capture"
# cudaGetErrorString(cudaErrorStreamCaptureUnjoined), as torch's "CUDA error: ..." carries it (CUDA 13.0), or its name
CAPTURE_REFUSED = r"capturing stream has unjoined work|cudaErrorStreamCaptureUnjoined"


def capture_refusal(exc: BaseException) -> str:
    """The line to print for an error ending the capture: "capture refused: ..." where it is CUDA's refusal of the
    unjoined fork, "FAIL: ..." for any other."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, RuntimeError) and re.search(CAPTURE_REFUSED, str(exc)):
        return f"capture refused: {first}"
    return f"FAIL: the capture failed otherwise: {type(exc).__name__}: {first}"


def main() -> int:
    a2a = fa.MoeAlltoAll(OneRank(), max_num_tokens=16, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
                         comm_stream=True)
    ids = torch.zeros(16, TOP_K, dtype=torch.int64, device="cuda")
    x = torch.zeros(16, HIDDEN, dtype=torch.bfloat16, device="cuda")
    failed = 0
    try:
        a2a.dispatch(ids, [x])  # eager first: the module is loaded, the views made
        a2a.combine()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
                a2a.dispatch_send(ids, [x])
        except Exception as exc:  # noqa: BLE001 - which error it is decides
            line = capture_refusal(exc)
            print(line)
            failed |= line.startswith("FAIL")
        else:
            print("FAIL: the capture ended with the communication stream not joined back")
            failed = 1
        try:
            a2a.dispatch_recv()
        except RuntimeError as exc:
            if RECEIVE_REFUSED in str(exc):
                print("receive refused")
            else:
                print(f"FAIL: the receive was refused otherwise: {exc}")
                failed = 1
        else:
            print("FAIL: the receive outside the capture of its send was not refused")
            failed = 1
    finally:
        torch.cuda.synchronize()
        a2a.destroy()
    return failed


if __name__ == "__main__":
    sys.exit(main())
