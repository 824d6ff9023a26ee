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
   target's argmax over the full vocabulary (for accuracy).

Shard ``i`` holds the sequences of selected prompts ``[i * shard_size, (i + 1) * shard_size)``
as one safetensors file of concatenated rows plus offsets (CPU tensors, whatever the device).
A shard on disk is never redone, and the prompt order does not depend on ``num_prompts``, so a
larger count later only adds shards.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


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


class ShardFile(Mapping):
    """A shard on disk, read as the trainer needs it: the small per-token and per-sequence
    tensors in memory, the hidden states (nearly all of its bytes) sliced per sequence from the
    memory-mapped file. Holding them all would not fit a small machine: 15,726 sequences are
    14 GB of fp16 states."""

    ON_DISK = ("aux_hidden", "final_hidden")

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(path), "pt")
        self._keys = list(self._file.keys())
        self._small = {k: self._file.get_tensor(k) for k in self._keys if k not in self.ON_DISK}

    def __getitem__(self, key: str) -> torch.Tensor:  # the whole tensor (read from disk)
        return self._small[key] if key in self._small else self._file.get_tensor(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def rows(self, key: str, start: int, end: int) -> torch.Tensor:
        if key in self._small:
            return self._small[key][start:end]
        return self._file.get_slice(key)[start:end]


@dataclass
class CapturedData:
    """Every captured sequence, rows of all shards concatenated per shard.

    Sequence j lives in shard ``shard[j]`` at rows ``start[j]:end[j]``; its response starts
    ``prompt_len[j]`` rows in.
    """

    shards: list[Mapping[str, torch.Tensor]]  # ShardFile when read from disk
    shard: list[int]
    start: list[int]
    end: list[int]
    prompt_len: list[int]

    def __len__(self) -> int:
        return len(self.start)

    def length(self, j: int) -> int:
        return self.end[j] - self.start[j]

    def rows(self, j: int, key: str) -> torch.Tensor:
        shard = self.shards[self.shard[j]]
        if isinstance(shard, ShardFile):
            return shard.rows(key, self.start[j], self.end[j])
        return shard[key][self.start[j]:self.end[j]]

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in zip(self.start, self.end))

    @property
    def num_response_tokens(self) -> int:
        return sum(e - s - p for s, e, p in zip(self.start, self.end, self.prompt_len))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_prompts(path: str | Path) -> list[str]:
    """The "prompt" field of every JSONL row (plain strings per line are accepted too)."""
    out = []
    with open(Path(path).expanduser(), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
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


def _captured_rows(runner, final: torch.Tensor, captured: list[torch.Tensor],
                   logits_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    aux = torch.cat(captured, dim=-1)
    # The full-vocabulary logits of a long packed batch are large: argmax them in pieces.
    argmax = torch.cat([runner.model.logits(final[i:i + logits_rows]).argmax(-1)
                        for i in range(0, final.shape[0], logits_rows)]).to(torch.int32)
    aux16, final16 = aux.to("cpu", torch.float16), final.to("cpu", torch.float16)
    if not (torch.isfinite(aux16).all() and torch.isfinite(final16).all()):
        raise ValueError("captured hidden states overflow fp16; this model needs bf16 shards")
    return aux16, final16, argmax.cpu()


@torch.inference_mode()
def capture_sequences(runner, seqs: list[list[int]], capture_layers: tuple[int, ...],
                      max_batch_tokens: int = 32768) -> dict[str, torch.Tensor]:
    """The shard rows (ids, aux and final hidden states, target argmax, offsets) of ``seqs``,
    captured in packed prefills of up to ``max_batch_tokens`` tokens (a longer sequence alone)."""
    max_seqs = runner.req_to_token.num_slots - 1
    page = runner.cfg.page_size
    free_pages = runner.kv_pool.num_pages - 1  # page 0 is the pool's padding page
    ids, aux, final, argmax, offsets = [], [], [], [], [0]
    group: list[list[int]] = []

    def flush() -> None:
        f, captured = runner.capture_hidden_states_many(group, tuple(capture_layers))
        a, fi, m = _captured_rows(runner, f, captured)
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


def capture_tokens_for(device) -> int:
    """Tokens per packed capture prefill: a GPU takes many sequences at once; on a CPU a pack
    of a few thousand tokens keeps the (full-vocabulary) argmax pieces and memory small."""
    return 32768 if device is not None and device.type != "cpu" else 4096


def capture_shard(runner, items: list[PromptItem], responses: list[list[int]], params: list,
                  capture_layers: tuple[int, ...], governor=None) -> dict[str, torch.Tensor]:
    """The shard's CPU tensors: every (prompt, response) with something to draft, captured in
    packed prefills on the runner's device."""
    kept = [(it, resp, p) for it, resp, p in zip(items, responses, params) if len(resp) >= 2]
    if not kept:
        raise ValueError(f"none of the {len(items)} responses of this shard has the 2+ tokens "
                         f"a draft needs; raise --max-new-tokens")
    if governor is not None:
        governor.update()
    shard = capture_sequences(runner, [list(it.prompt_ids) + list(resp) for it, resp, _ in kept],
                              capture_layers, capture_tokens_for(runner.device))
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


def shard_path(work_dir: Path, i: int) -> Path:
    return work_dir / f"shard-{i:05d}.safetensors"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _check_manifest(work_dir: Path, header: dict) -> None:
    path = work_dir / MANIFEST
    if not path.exists():
        return
    old = json.loads(path.read_text(encoding="utf-8"))
    for key in ("format", "model", "capture_layers", "selection"):
        if old.get(key) != header[key]:
            raise SystemExit(f"train-eagle: {work_dir} holds data made with another {key} "
                             f"({old.get(key)!r}, now {header[key]!r}); give another "
                             f"--work-dir or delete that one")


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
    _check_manifest(work_dir, header)
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
    todo = [i for i, chunk in enumerate(chunks) if not _shard_done(work_dir, i, len(chunk))]
    log(f"data: {len(items)} prompts in {len(chunks)} shards, {len(chunks) - len(todo)} already "
        f"on disk in {work_dir}")
    bar = tqdm(total=len(items), initial=sum(len(c) for i, c in enumerate(chunks) if i not in todo),
               desc="data", unit="seq", disable=not progress or not sys.stderr.isatty(),
               dynamic_ncols=True)  # in a log file the per-shard lines say the same
    runner = getattr(engine, "runner", None)
    device = getattr(runner, "device", None)
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
            shard = capture_shard(runner, chunks[i], responses[k:k + n], params[k:k + n],
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
            _write_manifest(work_dir, header, chunks)
    bar.close()
    _write_manifest(work_dir, header, chunks)
    return work_dir / MANIFEST


def _shard_done(work_dir: Path, i: int, num_prompts: int) -> bool:
    path = shard_path(work_dir, i)
    if not path.exists():
        return False
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            return int((f.metadata() or {}).get("num_prompts", -1)) == num_prompts
    except Exception:
        return False


def _write_manifest(work_dir: Path, header: dict, chunks: list) -> None:
    shards = [{"file": shard_path(work_dir, i).name, "num_prompts": len(c)}
              for i, c in enumerate(chunks) if _shard_done(work_dir, i, len(c))]
    _write_json(work_dir / MANIFEST, {**header, "shards": shards,
                                      "complete": len(shards) == len(chunks)})


def load_datasets(work_dirs: list[str | Path], max_sequences: int | None = None
                  ) -> CapturedData:
    """Several data directories as one, in the order given (the last directory's sequences come
    last, so a held-out tail is taken from it). They must hold the same capture layers."""
    data = CapturedData([], [], [], [], [])
    layers = None
    for d in work_dirs:
        manifest = _read_manifest(Path(d).expanduser())
        if layers is not None and manifest["capture_layers"] != layers:
            raise SystemExit(f"train-eagle: {d} captured layers {manifest['capture_layers']}, "
                             f"but the other data {layers}; mix only data of one model")
        layers = manifest["capture_layers"]
        if max_sequences is not None and len(data) >= max_sequences:
            break
        load_dataset(d, max_sequences, into=data)
    return data


def _read_manifest(work_dir: Path) -> dict:
    path = work_dir / MANIFEST
    if not path.exists():
        raise SystemExit(f"train-eagle: no training data in {work_dir} (no {MANIFEST}); run "
                         f"the data stage first (--stage data)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_dataset(work_dir: str | Path, max_sequences: int | None = None,
                 into: CapturedData | None = None) -> CapturedData:
    """Every shard listed in the manifest (the complete ones), as ShardFiles (hidden states
    stay on disk until a batch reads them); appended to ``into`` when given."""
    work_dir = Path(work_dir).expanduser()
    manifest = _read_manifest(work_dir)
    data = into if into is not None else CapturedData([], [], [], [], [])
    before = len(data)
    for entry in manifest["shards"]:
        if max_sequences is not None and len(data) >= max_sequences:
            break
        shard = ShardFile(work_dir / entry["file"])
        k = len(data.shards)
        data.shards.append(shard)
        offsets = shard["offsets"].tolist()
        for j, p in enumerate(shard["prompt_lens"].tolist()):
            if max_sequences is not None and len(data) >= max_sequences:
                break
            data.shard.append(k)
            data.start.append(offsets[j])
            data.end.append(offsets[j + 1])
            data.prompt_len.append(p)
    if len(data) == before:
        raise SystemExit(f"train-eagle: {work_dir} has no complete shard yet")
    return data


def response_token_counts(data: CapturedData, vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in the responses (for the draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for j in range(len(data)):
        ids = data.rows(j, "input_ids")[data.prompt_len[j]:].long()
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts
