"""Block-sparse DiT attention: one layout (key-block lists per query block), one kernel family, four backends.

Each sparse backend (sliding tile, video sparse, VMoBA, Sparse-VideoGen 2) is the code that turns the step's
DiTAttnMetadata (and, for data-dependent ones, q/k) into a `BlockSparseLayout`, plus an optional token
permutation; the kernels and the masked reference only ever see the layout.
"""
