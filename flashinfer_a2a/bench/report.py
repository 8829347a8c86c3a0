"""The benchmark's outputs: the printed table, ``results.json`` and ``results.png``."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from .timing import PHASES
from .traffic import gbps


def add_derived(case: dict[str, Any]) -> None:
    """Adds GB/s per implementation and mode, and the case summary (speed-up over NCCL, eager overhead)."""
    for impl, modes in case["impls"].items():
        moved = case.get("impl_bytes", {}).get(impl, case["bytes"])
        for stats in modes.values():
            if "error" in stats:
                continue
            stats["gbps"] = {phase: {kind: gbps(num_bytes, stats[phase]["max_rank"])
                                     for kind, num_bytes in moved[phase].items()} for phase in PHASES}
    ours = case["impls"].get("a2a", {})
    summary: dict[str, Any] = {}
    # Quantized wire formats: each fused row's dispatch over its pre-quantized one, and the bf16 combine over its
    # FP8-wire combine (the same combine for every format, timed once per row).
    for impl, modes in case["impls"].items():
        if not impl.endswith("-fused"):
            continue
        pre = case["impls"].get(impl.replace("-fused", "-pre"), {})
        for mode, stats in modes.items():
            if "dispatch" in stats and "dispatch" in pre.get(mode, {}):
                summary[f"{impl}_dispatch_over_pre_{mode}"] = (stats["dispatch"]["max_rank"]
                                                                / pre[mode]["dispatch"]["max_rank"])
            if "combine" in stats and "combine" in ours.get(mode, {}):
                summary[f"{impl}_combine_speedup_{mode}"] = (ours[mode]["combine"]["max_rank"]
                                                              / stats["combine"]["max_rank"])
    for mode, stats in ours.items():
        nccl = case["impls"].get("nccl_a2a", {}).get(mode, {})
        if "pair" in stats and "pair" in nccl:
            summary[f"pair_speedup_vs_nccl_a2a_{mode}"] = nccl["pair"]["max_rank"] / stats["pair"]["max_rank"]
        if "pair" in stats and "floor_us" in case:
            summary[f"pair_over_floor_{mode}"] = stats["pair"]["max_rank"] / case["floor_us"]
        pulled = case["impls"].get("a2a-pull", {}).get(mode, {})
        if "combine" in stats and "combine" in pulled:
            summary[f"combine_speedup_vs_pulled_{mode}"] = pulled["combine"]["max_rank"] / stats["combine"]["max_rank"]
    if "pair" in ours.get("graph", {}) and "pair" in ours.get("eager", {}):
        summary["eager_overhead_us_per_call"] = (ours["eager"]["pair"]["max_rank"]
                                                 - ours["graph"]["pair"]["max_rank"]) / len(PHASES)
    case["summary"] = summary


def _us(stats: dict, phase: str) -> str:
    return f"{stats[phase]['median']:8.1f} {stats[phase]['max_rank']:8.1f}"


def _pair_samples(meta: dict[str, Any]) -> str:
    group = meta.get("args", {}).get("pair_group", 1)
    return f"; a graph pair sample is the mean of {group} iterations" if group > 1 else ""


def describe_run(meta: dict[str, Any]) -> str:
    """The model shape, the ranks, the launcher and the GPU of a run, as the tables' first line names them."""
    shape = meta["shape"]
    return (f"{meta['model']}: hidden {shape['hidden']}, {shape['num_experts']} experts, top-{shape['top_k']}; "
            f"{meta['ep_size']} ranks ({meta['launcher']}) on {meta['gpu']}")


def format_table(meta: dict[str, Any], cases: list[dict[str, Any]]) -> str:
    lines = [
        f"{describe_run(meta)}; {meta['iters']} iterations after {meta['warmup']} warm-up",
        "times in us: median over ranks and iterations, then the slowest rank's (median over iterations); "
        "p99 and >2x of the slowest rank's pair" + _pair_samples(meta),
        "GB/s of the slowest rank's median time: rem = remote bytes per rank (over NVLink), log = logical bytes "
        "(local share included, as DeepEP counts)",
        "",
        f"{'tokens':>6} {'dtype':>5} {'routing':>7} {'impl':>11} {'mode':>5} | {'dispatch med/max':>17} | "
        f"{'combine med/max':>17} | {'pair med/max':>17} {'p99':>8} {'>2x':>4} | {'disp GB/s rem/log':>17} | "
        f"{'comb GB/s rem/log':>17} | {'host us/call':>12}",
    ]
    for case in cases:
        for impl, modes in case["impls"].items():
            for mode, stats in modes.items():
                head = f"{case['tokens']:>6} {case['dtype']:>5} {case['routing']:>7} {impl:>11} {mode:>5} |"
                if "error" in stats:
                    lines.append(f"{head} {stats['error']}")
                    continue
                rates = " | ".join(f"{stats['gbps'][p]['remote']:8.1f} {stats['gbps'][p]['logical']:8.1f}"
                                   for p in PHASES)
                host = stats.get("host_us")
                host_text = f"{host['dispatch']:5.1f} {host['combine']:5.1f}" if host else "-"
                lines.append(f"{head} {_us(stats, 'dispatch')} | {_us(stats, 'combine')} | {_us(stats, 'pair')} "
                             f"{stats['pair']['p99']:8.1f} {stats['pair']['over_2x']:>4} | {rates} | {host_text:>12}")
        summary = ", ".join(f"{k} {v:.2f}" for k, v in case.get("summary", {}).items())
        mb = {p: case["bytes"][p]["remote"] / 1e6 for p in PHASES}
        floor_text = f", floor of the pair {case['floor_us']:.1f} us" if "floor_us" in case else ""
        lines.append(f"{'':>6} remote MB per rank: dispatch {mb['dispatch']:.2f}, combine {mb['combine']:.2f}"
                     + floor_text + (f"; {summary}" if summary else ""))
    return "\n".join(lines)


def write_json(path: str, meta: dict[str, Any], cases: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "cases": cases}, f, indent=1, allow_nan=True)


def write_plot(path: str, meta: dict[str, Any], cases: list[dict[str, Any]]) -> Optional[str]:
    """Pair latency, dispatch and combine bandwidth against tokens per rank (CUDA-graph times), one colour per
    implementation (with dtype and routing when several were run). Returns why not, if not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    panels = {"pair": {}, **{phase: {} for phase in PHASES}}  # panel -> series key -> [(tokens, value)]
    labels = {k: len({c[k] for c in cases}) > 1 for k in ("dtype", "routing")}
    for case in cases:
        for impl, modes in case["impls"].items():
            stats = modes.get("graph", {})
            if "pair" not in stats:
                continue
            key = " ".join([impl] + [case[k] for k, shown in labels.items() if shown])
            panels["pair"].setdefault(key, []).append((case["tokens"], stats["pair"]["max_rank"]))
            if impl != "nccl_ag_rs":  # it moves every token to every rank: its GB/s says little
                for phase in PHASES:
                    panels[phase].setdefault(key, []).append((case["tokens"], stats["gbps"][phase]["remote"]))
    keys = sorted(panels["pair"])
    if not keys:
        return "no CUDA-graph rows to plot (the plot shows graph-mode times; run with --mode graph)"
    colours = plt.get_cmap("tab20" if len(keys) > 10 else "tab10")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    titles = {"pair": ("dispatch + combine (us, slowest rank)", "pair latency"),
              "dispatch": ("GB/s of remote bytes per rank", "dispatch bandwidth"),
              "combine": ("GB/s of remote bytes per rank", "combine bandwidth")}
    for ax, (panel, series) in zip(axes, panels.items()):
        for key in keys:
            if key in series:
                xs, ys = zip(*sorted(series[key]))
                ax.plot(xs, ys, marker="o", color=colours(keys.index(key) % colours.N), label=key,
                        linestyle="--" if key.startswith("nccl") else "-")
        ax.set(xscale="log", xlabel="tokens per rank", ylabel=titles[panel][0],
               title=f"{titles[panel][1]}, CUDA-graph replay")
        if panel == "pair":
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=8)
    fig.suptitle(f"{meta['model']} (hidden {meta['shape']['hidden']}, top-{meta['shape']['top_k']}), "
                 f"{meta['ep_size']} ranks, {meta['gpu']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(names) - 1) // 6), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def output_paths(output_dir: str) -> tuple[str, str]:
    os.makedirs(output_dir, exist_ok=True)
    return os.path.join(output_dir, "results.json"), os.path.join(output_dir, "results.png")
