"""FlashInfer 0.7.4's communication contract (``flashinfer.moe_ep.core.comm.communication``): the EP sizing
:class:`MoEEpCommParams`, the receive rows :class:`MoEEpDispatchResult`, the backend interface
:class:`MoEEpCommunication`, and the registry that :func:`create_communication` builds backends from.

The contract every backend keeps: ``dispatch`` returns ``ep_size * tokens_per_rank`` rank-major rows (block ``src``
holds what rank ``src`` sent here), each token at most once per rank with its full top-k routing; received ids are
global expert ids, and rows that carry no token have every id set to ``invalid_expert_id``; the expert side applies
the weights and sums over this rank's experts, one output row per received row; ``combine`` sums each token's rows
back on the rank that owns it. One dispatch/combine pair is in flight per object; every rank makes the same calls.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from .config import BootstrapConfig, QuantFormat


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# (value bytes, scale bytes) of one token's activations on the wire, per QuantFormat a dispatch carries (FlashInfer's
# rule): scales per block travel in a row-aligned payload of their own; a per-tensor scale does not travel.
WIRE_ROWS: dict[str, Callable[[int], tuple[int, int]]] = {
    "BF16": lambda hidden: (2 * hidden, 0),
    "FP16": lambda hidden: (2 * hidden, 0),
    "FP8PerTensor": lambda hidden: (hidden, 0),
    "DeepSeekFp8": lambda hidden: (hidden, 4 * _cdiv(hidden, 128)),
    "MXFP8": lambda hidden: (hidden, _cdiv(hidden, 32)),
    "NVFP4": lambda hidden: (_cdiv(hidden, 2), _cdiv(hidden, 16)),
    "MXFP4": lambda hidden: (_cdiv(hidden, 2), _cdiv(hidden, 32)),
}
# The formats our dispatch can quantize into while sending (flashinfer_a2a.library.wire_formats), same bytes.
QUANTIZING_FORMATS = {"DeepSeekFp8": "fp8_block", "MXFP8": "mxfp8", "NVFP4": "nvfp4"}
# The formats whose rows are plain activations of one dtype.
_PLAIN_DTYPES = {"BF16": torch.bfloat16, "FP16": torch.float16}


def format_name(dispatch_format: Any) -> Optional[str]:
    """The name of a ``dispatch_format`` (ours or FlashInfer's ``QuantFormat``, matched by name), None for None;
    ValueError for anything a dispatch cannot carry."""
    if dispatch_format is None:
        return None
    if (isinstance(dispatch_format, enum.Enum) and type(dispatch_format).__name__ == QuantFormat.__name__
            and dispatch_format.name in WIRE_ROWS):
        return dispatch_format.name
    raise ValueError(f"MoEEpCommParams.dispatch_format must be None or one of QuantFormat."
                     f"{{{', '.join(WIRE_ROWS)}}}, got {dispatch_format!r}")


@dataclass(frozen=True)
class MoEEpCommParams:
    """EP sizing shared by the backends (FlashInfer's fields, order and defaults).

    ``max_tokens_per_rank`` bounds the tokens a rank dispatches per call and sizes the receive rows; ``hidden_size``
    and ``dtype`` (None: bf16) describe an unquantized token row, which is also what the experts hand to ``combine``;
    ``dispatch_format`` (a :class:`QuantFormat`, or None for ``dtype`` rows) is what the activations travel as,
    values plus their per-block scales; ``invalid_expert_id`` (outside ``[0, num_experts)``) marks the received
    rows that carry no token.
    """

    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype: Optional[torch.dtype] = None
    dispatch_format: Optional[QuantFormat] = None
    invalid_expert_id: int = -1

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "max_tokens_per_rank", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEEpCommParams.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEEpCommParams.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if 0 <= self.invalid_expert_id < self.num_experts:
            raise ValueError(f"MoEEpCommParams.invalid_expert_id={self.invalid_expert_id} must lie outside "
                             f"[0, num_experts={self.num_experts}): it marks rows without a token")
        format_name(self.dispatch_format)

    @property
    def token_dtype(self) -> torch.dtype:
        """``dtype``, bf16 when None."""
        return torch.bfloat16 if self.dtype is None else self.dtype

    @property
    def dispatch_bytes_per_token(self) -> int:
        """Bytes of one token's dispatched activations, scales included: ``hidden_size * itemsize`` without a
        ``dispatch_format``; BF16 and FP16 ``2H``, FP8PerTensor ``H``, DeepSeekFp8 ``H + 4 ceil(H/128)``, MXFP8
        ``H + ceil(H/32)``, NVFP4 ``ceil(H/2) + ceil(H/16)``, MXFP4 ``ceil(H/2) + ceil(H/32)``."""
        name = format_name(self.dispatch_format)
        if name is None:
            return self.hidden_size * self.token_dtype.itemsize
        return sum(WIRE_ROWS[name](self.hidden_size))

    def wire_rows(self) -> tuple[int, int, Optional[torch.dtype]]:
        """``(value bytes, scale bytes, dtype)`` of one dispatched token: what ``hidden_states`` and
        ``hidden_states_scale`` rows must hold (no scales when 0), and the dtype the values must have for plain
        rows (None: any, quantized values being bytes)."""
        name = format_name(self.dispatch_format)
        if name is None:
            return self.hidden_size * self.token_dtype.itemsize, 0, self.token_dtype
        return (*WIRE_ROWS[name](self.hidden_size), _PLAIN_DTYPES.get(name))


@dataclass(frozen=True)
class MoEEpDispatchResult:
    """The rank-major receive rows of a dispatch: every tensor has ``ep_size * tokens_per_rank`` rows, views of the
    backend's workspace valid until the next dispatch on it."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    tokens_per_rank: int
    hidden_states_scale: Optional[torch.Tensor] = None
    eplb_gathered_stats: Optional[torch.Tensor] = None


class MoEEpCommunication(abc.ABC):
    """A self-contained expert-parallel dispatch/combine backend serving one EP group (FlashInfer's interface; see
    the module docstring for the row contract). One dispatch is followed by exactly one combine before the next;
    every rank makes the same calls."""

    backend_name: ClassVar[str]
    # Whether a dispatch/combine pair may be captured in a CUDA graph (after an eager one of the same shapes).
    supports_cuda_graph: ClassVar[bool] = True

    def __init__(self, bootstrap: BootstrapConfig, params: MoEEpCommParams) -> None:
        if not self._platform_supported():
            raise RuntimeError(f"{type(self).__name__} is not supported on this platform")
        self.bootstrap, self.params = bootstrap, params
        self.ep_rank, self.ep_size = bootstrap.rank, bootstrap.world_size
        if params.num_experts % self.ep_size:
            raise ValueError(f"{type(self).__name__} needs num_experts={params.num_experts} divisible by the EP size "
                             f"{self.ep_size}")
        self.num_local_experts = params.num_experts // self.ep_size

    def _platform_supported(self) -> bool:
        """Whether this object can run here; a backend whose answer depends on its options overrides it."""
        return self.is_platform_supported()

    @classmethod
    @abc.abstractmethod
    def is_platform_supported(cls) -> bool:
        """Whether the backend can run on this machine; callable before construction, never collective."""

    def _resolve_runtime_max_tokens_per_rank(self, runtime_max_tokens_per_rank: Optional[int]) -> int:
        """A dispatch's ``tokens_per_rank``: ``runtime_max_tokens_per_rank`` in ``(0, max_tokens_per_rank]``, or the
        capacity for None."""
        capacity = self.params.max_tokens_per_rank
        if runtime_max_tokens_per_rank is None:
            return capacity
        if (not isinstance(runtime_max_tokens_per_rank, int) or isinstance(runtime_max_tokens_per_rank, bool)
                or not 0 < runtime_max_tokens_per_rank <= capacity):
            raise ValueError(f"runtime_max_tokens_per_rank={runtime_max_tokens_per_rank!r} must be an int in "
                             f"(0, max_tokens_per_rank={capacity}]")
        return runtime_max_tokens_per_rank

    @abc.abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor] = None,
                 *, hidden_states_scale: Optional[torch.Tensor] = None,
                 runtime_max_tokens_per_rank: Optional[int] = None,
                 eplb_local_stats: Optional[torch.Tensor] = None) -> MoEEpDispatchResult:
        """Sends each token (``hidden_states`` ``[num_tokens, ...]``, ``topk_ids`` ``[num_tokens, top_k]`` global
        expert ids, ``topk_weights``, ``hidden_states_scale``) to the ranks owning its experts; the same
        ``runtime_max_tokens_per_rank`` on every rank (None: ``max_tokens_per_rank``, static shapes)."""

    @abc.abstractmethod
    def combine(self, expert_output: torch.Tensor, *, output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[num_tokens, hidden]``: each token's rows of ``expert_output`` (``[ep_size * tokens_per_rank, hidden]``
        or ``[ep_size, tokens_per_rank, hidden]``) summed over the ranks it went to, into ``output`` if given."""

    def get_combine_input_buffer(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A buffer of the backend's the experts may write into, saving a copy in :meth:`combine` (None: none)."""
        return None

    def destroy(self) -> None:  # noqa: B027 - a backend without resources has nothing to release
        """Releases the backend's resources; collective, idempotent."""


_BACKENDS: dict[str, type[MoEEpCommunication]] = {}


def register_communication(name: str) -> Callable[[type[MoEEpCommunication]], type[MoEEpCommunication]]:
    """Class decorator: registers a :class:`MoEEpCommunication` under ``name`` (its ``backend_name``)."""

    def register(cls: type[MoEEpCommunication]) -> type[MoEEpCommunication]:
        cls.backend_name = name
        _BACKENDS[name] = cls
        return cls

    return register


def communication_backend_name(backend: Any) -> str:
    """The registered name a backend string or config object (one with a ``backend_name`` str) stands for."""
    name = getattr(backend, "backend_name", backend)
    if not isinstance(name, str):
        raise TypeError(f"backend must be a name or a config with a backend_name str, got {backend!r}")
    return name


def is_communication_backend(backend: Any) -> bool:
    """Whether ``backend`` names a registered backend."""
    try:
        return communication_backend_name(backend) in _BACKENDS
    except TypeError:
        return False


def available_communication_backends() -> list[str]:
    """The registered backends that can run on this machine, sorted."""
    return sorted(name for name, cls in _BACKENDS.items() if cls.is_platform_supported())


def create_communication(bootstrap: BootstrapConfig, params: MoEEpCommParams, backend: Any,
                         **options: Any) -> MoEEpCommunication:
    """Builds the registered backend ``backend`` names (a name, or a config object such as
    :class:`NVLinkOneSidedConfig`, which the backend then receives as ``config``), passing it ``options`` as keyword
    arguments. Collective over the EP group."""
    name = communication_backend_name(backend)
    cls = _BACKENDS.get(name)
    if cls is None:
        raise KeyError(f"unknown communication backend {name!r}; registered: {sorted(_BACKENDS)}")
    if not isinstance(backend, str):
        options["config"] = backend
    return cls(bootstrap, params, **options)
