"""Relative L2 error of the FP8-wire combine against the bf16 combine, from the reference (CPU, no GPU needed).

    python docs/measurements/fp8_combine_error.py

Partials a rank computed for another rank cross the wire as FP8 E4M3 with an fp32 scale per 128 elements; a rank's
partials for its own tokens stay exact (flashinfer_a2a.reference.quant.reference_combine_fp8, which the kernel
matches bit for bit). Prints, per distribution and EP size, the error over every token and the worst token's.
"""

import torch

from flashinfer_a2a import reference as ref
from flashinfer_a2a.reference import quant

TOKENS, HIDDEN, EXPERTS, TOP_K = 256, 7168, 256, 8


def partials_of(kind: str, shape, gen):
    if kind == "gaussian":
        return torch.randn(*shape, generator=gen)
    dof = {"student-t3": 3.0, "student-t2": 2.0}[kind]
    normal = torch.randn(*shape, generator=gen)
    chi2 = torch.distributions.Chi2(torch.tensor(dof)).sample(shape)  # not seeded by gen: documented noise
    return normal / torch.sqrt(chi2 / dof)


def main() -> None:
    torch.manual_seed(0)
    print(f"{TOKENS} tokens/rank, hidden {HIDDEN}, top-{TOP_K} of {EXPERTS} experts, bf16 partials")
    print(f"{'partials':>12} {'ep':>3} {'rel. L2':>8} {'worst token':>12} {'bf16 vs fp32':>13}")
    for kind in ("gaussian", "student-t3", "student-t2"):
        for ep in (2, 8):
            gen = torch.Generator().manual_seed(ep)
            ids = [ref.random_topk_ids(TOKENS, TOP_K, EXPERTS, generator=gen) for _ in range(ep)]
            routing = ref.reference_dispatch(ids, [[torch.zeros(TOKENS, 1)] for _ in range(ep)], EXPERTS, TOKENS)
            parts = [partials_of(kind, (ep, TOKENS, HIDDEN), gen).to(torch.bfloat16) for _ in range(ep)]
            fp8 = torch.cat(quant.reference_combine_fp8(parts, routing)).float()
            bf16 = torch.cat(ref.reference_combine(parts, routing)).float()
            exact = torch.cat(ref.reference_combine(parts, routing, out_dtype=torch.float32))
            rel = float((fp8 - bf16).norm() / bf16.norm())
            worst = float(((fp8 - bf16).norm(dim=1) / bf16.norm(dim=1).clamp_min(1e-30)).max())
            base = float((bf16 - exact).norm() / exact.norm())
            print(f"{kind:>12} {ep:>3} {rel:8.2%} {worst:12.2%} {base:13.2%}")


if __name__ == "__main__":
    main()
