"""flashinfer_a2a: one-sided NVLink all-to-all (dispatch and combine) for Mixture-of-Experts expert parallelism.

Importing compiles nothing: the CUDA library is built (or its AOT copy loaded) on first use.
"""

from ._version import __version__
from .library.errors import A2AError, check_error
from .functional import (
    MAX_EP_SIZE,
    MAX_EPLB_EXPERTS,
    MAX_PAYLOADS,
    MAX_TOP_K,
    WorkspaceConfig,
    combine,
    combine_input,
    dispatch,
    get_metainfo_index_pairs,
    get_workspace_size,
    initialize,
    sanitize_expert_ids,
)
from .moe_alltoall import MoeAlltoAll

__all__ = [
    "A2AError",
    "MAX_EP_SIZE",
    "MAX_EPLB_EXPERTS",
    "MAX_PAYLOADS",
    "MAX_TOP_K",
    "MoeAlltoAll",
    "WorkspaceConfig",
    "__version__",
    "check_error",
    "combine",
    "combine_input",
    "dispatch",
    "get_metainfo_index_pairs",
    "get_workspace_size",
    "initialize",
    "sanitize_expert_ids",
]
