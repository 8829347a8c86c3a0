"""The benchmark of dispatch and combine against NCCL: ``python -m flashinfer_a2a.bench --help``.

One GPU runs simulated ranks (each on its own stream); several GPUs run one rank per process under torchrun or
mpirun. See ``docs/benchmarks.md`` for the method and what every column counts.
"""
