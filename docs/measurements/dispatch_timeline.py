"""Where one dispatch's time goes, block by block, on two GPUs: each block of an instrumented dispatch kernel records
the global timer when it starts, when its chunk is routed, when its copies are issued, when it has passed the
completion counter (whose fence waits for its remote stores), and the last block when it has signalled its peers
and when their signals arrived.

    cp -r . /tmp/timeline && cd /tmp/timeline && git apply docs/measurements/dispatch_timeline.patch
    FLASHINFER_A2A_CACHE_DIR=/tmp/timeline_jit torchrun --nproc-per-node 2 docs/measurements/dispatch_timeline.py

The patch (against the dispatch of commit 80e5259) writes the timestamps into the rank's own combine region, which
this script reads back after each dispatch: eager calls after a barrier, 10 timed of 12, medians printed in us from
the first block's start. 2xH200, 2026-11-24 (bf16: hidden 7168 plus int32 ids and fp32 weights; *-pre: the same
tokens pre-quantized, values and scales), rank 0:

    bf16 T=1:     route 2.8        copy done 3.8                   arrive 3.8   signalled 5.4
    bf16 T=128:   route 4.6 / 4.9  copy done 4.6 / 5.6 / 5.9       arrive 12.3  signalled 13.3
    bf16 T=1024:  route 5.1 / 6.4  copy done 19.5 / 37.9 / 46.5    arrive 48.4  signalled 49.5
    bf16 T=8192:  route 15.1 / 26.6  copy done 31.6 / 310.4 / 327.6  arrive 330.6  signalled 331.8
    fp8-pre 8192: route 14.8 / 26.1  copy done 28.4 / 162.3 / 175.0  arrive 177.5  signalled 178.7
    nvfp4-pre 8192: route 14.8 / 26.5  copy done 26.2 / 91.6 / 101.6  arrive 103.4  signalled 104.4

(route: median / last block; copy done: first / median / last block; the first is the short last chunk.)
"""

import statistics

import torch
import torch.distributed as dist

import flashinfer_a2a.functional as F
from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import random_topk_ids

HIDDEN, TOP_K, EXPERTS, MAX_TOKENS = 7168, 8, 256, 8192
FIELDS = ("start_max", "route_med", "route_max", "copy_min", "copy_med", "copy_max", "arrive_max", "signalled",
          "peers_in")


def payloads(kind: str, tokens: int, rank: int):
    torch.manual_seed(7 * rank + tokens)
    ids = random_topk_ids(tokens, TOP_K, EXPERTS).to(torch.int32).cuda()
    weights = torch.rand(tokens, TOP_K, device="cuda")
    if kind == "bf16":
        hidden = [torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)]
    elif kind == "fp8-pre":  # E4M3 values and an fp32 scale per 128 elements
        hidden = [torch.randint(0, 256, (tokens, HIDDEN), dtype=torch.uint8, device="cuda"),
                  torch.rand(tokens, HIDDEN // 128, device="cuda")]
    else:  # nvfp4-pre: packed E2M1 values and a byte scale per 16 elements
        hidden = [torch.randint(0, 256, (tokens, HIDDEN // 2), dtype=torch.uint8, device="cuda"),
                  torch.randint(0, 256, (tokens, HIDDEN // 16), dtype=torch.uint8, device="cuda")]
    return ids, [*hidden, ids, weights]


def timeline(trace: torch.Tensor) -> list[float]:
    """The FIELDS of one dispatch from its [blocks, 8] int64 timestamps (ns), in us from the first start."""
    blocks = int(trace[:, 0].ne(0).sum())
    t = trace[:blocks].double()
    last = int(t[:, 4].ne(0).nonzero().flatten()[0])
    start = t[:, 0].min()

    def us(value):
        return float(value - start) / 1e3

    return [us(t[:, 0].max()), us(t[:, 1].median()), us(t[:, 1].max()), us(t[:, 2].min()), us(t[:, 2].median()),
            us(t[:, 2].max()), us(t[:, 3].max()), us(t[last, 4]), us(t[last, 5])]


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    gloo = dist.new_group(backend="gloo")
    a2a = MoeAlltoAll(gloo, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN)
    offset = int(a2a.metainfo[F.get_metainfo_index_pairs()["combine_offset"]])
    trace = a2a.workspace[rank, offset : offset + 4096 * 64].view(torch.int64).view(4096, 8)
    for kind, tokens in (("bf16", 1), ("bf16", 128), ("bf16", 1024), ("bf16", 8192), ("fp8-pre", 8192),
                         ("nvfp4-pre", 8192)):
        ids, pay = payloads(kind, tokens, rank)
        rows = []
        for it in range(12):
            torch.cuda.synchronize()
            dist.barrier(gloo)
            trace.zero_()
            torch.cuda.synchronize()
            a2a.dispatch(ids, pay, tokens)
            torch.cuda.synchronize()
            if it >= 2:
                rows.append(timeline(trace.cpu()))
            a2a.combine()
        medians = [statistics.median(column) for column in zip(*rows)]
        print(f"rank {rank} {kind} T={tokens}: " + " ".join(f"{n}={v:.1f}" for n, v in zip(FIELDS, medians)),
              flush=True)
    a2a.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
