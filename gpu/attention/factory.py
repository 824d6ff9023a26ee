"""Picks an attention backend by name (config.toml runtime.attention_backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipc.worker_config import ATTENTION_BACKENDS

if TYPE_CHECKING:
    import torch

    from gpu.attention.base import AttentionBackend
    from gpu.kv_cache import KVPool, ReqToTokenPool


def resolve_attention_backend(name: str, device: "torch.device", deterministic: bool) -> str:
    """"auto" -> "triton" on CUDA (no host lengths: decode batches can replay CUDA graphs),
    "torch" on a CPU (Triton there runs only interpreted) or in deterministic mode."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and not deterministic else "torch"


def make_attention_backend(name: str, kv_pool: "KVPool", req_to_token: "ReqToTokenPool",
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           sliding_window: int | None = None,
                           deterministic: bool = False, scale: float | None = None,
                           window_layers: tuple[int, ...] | None = None) -> "AttentionBackend":
    """The backend `name` over `kv_pool`; imported here only when chosen (Triton is slow to
    import and absent on some machines). `deterministic` (runtime.deterministic, torch only):
    the batch-invariant torch backend. `scale`: of the scores (None: head_dim ** -0.5);
    `window_layers`: the layers `sliding_window` applies to (None: all)."""
    scale = head_dim ** -0.5 if scale is None else scale
    if deterministic and name == "torch":
        from gpu.attention.batch_invariant_backend import BatchInvariantAttentionBackend
        return BatchInvariantAttentionBackend(kv_pool, req_to_token, num_heads, num_kv_heads,
                                              head_dim, scale, sliding_window, window_layers)
    if name == "torch":
        from gpu.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim,
                                     scale, sliding_window, window_layers)
    if name == "triton":
        from gpu.attention import triton_decode
        from gpu.attention.triton_backend import TritonAttentionBackend
        # On a CPU Triton runs only in its interpreter, where every program of a grid costs
        # milliseconds: 2 chunks a sequence (the split and merge still run), not a GPU's 8.
        splits = (triton_decode.DEFAULT_NUM_KV_SPLITS if kv_pool.device.type != "cpu" else
                  triton_decode.INTERPRETED_NUM_KV_SPLITS)
        return TritonAttentionBackend(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim,
                                      scale, sliding_window, window_layers, splits)
    raise ValueError(f"attention backend '{name}' is unknown; choose one of {ATTENTION_BACKENDS}")
