"""Sequence parallelism for DiTs (Ulysses, ring, and USP = Ulysses x ring) on torch.distributed."""
