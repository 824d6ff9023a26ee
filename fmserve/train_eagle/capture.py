"""Hidden states for training data: teacher-forced prefills of whole sequences on the
engine's worker, several packed into one forward, capturing the head's inputs and targets.

Only training needs this, so it lives here and not in the worker: it borrows the worker's
pools while no request runs.
"""

from __future__ import annotations

import torch

from gpu.forward_batch import ForwardBatch, ForwardMode


@torch.inference_mode()
def capture_hidden_states(worker, seqs: list[list[int]], capture_layers: tuple[int, ...]
                          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A teacher-forced prefill of one or more sequences, packed (each attends only to itself):
    the final-normed hidden state of every position and the input residual of each layer in
    `capture_layers` ([n, H] each), rows concatenated in the order given.

    It borrows slots 1..len(seqs) and the first pages of the worker's pool, so call it only
    while the worker has no requests (between offline engine runs)."""
    worker.streams.synchronize()  # steps launched on other streams are done with the pool
    pool = worker.req_to_token
    lens = [len(s) for s in seqs]
    if not 0 < len(seqs) < pool.num_slots:
        raise ValueError(f"capture takes 1..{pool.num_slots - 1} sequences at once, "
                         f"got {len(seqs)}")
    if not all(0 < n <= worker.max_context_len for n in lens):
        raise ValueError(f"capture needs 1..{worker.max_context_len} tokens per sequence, "
                         f"got lengths {min(lens)}..{max(lens)}")
    pages = [-(-n // worker.page_size) for n in lens]
    if sum(pages) >= worker.kv_pool.num_pages:
        raise ValueError(f"{sum(lens)} tokens do not fit the KV pool of "
                         f"{worker.kv_pool.num_pages - 1} pages")
    dev = worker.device
    first = 1  # page 0 is the pool's padding page
    for slot, k in enumerate(pages, 1):
        pool.grant_pages(slot, 0, torch.arange(first, first + k, device=dev))
        first += k
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    slots = torch.arange(1, len(seqs) + 1, dtype=torch.long, device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.long, device=dev)
    out_loc = torch.cat([pool.req_to_token[slot, :n] for slot, n in enumerate(lens, 1)]).long()
    batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=positions,
                         slots=slots, seq_lens=seq_lens, prefix_lens=torch.zeros_like(seq_lens),
                         extend_lens=seq_lens, out_cache_loc=out_loc)
    batch.seq_lens_cpu, batch.seq_lens_sum = torch.tensor(lens), sum(lens)
    batch.prefix_lens_cpu = torch.zeros(len(lens), dtype=torch.long)
    batch.extend_lens_cpu = batch.seq_lens_cpu
    batch.max_seq_len = batch.max_extend_len = max(lens)
    worker.attn.init_forward_metadata(batch)
    return worker.model.hidden_states(batch, worker.attn, capture_layers)


def _captured_rows(worker, final: torch.Tensor, captured: list[torch.Tensor],
                   logits_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    aux = torch.cat(captured, dim=-1)
    # The full-vocabulary logits of a long packed batch are large: argmax them in pieces.
    argmax = torch.cat([worker.model.logits(final[i:i + logits_rows]).argmax(-1)
                        for i in range(0, final.shape[0], logits_rows)]).to(torch.int32)
    aux16, final16 = aux.to("cpu", torch.float16), final.to("cpu", torch.float16)
    if not (torch.isfinite(aux16).all() and torch.isfinite(final16).all()):
        raise ValueError("captured hidden states overflow fp16; this model needs bf16 shards")
    return aux16, final16, argmax.cpu()


@torch.inference_mode()
def capture_sequences(worker, seqs: list[list[int]], capture_layers: tuple[int, ...],
                      max_batch_tokens: int = 32768) -> dict[str, torch.Tensor]:
    """The shard rows (ids, aux and final hidden states, target argmax, offsets) of ``seqs``,
    captured in packed prefills of up to ``max_batch_tokens`` tokens (a longer sequence alone)."""
    max_seqs = worker.req_to_token.num_slots - 1
    page = worker.page_size
    free_pages = worker.kv_pool.num_pages - 1  # page 0 is the pool's padding page
    ids, aux, final, argmax, offsets = [], [], [], [], [0]
    group: list[list[int]] = []

    def flush() -> None:
        f, captured = capture_hidden_states(worker, group, tuple(capture_layers))
        a, fi, m = _captured_rows(worker, f, captured)
        aux.append(a)
        final.append(fi)
        argmax.append(m)
        group.clear()

    group_tokens = group_pages = 0
    for seq in seqs:
        pages = -(-len(seq) // page)
        if group and (group_tokens + len(seq) > max_batch_tokens or len(group) >= max_seqs
                      or group_pages + pages > free_pages):
            flush()
            group_tokens = group_pages = 0
        group.append(seq)
        group_tokens += len(seq)
        group_pages += pages
        ids.append(torch.tensor(seq, dtype=torch.int32))
        offsets.append(offsets[-1] + len(seq))
    if group:
        flush()
    return {"input_ids": torch.cat(ids), "aux_hidden": torch.cat(aux),
            "final_hidden": torch.cat(final), "target_argmax": torch.cat(argmax),
            "offsets": torch.tensor(offsets, dtype=torch.int64)}


def capture_tokens_for(device) -> int:
    """Tokens per packed capture prefill: a GPU takes many sequences at once; on a CPU a pack
    of a few thousand tokens keeps the (full-vocabulary) argmax pieces and memory small."""
    return 32768 if device is not None and device.type != "cpu" else 4096
