"""The collective choice of the shareable-handle type (pure logic; the mapping itself runs in tests/multigpu)."""

import pytest

from flashinfer_a2a.memory import cuda_driver as drv
from flashinfer_a2a.memory.symm_mem import choose_handle_type


def _caps(host, vmm=True, fd=True, fabric=False):
    return {"host": host, "vmm": vmm, "fd": fd, "fabric": fabric}


def test_one_host_uses_file_descriptors():
    assert choose_handle_type([_caps("a"), _caps("a", fabric=True)]) == drv.HANDLE_TYPE_POSIX_FD


def test_several_hosts_use_fabric_handles():
    assert choose_handle_type([_caps("a", fabric=True), _caps("b", fabric=True)]) == drv.HANDLE_TYPE_FABRIC


def test_one_host_without_fd_support_falls_back_to_fabric():
    assert choose_handle_type([_caps("a", fd=False, fabric=True), _caps("a", fabric=True)]) == drv.HANDLE_TYPE_FABRIC


@pytest.mark.parametrize(
    "caps, message",
    [
        ([_caps("a", fabric=True), _caps("b")], "several hosts"),
        ([_caps("a", vmm=False), _caps("a")], r"ranks \[0\]"),
        ([_caps("a", fd=False), _caps("a", fd=False)], "without POSIX"),
    ],
)
def test_no_common_handle_type_is_an_error_on_every_rank(caps, message):
    with pytest.raises(RuntimeError, match=message) as info:
        choose_handle_type(caps)
    assert "NCCL" in str(info.value)
