"""A 100-token text run teacher-forced through a model in one forward (a fresh paged KV cache):
the logits or hidden states at every position. The quantized-weight and 4-bit tests compare
models on it."""

from __future__ import annotations

import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool, ReqToTokenPool
from gpu.llama import LlamaModel

TEXT = ("The history of the bicycle begins in the early nineteenth century, when inventors in "
        "Europe built wooden machines that riders pushed along with their feet. Pedals came "
        "later, attached to the front wheel, and the wheels grew larger to go faster. The safety "
        "bicycle, with two wheels of equal size and a chain driving the rear one, made riding "
        "easier and safer, and within a few years millions of people used bicycles to travel to "
        "work, to visit friends and to explore the countryside on weekends. Today bicycles "
        "are built from steel, aluminium and carbon fibre, and cities add lanes for them.")


def prompt_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, through a fresh paged KV cache."""
    with torch.inference_mode():
        return model.logits(prompt_hidden(model, ids))


def prompt_hidden(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Final-normed hidden states at every position of one prompt (one forward)."""
    cfg, page = model.config, 16
    n = len(ids)
    pool = KVPool(cfg.num_layers, -(-n // page) + 1, page, cfg.num_kv_heads, cfg.head_dim,
                  model.dtype, "cpu")
    table = ReqToTokenPool(2, cfg.max_context_len, page, "cpu")
    table.grant_pages(1, 0, torch.arange(1, pool.num_pages))
    attn = TorchAttentionBackend(pool, table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 cfg.attn_scale, cfg.sliding_window, cfg.window_layers)
    lens = torch.tensor([n])
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids), torch.arange(n),
                         torch.tensor([1]), lens, torch.tensor([0]), lens,
                         table.req_to_token[1, :n].long(), seq_lens_cpu=lens,
                         prefix_lens_cpu=torch.tensor([0]), extend_lens_cpu=lens,
                         seq_lens_sum=n, max_seq_len=n, max_extend_len=n)
    attn.init_forward_metadata(batch)
    with torch.inference_mode():
        return model.hidden_states(batch, attn)[0]
