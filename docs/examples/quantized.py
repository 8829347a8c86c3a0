"""Quantized wire formats end to end, launched by torchrun (two processes may share one GPU):

    torchrun --nproc-per-node 2 docs/examples/quantized.py

A fused NVFP4 dispatch (swizzled scales), the same tokens dispatched pre-quantized (linear scales), identity experts
on the dequantized activations, and an FP8-wire combine. Every result is checked bit for bit against the torch
reference quantizers of flashinfer_a2a.reference.quant.
"""

import os

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import token_rank_mask
from flashinfer_a2a.reference.quant import dequantize_nvfp4, fp8_wire, quantize_nvfp4, unswizzle_scales_128x4

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("gloo")
group, rank, ep_size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
num_tokens = 300 + 17 * rank
hidden_bf16 = torch.randn(num_tokens, 7168, device="cuda").to(torch.bfloat16)
weights, ids = torch.randn(num_tokens, 256, device="cuda").softmax(-1).topk(8)
gs = torch.full((1,), 448 * 6 / 10.0, device="cuda")  # calibrated 448 * 6 / amax, the same on every rank

# begin fused-dispatch
a2a = MoeAlltoAll(group, max_num_tokens=8192, top_k=8, num_experts=256, hidden_size=7168,
                  dispatch_format="nvfp4", swizzled_scales=True)       # sizes the rows for the format
(values, scales, recv_ids, recv_w), counts = a2a.dispatch(
    ids, [hidden_bf16, ids, weights], quant_format="nvfp4", global_scale=gs, swizzled_scales=True)
# end fused-dispatch
# The views share one workspace with every MoeAlltoAll of the group: copy them before the next dispatch, and close
# the step with a combine (one dispatch may be pending per workspace); this step's experts return zeros.
values, scales, fused_counts, fused = values.clone(), scales.clone(), counts.cpu(), a2a
a2a.combine_input().zero_()
assert not a2a.combine().any()

packed, scales_linear = quantize_nvfp4(hidden_bf16, gs)  # the reference, [num_tokens, 3584] and [num_tokens, 448]
# begin prequantized-dispatch
a2a = MoeAlltoAll(group, max_num_tokens=8192, top_k=8, num_experts=256, hidden_size=7168,
                  dtype=torch.bfloat16, dispatch_format="nvfp4")
(recv_values, recv_scales, recv_ids, recv_w), counts = a2a.dispatch(ids, [packed, scales_linear, ids, weights])
# end prequantized-dispatch

# The fused kernel's bytes are the reference quantizer's, carried byte for byte by the plain dispatch.
assert torch.equal(fused_counts, counts.cpu()), "both dispatches route alike"
for src, c in enumerate(fused_counts.tolist()):
    assert torch.equal(values[src, :c], recv_values[src, :c]), f"NVFP4 values from rank {src} differ"
    unswizzled = unswizzle_scales_128x4(scales[src].cpu(), values.shape[1], 448)[:c]
    assert torch.equal(unswizzled.view(torch.uint8), recv_scales[src, :c].cpu().view(torch.uint8)), src

partials = dequantize_nvfp4(recv_values, recv_scales, gs, 7168).to(torch.bfloat16)  # identity experts
# begin fp8-combine
out = a2a.combine(partials, quant_format="fp8_block")   # or a2a.combine(quant_format="fp8_block") after combine_input()
# end fp8-combine

# Every rank a token went to returned its dequantized activation: the partials of other ranks cross as FP8
# (reference fp8_wire), this rank's stay exact, summed in fp32 in increasing rank order, rounded once to bf16.
mine = dequantize_nvfp4(packed, scales_linear, gs, 7168).to(torch.bfloat16)
went, acc = token_rank_mask(ids, 256, ep_size), torch.zeros(num_tokens, 7168, device="cuda")
for d in range(ep_size):
    acc = torch.where(went[:, d:d + 1], acc + (mine.float() if d == rank else fp8_wire(mine)), acc)
assert torch.equal(out, acc.to(torch.bfloat16)), "FP8-wire combine differs from the reference"
print(f"rank {rank}: nvfp4 dispatch and fp8_block combine bitwise ok, received {counts.tolist()}", flush=True)
a2a.destroy()
fused.destroy()
dist.destroy_process_group()
