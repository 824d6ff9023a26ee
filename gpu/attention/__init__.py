"""Attention backends: paged attention over the KV pool (torch reference, Triton kernels)."""
