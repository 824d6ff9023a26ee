"""Self-distilled training data for an EAGLE-3 head, in resumable fp16 shards.

1. Prompts come from a JSONL file (rows {"prompt": ...}), shuffled by a seed, rendered with the
   chat template; prompts longer than ``max_prompt_tokens`` are skipped (cutting a chat prompt
   would cut its template).
2. The target answers them with fmserve's own offline Engine, batched: greedy for most, seeded
   sampling (temperature 0.7-1.0) for a ``sampled_fraction`` of them, so the head also sees
   text off the greedy path.
3. Teacher-forced prefills of prompt + response (on the Engine's device, several sequences
   packed into one forward) capture, per position, the input residual of the head's capture
   layers (concatenated: the head's first-step input), the target's final-normed hidden state
   (target logits over the draft vocabulary are computed from it at train time) and the
   target's argmax over the full vocabulary (for accuracy): capture.py.

Shard ``i`` holds the sequences of selected prompts ``[i * shard_size, (i + 1) * shard_size)``
as one safetensors file of concatenated rows plus offsets (CPU tensors, whatever the device;
shards.py). A shard on disk is never redone, and the prompt order does not depend on
``num_prompts``, so a larger count later only adds shards.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fmserve.jsonl import jsonl_rows
from fmserve.train_eagle.capture import capture_sequences, capture_tokens_for
from fmserve.train_eagle.shards import (FORMAT_VERSION, MANIFEST, check_manifest, shard_done,
                                        shard_path, write_manifest)


@dataclass(frozen=True)
class DataConfig:
    prompts: str
    num_prompts: int = 2000
    max_prompt_tokens: int = 384
    max_new_tokens: int = 192
    sampled_fraction: float = 0.25
    shard_size: int = 200
    seed: int = 0

    def selection_key(self) -> dict:
        """What fixes the contents of shard i (everything but how many prompts are wanted)."""
        key = asdict(self)
        key.pop("num_prompts")
        key["prompts"] = str(Path(self.prompts).expanduser().resolve())
        return key


@dataclass(frozen=True)
class PromptItem:
    index: int  # position in the selection: fixes the shard and the sampling seed
    prompt_ids: list[int]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_prompts(path: str | Path) -> list[str]:
    """The "prompt" field of every JSONL row (plain strings per line are accepted too); a line
    that is not JSON, nests too deep or is not UTF-8 is named (fmserve/jsonl.py)."""
    out = []
    for n, row in jsonl_rows(str(Path(path).expanduser())):
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{path}:{n}: no \"prompt\" string in this row")
        out.append(prompt)
    if not out:  # else a data run made a "complete" set of 0 shards, and that locked the work dir
        raise ValueError(f"{path}: no prompts (the file has no rows): give a JSONL file with a "
                         f"\"prompt\" string on each line")
    return out


def select_prompts(prompts: list[str], tokenizer, num: int, max_prompt_tokens: int,
                   seed: int, shuffle: bool = True) -> list[PromptItem]:
    """The first ``num`` prompts (in a seeded shuffle) whose chat rendering fits."""
    order = list(range(len(prompts)))
    if shuffle:
        random.Random(seed).shuffle(order)
    items: list[PromptItem] = []
    for i in order:
        if len(items) >= num:
            break
        ids = tokenizer.encode_chat([{"role": "user", "content": prompts[i]}],
                                    add_generation_prompt=True)
        if len(ids) <= max_prompt_tokens:
            items.append(PromptItem(len(items), ids))
    return items


def sampling_for(item: PromptItem, cfg: DataConfig):
    """Greedy, or (for about ``sampled_fraction`` of prompts) seeded sampling at 0.7-1.0."""
    from ipc.sampling import SamplingParams

    rng = random.Random(f"{cfg.seed}:{item.index}")
    if rng.random() < cfg.sampled_fraction:
        return SamplingParams(temperature=round(rng.uniform(0.7, 1.0), 3),
                              seed=rng.getrandbits(62), max_new_tokens=cfg.max_new_tokens)
    return SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens)


def generate_responses(engine, items: list[PromptItem], params: list, governor=None,
                       check_every: int = 2000) -> list[list[int]]:
    """One batched Engine run; re-checks the thread count every ``check_every`` tokens."""
    submitted = engine.submit([it.prompt_ids for it in items], params)
    out: dict[str, list[int]] = {rid: [] for rid, _ in submitted}
    for n, o in enumerate(engine.run(), 1):
        out[o.rid] += o.token_ids
        if governor is not None and n % check_every == 0:
            governor.update()
    return [out[rid] for rid, _ in submitted]


def capture_shard(worker, items: list[PromptItem], responses: list[list[int]], params: list,
                  capture_layers: tuple[int, ...], governor=None) -> dict[str, torch.Tensor]:
    """The shard's CPU tensors: every (prompt, response) with something to draft, captured in
    packed prefills on the worker's device."""
    kept = [(it, resp, p) for it, resp, p in zip(items, responses, params) if len(resp) >= 2]
    if not kept:
        raise ValueError(f"none of the {len(items)} responses of this shard has the 2+ tokens "
                         f"a draft needs; raise --max-new-tokens")
    if governor is not None:
        governor.update()
    shard = capture_sequences(worker, [list(it.prompt_ids) + list(resp) for it, resp, _ in kept],
                              capture_layers, capture_tokens_for(worker.device))
    shard["prompt_lens"] = torch.tensor([len(it.prompt_ids) for it, _, _ in kept],
                                        dtype=torch.int64)
    shard["sampled"] = torch.tensor([int(not p.greedy) for _, _, p in kept], dtype=torch.int8)
    return shard


def shard_groups(todo: list[int], sizes: list[int], gen_batch_size: int | None
                 ) -> list[list[int]]:
    """Shards to make, in runs of consecutive ones whose prompts together fit
    ``gen_batch_size`` (one batched Engine run each; at least one shard a run). None: one shard
    a run."""
    groups: list[list[int]] = []
    for i in todo:
        if (groups and gen_batch_size and groups[-1][-1] == i - 1
                and sum(sizes[j] for j in groups[-1]) + sizes[i] <= gen_batch_size):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def device_label(device) -> str:
    """'cpu', or 'cuda (<GPU name>)' for a GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type


def build_dataset(engine, cfg: DataConfig, work_dir: str | Path, capture_layers: tuple[int, ...],
                  model_name: str, progress: bool = True, governor=None,
                  gen_batch_size: int | None = None) -> Path:
    """Make every shard that is not on disk yet; returns the manifest's path.

    ``gen_batch_size``: generate the responses of consecutive shards in one Engine run while
    their prompts fit it (None: one shard a run). Shards are the same either way."""
    from tqdm import tqdm

    work_dir = Path(work_dir).expanduser()
    work_dir.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT_VERSION, "model": model_name,
              "capture_layers": list(capture_layers), "selection": cfg.selection_key()}
    check_manifest(work_dir, header)
    prompts = read_prompts(cfg.prompts)
    items = select_prompts(prompts, engine.tokenizer, cfg.num_prompts, cfg.max_prompt_tokens,
                           cfg.seed)
    if not items:  # before any manifest: an empty "complete" set would lock the work dir
        raise ValueError(f"none of the {len(prompts)} prompts of {cfg.prompts} fits in "
                         f"--max-prompt-tokens {cfg.max_prompt_tokens} tokens (the chat template "
                         f"included): give shorter prompts, or a larger --max-prompt-tokens")
    if len(items) < cfg.num_prompts:
        log(f"only {len(items)} prompts of {cfg.prompts} fit {cfg.max_prompt_tokens} tokens "
            f"(asked for {cfg.num_prompts})")
    chunks = [items[i:i + cfg.shard_size] for i in range(0, len(items), cfg.shard_size)]
    todo = [i for i, chunk in enumerate(chunks) if not shard_done(work_dir, i, len(chunk))]
    log(f"data: {len(items)} prompts in {len(chunks)} shards, {len(chunks) - len(todo)} already "
        f"on disk in {work_dir}")
    bar = tqdm(total=len(items), initial=sum(len(c) for i, c in enumerate(chunks) if i not in todo),
               desc="data", unit="seq", disable=not progress or not sys.stderr.isatty(),
               dynamic_ncols=True)  # in a log file the per-shard lines say the same
    # the capture borrows the worker's pools between runs; nothing to make: no engine needed
    worker = engine.worker.state if todo else None
    device = getattr(worker, "device", None)
    for group in shard_groups(todo, [len(c) for c in chunks], gen_batch_size):
        t0 = time.perf_counter()
        group_items = [it for i in group for it in chunks[i]]
        params = [sampling_for(it, cfg) for it in group_items]
        responses = generate_responses(engine, group_items, params, governor)
        gen_share = (time.perf_counter() - t0) / len(group_items)  # generation s per prompt
        k = 0
        for i in group:
            t1 = time.perf_counter()
            n = len(chunks[i])
            shard = capture_shard(worker, chunks[i], responses[k:k + n], params[k:k + n],
                                  capture_layers, governor)
            k += n
            tmp = shard_path(work_dir, i).with_suffix(".tmp")
            from safetensors.torch import save_file
            meta = {"num_prompts": str(n), "first_index": str(chunks[i][0].index)}
            if device is not None:
                meta["device"] = str(device)
            save_file(shard, str(tmp), metadata=meta)
            os.replace(tmp, shard_path(work_dir, i))
            dt = gen_share * n + time.perf_counter() - t1
            n_seq = int(shard["prompt_lens"].numel())
            n_resp = int(shard["input_ids"].numel() - shard["prompt_lens"].sum())
            bar.update(n)
            log(f"shard {i}: {n_seq} sequences, {int(shard['input_ids'].numel())} tokens "
                f"({n_resp} response) in {dt:.0f} s: {n_seq / dt:.2f} seq/s, "
                f"{n_resp / dt:.0f} response tok/s"
                + (f" on {device_label(device)}" if device is not None and device.type != "cpu"
                   else "")
                + (f", {governor.current} threads" if governor is not None else ""))
            write_manifest(work_dir, header, chunks)
    bar.close()
    write_manifest(work_dir, header, chunks)
    return work_dir / MANIFEST


