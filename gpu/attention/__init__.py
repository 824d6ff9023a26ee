"""Attention backends: paged attention over the KV pool (torch reference, Triton kernels);
`factory.make_attention_backend` picks one by name."""
