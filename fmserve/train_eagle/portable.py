"""Training data as token ids alone, to move it between machines.

Captured shards hold fp16 hidden states (about 4.6 KB a token for the default model: GBs for a
few thousand sequences), but they are a pure function of the model and the token ids. So
``export_tokens`` writes the sequences of one or more data directories as ids (a few MB), and
``recapture`` rebuilds shards of the usual format from them on another machine, a GPU say, by
teacher-forced prefills of many sequences at once. The responses are not generated again: the
head trains on exactly the text the source machine's target wrote.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from fmserve.train_eagle.capture import capture_sequences
from fmserve.train_eagle.data import log
from fmserve.train_eagle.shards import (FORMAT_VERSION, MANIFEST, check_manifest, shard_done,
                                        shard_path, write_json)

TOKENS_FORMAT = "fmserve-eagle-tokens-1"


def export_tokens(data_dirs: list[str | Path], out: str | Path) -> tuple[int, int]:
    """Every complete shard's sequences of ``data_dirs`` (in order) as one safetensors file of
    ids, offsets, prompt lengths and sampled flags. Returns (sequences, tokens)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    if not data_dirs:
        raise SystemExit("train-eagle: no data to export: the work dir has no data/manifest.json "
                         "and no --extra-data was given")
    ids, offsets, prompt_lens, sampled, layers, models = [], [0], [], [], None, set()
    for d in data_dirs:
        d = Path(d).expanduser()
        manifest_path = d / MANIFEST
        if not manifest_path.exists():
            raise SystemExit(f"train-eagle: no training data in {d} (no {MANIFEST})")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if layers is not None and manifest["capture_layers"] != layers:
            raise SystemExit(f"train-eagle: {d} captured layers {manifest['capture_layers']}, "
                             f"the other data {layers}; export only data of one model")
        layers = manifest["capture_layers"]
        models.add(manifest["model"])
        for entry in manifest["shards"]:
            with safe_open(str(d / entry["file"]), "pt") as f:
                shard_ids = f.get_tensor("input_ids").to(torch.int32)
                shard_off = f.get_tensor("offsets").tolist()
                prompt_lens += f.get_tensor("prompt_lens").tolist()
                sampled += f.get_tensor("sampled").tolist()
            ids.append(shard_ids)
            offsets += [offsets[-1] + o for o in shard_off[1:]]
    if not ids:
        raise SystemExit(f"train-eagle: no complete shard in {', '.join(map(str, data_dirs))}")
    tensors = {"input_ids": torch.cat(ids), "offsets": torch.tensor(offsets, dtype=torch.int64),
               "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int64),
               "sampled": torch.tensor(sampled, dtype=torch.int8)}
    out = Path(out).expanduser()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out), metadata={
            "format": TOKENS_FORMAT, "capture_layers": json.dumps(layers),
            "models": json.dumps(sorted(models)),
            "sources": json.dumps([str(d) for d in data_dirs])})
    except OSError as e:
        raise SystemExit(f"train-eagle: cannot write the tokens file (--tokens-file {out}): "
                         f"{e}") from e
    return len(prompt_lens), int(tensors["input_ids"].numel())


def read_tokens(path: str | Path) -> tuple[list[list[int]], list[int], list[int], dict]:
    """(sequences, prompt lengths, sampled flags, metadata) of an ``export_tokens`` file."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in ("input_ids", "offsets", "prompt_lens", "sampled")}
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
        raise SystemExit(f"train-eagle: cannot read the tokens file {path}: {e}; make one with "
                         f"--stage tokens --tokens-file {path}") from e
    if meta.get("format") != TOKENS_FORMAT:
        raise SystemExit(f"train-eagle: {path} is not a tokens file of this version "
                         f"(format {meta.get('format')!r}, want {TOKENS_FORMAT!r})")
    ids, off = t["input_ids"].tolist(), t["offsets"].tolist()
    seqs = [ids[a:b] for a, b in zip(off[:-1], off[1:])]
    return seqs, t["prompt_lens"].tolist(), t["sampled"].tolist(), meta


def recapture(worker, tokens_file: str | Path, work_dir: str | Path,
              capture_layers: tuple[int, ...], model_name: str, shard_size: int = 256,
              max_batch_tokens: int = 32768, progress: bool = True) -> Path:
    """Shards of ``tokens_file``'s sequences captured on ``worker`` (resumable: shards on disk
    are kept). Returns the manifest's path; train on it as on generated data."""
    import json

    from safetensors.torch import save_file
    from tqdm import tqdm

    seqs, prompt_lens, sampled, meta = read_tokens(tokens_file)
    if json.loads(meta.get("capture_layers", "null")) != list(capture_layers):
        raise SystemExit(f"train-eagle: {tokens_file} was captured at layers "
                         f"{meta.get('capture_layers')}, this model's head reads "
                         f"{list(capture_layers)}; export data of the same model")
    work_dir = Path(work_dir).expanduser()
    work_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(Path(tokens_file).expanduser().read_bytes()).hexdigest()[:16]
    header = {"format": FORMAT_VERSION, "model": model_name,
              "capture_layers": list(capture_layers), "selection": {"tokens_sha256": digest}}
    check_manifest(work_dir, header)
    starts = list(range(0, len(seqs), shard_size))
    shards = []
    bar = tqdm(total=len(seqs), desc="recapture", unit="seq", disable=not progress,
               dynamic_ncols=True)
    t0 = time.perf_counter()
    for i, a in enumerate(starts):
        b = min(a + shard_size, len(seqs))
        shards.append({"file": shard_path(work_dir, i).name, "num_prompts": b - a})
        if shard_done(work_dir, i, b - a):
            bar.update(b - a)
            continue
        shard = capture_sequences(worker, seqs[a:b], capture_layers, max_batch_tokens)
        shard["prompt_lens"] = torch.tensor(prompt_lens[a:b], dtype=torch.int64)
        shard["sampled"] = torch.tensor(sampled[a:b], dtype=torch.int8)
        tmp = shard_path(work_dir, i).with_suffix(".tmp")
        save_file(shard, str(tmp), metadata={"num_prompts": str(b - a), "first_index": str(a)})
        tmp.replace(shard_path(work_dir, i))
        bar.update(b - a)
        write_json(work_dir / MANIFEST, {**header, "shards": shards, "complete": False})
    bar.close()
    write_json(work_dir / MANIFEST, {**header, "shards": shards, "complete": True})
    dt = time.perf_counter() - t0
    log(f"recapture: {len(seqs)} sequences, {sum(map(len, seqs))} tokens in {dt:.0f} s "
        f"-> {work_dir}")
    return work_dir / MANIFEST
