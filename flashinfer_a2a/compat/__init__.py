"""Foreign API shapes translated onto flashinfer_a2a. The core never imports this package.

- :mod:`flashinfer_a2a.compat.flashinfer`: FlashInfer's ``MoeAlltoAll``, ``moe_a2a_get_workspace_size_per_rank``,
  ``Mapping``, ``MnnvlConfig`` and ``CommBackend``, for engines written against ``flashinfer.comm``.
- :mod:`flashinfer_a2a.compat.checkpoint`: how ``MoeAlltoAll.checkpoint_prepare`` / ``checkpoint_restore`` release
  a workspace's memory across a process checkpoint and map it again at the same addresses.
"""
