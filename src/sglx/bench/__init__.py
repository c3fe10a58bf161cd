"""Benchmarks behind `sglx bench`: serving load (serving.py); attention and one-batch join later."""
