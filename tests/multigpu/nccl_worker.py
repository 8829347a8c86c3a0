"""One rank of the nccl-transport checks on several GPUs: ``torchrun --nproc-per-node 2 -m
tests.multigpu.nccl_worker``. Prints ``CHECK <name> rank <r> ok`` per passed check; a failure raises."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll

from ..nccl_workers import HIDDEN, NUM_EXPERTS, TOP_K, check_errors, check_transport, rank_inputs


def compare_transports(rank: int, ep_size: int, group) -> None:
    """nccl and nvlink, the same calls on every rank: the same counts, valid receive rows and combine bytes."""
    runtime_max = 40
    kw = dict(max_num_tokens=runtime_max, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
              extra_dispatch_bytes_per_token=128, device=rank)
    for seed, fmt in enumerate([None, "fp8_block", "mxfp8", "nvfp4"]):
        results = {}
        for transport in ("nvlink", "nccl"):
            moe = MoeAlltoAll(group, transport=transport, **kw)
            ids, payloads = rank_inputs(ep_size, runtime_max, 50 + seed, torch.int64)
            gs = torch.full((1,), 3.0, device="cuda") if fmt == "nvfp4" else None
            recv, counts = moe.dispatch(ids[rank].cuda(), [p.cuda() for p in payloads[rank]], runtime_max,
                                        quant_format=fmt, global_scale=gs)
            got_counts = counts.cpu().clone()
            rows = [r[src, : int(got_counts[src])].cpu().contiguous().view(torch.uint8)
                    for r in recv for src in range(ep_size)]
            gen = torch.Generator().manual_seed(seed)
            partials = [torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).bfloat16() for _ in range(ep_size)]
            out = moe.combine(partials[rank].cuda(), quant_format="fp8_block" if fmt else None)
            results[transport] = (got_counts, rows, out.cpu())
            moe.destroy()
        (c1, rows1, out1), (c2, rows2, out2) = results["nvlink"], results["nccl"]
        assert torch.equal(c1, c2), (fmt, c1, c2)
        assert all(torch.equal(a, b) for a, b in zip(rows1, rows2)), f"{fmt}: receive rows differ"
        assert torch.equal(out1.view(torch.uint8), out2.view(torch.uint8)), f"{fmt}: combine differs"


def main() -> None:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    ep_size = dist.get_world_size()
    checks = {
        "padded": lambda: check_transport(rank, ep_size, "cuda"),
        "exact": lambda: check_transport(rank, ep_size, "cuda", exact=True),
        "errors": lambda: check_errors(rank, ep_size, "cuda"),
        "nvlink_equal": lambda: compare_transports(rank, ep_size, dist.group.WORLD),
    }
    for name, check in checks.items():
        check()
        torch.cuda.synchronize()
        print(f"CHECK {name} rank {rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
