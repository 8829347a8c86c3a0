"""MoeAlltoAll(transport="hierarchical") on 4 spawned gloo ranks (CPU): nodes of 2, 1 and 4, bitwise against
flashinfer_a2a.reference and the flat nccl transport; its argument errors; the node split and its sub-groups."""

import pytest

from flashinfer_a2a.transports.hierarchical import TRANSPORTS, check_transport_choice
from flashinfer_a2a.transports.node_groups import NodeSplit, check_node_size

from .examples import run_on_cpu_under_torchrun
from .nccl_workers import spawn_gloo

MODULE = "tests.hierarchical_workers"


def test_node_sizes_on_gloo(tmp_path):
    spawn_gloo(["node_sizes"], 4, tmp_path, timeout_s=600, module=MODULE)


def test_idle_steps_errors_layers_and_subgroups_on_gloo(tmp_path):
    spawn_gloo(["idle", "errors", "layers", "subgroups"], 4, tmp_path, module=MODULE)


def test_node_split():
    split = NodeSplit(ep_size=8, node_size=4, rank=6)
    assert (split.num_nodes, split.node, split.local) == (2, 1, 2)


@pytest.mark.parametrize("node_size, error, match", [
    (None, ValueError, "needs node_size"),
    (3, ValueError, "node_size must be a positive divisor of ep_size=8"),
    (0, ValueError, "node_size must be a positive divisor"),
    (-2, ValueError, "got node_size=-2"),
    (True, TypeError, "node_size must be an int, got bool"),
    (2.0, TypeError, "node_size must be an int, got float"),
])
def test_node_size_errors(node_size, error, match):
    with pytest.raises(error, match=match):
        check_node_size(node_size, 8)


def test_transport_choice():
    assert TRANSPORTS == ("auto", "nvlink", "nccl", "hierarchical")
    for node_size in (1, 2, 4, 8):
        check_transport_choice("hierarchical", False, node_size, 8)
    check_transport_choice("nccl", True, None, 8)
    with pytest.raises(ValueError, match="node_size is used by transport='hierarchical' only"):
        check_transport_choice("auto", False, 2, 8)
    with pytest.raises(ValueError, match="exact=True needs transport='nccl', got transport='hierarchical'"):
        check_transport_choice("hierarchical", True, 2, 8)
    with pytest.raises(ValueError, match="transport must be one of auto, nvlink, nccl, hierarchical, got 'ib'"):
        check_transport_choice("ib", False, None, 8)


def test_bench_transport_flag():
    from flashinfer_a2a.bench import args as bench_args

    args = bench_args.parse_args(["--transport", "hierarchical", "--node-size", "2"])
    assert (args.transport, args.node_size) == ("hierarchical", 2)
    assert bench_args.parse_args([]).node_size is None
    for argv in (["--transport", "hierarchical"], ["--node-size", "2"], ["--transport", "hierarchical",
                                                                        "--node-size", "0"]):
        with pytest.raises(SystemExit):
            bench_args.parse_args(argv)


def test_row_layout():
    """A routed row: the source node and one byte per rank in a 16-byte header, the payloads after it, the whole row a
    multiple of 16 bytes (the node stage copies it in 16-byte vectors)."""
    from flashinfer_a2a.transports.hierarchical import _RowLayout

    layout = _RowLayout(header=80, widths=(14336, 32, 3))
    assert layout.offsets == [80, 80 + 14336, 80 + 14368]
    assert layout.width == 80 + 14384 and layout.width % 16 == 0


def test_example_runs_on_cpu_under_torchrun():
    """docs/examples/hierarchical.py (shown in docs/multi_node.md) on 4 gloo ranks."""
    out = run_on_cpu_under_torchrun("hierarchical", 4, 27500)
    for rank in range(4):
        assert f"rank {rank}: MoeAlltoAll over the hierarchical transport ok" in out, out[-6000:]
