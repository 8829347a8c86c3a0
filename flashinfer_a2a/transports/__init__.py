"""How a :class:`flashinfer_a2a.MoeAlltoAll` moves its rows: one interface (:class:`.base.Transport`), the one-sided
NVLink transport (:mod:`.nvlink`) and the NCCL one (:mod:`.nccl`)."""
