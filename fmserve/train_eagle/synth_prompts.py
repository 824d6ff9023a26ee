"""User-style prompts written by the target itself, self-instruct style.

A draft head learns the target's answers to the prompts it is trained on. train.jsonl is mostly
T0 task templates (classify this, answer from this passage), whose answers are a few words;
users ask for emails, lists, stories and code, whose answers are long chatty text. The head
trained on the first generalises poorly to the second.

This stage writes more prompts of the second kind without touching dev.jsonl: it shows the
target a few human-written instructions (the seed tasks of train.jsonl) as a numbered list and
lets it continue the list, as the self-instruct paper does with a base model. The new
instructions are odd at times (a 135M model writes them), but they are instructions, and what
the head learns from is the target's answer to them.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

SEED_SOURCE_PREFIX = "seed_tasks"
EXAMPLES_PER_PROMPT = 4
MAX_EXAMPLE_CHARS = 400
MIN_TASK_CHARS = 12
MAX_TASK_CHARS = 800


@dataclass(frozen=True)
class SynthConfig:
    seed_file: str  # JSONL rows with "prompt" (and "source": rows from seed tasks are used)
    num_prompts: int
    seed: int = 0
    temperature: float = 0.9
    top_p: float = 0.95
    max_new_tokens: int = 96
    batch_size: int = 64


def read_seed_instructions(path: str | Path) -> list[str]:
    """The seed tasks' prompts of a JSONL file (rows whose "source" starts with "seed_tasks"),
    or every prompt when no row is marked so."""
    rows = []
    with open(Path(path).expanduser(), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ValueError(f"{path}:{n}: expected a JSON object with a \"prompt\" string")
                rows.append(row)
    seeds = [r["prompt"].strip() for r in rows
             if str(r.get("source", "")).startswith(SEED_SOURCE_PREFIX)]
    if not seeds:
        seeds = [r["prompt"].strip() for r in rows]
    seeds = [s for s in seeds if MIN_TASK_CHARS <= len(s) <= MAX_EXAMPLE_CHARS]
    if len(seeds) < EXAMPLES_PER_PROMPT:
        raise ValueError(f"{path}: only {len(seeds)} usable seed instructions (of at most "
                         f"{MAX_EXAMPLE_CHARS} characters); need at least {EXAMPLES_PER_PROMPT}")
    return seeds


def list_prompt(examples: list[str]) -> str:
    """A numbered task list that ends where the model writes the next task."""
    body = "".join(f"Task {k}: {e}\n\n" for k, e in enumerate(examples, 1))
    return ("Here are some tasks that people ask an AI assistant to do:\n\n" + body
            + f"Task {len(examples) + 1}:")


def clean_task(text: str) -> str | None:
    """The new task from the model's continuation, or None when it is not usable."""
    task = re.split(r"\n\s*Task\s*\d*\s*:", text)[0].strip()
    # An instruction and at most one input paragraph, as the seed tasks are; a small model
    # tends to ramble on after them.
    task = "\n\n".join(p.strip() for p in re.split(r"\n\s*\n", task)[:2] if p.strip())
    if not (MIN_TASK_CHARS <= len(task) <= MAX_TASK_CHARS):
        return None
    if not re.search(r"[A-Za-z]{3}", task):
        return None
    return task


def dedup_key(task: str) -> str:
    return re.sub(r"\W+", " ", task.lower()).strip()[:80]


def synthesize(engine, cfg: SynthConfig, progress: bool = True) -> list[str]:
    """``cfg.num_prompts`` new distinct instructions (fewer only if the model keeps repeating)."""
    from tqdm import tqdm

    from ipc.sampling import SamplingParams

    seeds = read_seed_instructions(cfg.seed_file)
    rng = random.Random(cfg.seed)
    seen = {dedup_key(s) for s in seeds}
    out: list[str] = []
    bar = tqdm(total=cfg.num_prompts, desc="prompts", unit="prompt", disable=not progress)
    rounds_without_gain = 0
    while len(out) < cfg.num_prompts and rounds_without_gain < 3:
        batch = [list_prompt(rng.sample(seeds, EXAMPLES_PER_PROMPT))
                 for _ in range(cfg.batch_size)]
        params = [SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                 seed=rng.getrandbits(62), max_new_tokens=cfg.max_new_tokens,
                                 stop=["\nTask"]) for _ in batch]
        before = len(out)
        for completion in engine.generate(batch, params):
            task = clean_task(completion.text)
            key = dedup_key(task) if task is not None else None
            if key is None or key in seen or len(out) >= cfg.num_prompts:
                continue
            seen.add(key)
            out.append(task)
            bar.update(1)
        rounds_without_gain = 0 if len(out) > before else rounds_without_gain + 1
    bar.close()
    return out


def write_prompts(path: str | Path, tasks: list[str], seeds: list[str]) -> Path:
    """A prompts JSONL for the data stage: the seed instructions, then the synthesized ones."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in seeds:
            f.write(json.dumps({"source": SEED_SOURCE_PREFIX, "prompt": s}) + "\n")
        for t in tasks:
            f.write(json.dumps({"source": "synth/self-instruct", "prompt": t}) + "\n")
    tmp.replace(path)
    return path
