"""Foreign API shapes translated onto flashinfer_a2a. The core never imports this package.

- :mod:`flashinfer_a2a.compat.flashinfer`: FlashInfer 0.7.2's ``MoeAlltoAll``, ``moe_a2a_get_workspace_size_per_rank``,
  ``moe_a2a_active_rank_mask``, ``Mapping``, ``MnnvlConfig`` and ``CommBackend``, for engines written against
  ``flashinfer.comm``.
- :mod:`flashinfer_a2a.compat.moe_ep`: FlashInfer 0.7.4's ``flashinfer.moe_ep`` one-sided surface
  (``create_communication``, ``BootstrapConfig``, ``MoEEpCommParams``, ``NVLinkOneSidedConfig``,
  ``NVLinkOneSidedAlltoAll``, ...), for engines written against it. Both sit on the same native calls.
- :mod:`flashinfer_a2a.compat.checkpoint`: how ``checkpoint_prepare`` / ``checkpoint_restore`` release a workspace's
  memory across a process checkpoint and map it again at the same addresses.
"""
