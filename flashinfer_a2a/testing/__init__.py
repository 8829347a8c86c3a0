"""Several ranks on one GPU, for tests and the benchmark: :class:`.simulate.SimulatedRanks` drives the functional API,
:class:`.simulated_group.SimulatedGroup` builds :class:`flashinfer_a2a.MoeAlltoAll` objects as real ranks do."""
