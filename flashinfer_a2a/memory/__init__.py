"""Memory every rank maps: symmetric workspaces over CUDA virtual memory (:mod:`.symm_mem`, with the file-descriptor
exchange of :mod:`.fd_exchange` and the driver calls of :mod:`.cuda_driver`), the workspaces shared by every layer of
a group with their call order and stream order (:mod:`.shared_workspace`, :mod:`.call_order`), teardown that
survives dead peers (:mod:`.lifecycle`), and buffers from NCCL's allocator for the nccl transport's peer exchange
(:mod:`.nccl_memory`).
"""
