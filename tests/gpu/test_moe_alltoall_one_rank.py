"""MoeAlltoAll on one GPU as a group of one rank: the eager path (bound calls, cached views) and the settings it reads
when built."""

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a import reference as ref

HIDDEN, TOP_K, EXPERTS = 256, 4, 8


class OneRank:
    rank, size = 0, 1

    def allgather(self, data):
        return [bytes(data)]

    def broadcast(self, data, root=0):
        return bytes(data)

    def barrier(self):
        pass


def _build(**kwargs):
    return MoeAlltoAll(OneRank(), max_num_tokens=64, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN, **kwargs)


def test_eager_rounds_with_cached_views():
    a2a = _build()
    gen = torch.Generator().manual_seed(torch.seed())
    try:
        for tokens, runtime_max in ((40, 64), (7, 9), (40, 64), (0, 9)):  # views built per shape, then reused
            ids = ref.random_topk_ids(tokens, TOP_K, EXPERTS, generator=gen).cuda()
            x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
            w = torch.rand(tokens, TOP_K, generator=gen).cuda()
            (recv_x, recv_ids, recv_w), counts = a2a.dispatch(ids, [x, ids, w], runtime_max)
            assert recv_x.shape == (1, runtime_max, HIDDEN) and recv_ids.shape == (1, runtime_max, TOP_K)
            partials = a2a.combine_input()
            partials.fill_(float("nan"))  # rows past the count must not be read
            partials[0, :tokens] = recv_x[0, :tokens] * 2
            out = a2a.combine()
            torch.cuda.synchronize()
            assert counts.tolist() == [tokens]
            assert torch.equal(recv_x[0, :tokens], x) and torch.equal(recv_ids[0, :tokens], ids)
            assert torch.equal(recv_w[0, :tokens], w)
            assert torch.equal(out, x * 2)  # one rank: each token's sum is its own partial
        fa.check_error(a2a.workspace, 0)
    finally:
        a2a.destroy()


def test_eager_views_follow_each_payload_shape():
    """Eager receive views are cached under the C++'s id of the payloads' row shapes: rows of equal bytes but another
    shape or dtype get views of their own, a repeated shape the same views (and the same combine input), and more
    shapes than the id table holds (64) start it over without a wrong view."""
    a2a = _build()
    gen = torch.Generator().manual_seed(torch.seed())
    tokens, runtime_max = 5, 8
    shapes = [((4,), torch.float32), ((2, 2), torch.float32), ((8,), torch.bfloat16), ((4,), torch.int32)]
    shapes += [((k,), torch.uint8) for k in range(1, 71)]
    try:
        for _ in range(2):
            for trailing, dtype in shapes:
                ids = ref.random_topk_ids(tokens, TOP_K, EXPERTS, generator=gen).cuda()
                extra = torch.randint(0, 100, (tokens, *trailing), generator=gen).to(dtype).cuda()
                views, inputs = [], []
                for _ in range(2):
                    (recv_ids, recv_extra), counts = a2a.dispatch(ids, [ids, extra], runtime_max)
                    views.append(recv_extra)
                    partials = a2a.combine_input()
                    inputs.append(partials)
                    partials.fill_(float("nan"))
                    partials[0, :tokens] = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
                    out = torch.full((tokens, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
                    assert a2a.combine(out=out) is out
                    torch.cuda.synchronize()
                    assert recv_extra.shape == (1, runtime_max, *trailing) and recv_extra.dtype == dtype
                    assert torch.equal(recv_extra[0, :tokens], extra) and torch.equal(recv_ids[0, :tokens], ids)
                    assert torch.equal(out, partials[0, :tokens])
                assert views[0] is views[1] and inputs[0] is inputs[1]  # the same shape again: the cached views
        with pytest.raises(ValueError, match=r"out must be \[num_tokens=5, hidden=256\], got \(4, 256\)"):
            a2a.dispatch(ids, [ids], runtime_max)
            a2a.combine(out=torch.empty(4, HIDDEN, dtype=torch.bfloat16, device="cuda"))
        a2a.combine()  # the refused combine left the dispatch pending
        fa.check_error(a2a.workspace, 0)
    finally:
        a2a.destroy()


def test_settings_are_read_when_built(monkeypatch):
    monkeypatch.setenv("FLASHINFER_A2A_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="FLASHINFER_A2A_TIMEOUT_S"):
        _build()
    monkeypatch.delenv("FLASHINFER_A2A_TIMEOUT_S")
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 9]], dtype=torch.int32, device="cuda")  # 9: not an expert
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16, device="cuda")

    monkeypatch.setenv("FLASHINFER_A2A_DEBUG", "1")
    checked = _build()
    monkeypatch.delenv("FLASHINFER_A2A_DEBUG")  # too late: checked was built in debug mode
    try:
        with pytest.raises(ValueError, match="expert id 9"):  # the host check, before any launch
            checked.dispatch(ids, [x])
    finally:
        checked.destroy()

    unchecked = _build()
    monkeypatch.setenv("FLASHINFER_A2A_DEBUG", "1")  # too late again: no host check, the kernel records the id
    try:
        unchecked.dispatch(ids, [x])
        unchecked.combine()
        with pytest.raises(ValueError, match="flat index 7"):
            fa.check_error(unchecked.workspace, 0)
    finally:
        unchecked.destroy()
