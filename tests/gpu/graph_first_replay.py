"""CUDA-graph replays of simulated ranks (ep 5-8), many workspaces made one after another in one process.

For each workspace, every rank's dispatch + expert copy + zero-copy combine is captured into one CUDA graph (inputs
filled, one eager warm-up step, synchronize, capture under torch.cuda.graph, synchronize), then replayed 3 times
with new routing and payloads. Before each replay, every rank's counts, received rows and combine output are
poisoned (:func:`poison`), so that a replay that wrote nothing fails even where its routing repeats the last one's.
After each replay recv_counts is compared with counts computed on the host from the ids, the combine with its exact
value (the "expert" copies the received hidden rows back, so out[t] = n_dest(t) * x[t]: a sum of equal bf16 values
in fp32 is exact), and every rank's error record is read with check_error. Before simulated ranks captured their
steps as halves (flashinfer_a2a.testing.simulate), replays of some workspaces timed out waiting for a peer whose
graph branch had not started.

Run by tests/gpu/test_simulated_graphs.py, or alone (one GPU):
    python -m tests.gpu.graph_first_replay --workspaces 500
Prints one line per workspace (shape, PASS or FAIL with the first differing counts and the error record); exits 1
if any workspace failed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from flashinfer_a2a import check_error
from flashinfer_a2a import functional as F
from flashinfer_a2a.reference import POISON_BYTE
from flashinfer_a2a.testing.simulate import SimulatedRanks

# (ep, max_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token) of shapes seen failing.
FAILING_SHAPES = [(6, 64, 12, 6288, 2048), (8, 128, 18, 16600, 16384), (8, 17, 8, 49248, 16384),
                  (8, 17, 8, 2144, 2048)]
DEV = "cuda"
BF16 = torch.bfloat16


def random_shape(rng: random.Random):
    """A random graph workspace shape, ep 5-8."""
    top_k = rng.randint(1, 32)
    cbpt = 2 * rng.choice([1024, 4096, 8192])
    dbpt = cbpt + 12 * top_k + (2 * cbpt if rng.random() < 0.5 else 0)  # x + int64 ids + fp32 weights (+ quant room)
    return rng.randint(5, 8), rng.choice([1, 2, 5, 17, 64, 128, 200, 300]), top_k, dbpt, cbpt


def expert_owners(num_experts: int, ep: int) -> torch.Tensor:
    """[num_experts] rank of each expert: contiguous ranges, the first num_experts % ep ranks own one more."""
    base, rem = divmod(num_experts, ep)
    return torch.tensor([r for r in range(ep) for _ in range(base + (r < rem))], dtype=torch.int64)


def sent_mask(ids: torch.Tensor, owners: torch.Tensor, ep: int) -> torch.Tensor:
    """[n, ep] bool: token t goes to rank d once if any of its ids (-1 skipped) is an expert of d."""
    ids = ids.to(torch.int64)
    dest = torch.where(ids >= 0, owners[ids.clamp(min=0)], ep)  # ep: a column for "nowhere"
    mask = torch.zeros(ids.shape[0], ep + 1, dtype=torch.bool)
    return mask.scatter_(1, dest, True)[:, :ep]


def make_ids(rng: random.Random, gen: torch.Generator, n: int, k: int, num_experts: int) -> torch.Tensor:
    """[n, k] host ids: uniform, some -1, duplicates when num_experts is small."""
    ids = torch.randint(0, num_experts, (n, k), generator=gen)
    p_neg = rng.choice([0.0, 0.0, 0.1, 0.5])
    ids[torch.rand(n, k, generator=gen) < p_neg] = -1
    return ids


def poison(rec, outs) -> None:
    """Fills what a step writes with what no step leaves: every rank's counts with -1, its received rows and its
    combine output with POISON_BYTE."""
    for recv, counts in rec:
        counts.fill_(-1)
        for t in recv:
            t.view(torch.uint8).fill_(POISON_BYTE)
    for out in outs:
        out.view(torch.uint8).fill_(POISON_BYTE)


def step_problems(host_ids, x, owners: torch.Tensor, rec, outs) -> list[str]:
    """How a step's counts and combine outputs differ from what the host computes from its ids ``host_ids`` and
    hidden rows ``x`` (per rank): counts by source, and ``out[t] = n_dest(t) * x[t]`` exactly."""
    ep = len(host_ids)
    sent = [sent_mask(host_ids[s], owners, ep) for s in range(ep)]
    want = torch.stack([m.sum(0) for m in sent], dim=1).to(torch.int32)  # [dest, src]
    got = torch.stack([c for _, c in rec]).cpu()
    problems = []
    if not torch.equal(got, want):
        d = int((got != want).any(1).nonzero()[0])
        problems.append(f"recv_counts of rank {d} (by src): want {want[d].tolist()} got {got[d].tolist()}")
    bad = {}
    for r in range(ep):
        exact = (sent[r].sum(1, keepdim=True).float().to(x[r].device) * x[r].float()).to(BF16)
        nbad = int((outs[r].float() != exact.float()).any(1).sum())
        if nbad:
            bad[r] = nbad
    if bad:
        problems.append(f"combine rows differ {{rank: rows}} {bad}")
    return problems


def error_records(ranks: SimulatedRanks) -> list[str]:
    records = []
    for r in range(ranks.ep_size):
        try:
            check_error(ranks.workspace, r)
        except Exception as e:  # noqa: BLE001 - A2AError, or ValueError for an invalid expert id
            records.append(f"rank {r}: {type(e).__name__}: {e}"[:220])
    return records


def run_workspace(shape, rng: random.Random, gen: torch.Generator, dgen: torch.Generator,
                  timeout_s: float) -> tuple[str, bool]:
    ep, max_tokens, top_k, dbpt, cbpt = shape
    cfg = F.WorkspaceConfig(ep_size=ep, max_num_tokens=max_tokens, top_k=top_k, dispatch_bytes_per_token=dbpt,
                            combine_bytes_per_token=cbpt)
    ranks = SimulatedRanks(cfg, DEV)
    torch.cuda.synchronize()
    num_tokens = [rng.choice([0, max_tokens, rng.randint(0, max_tokens), rng.randint(0, max_tokens)])
                  for _ in range(ep)]
    rmax = max(1, max(num_tokens))
    rmax = rmax if rng.random() < 0.5 else rng.randint(rmax, max_tokens)
    k = rng.randint(1, top_k)
    num_experts = max(1, rng.choice([ep - 1, ep, ep + 1, 2 * ep, 3 * ep + 1, 16, 64, 256]))
    hidden = rng.choice([cbpt // 2, cbpt // 4, 64])
    id_dtype = rng.choice([torch.int32, torch.int64])
    owners = expert_owners(num_experts, ep)
    ids_d = [torch.zeros(n, k, dtype=id_dtype, device=DEV) for n in num_tokens]
    x_d = [torch.zeros(n, hidden, dtype=BF16, device=DEV) for n in num_tokens]
    w_d = [torch.zeros(n, k, dtype=torch.float32, device=DEV) for n in num_tokens]
    host_ids = [None] * ep

    def fill():  # new contents in the captured tensors
        for r in range(ep):
            host_ids[r] = make_ids(rng, gen, num_tokens[r], k, num_experts)
            ids_d[r].copy_(host_ids[r])
            x_d[r].copy_((torch.randn(num_tokens[r], hidden, device=DEV, generator=dgen) * 3).to(BF16))
            w_d[r].copy_(torch.rand(num_tokens[r], k, device=DEV, generator=dgen))

    def step():  # every rank: dispatch, expert copy into the zero-copy combine input, combine
        rec = ranks.dispatch(ids_d, [[x_d[r], ids_d[r], w_d[r]] for r in range(ep)], rmax, num_experts,
                             timeout_s=timeout_s)
        ranks.run(lambda r: ranks.combine_input(r, rmax, hidden, BF16).copy_(rec[r][0][0]))
        outs = ranks.combine([c for _, c in rec], num_tokens, rmax, None, hidden=hidden, dtype=BF16,
                             timeout_s=timeout_s)
        return rec, outs

    def check(rec, outs) -> list[str]:
        torch.cuda.synchronize()
        problems = step_problems(host_ids, x_d, owners, rec, outs)
        errors = error_records(ranks)
        if errors:
            problems.append(f"error record {errors[0]}" + (f" (+{len(errors) - 1} ranks)" if len(errors) > 1 else ""))
        return problems

    fill()
    warm = check(*step())  # eager warm-up before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rec, outs = step()
    torch.cuda.synchronize()
    replays = []
    for _ in range(3):
        fill()
        poison(rec, outs)
        graph.replay()
        replays.append(check(rec, outs))
    del graph
    head = (f"ep={ep} max_tokens={max_tokens} top_k={top_k} dbpt={dbpt} cbpt={cbpt} | tokens={num_tokens} "
            f"rmax={rmax} k={k} E={num_experts} hidden={hidden} ids={str(id_dtype)[6:]}")
    failed = [i for i, p in enumerate(replays) if p]
    if not failed and not warm:
        return f"PASS {head}", True
    first = replays[failed[0]] if failed else warm
    where = f"replays {failed}" if failed else "no replay"
    return (f"FAIL {head} | {where} failed, eager warm-up {'FAILED' if warm else 'ok'}; "
            f"first: {'; '.join(first) or 'none'}"), False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workspaces", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="timeout_s of every call (default: FLASHINFER_A2A_TIMEOUT_S, 10 s)")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="start no workspace after this")
    args = ap.parse_args(argv)
    start = time.monotonic()
    torch.cuda.set_device(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, timeout_s={args.timeout_s}, "
          f"seed {args.seed}", flush=True)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)  # host: ids (their counts are computed on the host)
    dgen = torch.Generator(device=DEV).manual_seed(args.seed)  # device: hidden rows and weights
    nfail = nrun = 0
    for i in range(args.workspaces):
        if time.monotonic() - start > args.max_seconds:
            print(f"stopped: {args.max_seconds:.0f} s spent", flush=True)
            break
        shape = FAILING_SHAPES[i % 6] if i % 6 < 4 else random_shape(rng)  # four failing shapes, two random
        line, ok = run_workspace(shape, rng, gen, dgen, args.timeout_s)
        nrun, nfail = nrun + 1, nfail + (not ok)
        print(f"[{i:3d}] {line}", flush=True)
        if shape[0] >= 8:  # free the cache after a workspace of 8 ranks
            torch.cuda.empty_cache()
    print(f"{nfail} of {nrun} workspaces failed ({time.monotonic() - start:.1f} s, timeout_s={args.timeout_s})")
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
