"""The implementations the benchmark times, each as per-rank dispatch/combine steps over the same inputs.

- ``a2a``: this package as ``MoeAlltoAll`` builds it by default. Dispatch sends the hidden states (and, unless
  ``--hidden-only``, the top-k ids and weights); combine is the zero-copy one (the expert outputs already sit in the
  combine input): pulled, or pushed from 4096 tokens per rank (2048 on three ranks or more) where every rank has a
  GPU of its own and the workspace is sized for as many (``push_combine``'s default).
- ``a2a-pull`` (every rank on a GPU of its own): the same with a workspace built with ``push_combine=False``, so the
  combine is pulled at every size.
- ``<format>-fused`` (``--quant``): dispatch quantizes the bf16|fp16 hidden states into the format while sending
  them; combine sends the partials over the FP8 wire, pushed from 2048 tokens per rank (128 on three ranks or more)
  where every rank has a GPU of its own (the workspace is sized with ``combine_format="fp8_block"``), pulled below
  and between simulated ranks; from a partials tensor (a pulled zero-copy input would be quantized in place, so a
  replayed loop would quantize its own output).
- ``<format>-pre``: dispatch of the same hidden states pre-quantized (values and scales as two payloads, quantized
  once outside the timing); the bf16 zero-copy combine.
- ``nccl_a2a``: NCCL ``all_to_all_single``. Dispatch packs each (token, destination) row in destination order
  (``index_select`` of a ``[tokens, row_bytes]`` byte view holding every payload) and exchanges them; combine sends
  the partials back, gathers each token's partials (``index_select``, a zero row where a rank was not involved) and
  sums them (``sum`` over ranks, fp32 accumulation). The split sizes are computed once, outside the timing, which
  favours NCCL: an engine must exchange them every step.
- ``nccl_ag_rs``: all_gather of every rank's packed rows, then reduce_scatter of ``[ep_size * tokens, hidden]``
  (what vLLM runs by default); it moves every token to every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from .. import config
from .. import functional as F
from ..library.constants import COMBINE_PULL
from ..library.errors import check_error
from ..library.wire_formats import wire_format
from ..moe_alltoall import MoeAlltoAll
from ..reference import quant, random_topk_ids, token_rank_mask
from ..testing.simulate import SimulatedRanks
from ..transports.nvlink_eager import EagerCalls
from .args import BenchArgs
from .session import Session
from .timing import RankSteps
from .traffic import Traffic, count_rows


@dataclasses.dataclass
class Case:
    """One benchmarked shape: every rank's routing (CPU, drawn from the shared seed) and this process's inputs."""

    tokens: int
    dtype: torch.dtype
    routing: str
    num_experts: int
    topk_ids: list[torch.Tensor]  # every rank's [tokens, top_k] int32, CPU
    traffic: Traffic
    payloads: dict[int, list[torch.Tensor]]  # rank -> device payloads, for the ranks of this process

    @property
    def hidden(self) -> int:
        return self.payloads[next(iter(self.payloads))][0].shape[1]


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one row of ours times: ``plain`` (the hidden states as they are), ``pull`` (the same, the combine
    always pulled), ``fused`` (quantized into ``fmt`` by dispatch; FP8-wire combine) or ``pre`` (the same hidden states
    pre-quantized into ``fmt``; bf16 combine)."""

    kind: str = "plain"
    fmt: Optional[str] = None
    num_sms: int = 0  # SM budget (0: the whole GPU)

    @property
    def name(self) -> str:
        if self.fmt is None:
            base = "a2a" if self.kind == "plain" else f"a2a-{self.kind}"
        else:
            base = f"{self.fmt.replace('_block', '')}-{self.kind}"
        return f"{base}-sm{self.num_sms}" if self.num_sms else base


def variants(args: BenchArgs, dtype: torch.dtype, simulated: bool = False) -> list[Variant]:
    """Plain (and, with a GPU per rank, plain with the combine always pulled), then fused and pre for each
    ``--quant`` format (quantization takes bf16|fp16 hidden states), then plain under each ``--num-sms`` budget."""
    quantizable = dtype in (torch.bfloat16, torch.float16)
    pull = not simulated and args.transport == "nvlink"  # simulated ranks and the nccl transport never push
    budgets = [Variant(num_sms=n) for n in args.num_sms] if args.transport == "nvlink" else []
    return ([Variant()] + budgets + ([Variant("pull")] if pull else []) +
            [Variant(kind, fmt) for fmt in (args.quant_formats if quantizable else ()) for kind in ("fused", "pre")])


def routing_payload_bytes(args: BenchArgs) -> int:
    """Bytes of the top-k int32 ids and fp32 weights dispatched with each token (0 with ``--hidden-only``)."""
    return args.shape.top_k * 8 if args.routing_payloads else 0


def dispatch_row_bytes(args: BenchArgs, dtype: torch.dtype, variant: Variant = Variant()) -> int:
    """Bytes dispatched per (token, destination): hidden states (or their values and scales), plus top-k int32
    ids and fp32 weights."""
    if variant.fmt is not None:
        return wire_format(variant.fmt).row_bytes(args.shape.hidden) + routing_payload_bytes(args)
    return args.shape.hidden * dtype.itemsize + routing_payload_bytes(args)


def combine_row_bytes(args: BenchArgs, dtype: torch.dtype, variant: Variant = Variant()) -> int:
    """Bytes of one combine partial: ``hidden`` elements, or FP8 values and an fp32 scale per 128 (fused rows)."""
    if variant.kind == "fused":
        return wire_format("fp8_block").row_bytes(args.shape.hidden)
    return args.shape.hidden * dtype.itemsize


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """The usual per-tensor NVFP4 scale ``448 * 6 / amax`` (1 for an all-zero tensor), one fp32 on x's device."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return torch.where(amax > 0, 448.0 * 6.0 / amax, torch.ones_like(amax)).reshape(1)


def make_case(args: BenchArgs, session: Session, tokens: int, dtype: torch.dtype, routing: str, seed: int) -> Case:
    shape = args.shape
    gen = torch.Generator().manual_seed(seed)
    skew = args.skew if routing == "skewed" else None
    ids = [random_topk_ids(tokens, shape.top_k, shape.num_experts, generator=gen, skew=skew)
           for _ in range(session.ep_size)]
    here = range(session.ep_size) if session.simulated else [session.rank]
    payloads = {}
    for rank in here:
        dev_gen = torch.Generator(session.device).manual_seed(seed * 1000 + rank)
        x = torch.randn(tokens, shape.hidden, generator=dev_gen, device=session.device).to(dtype)
        rank_payloads = [x]
        if args.routing_payloads:
            weights = torch.rand(tokens, shape.top_k, generator=dev_gen, device=session.device)
            rank_payloads += [ids[rank].to(session.device), weights]
        payloads[rank] = rank_payloads
    return Case(tokens, dtype, routing, shape.num_experts, ids, count_rows(ids, shape.num_experts), payloads)


class A2A:
    """This package's dispatch/combine for one dtype and variant, with a workspace sized for the largest token
    count."""

    def __init__(self, args: BenchArgs, session: Session, dtype: torch.dtype, variant: Variant = Variant()) -> None:
        self.session, self.num_experts, self.variant = session, args.shape.num_experts, variant
        max_tokens = max(args.tokens)
        if session.simulated and args.transport != "nvlink":
            raise ValueError(f"--transport {args.transport} needs one process per GPU (launch with torchrun or "
                             "mpirun): simulated ranks share one GPU, which NCCL refuses")
        if session.simulated:
            config = F.WorkspaceConfig(ep_size=session.ep_size, max_num_tokens=max_tokens,
                                       dispatch_bytes_per_token=dispatch_row_bytes(args, dtype, variant),
                                       combine_bytes_per_token=args.shape.hidden * dtype.itemsize,
                                       top_k=args.shape.top_k)
            self.sim = SimulatedRanks(config, session.device)
            self.moe = None
        else:
            nccl = args.transport != "nvlink"  # the NCCL group: the bootstrap group may be gloo or MPI
            self.moe = MoeAlltoAll(session.nccl_group if nccl else session.group, transport=args.transport,
                                   node_size=args.node_size,
                                   max_num_tokens=max_tokens, top_k=args.shape.top_k,
                                   num_experts=args.shape.num_experts, hidden_size=args.shape.hidden, dtype=dtype,
                                   extra_dispatch_bytes_per_token=routing_payload_bytes(args),
                                   dispatch_format=variant.fmt,
                                   combine_format="fp8_block" if variant.kind == "fused" else None,
                                   push_combine=False if variant.kind == "pull" else None,
                                   device=session.device.index, num_sms=variant.num_sms or None)
            self.sim = None

    def steps(self, case: Case) -> list[RankSteps]:
        """Steps of the ranks of this process; runs one untimed round first and fills the combine inputs."""
        steps = [self._rank_steps(case, rank) for rank in case.payloads]
        for s in steps:
            with s.on_stream():
                s.dispatch()
        for rank, s in zip(case.payloads, steps):
            with s.on_stream():
                self._combine_input(case, rank).normal_()
        for s in steps:
            with s.on_stream():
                s.combine()
        torch.cuda.synchronize()
        self.check(case)
        return steps

    def check(self, case: Case) -> None:
        """Raises A2AError if any rank of this process recorded a protocol error (a timeout would fake a time)."""
        for rank in case.payloads if self.workspace is not None else ():  # the nccl transport has none
            check_error(self.workspace, rank)

    @property
    def workspace(self) -> torch.Tensor:
        return self.sim.workspace if self.sim is not None else self.moe.workspace

    def _combine_input(self, case: Case, rank: int) -> torch.Tensor:
        if self.sim is not None:
            return self.sim.combine_input(rank, case.tokens, case.hidden, case.dtype)
        return self.moe.combine_input(case.hidden, case.dtype)

    def _rank_steps(self, case: Case, rank: int) -> RankSteps:
        ids, payloads, tokens = case.topk_ids[rank], case.payloads[rank], case.tokens
        device, variant = self.session.device, self.variant
        ids_dev = payloads[1] if len(payloads) > 1 else ids.to(device)
        out = torch.empty(tokens, case.hidden, dtype=case.dtype, device=device)
        dispatch_kw: dict = {}
        combine_kw: dict = {"out": out}
        partials = None  # the zero-copy combine input, but for the FP8 wire (see the module docstring)
        gs = nvfp4_global_scale(payloads[0]) if variant.fmt == "nvfp4" else None
        if variant.kind == "fused":
            dispatch_kw = {"quant_format": variant.fmt, "global_scale": gs}
            combine_kw["quant_format"] = "fp8_block"
            partials = torch.randn(self.session.ep_size, tokens, case.hidden, device=device).to(case.dtype)
        elif variant.kind == "pre":  # quantized once by the reference, on the device, outside the timing
            payloads = [*quant.quantize(payloads[0], variant.fmt, None if gs is None else float(gs)), *payloads[1:]]
        if self.moe is not None:
            moe = self.moe
            return RankSteps(lambda: moe.dispatch(ids_dev, payloads, tokens, **dispatch_kw),
                             lambda: moe.combine(partials, **combine_kw))
        # Simulated ranks run the path MoeAlltoAll runs (an engine's): its eager calls, bound once per rank, with
        # receive views made once. Two bindings, as the dispatch and the combine get different SM budgets here.
        sim, num_sms, timeout = self.sim, variant.num_sms, config.timeout_or_default(None)
        counts = torch.empty(sim.ep_size, dtype=torch.int32, device=device)

        def pulled(quant_format: Optional[str], runtime_max: int) -> int:
            return COMBINE_PULL  # ranks sharing a GPU always pull

        def bind(sms: int) -> EagerCalls:
            return EagerCalls(sim.workspace, counts, rank, sim.config, self.num_experts, sms, False, pulled, False)

        sends, sums = bind(num_sms or sim.dispatch_sms), bind(num_sms)

        def dispatch():
            return sends.dispatch(ids_dev, payloads, tokens, timeout, **dispatch_kw), counts

        def combine():
            sums.combine(partials, out, tokens, case.hidden, case.dtype, tokens, timeout,
                         combine_kw.get("quant_format"))

        return RankSteps(dispatch, combine, sim.streams[rank])

    def close(self) -> None:
        if self.moe is not None:
            self.moe.destroy()


def _packed_rows(payloads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[tokens, row_bytes] uint8``: every payload's row side by side (the layout NCCL's pack gathers from)."""
    tokens = payloads[0].shape[0]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(tokens, -1) for p in payloads], dim=1)


def nccl_a2a_steps(session: Session, case: Case) -> RankSteps:
    import torch.distributed as dist

    rank, group, device, ep_size = session.rank, session.nccl_group, session.device, session.ep_size
    masks = [token_rank_mask(ids, case.num_experts, ep_size) for ids in case.topk_ids]
    dest_major = masks[rank].t().nonzero()  # (destination, token) pairs, destination major, tokens in order
    sent = len(dest_major)
    send_tokens = dest_major[:, 1].to(device)
    # Unpack by gathering: row [t, d] of `gather_rows` is the partial token t got back from rank d, or a zero row.
    gather_rows = torch.full((case.tokens, ep_size), sent, dtype=torch.int64)
    gather_rows[dest_major[:, 1], dest_major[:, 0]] = torch.arange(sent)
    gather_rows = gather_rows.view(-1).to(device)
    in_splits = masks[rank].sum(0).tolist()
    out_splits = [int(m[:, rank].sum()) for m in masks]
    packed = _packed_rows(case.payloads[rank])
    send = torch.empty(sent, packed.shape[1], dtype=torch.uint8, device=device)
    recv = torch.empty(sum(out_splits), packed.shape[1], dtype=torch.uint8, device=device)
    partials = torch.randn(sum(out_splits), case.hidden, device=device).to(case.dtype)
    returned = torch.zeros(sent + 1, case.hidden, dtype=case.dtype, device=device)  # + the zero row
    gathered = torch.empty(case.tokens * ep_size, case.hidden, dtype=case.dtype, device=device)
    out = torch.empty(case.tokens, case.hidden, dtype=case.dtype, device=device)

    def dispatch():
        torch.index_select(packed, 0, send_tokens, out=send)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)

    def combine():
        dist.all_to_all_single(returned[:sent], partials, in_splits, out_splits, group=group)
        torch.index_select(returned, 0, gather_rows, out=gathered)
        torch.sum(gathered.view(case.tokens, ep_size, case.hidden), dim=1, out=out)

    return RankSteps(dispatch, combine)


def nccl_ag_rs_steps(session: Session, case: Case) -> RankSteps:
    import torch.distributed as dist

    group, device, ep_size = session.nccl_group, session.device, session.ep_size
    packed = _packed_rows(case.payloads[session.rank])
    gathered = torch.empty(ep_size * case.tokens, packed.shape[1], dtype=torch.uint8, device=device)
    partials = torch.randn(ep_size * case.tokens, case.hidden, device=device).to(case.dtype)
    out = torch.empty(case.tokens, case.hidden, dtype=case.dtype, device=device)
    return RankSteps(lambda: dist.all_gather_into_tensor(gathered, packed, group=group),
                     lambda: dist.reduce_scatter_tensor(out, partials, group=group))
