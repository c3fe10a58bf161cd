"""sglx's own Triton kernels for paged attention.

Modules import triton at their top, so import them only where triton is wanted (the `triton` backend
loads them lazily). Set TRITON_INTERPRET=1 before the first import to run them on CPU (tests do).
"""
