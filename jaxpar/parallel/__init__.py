"""Parallel algorithms that need more than sharding annotations: SUMMA matmuls on the
2D tensor grid (``summa``), sequence-parallel attention (``sequence``: ring, RSA,
Ulysses) and its causal load-balanced token layout (``zigzag``), and pipeline
schedules (``pipeline_schedule``) with the SPMD program that runs them (``pipeline``)."""
