"""initialize on a real CUDA workspace: clears exactly this rank's metadata and returns the metainfo."""

import torch

import flashinfer_a2a as fa
from flashinfer_a2a.library import ops
from flashinfer_a2a.library.errors import metadata_offsets
from flashinfer_a2a.functional import empty_workspace


def test_initialize_clears_only_this_ranks_metadata():
    config = fa.WorkspaceConfig(ep_size=4, max_num_tokens=64, dispatch_bytes_per_token=7168 * 2,
                                combine_bytes_per_token=7168 * 2, top_k=8)
    ws = empty_workspace(4, config.bytes_per_rank, "cuda")
    ws.fill_(0xA5)
    metainfo = fa.initialize(ws, 2, config)
    torch.cuda.synchronize()
    meta_bytes = metadata_offsets()["metadata_bytes"]
    index = fa.get_metainfo_index_pairs()
    cleared = int(metainfo[index["routing_offset"]])  # the metadata and the push flags
    assert cleared > meta_bytes
    host = ws.cpu()
    assert torch.all(host[2, :cleared] == 0)
    assert torch.all(host[2, cleared:] == 0xA5)
    assert torch.all(host[[0, 1, 3]] == 0xA5)
    assert int(metainfo[index["bytes_per_rank"]]) == config.bytes_per_rank
    assert int(metainfo[index["metadata_bytes"]]) == meta_bytes
    cpu_ws = empty_workspace(4, config.bytes_per_rank, "cpu")
    assert torch.equal(fa.initialize(cpu_ws, 2, config), metainfo)


def test_initialize_opcheck():
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=256,
                                combine_bytes_per_token=256, top_k=4)
    ws = empty_workspace(2, config.bytes_per_rank, "cuda")
    metainfo = torch.empty(len(ops.METAINFO_NAMES), dtype=torch.int64)
    torch.library.opcheck(ops.initialize.overload, (ws, metainfo, 1, *config.sizes()))
