"""Foreign API shapes translated onto flashinfer_a2a. The core never imports this package.

- :mod:`flashinfer_a2a.compat.flashinfer`: FlashInfer's ``MoeAlltoAll``, ``moe_a2a_get_workspace_size_per_rank``,
  ``Mapping``, ``MnnvlConfig`` and ``CommBackend``, for engines written against ``flashinfer.comm``.
"""
