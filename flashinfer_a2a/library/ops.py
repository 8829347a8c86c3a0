"""The torch boundary: every ``flashinfer_a2a::<name>`` op, each with its fake implementation directly below it.

Ops are defined through ``torch.library.Library`` with explicit schemas: the ``(a!)`` annotations name every tensor
an op writes (the workspace included), which is what ``torch.compile`` and CUDA-graph capture rely on. The
implementations call the tvm-ffi module, which builds on first use (never at import).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import checks as _check
from .constants import COMBINE_PULL, COMBINE_PUSH, check_sizes
from ..jit import get_a2a_module

_LIB = torch.library.Library("flashinfer_a2a", "DEF")

# Names of the metainfo entries (byte offsets within a rank's workspace), in the order of the index tensor that
# ``get_metainfo_index_pairs`` returns. The C++ side defines the indices; the op checks both sides agree.
METAINFO_NAMES = (
    "dispatch_epoch_offset",
    "blocks_done_offset",
    "error_code_offset",
    "error_phase_offset",
    "error_peer_offset",
    "error_epoch_offset",
    "error_detail_offset",
    "dispatch_signal_offset",
    "peer_runtime_max_offset",
    "combine_signal_offset",
    "inactive_ranks_offset",
    "metadata_bytes",
    "eplb_offset",
    "push_flags_offset",
    "routing_offset",
    "dispatch_offset",
    "combine_offset",
    "bytes_per_rank",
)


def _plain_eager_call(args: tuple) -> bool:
    """True when going through the dispatcher would only reach the implementation: not tracing, no dispatch mode
    (FakeTensorMode, a TorchDispatchMode) active, and a plain tensor first (no tensor subclass)."""
    # is_compiling first: dynamo folds it to True and never traces the rest.
    return (not torch.compiler.is_compiling() and bool(args) and type(args[0]) is torch.Tensor
            and torch._C._len_torch_dispatch_stack() == 0)


class Op:
    """A registered op (``torch.ops.flashinfer_a2a.<name>``). A plain eager call runs the implementation directly:
    the dispatcher would only route it there, at several microseconds per call; anything else (torch.compile, fake
    tensors, dispatch modes, subclasses) goes through the dispatcher."""

    def __init__(self, name: str, impl: Callable) -> None:
        self.name = name
        self.impl = impl
        self.overload = getattr(torch.ops.flashinfer_a2a, name).default

    def __call__(self, *args):
        if _plain_eager_call(args):
            try:  # inline rather than _caller_errors: no extra frame on the eager hot path
                return self.impl(*args)
            except (ValueError, TypeError) as exc:
                raise type(exc)(str(exc)) from None
        return self.overload(*args)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(f"flashinfer_a2a::{self.name}", fake, lib=_LIB)
        return fake


def _caller_errors(impl: Callable) -> Callable:
    """``impl`` raising a caller's mistake (ValueError, TypeError from the C++ checks) as a plain exception of the
    same type and message: without the C++ frames tvm-ffi appends to the traceback, which name source paths of
    the machine the library was built on. (Op.__call__ does the same inline for plain eager calls.)"""

    def call(*args, **kwargs):
        try:
            return impl(*args, **kwargs)
        except (ValueError, TypeError) as exc:
            raise type(exc)(str(exc)) from None

    call.__name__, call.__doc__ = impl.__name__, impl.__doc__
    return call


def register(schema: str, dispatch_key: str = "CompositeExplicitAutograd") -> Callable[[Callable], Op]:
    """Defines ``flashinfer_a2a::<schema>`` and registers the decorated function as its implementation.

    ``torch.library.Library.impl`` costs less per call than ``torch.library.custom_op`` (which wraps every call in
    Python-side checks), and it really registers: the op exists for the dispatcher, FakeTensor and torch.compile.
    """

    def wrap(impl: Callable) -> Op:
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(name, _caller_errors(impl), dispatch_key)
        return Op(name, impl)

    return wrap


_SIZES = "int ep_size, int max_num_tokens, int top_k, int dispatch_bytes_per_token, int combine_bytes_per_token"


@register(f"get_workspace_size({_SIZES}) -> int")
def get_workspace_size(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token):
    module = get_a2a_module()
    return int(
        module.get_workspace_size(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token)
    )


@get_workspace_size.register_fake
def _get_workspace_size_fake(*sizes):
    check_sizes(*sizes)
    return get_workspace_size.impl(*sizes)  # host arithmetic: the fake computes what the real op does


@register("get_metainfo_index_pairs() -> Tensor")
def get_metainfo_index_pairs():
    pairs = dict(get_a2a_module().get_metainfo_index_pairs())
    if set(pairs) != set(METAINFO_NAMES):
        raise RuntimeError(f"metainfo names differ between C++ ({sorted(pairs)}) and Python ({METAINFO_NAMES})")
    return torch.tensor([pairs[name] for name in METAINFO_NAMES], dtype=torch.int64)


@get_metainfo_index_pairs.register_fake
def _get_metainfo_index_pairs_fake():
    return torch.empty(len(METAINFO_NAMES), dtype=torch.int64)


@register(f"initialize(Tensor(a!) workspace, Tensor(b!) metainfo, int ep_rank, {_SIZES}) -> ()")
def initialize(workspace, metainfo, ep_rank, *sizes):
    get_a2a_module().initialize(workspace, metainfo, ep_rank, *sizes)


@initialize.register_fake
def _initialize_fake(workspace, metainfo, ep_rank, *sizes):
    _check.check_initialize_args(workspace, metainfo, ep_rank, sizes, len(METAINFO_NAMES))


@register(
    "dispatch(Tensor(a!) workspace, Tensor topk_ids, Tensor[] payloads, Tensor(b!) recv_counts, int ep_rank, "
    f"{_SIZES}, SymInt runtime_max_tokens_per_rank, int num_experts, float timeout_s, int quant_format=0, "
    "Tensor? global_scale=None, bool swizzled_scales=False, int phase=0, int num_sms=0, "
    "bool one_gpu_per_rank=False, Tensor? eplb_local_stats=None) -> ()",
    dispatch_key="CUDA",
)
def dispatch(workspace, topk_ids, payloads, recv_counts, ep_rank, ep_size, max_num_tokens, top_k,
             dispatch_bytes_per_token, combine_bytes_per_token, runtime_max_tokens_per_rank, num_experts, timeout_s,
             quant_format=0, global_scale=None, swizzled_scales=False, phase=0, num_sms=0, one_gpu_per_rank=False,
             eplb_local_stats=None):
    get_a2a_module().dispatch(workspace, topk_ids, payloads, recv_counts, ep_rank, ep_size, max_num_tokens,
                              top_k, dispatch_bytes_per_token, combine_bytes_per_token, runtime_max_tokens_per_rank,
                              num_experts, timeout_s, quant_format, global_scale, swizzled_scales, phase, num_sms,
                              one_gpu_per_rank, eplb_local_stats)


@dispatch.register_fake
def _dispatch_fake(workspace, topk_ids, payloads, recv_counts, ep_rank, ep_size, max_num_tokens, top_k,
                   dispatch_bytes_per_token, combine_bytes_per_token, runtime_max_tokens_per_rank, num_experts,
                   timeout_s, quant_format=0, global_scale=None, swizzled_scales=False, phase=0, num_sms=0,
                   one_gpu_per_rank=False, eplb_local_stats=None):
    sizes = (ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token)
    _check.check_split_args("dispatch", phase, ("send and receive", "send only"), num_sms)
    _check.check_dispatch_args(workspace, topk_ids, payloads, recv_counts, ep_rank, sizes,
                               runtime_max_tokens_per_rank, num_experts, timeout_s, quant_format, global_scale,
                               swizzled_scales, eplb_local_stats)


# The receive half of a dispatch sent with phase=1 (flashinfer_a2a.split_phase): one block waits for the peers'
# counts. recv_counts is its output; the workspace is written too (its error record).
@register(f"dispatch_recv(Tensor(a!) workspace, Tensor(b!) recv_counts, int ep_rank, {_SIZES}, "
          "int runtime_max_tokens_per_rank, float timeout_s) -> ()", dispatch_key="CUDA")
def dispatch_recv(workspace, recv_counts, ep_rank, *sizes_and_args):
    get_a2a_module().dispatch_recv(workspace, recv_counts, ep_rank, *sizes_and_args)


@dispatch_recv.register_fake
def _dispatch_recv_fake(workspace, recv_counts, ep_rank, ep_size, max_num_tokens, top_k, dispatch_bytes_per_token,
                        combine_bytes_per_token, runtime_max_tokens_per_rank, timeout_s):
    sizes = (ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token)
    _check.check_dispatch_recv_args(workspace, recv_counts, ep_rank, sizes, runtime_max_tokens_per_rank, timeout_s)


@register(
    "combine(Tensor(a!) workspace, Tensor? partials, Tensor recv_counts, Tensor(b!) out, int ep_rank, "
    f"{_SIZES}, SymInt runtime_max_tokens_per_rank, float timeout_s, bool one_gpu_per_rank, int quant_format=0, "
    "int combine_mode=0, int phase=0, int num_sms=0) -> ()",
    dispatch_key="CUDA",
)
def combine(workspace, partials, recv_counts, out, ep_rank, ep_size, max_num_tokens, top_k, dispatch_bytes_per_token,
            combine_bytes_per_token, runtime_max_tokens_per_rank, timeout_s, one_gpu_per_rank, quant_format=0,
            combine_mode=0, phase=0, num_sms=0):
    get_a2a_module().combine(workspace, partials, recv_counts, out, ep_rank, ep_size, max_num_tokens, top_k,
                             dispatch_bytes_per_token, combine_bytes_per_token, runtime_max_tokens_per_rank, timeout_s,
                             one_gpu_per_rank, quant_format, combine_mode, phase, num_sms)


@combine.register_fake
def _combine_fake(workspace, partials, recv_counts, out, ep_rank, ep_size, max_num_tokens, top_k,
                  dispatch_bytes_per_token, combine_bytes_per_token, runtime_max_tokens_per_rank, timeout_s,
                  one_gpu_per_rank, quant_format=0, combine_mode=0, phase=0, num_sms=0):
    sizes = (ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token)
    _check.check_split_args("combine", phase, ("send and receive", "send", "receive"), num_sms)
    if phase and combine_mode == COMBINE_PUSH:
        raise ValueError(f"combine_mode={combine_mode} (push) cannot be split: phase must be 0, got {phase}; split "
                         f"combines use combine_mode={COMBINE_PULL} (pull)")
    _check.check_combine_args(workspace, partials, recv_counts, out, ep_rank, sizes, runtime_max_tokens_per_rank,
                              timeout_s, quant_format, one_gpu_per_rank, combine_mode)


@register("sanitize_expert_ids(Tensor(a!) recv_topk_ids, Tensor recv_counts, int invalid_id) -> ()", "CUDA")
def sanitize_expert_ids(recv_topk_ids, recv_counts, invalid_id):
    get_a2a_module().sanitize_expert_ids(recv_topk_ids, recv_counts, invalid_id)


@sanitize_expert_ids.register_fake
def _sanitize_expert_ids_fake(recv_topk_ids, recv_counts, invalid_id):
    _check.check_sanitize_args(recv_topk_ids, recv_counts, invalid_id)


# The nccl transport's kernels (flashinfer_a2a/transports/nccl.py; the wire: library/nccl_wire.py).
@register(
    "nccl_pack(Tensor(a!) send, Tensor topk_ids, Tensor[] payloads, int ep_size, SymInt runtime_max_tokens_per_rank, "
    "int num_experts, int quant_format=0, Tensor? global_scale=None, bool swizzled_scales=False) -> ()",
    dispatch_key="CUDA",
)
def nccl_pack(send, topk_ids, payloads, ep_size, runtime_max_tokens_per_rank, num_experts, quant_format=0,
              global_scale=None, swizzled_scales=False):
    get_a2a_module().nccl_pack(send, topk_ids, payloads, ep_size, runtime_max_tokens_per_rank, num_experts,
                               quant_format, global_scale, swizzled_scales)


@nccl_pack.register_fake
def _nccl_pack_fake(send, topk_ids, payloads, ep_size, runtime_max_tokens_per_rank, num_experts, quant_format=0,
                    global_scale=None, swizzled_scales=False):
    _check.check_nccl_pack_args(send, topk_ids, payloads, ep_size, runtime_max_tokens_per_rank, num_experts,
                                quant_format, global_scale, swizzled_scales)


@register(
    "nccl_select(Tensor gathered, Tensor(a!)[] recv, Tensor(b!) recv_counts, int ep_rank, "
    "SymInt runtime_max_tokens_per_rank, int quant_format=0, int quant_hidden=0, bool swizzled_scales=False) -> ()",
    dispatch_key="CUDA",
)
def nccl_select(gathered, recv, recv_counts, ep_rank, runtime_max_tokens_per_rank, quant_format=0, quant_hidden=0,
                swizzled_scales=False):
    get_a2a_module().nccl_select(gathered, recv, recv_counts, ep_rank, runtime_max_tokens_per_rank, quant_format,
                                 quant_hidden, swizzled_scales)


@nccl_select.register_fake
def _nccl_select_fake(gathered, recv, recv_counts, ep_rank, runtime_max_tokens_per_rank, quant_format=0,
                      quant_hidden=0, swizzled_scales=False):
    _check.check_nccl_select_args(gathered, recv, recv_counts, ep_rank, runtime_max_tokens_per_rank, quant_format,
                                  quant_hidden, swizzled_scales)


@register("nccl_combine_wire(Tensor(a!) wire, Tensor partials, Tensor recv_counts, int ep_rank) -> ()", "CUDA")
def nccl_combine_wire(wire, partials, recv_counts, ep_rank):
    get_a2a_module().nccl_combine_wire(wire, partials, recv_counts, ep_rank)


@nccl_combine_wire.register_fake
def _nccl_combine_wire_fake(wire, partials, recv_counts, ep_rank):
    _check.check_nccl_combine_wire_args(wire, partials, recv_counts, ep_rank)


@register("nccl_combine_sum(Tensor(a!) out, Tensor returned, Tensor send, Tensor partials, int ep_rank, "
          "bool fp8_wire) -> ()", "CUDA")
def nccl_combine_sum(out, returned, send, partials, ep_rank, fp8_wire):
    get_a2a_module().nccl_combine_sum(out, returned, send, partials, ep_rank, fp8_wire)


@nccl_combine_sum.register_fake
def _nccl_combine_sum_fake(out, returned, send, partials, ep_rank, fp8_wire):
    _check.check_nccl_combine_sum_args(out, returned, send, partials, ep_rank, fp8_wire)


@_caller_errors
def dispatch_layout(
    ep_size: int,
    max_num_tokens: int,
    top_k: int,
    dispatch_bytes_per_token: int,
    combine_bytes_per_token: int,
    runtime_max_tokens_per_rank: int,
    payload_row_bytes: Sequence[int],
    quant: tuple[int, int, bool] = (0, 0, False),
) -> tuple[list[int], int]:
    """Byte offsets, within a rank's workspace, of each receive region and of the combine region. ``quant`` is
    ``(quant_format, hidden, swizzled_scales)`` of a quantizing dispatch, whose first payload arrives as two regions
    (values, scales).

    Host arithmetic from the C++ layout (Python never re-derives offsets); not an op, since it returns no tensor.
    """
    offsets = get_a2a_module().get_dispatch_layout(
        ep_size,
        max_num_tokens,
        top_k,
        dispatch_bytes_per_token,
        combine_bytes_per_token,
        runtime_max_tokens_per_rank,
        [int(b) for b in payload_row_bytes],
        *quant,
    )
    offsets = [int(o) for o in offsets]
    return offsets[:-1], offsets[-1]


@_caller_errors
def nccl_wire_layout(ep_size: int, runtime_max_tokens_per_rank: int, payload_row_bytes: Sequence[int],
                     quant: tuple[int, int, bool] = (0, 0, False)) -> tuple[int, list[int], int]:
    """``(plane_stride, segment offsets, total bytes)`` of the nccl transport's send buffer, from the C++ layout
    (library/nccl_wire.py mirrors it for the CPU path). ``quant`` as for :func:`dispatch_layout`."""
    out = [int(v) for v in get_a2a_module().get_nccl_wire_layout(ep_size, runtime_max_tokens_per_rank, *quant,
                                                                   [int(b) for b in payload_row_bytes])]
    return out[0], out[1:-1], out[-1]


def bind_eager_calls(workspace, recv_counts, ep_rank: int, sizes: Sequence[int], num_experts: int, num_sms: int,
                     one_gpu_per_rank: bool) -> tuple[Callable, Callable, Callable]:
    """``(dispatch, dispatch_recv, combine)``: the C++ entries with the arguments that stay fixed for one instance
    (workspace, counts tensor, rank, sizes, experts, SM budget) bound once, so that an eager call converts only what
    changes (about half a microsecond a tensor). Each call still runs every check of the entry before it launches;
    the bound dispatch returns the id of its payloads' row shapes. Every bound call takes a CUDA tensor (the bound
    dispatch_recv takes the counts tensor at each call): tvm-ffi launches on torch's current stream only when a
    call passes a tensor, and on the legacy default stream otherwise. Used by
    :mod:`flashinfer_a2a.transports.nvlink_eager`; traced calls go through the ops above."""
    module = get_a2a_module()
    return (module.bind_dispatch(workspace, recv_counts, ep_rank, *sizes, num_experts, num_sms, one_gpu_per_rank),
            module.bind_dispatch_recv(workspace, ep_rank, *sizes),
            module.bind_combine(workspace, recv_counts, ep_rank, *sizes, one_gpu_per_rank, num_sms))


def load() -> None:
    """Builds (first use) or loads the library now, e.g. before a timed loop or a wait on peers."""
    get_a2a_module()
