"""EAGLE speculative decoding: draft heads (EAGLE-3 and EAGLE-1) and their checkpoints."""
