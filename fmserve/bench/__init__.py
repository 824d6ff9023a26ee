"""The benchmarks behind `fmserve bench offline|serve|spec|prefix|peers`."""

from pathlib import Path

# Their default prompts, shipped as package data (pyproject.toml) so an installed fmserve has
# them: the 252 rows of the dev set, self-instruct's human-written user-oriented instructions
# (github.com/yizhongw/self-instruct, Apache-2.0), "source" and "prompt" of each. Never trained
# on: `fmserve train-eagle` evaluates heads on them.
DEV_PROMPTS = Path(__file__).resolve().parent / "dev_prompts.jsonl"


def dev_texts() -> list[str]:
    """The dev set's prompts."""
    from fmserve.jsonl import read_prompts

    return read_prompts(str(DEV_PROMPTS))
