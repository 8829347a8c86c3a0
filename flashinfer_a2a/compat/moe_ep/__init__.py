"""FlashInfer 0.7.4's ``flashinfer.moe_ep`` one-sided surface over flashinfer_a2a: an engine written for it changes
its import lines::

    from flashinfer_a2a.compat.moe_ep import (BootstrapConfig, MoEEpCommParams, NVLinkOneSidedConfig, QuantFormat,
                                              create_communication)

Same names, signatures, defaults and return types: :class:`BootstrapConfig`, :class:`MoEEpCommParams` (with its
``dispatch_bytes_per_token`` per :class:`QuantFormat`), :func:`create_communication`, :func:`register_communication`,
:func:`available_communication_backends`, :class:`MoEEpDispatchResult`, :class:`MoEEpCommunication`,
:class:`NVLinkOneSidedConfig` and the ``nvlink_one_sided`` backend :class:`NVLinkOneSidedAlltoAll`, over the native
:class:`flashinfer_a2a.MoeAlltoAll` (its :attr:`~NVLinkOneSidedAlltoAll.native`). docs/integration.md maps every name
from FlashInfer 0.7.2 to 0.7.4 to ours and lists what differs; :mod:`flashinfer_a2a.compat.flashinfer` keeps the 0.7.2
``flashinfer.comm`` surface over the same native calls.
"""

from .communication import (
    MoEEpCommParams,
    MoEEpCommunication,
    MoEEpDispatchResult,
    available_communication_backends,
    communication_backend_name,
    create_communication,
    is_communication_backend,
    register_communication,
)
from .config import BootstrapConfig, NVLinkOneSidedConfig, QuantFormat
from .nvlink_one_sided import NVLinkOneSidedAlltoAll

__all__ = [
    "BootstrapConfig",
    "MoEEpCommParams",
    "MoEEpCommunication",
    "MoEEpDispatchResult",
    "NVLinkOneSidedAlltoAll",
    "NVLinkOneSidedConfig",
    "QuantFormat",
    "available_communication_backends",
    "communication_backend_name",
    "create_communication",
    "is_communication_backend",
    "register_communication",
]
