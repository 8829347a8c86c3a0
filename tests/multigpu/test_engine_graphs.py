"""The engines' CUDA-graph flows (tests/multigpu/engine_graphs.py): build every layer, warm up eagerly on the default
stream, capture one graph per batch size on torch.cuda.graph's stream or the engine's own, a draft model's graph
replayed between the target's, NVFP4 and bf16 layers in one graph; through MoeAlltoAll and through the
FlashInfer-compatible layer with SGLang's and vLLM's adapters; and many workspaces made, captured, replayed and
destroyed one after another in each process. Two processes on one GPU, and one process per GPU
where there are two or more; skipped without a GPU."""

import pytest
import torch

from .test_multigpu import NUM_GPUS, _launch_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
APIS = ["native", "sglang", "vllm", "many_workspaces"]


def _check(out, nproc):
    for api in APIS:
        for rank in range(nproc):
            assert f"CHECK engine_graphs {api} rank {rank} ok" in out, out[-6000:]


def test_engine_graph_flows_two_processes_on_one_gpu():
    _check(_launch_module("tests.multigpu.engine_graphs", 2, APIS, extra_env={"FLASHINFER_A2A_TEST_SHARED_GPU": "1"}),
           2)


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("nproc", sorted({2, NUM_GPUS} - {0, 1}))
def test_engine_graph_flows_one_process_per_gpu(nproc):
    _check(_launch_module("tests.multigpu.engine_graphs", nproc, APIS), nproc)
