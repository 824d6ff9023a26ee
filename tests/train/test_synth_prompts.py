"""Self-instruct prompt synthesis for draft-head training data (`train-eagle --stage prompts`)."""

from __future__ import annotations

import json

import pytest

from fmserve.train_eagle.synth_prompts import (EXAMPLES_PER_PROMPT, SynthConfig, clean_task,
                                               dedup_key, list_prompt, read_seed_instructions,
                                               synthesize, write_prompts)

SEEDS = ["Write a haiku about autumn leaves.", "Sort these numbers: 3, 1, 2.",
         "Suggest a name for a grey cat.", "Explain what a compiler does.",
         "Translate 'good morning' into French."]


def _seed_file(tmp_path, rows):
    path = tmp_path / "seeds.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_clean_task_keeps_an_instruction_and_one_input():
    assert clean_task(" Write a poem about the sea.\nTask 6: Something else") == \
        "Write a poem about the sea."
    assert clean_task("Summarise this.\n\nThe text to summarise.\n\nAnd then it rambles on.") == \
        "Summarise this.\n\nThe text to summarise."
    assert clean_task("ok") is None  # too short
    assert clean_task("12345 67890 !!!") is None  # no words
    assert clean_task("x" * 2000) is None  # too long
    assert dedup_key("Write a Poem!") == dedup_key("write a poem")


def test_seed_instructions_prefer_the_seed_tasks(tmp_path):
    rows = [{"source": "t0/x", "prompt": "A T0 prompt that is long enough."}] + \
        [{"source": "seed_tasks", "prompt": s} for s in SEEDS]
    assert read_seed_instructions(_seed_file(tmp_path, rows)) == SEEDS
    # no row is a seed task: every prompt is one
    plain = [{"prompt": s} for s in SEEDS]
    assert read_seed_instructions(_seed_file(tmp_path, plain)) == SEEDS
    with pytest.raises(ValueError, match="need at least"):
        read_seed_instructions(_seed_file(tmp_path, plain[:EXAMPLES_PER_PROMPT - 1]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a JSON object"):
        read_seed_instructions(bad)
    prompt = list_prompt(SEEDS[:4])
    assert prompt.endswith("Task 5:") and "Task 1: " + SEEDS[0] in prompt


def test_the_target_writes_distinct_new_instructions(model_path, tmp_path):
    from fmserve.engine import Engine

    seeds = _seed_file(tmp_path, [{"source": "seed_tasks", "prompt": s} for s in SEEDS])
    engine = Engine(str(model_path), max_kv_tokens=4096, max_running_requests=8, progress=False)
    cfg = SynthConfig(seed_file=str(seeds), num_prompts=6, max_new_tokens=32, batch_size=8)
    tasks = synthesize(engine, cfg, progress=False)
    assert len(tasks) == 6
    keys = {dedup_key(t) for t in tasks}
    assert len(keys) == 6 and not keys & {dedup_key(s) for s in SEEDS}
    assert all(clean_task(t) == t for t in tasks)
    assert synthesize(engine, cfg, progress=False) == tasks  # seeded: the same again
    out = write_prompts(tmp_path / "out" / "prompts.jsonl", tasks, SEEDS)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == SEEDS + tasks
    assert {r["source"] for r in rows} == {"seed_tasks", "synth/self-instruct"}
