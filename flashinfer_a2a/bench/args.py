"""Command-line arguments of the benchmark: model presets, token counts, dtypes, routing, iterations, output."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

import torch

from ..functional import MAX_EP_SIZE, MAX_TOP_K
from .timing import GRAPH_PAIR_GROUP


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    num_experts: int
    top_k: int


PRESETS = {
    "deepseek-v3": ModelShape(hidden=7168, num_experts=256, top_k=8),
    "qwen3": ModelShape(hidden=4096, num_experts=128, top_k=8),
    "gpt-oss": ModelShape(hidden=2880, num_experts=128, top_k=4),
    "mixtral": ModelShape(hidden=4096, num_experts=8, top_k=2),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROUTINGS = ("uniform", "skewed")
MODES = ("graph", "eager")
IMPLS = ("a2a", "nccl_a2a", "nccl_ag_rs")
QUANT_FORMATS = ("fp8_block", "mxfp8", "nvfp4")
TRANSPORTS = ("nvlink", "nccl", "hierarchical")


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    model: str
    shape: ModelShape
    tokens: tuple[int, ...]
    dtypes: tuple[str, ...]
    routings: tuple[str, ...]
    skew: float
    iters: int
    warmup: int
    modes: tuple[str, ...]
    baselines: bool
    routing_payloads: bool
    quant_formats: tuple[str, ...]
    sim_ranks: int
    output_dir: str
    seed: int
    quiet: bool
    transport: str = "nvlink"
    num_sms: tuple[int, ...] = ()  # SM budgets timed besides the whole GPU (rows a2a-sm<N>)
    overlap: bool = False  # time the dual-batch overlap study (flashinfer_a2a.bench.overlap) instead
    gemm_carveout: bool = False  # --overlap: under a budget, the interleaved GEMMs leave its multiprocessors free
    pair_group: int = GRAPH_PAIR_GROUP  # graph mode: iterations per timed sample of the pair (bench.timing)
    floor: Optional[str] = None  # link_floor.py's JSON: rows of this package as multiples of the floor (bench.floor)
    node_size: Optional[int] = None  # --transport hierarchical: ranks per node


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _list_of(convert, choices: Optional[Sequence[str]] = None):
    """A flag value that is a comma-separated list (flags also take several space-separated values)."""

    def parse(text: str) -> list:
        items = [item for item in text.split(",") if item]
        if not items:
            raise argparse.ArgumentTypeError("expected at least one value")
        if choices is not None:
            for item in items:
                if item not in choices:
                    raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(choices)}")
        return [convert(item) for item in items]

    return parse


def _flatten(values: Sequence[Sequence], default: Sequence) -> tuple:
    flat = [v for group in values for v in group] if values else list(default)
    return tuple(dict.fromkeys(flat))  # keep order, drop repeats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashinfer_a2a.bench",
        description="Times dispatch, combine and the pair (CUDA-graph replay and eager) against NCCL all_to_all_single "
        "and all_gather + reduce_scatter. One GPU: simulated ranks. Several: launch with torchrun or mpirun, one "
        "process per GPU.",
    )
    parser.add_argument("--model", choices=sorted(PRESETS), default="deepseek-v3",
                        help="shape preset (hidden/experts/top-k); default %(default)s")
    parser.add_argument("--hidden", type=_positive_int, help="hidden size (overrides the preset)")
    parser.add_argument("--num-experts", type=_positive_int, help="experts over all ranks (overrides the preset)")
    parser.add_argument("--top-k", type=_positive_int, help="experts per token (overrides the preset)")
    parser.add_argument("--tokens", nargs="+", type=_list_of(_positive_int), metavar="N",
                        help="tokens per rank, a list (default 1 128 1024 8192)")
    parser.add_argument("--dtype", nargs="+", type=_list_of(str, list(DTYPES)), metavar="DTYPE", dest="dtypes",
                        help=f"activation dtype(s) dispatched and combined: {', '.join(DTYPES)} (default bf16)")
    parser.add_argument("--routing", nargs="+", type=_list_of(str, ROUTINGS), metavar="KIND", dest="routings",
                        help="uniform: experts drawn uniformly; skewed: Zipf over expert ids, low ranks hot "
                        "(default uniform)")
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of skewed routing (default 1.0)")
    parser.add_argument("--iters", type=_positive_int, default=1000, help="timed iterations (default 1000)")
    parser.add_argument("--warmup", type=_positive_int, default=20, help="untimed iterations first (default 20)")
    parser.add_argument("--pair-group", type=_positive_int, default=GRAPH_PAIR_GROUP, metavar="N",
                        help="graph mode: time the pair over groups of N iterations, one sample per group (an event "
                             f"node between every iteration costs GPU time; default {GRAPH_PAIR_GROUP})")
    parser.add_argument("--mode", nargs="+", type=_list_of(str, MODES), metavar="MODE", dest="modes",
                        help="graph (CUDA-graph replay) and/or eager (default both)")
    parser.add_argument("--no-baselines", action="store_true", help="skip the NCCL baselines")
    parser.add_argument("--hidden-only", action="store_true",
                        help="dispatch only the hidden states (default: also the top-k ids and weights, as an "
                        "engine does)")
    parser.add_argument("--quant", nargs="+", type=_list_of(str, [*QUANT_FORMATS, "none"]), metavar="FORMAT",
                        dest="quant_formats",
                        help="wire formats timed besides plain bf16|fp16 (each as a fused quantizing dispatch with the "
                             f"FP8-wire combine, and as a pre-quantized dispatch): {', '.join(QUANT_FORMATS)} or none "
                             "(default all three)")
    parser.add_argument("--sim-ranks", type=_positive_int, default=2,
                        help="ranks simulated on one GPU when not launched by torchrun/mpirun (default 2)")
    parser.add_argument("--output-dir", default="bench_results", help="where the JSON and PNG go (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the routing and the payloads (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--transport", choices=TRANSPORTS, default="nvlink",
                        help="MoeAlltoAll's transport for our rows: nvlink (one-sided), nccl (the NCCL process "
                        "group's collectives; one process per GPU) or hierarchical (NCCL between nodes of "
                        "--node-size ranks, NVLink inside each); default %(default)s")
    parser.add_argument("--node-size", type=_positive_int, metavar="N",
                        help="--transport hierarchical: ranks per node (contiguous ranks form a node; e.g. 2 on 4 "
                             "GPUs times 2 nodes of 2)")
    parser.add_argument("--num-sms", nargs="+", type=_list_of(_positive_int), metavar="N",
                        help="SM budgets (MoeAlltoAll num_sms) timed as rows a2a-sm<N> besides the whole GPU")
    parser.add_argument("--floor", metavar="JSON",
                        help="what docs/measurements/link_floor.py --json measured on these GPUs: prints each row of "
                             "this package as a multiple of the floor of its step")
    parser.add_argument("--overlap", action="store_true",
                        help="time dual-batch overlap instead: two micro-batches on two workspaces, each with an "
                             "expert stage (DeepSeek-V3 grouped GEMMs on the received tokens) and a dense GEMM stage; "
                             "reports the a2a alone, the stage alone, serial and interleaved with the split halves on "
                             "a communication stream (docs/overlap.md)")
    parser.add_argument("--gemm-carveout", action="store_true",
                        help="--overlap: under an SM budget, limit the interleaved loop's GEMMs to the other "
                             "multiprocessors (torch's experimental SM carve-out); by default they may take every one")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> BenchArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    preset = PRESETS[ns.model]
    shape = ModelShape(hidden=ns.hidden or preset.hidden, num_experts=ns.num_experts or preset.num_experts,
                       top_k=ns.top_k or preset.top_k)
    if shape.top_k > MAX_TOP_K:
        parser.error(f"--top-k must be at most {MAX_TOP_K}, got {shape.top_k}")
    if shape.top_k > shape.num_experts:
        parser.error(f"--top-k ({shape.top_k}) must not exceed --num-experts ({shape.num_experts})")
    if ns.sim_ranks > MAX_EP_SIZE:
        parser.error(f"--sim-ranks must be at most {MAX_EP_SIZE}, got {ns.sim_ranks}")
    if ns.skew < 0:
        parser.error(f"--skew must be >= 0, got {ns.skew}")
    if ns.gemm_carveout and not (ns.overlap and ns.num_sms):
        parser.error("--gemm-carveout goes with --overlap and --num-sms (it leaves the budget's multiprocessors free)")
    if (ns.transport == "hierarchical") != (ns.node_size is not None):
        parser.error("--node-size goes with --transport hierarchical, and it needs one")
    return BenchArgs(
        model=ns.model if (ns.hidden, ns.num_experts, ns.top_k) == (None, None, None) else "custom",
        shape=shape,
        tokens=_flatten(ns.tokens, (1, 128, 1024, 8192)),
        dtypes=_flatten(ns.dtypes, ("bf16",)),
        routings=_flatten(ns.routings, ("uniform",)),
        skew=ns.skew,
        iters=ns.iters,
        warmup=ns.warmup,
        pair_group=ns.pair_group,
        modes=_flatten(ns.modes, MODES),
        baselines=not ns.no_baselines,
        routing_payloads=not ns.hidden_only,
        quant_formats=tuple(f for f in _flatten(ns.quant_formats, QUANT_FORMATS) if f != "none"),
        sim_ranks=ns.sim_ranks,
        output_dir=ns.output_dir,
        seed=ns.seed,
        quiet=ns.quiet,
        transport=ns.transport,
        num_sms=_flatten(ns.num_sms, ()),
        overlap=ns.overlap,
        gemm_carveout=ns.gemm_carveout,
        floor=ns.floor,
        node_size=ns.node_size,
    )
