"""Captured training data on disk: one safetensors file per shard plus a manifest, and how the
trainer reads it back (hidden states memory-mapped, sliced per sequence)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


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


def shard_path(work_dir: Path, i: int) -> Path:
    return work_dir / f"shard-{i:05d}.safetensors"


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def check_manifest(work_dir: Path, header: dict) -> None:
    path = work_dir / MANIFEST
    if not path.exists():
        return
    old = json.loads(path.read_text(encoding="utf-8"))
    for key in ("format", "model", "capture_layers", "selection"):
        if old.get(key) != header[key]:
            raise SystemExit(f"train-eagle: {work_dir} holds data made with another {key} "
                             f"({old.get(key)!r}, now {header[key]!r}); give another "
                             f"--work-dir or delete that one")


def shard_done(work_dir: Path, i: int, num_prompts: int) -> bool:
    path = shard_path(work_dir, i)
    if not path.exists():
        return False
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            return int((f.metadata() or {}).get("num_prompts", -1)) == num_prompts
    except Exception:
        return False


def write_manifest(work_dir: Path, header: dict, chunks: list) -> None:
    shards = [{"file": shard_path(work_dir, i).name, "num_prompts": len(c)}
              for i, c in enumerate(chunks) if shard_done(work_dir, i, len(c))]
    write_json(work_dir / MANIFEST, {**header, "shards": shards,
                                      "complete": len(shards) == len(chunks)})


def load_datasets(work_dirs: list[str | Path], max_sequences: int | None = None
                  ) -> CapturedData:
    """Several data directories as one, in the order given (the last directory's sequences come
    last, so a held-out tail is taken from it). They must hold the same capture layers."""
    data = CapturedData([], [], [], [], [])
    layers = None
    for d in work_dirs:
        manifest = read_manifest(Path(d).expanduser())
        if layers is not None and manifest["capture_layers"] != layers:
            raise SystemExit(f"train-eagle: {d} captured layers {manifest['capture_layers']}, "
                             f"but the other data {layers}; mix only data of one model")
        layers = manifest["capture_layers"]
        if max_sequences is not None and len(data) >= max_sequences:
            break
        load_dataset(d, max_sequences, into=data)
    return data


def read_manifest(work_dir: Path) -> dict:
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
    manifest = read_manifest(work_dir)
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
