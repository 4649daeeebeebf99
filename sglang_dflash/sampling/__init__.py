"""Sampling parameters and the batched sampling math (penalties, temperature, top-k/p, min-p)."""
