"""Numbers the Python side shares with the C++ library, which owns them.

The library exports them (``get_constants``); :func:`library_constants` reads them on first use, so importing the
package compiles nothing. The few needed at import time (the limits re-exported as ``flashinfer_a2a.MAX_*``, and
the size checks the fake implementations run while tracing, before any library exists) are literals here, and
tests/test_validation.py pins each one to the library's value.
"""

from __future__ import annotations

import functools

MAX_EP_SIZE = 72  # kMaxRanks: one GB200 NVL72 NVLink domain
MAX_TOP_K = 32  # kMaxTopK
MAX_PAYLOADS = 8  # kMaxPayloads
MAX_EPLB_EXPERTS = 1024  # kMaxEplbExperts: EPLB statistics a dispatch carries per rank
MAX_NUM_TOKENS_LIMIT = 1 << 24  # max_num_tokens must stay below: slots take kRouteSlotBits of a routing entry
MAX_TIMEOUT_S = 1e6  # TimeoutNs in csrc/kernels.h
QUANT_FORMAT_CODES = range(4)  # QuantFormat: none, fp8_block, mxfp8, nvfp4
SPLIT_BOTH, SPLIT_SEND, SPLIT_RECV = 0, 1, 2  # CombinePhase / DispatchPhase: whole call, send half, receive half
COMBINE_PULL = 0  # CombineMode::kPull
COMBINE_PUSH = 1  # CombineMode::kPush
FP8_WIRE_HIDDEN_MULTIPLE = 8  # kQuantLaneElems: an FP8-wire combine quantizes 8 elements a lane
FP8_WIRE_MAX_HIDDEN = 256 * 128  # kFp8WireMaxCols scales of 128 elements: a row's scales wait in shared memory

#: (literal above, key in the library's table): every pair tests/test_validation.py checks.
PINNED = {
    "MAX_EP_SIZE": "max_ep_size",
    "MAX_TOP_K": "max_top_k",
    "MAX_PAYLOADS": "max_payloads",
    "MAX_EPLB_EXPERTS": "max_eplb_experts",
    "MAX_NUM_TOKENS_LIMIT": "max_num_tokens_limit",
    "SPLIT_BOTH": "split_both",
    "SPLIT_SEND": "split_send",
    "SPLIT_RECV": "split_recv",
    "COMBINE_PULL": "combine_pull",
    "COMBINE_PUSH": "combine_push",
    "FP8_WIRE_HIDDEN_MULTIPLE": "fp8_wire_hidden_multiple",
    "FP8_WIRE_MAX_HIDDEN": "fp8_wire_max_hidden",
}


@functools.cache
def library_constants() -> dict[str, int]:
    """Every constant the library exports (limits, error and phase codes, quant-format codes, the call-layout
    fingerprint fields as ``shift << 8 | bits``). Builds or loads the library on first call."""
    from ..jit import get_a2a_module

    return {str(name): int(value) for name, value in dict(get_a2a_module().get_constants()).items()}


def call_layout_fields() -> dict[str, tuple[int, int]]:
    """Field name -> (shift, bits) of the dispatch call-layout fingerprint (see errors.describe_call_layout)."""
    prefix = "call_layout:"
    return {name[len(prefix):]: (value >> 8, value & 0xFF)
            for name, value in library_constants().items() if name.startswith(prefix)}


def check_sizes(ep_size: int, max_num_tokens: int, top_k: int, dispatch_bytes_per_token: int,
                combine_bytes_per_token: int) -> None:
    """ValueError naming the first size outside what the library accepts (the same bounds as
    ``MakeWorkspaceConfig`` in csrc/workspace.h), checked on the host without the library."""
    if not 1 <= ep_size <= MAX_EP_SIZE:
        raise ValueError(f"ep_size must be in [1, {MAX_EP_SIZE}], got {ep_size}")
    if not 1 <= max_num_tokens < MAX_NUM_TOKENS_LIMIT:
        raise ValueError(f"max_num_tokens must be in [1, {MAX_NUM_TOKENS_LIMIT}), got {max_num_tokens}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [1, {MAX_TOP_K}], got {top_k}")
    if dispatch_bytes_per_token < 0:
        raise ValueError(f"dispatch_bytes_per_token must be >= 0, got {dispatch_bytes_per_token}")
    if combine_bytes_per_token < 0:
        raise ValueError(f"combine_bytes_per_token must be >= 0, got {combine_bytes_per_token}")
