"""FlashInfer 0.7.4's configuration types for the one-sided path: :class:`QuantFormat` (``flashinfer.fused_moe``),
:class:`BootstrapConfig` (``flashinfer.moe_ep``) and :class:`NVLinkOneSidedConfig`, with the same fields, order and
defaults. What each field selects here is documented on the class."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

# FlashInfer's bound on timeout_sec: one day.
MAX_TIMEOUT_SEC = 24 * 60 * 60


class QuantFormat(enum.Enum):
    """FlashInfer's ``flashinfer.fused_moe.QuantFormat``: the numeric format of the activations a dispatch carries
    (``MoEEpCommParams.dispatch_format``). Members and values are FlashInfer's; a member of FlashInfer's own enum is
    accepted wherever this one is (matched by name)."""

    BF16 = 0
    FP16 = 1
    FP8PerTensor = 2
    DeepSeekFp8 = 3  # E4M3 values, one fp32 scale per 128: our "fp8_block"
    MXFP8 = 4  # E4M3 values, one UE8M0 scale byte per 32: our "mxfp8"
    NVFP4 = 5  # packed E2M1 values, one E4M3 scale byte per 16: our "nvfp4"
    MXFP4 = 6
    MXINT4 = 7
    INT4 = 8

    def __repr__(self) -> str:
        return f"QuantFormat.{self.name}"


@dataclass(frozen=True)
class BootstrapConfig:
    """The EP group a backend is built on (FlashInfer's ``flashinfer.moe_ep.BootstrapConfig``).

    ``world_size`` and ``rank`` are the EP group's. The one-sided backend reads only ``process_group`` (a
    ``torch.distributed`` process group, None for the default one; here also an mpi4py communicator or a
    :class:`flashinfer_a2a.comm.Communicator`) and ``device`` (this rank's CUDA device; None: the current one).
    ``stream`` is not read: every call runs on the caller's current stream, as FlashInfer's one-sided calls do.
    ``auto_bootstrap``, ``nccl_comm`` and ``tcp_store`` serve FlashInfer's NCCL-EP and NIXL-EP fleets, which are not
    offered here.
    """

    world_size: int
    rank: int
    stream: int = 0
    auto_bootstrap: bool = True
    device: Optional[int] = field(default=None, kw_only=True)
    nccl_comm: Optional[int] = None
    process_group: Any = field(default=None, compare=False, hash=False)
    tcp_store: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"BootstrapConfig.world_size must be positive, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"BootstrapConfig.rank={self.rank} is outside [0, world_size={self.world_size})")
        if self.device is not None and self.device < 0:
            raise ValueError(f"BootstrapConfig.device must be a CUDA device ordinal (>= 0) or None, got {self.device}")


@dataclass
class NVLinkOneSidedConfig:
    """Options of :class:`flashinfer_a2a.compat.moe_ep.NVLinkOneSidedAlltoAll`, FlashInfer 0.7.4's fields in its
    order. Pass it as ``backend`` to :func:`flashinfer_a2a.compat.moe_ep.create_communication`.

    What each selects here:

    - ``extra_payload_bytes_per_token``: room per token for anything sent besides the activations, their scales, the
      int32 ids and the fp32 weights.
    - ``eplb_stats_num_experts``: a dispatch given ``eplb_local_stats`` of that length carries them to every rank
      (:attr:`MoEEpDispatchResult.eplb_gathered_stats`); at most ``num_experts`` and
      :data:`flashinfer_a2a.functional.MAX_EPLB_EXPERTS` (1024). The nvlink transport only.
    - ``enable_rank_mask``: calls take ``active_rank_mask`` (a call passing none means every rank). Unlike FlashInfer,
      steps are captured in CUDA graphs all the same: the active set lives in the workspace, so a replay follows the
      set in force when it runs.
    - ``use_low_precision_combine``: the partials cross the links as FP8 E4M3 **with one fp32 scale per 128
      elements** (FlashInfer casts to E4M3 without scales), and are summed in fp32.
    - ``comm_backend``: a FlashInfer ``CommBackend`` (``Get_rank``, ``Get_size``, ``allgather``) to set the workspace
      up over, instead of ``BootstrapConfig.process_group``.
    - ``cft``, ``cft_max_tokens_for_dispatch``, ``cft_max_tokens_for_combine``, ``lamport``, ``lamport_max_tokens``:
      FlashInfer's Blackwell-only transports (CFT counted writes; Lamport flag-in-data rows). Checked as FlashInfer
      checks them and accepted, but there is no such transport here: every step takes the one-sided path (pushed
      dispatch, pulled or pushed combine), on Hopper and Blackwell alike, and ``lamport_enabled`` is False.
      ``lamport=True`` logs a warning that it is unavailable, as FlashInfer does on a GPU without it.
    - ``timeout_sec``: bound on every wait for a peer, in seconds of the GPU's global timer (FlashInfer counts
      nominal seconds at 2 GHz). On expiry the kernel records the peer and returns, and
      :func:`flashinfer_a2a.check_error` raises naming it; nothing traps.
    - ``enable_pdl``: our kernels always launch with programmatic dependent launch on sm_90+ (each waits in-kernel
      for its predecessor, none releases its successor early), which is what FlashInfer's default picks there;
      ``False`` is accepted and changes nothing observable (stream order holds either way).
    """

    backend_name: str = "nvlink_one_sided"
    extra_payload_bytes_per_token: int = 0
    eplb_stats_num_experts: int = 0
    enable_rank_mask: bool = False
    use_low_precision_combine: bool = False
    comm_backend: Any = None
    cft: Optional[bool] = None
    cft_max_tokens_for_dispatch: int = 128
    cft_max_tokens_for_combine: int = 128
    lamport: Optional[bool] = None
    lamport_max_tokens: Optional[int] = None
    timeout_sec: int = 300
    enable_pdl: Optional[bool] = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: NVLinkOneSidedConfig, num_experts: int) -> None:
    """FlashInfer's construction checks of ``config``, before anything collective (every rank passes the same
    config, so every rank raises alike)."""
    if config.lamport is True and config.cft is True:
        raise ValueError("NVLinkOneSidedConfig: lamport=True and cft=True both claim every eligible step; set one "
                         "of them to None or False")
    if not _is_int(config.extra_payload_bytes_per_token) or config.extra_payload_bytes_per_token < 0:
        raise ValueError(f"NVLinkOneSidedConfig.extra_payload_bytes_per_token must be an int >= 0, got "
                         f"{config.extra_payload_bytes_per_token!r}")
    if not _is_int(config.eplb_stats_num_experts) or not 0 <= config.eplb_stats_num_experts <= num_experts:
        raise ValueError(f"NVLinkOneSidedConfig.eplb_stats_num_experts must be in [0, num_experts={num_experts}], "
                         f"got {config.eplb_stats_num_experts!r}")
    if not _is_int(config.timeout_sec):
        raise TypeError(f"NVLinkOneSidedConfig.timeout_sec must be an int (seconds), got {config.timeout_sec!r}")
    if not 1 <= config.timeout_sec <= MAX_TIMEOUT_SEC:
        raise ValueError(f"NVLinkOneSidedConfig.timeout_sec must be in [1, {MAX_TIMEOUT_SEC}], got "
                         f"{config.timeout_sec}")
    for name in ("cft_max_tokens_for_dispatch", "cft_max_tokens_for_combine"):
        if not _is_int(getattr(config, name)) or getattr(config, name) < 0:
            raise ValueError(f"NVLinkOneSidedConfig.{name} must be an int >= 0, got {getattr(config, name)!r}")
    if config.lamport_max_tokens is not None and (not _is_int(config.lamport_max_tokens)
                                                  or config.lamport_max_tokens < 1):
        raise ValueError(f"NVLinkOneSidedConfig.lamport_max_tokens must be a positive int or None, got "
                         f"{config.lamport_max_tokens!r}")
    for name in ("cft", "lamport", "enable_pdl"):
        if getattr(config, name) not in (None, True, False):
            raise ValueError(f"NVLinkOneSidedConfig.{name} must be None, True or False, got {getattr(config, name)!r}")
    for name, transport in (("lamport", "Lamport"), ("cft", "CFT counted-write")):
        if getattr(config, name) and name not in _WARNED:  # once a process: an engine builds a layer per MoE layer
            _WARNED.add(name)
            logger.warning("NVLinkOneSidedConfig.%s=True: flashinfer_a2a has no %s transport; every step takes the "
                           "one-sided path", name, transport)


_WARNED: set[str] = set()
