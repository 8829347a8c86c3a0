"""Rank bodies for tests/test_compat_flashinfer.py (FlashInfer-style communicators and checkpoints over gloo ranks)
and tests/gpu/test_compat_engines.py (checkpoint and restore of symmetric memory between processes on one GPU),
spawned."""

from __future__ import annotations

from pathlib import Path

from .comm_workers import expect_raises, spawn_checks


class VllmLikeBackend:
    """Shaped as vLLM's CommBackend over a CPU group in the versions whose bcast and barrier raise."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group

    def Get_rank(self):
        return self.dist.get_rank(self.group)

    def Get_size(self):
        return self.dist.get_world_size(self.group)

    def allgather(self, data):
        out = [None] * self.Get_size()
        self.dist.all_gather_object(out, data, group=self.group)
        return out

    def bcast(self, data, root):
        raise NotImplementedError("bcast")

    def barrier(self):
        raise NotImplementedError("barrier")

    def Split(self, color, key):
        return self


class NoBarrierBackend(VllmLikeBackend):
    """Shaped as the versions that have neither bcast nor barrier."""

    bcast = None
    barrier = None


def check_adapter(rank: int, world_size: int, tmp: Path) -> None:
    from flashinfer_a2a.compat.comm_backend import CommBackendCommunicator

    for backend in (VllmLikeBackend(), NoBarrierBackend()):
        comm = CommBackendCommunicator(backend)
        assert (comm.rank, comm.size) == (rank, world_size)
        assert comm.allgather(b"x%d" % rank * (rank + 1)) == [b"x%d" % r * (r + 1) for r in range(world_size)]
        root = world_size - 1
        assert comm.broadcast(b"from-root" if rank == root else None, root=root) == b"from-root"
        # barrier: no rank leaves before every rank has entered (each leaves a file before entering)
        mark = tmp / f"{type(backend).__name__}-{rank}"
        mark.write_text("in")
        comm.barrier()
        assert all((tmp / f"{type(backend).__name__}-{r}").exists() for r in range(world_size))
        comm.barrier()  # nobody deletes while a peer still looks
        mark.unlink()


def check_split(rank: int, world_size: int, tmp: Path) -> None:
    from flashinfer_a2a.compat.comm_backend import CommBackendCommunicator, TorchDistBackend

    sub = TorchDistBackend().Split(rank % 2, rank)
    members = [r for r in range(world_size) if r % 2 == rank % 2]
    assert sub.Get_size() == len(members) and sub.Get_rank() == members.index(rank)
    assert list(sub.allgather(rank)) == members
    assert sub.bcast(rank * 10 if sub.Get_rank() == 1 else None, 1) == members[1] * 10
    sub.barrier()
    comm = CommBackendCommunicator(sub)
    assert comm.allgather(b"%d" % rank) == [b"%d" % r for r in members]


class _CpuAllocation:
    """A workspace in this process's CPU memory (the ``allocate_workspace`` interface of
    :mod:`flashinfer_a2a.memory.shared_workspace`): this rank's row is its own, as with symmetric memory."""

    one_gpu_per_rank = False

    def __init__(self, ep_size: int, bytes_per_rank: int) -> None:
        from flashinfer_a2a import functional as F

        self.tensor = F.empty_workspace(ep_size, bytes_per_rank, "cpu")
        self.bytes_per_rank = bytes_per_rank

    def destroy(self) -> None:
        self.tensor = None


class CheckpointedBackend(VllmLikeBackend):
    """vLLM's backend shape with a CPU workspace; ``closed`` stands for a communicator that did not survive the
    process checkpoint: any collective on it raises."""

    def __init__(self, group=None):
        super().__init__(group)
        self.closed = False

    def allgather(self, data):
        if self.closed:
            raise RuntimeError("this communicator was used after the checkpoint")
        return super().allgather(data)

    def allocate_workspace(self, bytes_per_rank, device=None):
        return _CpuAllocation(self.Get_size(), bytes_per_rank)


class OtherRankBackend(VllmLikeBackend):
    """A communicator of the right size whose ranks are numbered differently."""

    def Get_rank(self):
        return (super().Get_rank() + 1) % self.Get_size()


def check_checkpoint(rank: int, world_size: int, tmp: Path) -> None:
    """checkpoint_prepare/checkpoint_restore between processes: refused on every rank while one has a dispatch
    pending; calls between them raise; the restore takes a new communicator (the old one is never used again, not
    even by destroy) and leaves the workspace as a fresh one."""
    import torch
    import torch.distributed as dist

    from flashinfer_a2a import functional as F
    from flashinfer_a2a.memory import shared_workspace
    from flashinfer_a2a.compat import checkpoint
    from flashinfer_a2a.compat import flashinfer as fi

    old = CheckpointedBackend()
    mapping = fi.Mapping(world_size, rank, 8, tp_size=world_size, moe_ep_size=world_size)
    config = fi.MnnvlConfig(comm_backend=old)
    layers = [fi.MoeAlltoAll(mapping, 16, 4, 8, hidden_size=256, mnnvl_config=config) for _ in range(2)]
    shared = layers[0]._a2a._transport.shared
    assert layers[1]._a2a._transport.shared is shared
    address, metadata_end = shared.tensor.data_ptr(), int(shared.metainfo[F.get_metainfo_index_pairs()
                                                                           ["routing_offset"]])
    fresh = F.empty_workspace(world_size, shared.config.bytes_per_rank, "cpu")
    F.initialize(fresh, rank, shared.config)
    shared.tensor[rank, :metadata_end].fill_(7)  # stands for the epochs and signals of steps run before

    if rank == 0:  # what a dispatch leaves (a GPU launch) on this rank only
        shared.pending = (4, 16, torch.zeros(world_size, dtype=torch.int32))
        shared.order.advance("dispatch")
    expect_raises(RuntimeError, "rank 0 has a dispatched step pending", layers[1].checkpoint_prepare)
    assert not checkpoint.is_detached(shared) and bool((shared.tensor[rank, :metadata_end] == 7).all())
    if rank == 0:
        shared.pending = None
        shared.order.reset()

    layers[1].checkpoint_prepare()
    layers[0].checkpoint_prepare()  # the workspace is released already: no collective
    assert bool((shared.tensor[rank] == checkpoint.POISON_BYTE).all())
    old.closed = True  # the process was checkpointed and restored: its old communicator is gone
    ids = torch.zeros(4, 4, dtype=torch.int32)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    expect_raises(RuntimeError, "released by checkpoint_prepare", layers[0].dispatch, ids, [x, ids], 16)
    expect_raises(RuntimeError, "released by checkpoint_prepare", layers[1].combine,
                  torch.zeros(world_size, 16, 256, dtype=torch.bfloat16), 16)
    expect_raises(RuntimeError, "released by checkpoint_prepare", fi.MoeAlltoAll, mapping, 16, 4, 8,
                  hidden_size=256, mnnvl_config=config)
    expect_raises(RuntimeError, f"is rank {(rank + 1) % world_size} of {world_size}", layers[0].checkpoint_restore,
                  OtherRankBackend())

    new = CheckpointedBackend(dist.new_group(list(range(world_size))))
    layers[0].checkpoint_restore(new)
    layers[1].checkpoint_restore(old)  # restored already: a no-op, the closed communicator is not touched
    assert not checkpoint.is_detached(shared)
    assert shared.tensor.data_ptr() == address
    assert torch.equal(shared.tensor[rank, :metadata_end], fresh[rank, :metadata_end])
    assert shared.comm.backend is new and all(layer._a2a.comm.backend is new for layer in layers)
    for layer in layers:
        layer.destroy()  # its barrier runs over the new communicator
    assert shared_workspace.live_workspaces() == []


def check_checkpoint_vmm(rank: int, world_size: int, tmp: Path) -> None:
    """The virtual-memory steps of checkpoint and restore, with the CUDA driver calls recorded instead of made (no
    GPU here): release unmaps every rank's range and releases every handle, keeping the address range; remap
    allocates, exchanges descriptors with the peers (real ones, over Unix sockets) and maps each rank's handle at
    its old address; a rank that cannot allocate makes the exchange fail on every rank, not hang it."""
    import os

    from flashinfer_a2a.memory import cuda_driver as drv
    from flashinfer_a2a.compat import checkpoint
    from flashinfer_a2a.compat.comm_backend import CommBackendCommunicator, TorchDistBackend
    from flashinfer_a2a.memory.symm_mem import SymmetricWorkspace, _Mapping

    calls, created = [], []

    def mem_create(size, device, handle_type):
        created.append(100 * (rank + 1) + len(created))
        return created[-1]

    imported = {}

    def import_fd(fd):  # a handle naming the peer: what it exported travels as the descriptor's target
        handle = 1000 + int(os.readlink(f"/proc/self/fd/{fd}").rsplit("-", 1)[1])
        imported[handle] = fd
        return handle

    drv.mem_create = mem_create
    drv.export_fd = lambda handle: os.open(tmp / f"export-{rank}-{handle}", os.O_CREAT | os.O_RDONLY)
    drv.import_fd = import_fd
    drv.map_and_enable = lambda ptr, size, handle, device: calls.append(("map", ptr, handle))
    drv.unmap = lambda ptr, size: calls.append(("unmap", ptr))
    drv.release = lambda handle: calls.append(("release", handle))

    size, base = 1 << 21, 1 << 40
    workspace = object.__new__(SymmetricWorkspace)
    workspace.bytes_per_rank, workspace.device, workspace.handle_type = size, 0, drv.HANDLE_TYPE_POSIX_FD
    workspace._timeout_s = 20.0
    m = workspace._mapping = _Mapping(0, size, world_size)
    m.base, m.own = base, 7
    m.handles = [7 if r == rank else 70 + r for r in range(world_size)]
    m.mapped = list(range(world_size))
    comm = CommBackendCommunicator(TorchDistBackend())

    checkpoint._unmap(workspace)
    assert calls == [("unmap", base + r * size) for r in range(world_size)] + \
        [("release", 70 + r) for r in range(world_size) if r != rank] + [("release", 7)]
    assert (m.mapped, m.handles, m.own, m.base) == ([], [], 0, base)

    calls.clear()
    checkpoint._map(workspace, comm)
    own = created[-1]
    peers = {r: h for r, h in enumerate(m.handles) if r != rank}
    assert m.own == own and m.handles[rank] == own and m.mapped == list(range(world_size))
    assert calls == [("map", base + r * size, m.handles[r]) for r in range(world_size)]
    for r, handle in peers.items():  # each peer's handle came from the descriptor it exported
        assert handle == 1000 + 100 * (r + 1) + (len(created) - 1), (r, handle)

    checkpoint._unmap(workspace)

    def cannot_allocate(size, device, handle_type):
        raise drv.CudaDriverError("cuMemCreate", 2, "out of memory")

    if rank == 1:
        drv.mem_create = cannot_allocate
    calls.clear()
    try:
        checkpoint._map(workspace, comm)
    except drv.CudaDriverError as exc:
        assert rank == 1 and "out of memory" in str(exc)
    except RuntimeError as exc:
        assert rank != 1 and "ranks [1] could not take part" in str(exc), exc
    else:
        raise AssertionError("the exchange went on without rank 1")
    assert calls == [] and m.mapped == []
    checkpoint._unmap(workspace)
    assert m.own == 0 and m.handles == []


class _Steps:
    """Dispatch and combine through one FlashInfer-style layer, every rank drawing every rank's inputs from one
    seed, checked bit for bit against the reference on this rank: the received rows, and the combine of fresh
    partials written into the zero-copy payload. ``capture`` records one step in a CUDA graph whose inputs
    :meth:`replay` refills."""

    HIDDEN, TOP_K, MAX_TOKENS = 1024, 4, 64

    def __init__(self, rank: int, world_size: int, experts: int) -> None:
        self.rank, self.world_size, self.experts = rank, world_size, experts
        self.graph = None

    def inputs(self, seed: int, tokens: list[int], runtime_max: int):
        import torch

        from flashinfer_a2a import reference as ref

        gen = torch.Generator().manual_seed(seed)
        ids = [ref.random_topk_ids(n, self.TOP_K, self.experts, generator=gen, minus_one_frac=0.1) for n in tokens]
        xs = [ref.random_payload(n, (self.HIDDEN,), torch.bfloat16, generator=gen) for n in tokens]
        ws = [torch.rand(n, self.TOP_K, generator=gen) for n in tokens]
        partials = [torch.randn(self.world_size, runtime_max, self.HIDDEN, generator=gen).to(torch.bfloat16)
                    for _ in tokens]
        return ids, xs, ws, partials

    def check(self, recv, out, ids, xs, ws, partials, runtime_max) -> None:
        import torch

        from flashinfer_a2a import reference as ref

        torch.cuda.synchronize()
        want = ref.reference_dispatch(ids, [list(p) for p in zip(xs, ids, ws)], self.experts, runtime_max)
        valid = ref.valid_row_mask(want.recv_counts[self.rank], runtime_max)
        for p, view in enumerate(recv):
            got, expected = view.cpu()[valid], want.recv_payloads[self.rank][p][valid]
            assert ref.bitwise_equal(got, expected), f"rank {self.rank}: received payload {p} differs"
        expected = ref.reference_combine(partials, want)[self.rank]
        assert ref.bitwise_equal(out.cpu(), expected), f"rank {self.rank}: combine differs from the reference"

    def _step(self, layer, ids, x, w, partial, runtime_max, output=None):
        import torch

        recv = layer.dispatch(ids, [x, ids, w], runtime_max)
        payload = layer.get_combine_payload_tensor_in_workspace(runtime_max, self.HIDDEN, torch.bfloat16)
        payload.copy_(partial)
        return recv, layer.combine(payload, runtime_max, payload_in_workspace=True, output=output)

    def eager(self, layer, seed: int, tokens: list[int]) -> None:
        runtime_max = max(tokens)
        ids, xs, ws, partials = self.inputs(seed, tokens, runtime_max)
        r = self.rank
        recv, out = self._step(layer, ids[r].cuda(), xs[r].cuda(), ws[r].cuda(), partials[r].cuda(), runtime_max)
        self.check(recv, out, ids, xs, ws, partials, runtime_max)

    def capture(self, layer, tokens: list[int]) -> None:
        import torch

        self.layer, self.tokens, runtime_max = layer, tokens, max(tokens)
        ids, xs, ws, partials = self.inputs(0, tokens, runtime_max)
        r = self.rank
        self.static = [ids[r].cuda(), xs[r].cuda(), ws[r].cuda(), partials[r].cuda()]
        self.out = torch.empty(tokens[r], self.HIDDEN, dtype=torch.bfloat16, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.recv, _ = self._step(layer, *self.static, runtime_max, output=self.out)

    def replay(self, seed: int) -> None:
        runtime_max = max(self.tokens)
        ids, xs, ws, partials = self.inputs(seed, self.tokens, runtime_max)
        r = self.rank
        for static, new in zip(self.static, (ids[r], xs[r], ws[r], partials[r])):
            static.copy_(new)
        self.out.fill_(float("nan"))
        self.graph.replay()
        self.check(self.recv, self.out, ids, xs, ws, partials, runtime_max)


def check_checkpoint_gpu(rank: int, world_size: int, tmp: Path) -> None:
    """Symmetric memory between processes on GPU 0 through checkpoint_prepare/checkpoint_restore, twice: the
    memory is released (the GPU's free memory grows), calls between raise, the restore maps new memory at the same
    addresses over a new communicator, and eager steps and a CUDA graph captured before the checkpoint then give
    the reference's rows and sums bit for bit."""
    import torch
    import torch.distributed as dist

    import flashinfer_a2a as fa
    from flashinfer_a2a.compat import checkpoint
    from flashinfer_a2a.compat import flashinfer as fi

    assert world_size == 2
    torch.cuda.set_device(0)  # every rank on GPU 0, each in its own process: symmetric memory across processes
    experts = 8 * world_size
    mapping = fi.Mapping(world_size, rank, 8, tp_size=world_size, moe_ep_size=world_size)
    config = fi.MnnvlConfig(comm_backend=fi.TorchDistBackend())
    layers = [fi.MoeAlltoAll(mapping, _Steps.MAX_TOKENS, _Steps.TOP_K, experts, hidden_size=_Steps.HIDDEN,
                             mnnvl_config=config) for _ in range(2)]
    shared = layers[0]._a2a._transport.shared
    assert layers[1]._a2a._transport.shared is shared and type(shared.allocation).__name__ == "SymmetricWorkspace"
    address = layers[0].workspace.data_ptr()
    seed = [torch.seed() % (1 << 31) if rank == 0 else None]
    dist.broadcast_object_list(seed, src=0)
    steps, seed = _Steps(rank, world_size, experts), seed[0]
    steps.eager(layers[0], seed, [64, 0])  # every kernel loaded before the capture
    steps.eager(layers[1], seed + 1, [5, 33])
    steps.capture(layers[1], [24, 9])
    steps.replay(seed + 2)

    for round_ in range(2):
        base = seed + 10 * (round_ + 1)
        dist.barrier()
        free_before = torch.cuda.mem_get_info()[0]
        layers[round_].checkpoint_prepare()
        layers[1 - round_].checkpoint_prepare()  # released already: a no-op
        assert checkpoint.is_detached(shared) and shared.allocation._mapping.mapped == []
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert freed >= shared.allocation.bytes_per_rank, f"rank {rank}: {freed} bytes freed"
        ids = torch.zeros(3, _Steps.TOP_K, dtype=torch.int32, device="cuda")
        x = torch.zeros(3, _Steps.HIDDEN, dtype=torch.bfloat16, device="cuda")
        expect_raises(RuntimeError, "released by checkpoint_prepare", layers[0].dispatch, ids, [x, ids], 8)
        # the process is checkpointed and restored here; then a new communicator over the same ranks
        backend = fi.TorchDistBackend(dist.new_group(list(range(world_size))))
        layers[1 - round_].checkpoint_restore(backend)
        assert not checkpoint.is_detached(shared) and shared.comm.backend is backend
        assert all(layer.workspace.data_ptr() == address for layer in layers)
        steps.replay(base)  # the graph captured before the checkpoint
        steps.eager(layers[0], base + 1, [3, 64])
        steps.replay(base + 2)
        fa.check_error(layers[0].workspace, rank)
    for layer in layers:
        layer.destroy()


CHECKS = {"adapter": check_adapter, "split": check_split, "checkpoint": check_checkpoint,
          "checkpoint_vmm": check_checkpoint_vmm, "checkpoint_gpu": check_checkpoint_gpu}


def spawn(check: str, world_size: int, tmp_path: Path, timeout_s: float = 120.0) -> None:
    """Runs ``CHECKS[check](rank, world_size, tmp_path)`` on ``world_size`` gloo ranks; re-raises a rank's error."""
    spawn_checks(__name__, check, world_size, tmp_path, timeout_s=timeout_s)
