"""The benches' default prompts ship inside the package (fmserve/bench/dev_prompts.jsonl,
package data in pyproject.toml): an installed fmserve has no ../shared/ beside it."""

import tomllib
from pathlib import Path

import fmserve
from fmserve.bench import DEV_PROMPTS
from fmserve.cli import build_parser
from fmserve.jsonl import read_prompts

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_prompts_resolve_inside_the_package_and_every_bench_defaults_to_them():
    package = Path(fmserve.__file__).resolve().parent
    assert DEV_PROMPTS.is_relative_to(package) and DEV_PROMPTS.is_file()
    assert len(read_prompts(str(DEV_PROMPTS))) == 252  # all of dev.jsonl
    parser = build_parser()
    for argv, dest in ((["bench", "offline"], "prompts"), (["bench", "peers"], "prompts"),
                       (["train-eagle"], "eval_prompts")):
        assert getattr(parser.parse_args(argv), dest) == str(DEV_PROMPTS), argv
    # declared as package data, so that `pip install` (not only a checkout) carries it
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert DEV_PROMPTS.name in setuptools["package-data"]["fmserve.bench"]
