"""`fmserve train-eagle`: make data, train an EAGLE-3 head, measure its accept length.

    fmserve train-eagle                               all stages, the default model
    fmserve train-eagle --stage data --num-prompts 800
    fmserve train-eagle --stage train --resume        continue from the latest checkpoint
    fmserve train-eagle --stage eval --out heads/x    accept length on held-out prompts
    fmserve train-eagle --device cuda                 every stage on the GPU (auto: when present)
    fmserve train-eagle --stage prompts --synth-prompts 3000
                                                      user-style prompts written by the target
                                                      (self-instruct), for --prompts of a data run
    fmserve train-eagle --stage tokens --tokens-file t.safetensors
                                                      the data's sequences as token ids (MBs, not
                                                      the GBs of hidden states), to move them
    fmserve train-eagle --stage data --tokens-file t.safetensors
                                                      capture their hidden states again (on a GPU)

Every stage is resumable: data shards and checkpoints on disk are never redone. Shards and
checkpoints hold CPU tensors, so a run resumes on either device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fmserve.arg_types import positive_int
from fmserve.bench import DEV_PROMPTS
from fmserve.train_eagle import GEN_BATCH, MIN_GEN_KV_TOKENS

DEFAULT_TRAIN_PROMPTS = "/work/shared/data/prompts/train.jsonl"
DEFAULT_EVAL_PROMPTS = str(DEV_PROMPTS)  # shipped with the package
STAGES = ("prompts", "tokens", "data", "train", "eval", "all")  # all: data, train, eval
DEVICES = ("auto", "cpu", "cuda")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="a .gguf file, a Hugging Face model directory, 'default' or "
                        "'gemma3-270m'")
    p.add_argument("--stage", default="all", choices=STAGES)
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="where every stage runs (auto: cuda when a GPU is visible, else cpu); "
                        "on cuda training runs under bf16 autocast with fp32 master weights")
    p.add_argument("--work-dir", default=None,
                   help="data shards and checkpoints "
                        "(default ~/.cache/fmserve/train-eagle/<model>)")
    p.add_argument("--out", default=None,
                   help="where the trained head goes (default ./heads/<model>-eagle3)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: all cores); fewer are used while other processes "
                        "keep cores busy, unless --fixed-threads")
    p.add_argument("--fixed-threads", action="store_true",
                   help="keep --threads even when other processes keep cores busy")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--seed", type=int, default=0)

    d = p.add_argument_group("data")
    d.add_argument("--prompts", default=DEFAULT_TRAIN_PROMPTS, help="JSONL rows with \"prompt\"")
    d.add_argument("--num-prompts", type=positive_int, default=2000)
    d.add_argument("--max-prompt-tokens", type=positive_int, default=384,
                   help="prompts longer than this (chat template included) are skipped")
    d.add_argument("--max-new-tokens", type=positive_int, default=192)
    d.add_argument("--sampled-fraction", type=float, default=0.25,
                   help="share of responses sampled at temperature 0.7-1.0 (the rest greedy)")
    d.add_argument("--shard-size", type=int, default=200, help="sequences per data shard")
    d.add_argument("--tokens-file", default=None,
                   help="--stage tokens writes the data's sequences (work dir and --extra-data) "
                        "here as token ids; --stage data with it captures those sequences "
                        "instead of generating new ones")
    d.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="the target's dtype while making data (as when serving)")
    d.add_argument("--gen-batch-size", type=int, default=None,
                   help=f"requests the Engine generates at once (default {GEN_BATCH['cpu']} on "
                        f"cpu, {GEN_BATCH['cuda']} on cuda); consecutive shards whose prompts "
                        f"fit it are generated in one run")
    d.add_argument("--gen-kv-tokens", type=int, default=None,
                   help="the Engine's KV pool in tokens (default: room for --gen-batch-size "
                        f"requests of the longest prompt and response, at least "
                        f"{MIN_GEN_KV_TOKENS})")

    s = p.add_argument_group("prompt synthesis (--stage prompts)")
    s.add_argument("--synth-prompts", type=positive_int, default=3000,
                   help="new instructions to write, in the style of --prompts' seed tasks")
    s.add_argument("--synth-out", default=None,
                   help="the JSONL written: the seed tasks, then the new instructions "
                        "(default <work-dir>/synth-prompts.jsonl)")

    t = p.add_argument_group("training")
    t.add_argument("--ttt-steps", type=positive_int, default=4,
                   help="training-time-test unroll depth")
    t.add_argument("--step-loss-decay", type=float, default=0.8,
                   help="the loss of unroll step k is weighted by this ** k (1: all alike)")
    t.add_argument("--draft-vocab-size", type=positive_int, default=8192)
    t.add_argument("--head-intermediate-size", type=int, default=0, metavar="N",
                   help="the head's MLP width; 0 = the target's (1536 for the default model; "
                        "up to 2944 keeps its head under 25 MB in fp16), or --init-head's")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warmup (default: 5%% of the steps, at most 50)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine decays to lr * this")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop after this many steps")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="fit the run (its LR schedule included) to this much wall time: the "
                        "speed of the first steps sets the number of steps")
    t.add_argument("--max-batch-tokens", type=positive_int, default=2048,
                   help="padded tokens per batch (sequences of similar length batched)")
    t.add_argument("--max-train-sequences", type=positive_int, default=None,
                   help="train on the first N captured sequences only")
    t.add_argument("--prompt-loss-weight", type=float, default=0.0,
                   help="also train draft chains rooted in the prompt, their loss weighted by "
                        "this (0: response only, as SpecForge; more data when data is scarce)")
    t.add_argument("--no-vocab-prior", action="store_true",
                   help="pick the draft vocabulary from response counts alone (default: also "
                        "count the tokens of --prompts' prompts and references)")
    t.add_argument("--val-sequences", type=int, default=64,
                   help="hold out the last N captured sequences; at each checkpoint the head "
                        "ships only if their estimated accept length is the best so far")
    t.add_argument("--save-every", type=positive_int, default=50,
                   help="checkpoint every N steps")
    t.add_argument("--log-every", type=positive_int, default=10, help="log a line every N steps")
    t.add_argument("--keep-checkpoints", type=int, default=2)
    t.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --work-dir")
    t.add_argument("--init-head", default="",
                   help="start from this head directory's weights and draft vocabulary "
                        "(fine-tune a trained head on more data) instead of a fresh head")
    t.add_argument("--refresh-vocab", action="store_true",
                   help="with --init-head: count the draft vocabulary on this run's data "
                        "instead of keeping the head's (shared tokens keep their trained "
                        "lm_head rows, new ones start from a fitted map of their embedding)")
    t.add_argument("--extra-data", action="append", default=[], metavar="DIR",
                   help="also train on the data directory of another work dir (repeatable); "
                        "the held-out sequences still come from --work-dir's own data")
    t.add_argument("--ship-dtype", default="fp16", choices=["fp16", "bf16", "fp32"],
                   help="weight dtype of the written head")
    t.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="training arithmetic: bf16 autocast over fp32 master weights, or fp32 "
                        "(auto: bf16 on a GPU, fp32 on a CPU; bf16 pays on CPUs with bf16 "
                        "matrix units, e.g. AMX: 1.4x on a 2-core Xeon)")

    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-prompts", default=DEFAULT_EVAL_PROMPTS,
                   help="held-out JSONL prompts (never trained on)")
    e.add_argument("--eval-num-prompts", type=positive_int, default=64)
    e.add_argument("--eval-max-new-tokens", type=positive_int, default=128)
    e.add_argument("--eval-mode", default="spec", choices=["spec", "estimate", "both"],
                   help="spec: the Engine's real speculative path; estimate: a teacher-forced "
                        "offline estimate (no speculative runtime needed)")
    e.add_argument("--num-steps", type=int, default=4, help="draft depth at eval")
    e.add_argument("--eval-shapes", default="chain,tree",
                   help="spec eval: chain (--num-steps drafts), tree (--num-steps deep, "
                        "--eval-topk children a node, --eval-draft-tokens verified) or both")
    e.add_argument("--eval-topk", type=int, default=4, help="spec eval: the tree's children a node")
    e.add_argument("--eval-draft-tokens", type=int, default=8,
                   help="spec eval: the tree's nodes verified per step, the root included")
    e.add_argument("--eval-batch", type=positive_int, default=64,
                   help="spec eval: requests decoded together")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-eagle", help="train an EAGLE-3 draft head for a model (self-distilled, resumable)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def model_slug(model_path: Path) -> str:
    name = model_path.name.lower()
    return name.removesuffix(".gguf")


def resolve_device_arg(spec: str) -> str:
    """'cpu' or 'cuda' for --device (auto: cuda when torch sees a GPU)."""
    from gpu.device import resolve_device

    try:
        return resolve_device(spec).type
    except ValueError as e:
        raise SystemExit(f"train-eagle: {e}") from e


def check_files(args) -> None:
    """The prompt files the stages will read, and an --out given, checked before any stage:
    --stage all reads --eval-prompts after hours of data and training, and an --out that cannot
    hold the head was found when training wrote its first checkpoint's head."""
    from fmserve.train_eagle.data import read_prompts

    files = []
    if args.stage in ("data", "all") and not args.tokens_file:
        files.append(("--prompts", args.prompts))
    if args.stage in ("eval", "all"):
        files.append(("--eval-prompts", args.eval_prompts))
    for flag, path in files:
        try:
            read_prompts(path)
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    if args.out and args.stage in ("train", "eval", "all"):
        check_out(Path(args.out).expanduser())


def check_out(out: Path) -> None:
    """The head directory: it, or the first of its parents that exists, must be a directory."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: the head is a directory (config.json + "
                         f"model.safetensors); give another --out, or remove that file")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out} cannot be made: {parent} is a file, not a directory")


def release_device_memory(device: str) -> None:
    """Hand cached GPU memory back between stages (each stage builds its own model)."""
    if device == "cuda":
        import gc

        import torch
        gc.collect()
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    from fmserve.default_model import resolve_model_path
    from fmserve.train_eagle.data import device_label, log
    from fmserve.train_eagle.stages import (export_data_tokens, make_data, make_prompts,
                                            recapture_data)
    from fmserve.train_eagle.threads import ThreadGovernor

    if not 0.0 < args.step_loss_decay <= 2.0:
        raise SystemExit(f"train-eagle: --step-loss-decay must be in (0, 2], got "
                         f"{args.step_loss_decay} (1 weights every unroll step alike)")
    if args.shard_size < 1:
        raise SystemExit(f"train-eagle: --shard-size must be >= 1, got {args.shard_size}")
    if args.head_intermediate_size < 0:
        raise SystemExit(f"train-eagle: --head-intermediate-size must be >= 1 (or 0 for the "
                         f"target's width), got {args.head_intermediate_size}")
    from fmserve.train_eagle.evaluate import eval_spec_shapes
    try:
        eval_spec_shapes(args)
    except ValueError as e:
        raise SystemExit(f"train-eagle: {e}") from None
    if args.init_head and args.stage in ("train", "all"):  # not after the data stage's hours
        from gpu.eagle.head_config import read_head_config
        try:
            read_head_config(args.init_head)
        except ValueError as e:
            raise SystemExit(f"train-eagle: --init-head: {e}") from None
    check_files(args)
    args.device = resolve_device_arg(args.device)
    governor = ThreadGovernor(args.threads, adaptive=not args.fixed_threads, device=args.device)
    model_path = resolve_model_path(args.model, progress=not args.no_progress)
    default = args.model in (None, "", "default")
    slug = "smollm2-135m-instruct" if default else model_slug(model_path)
    work_dir = Path(args.work_dir or Path.home() / ".cache" / "fmserve" / "train-eagle" / slug)
    work_dir = work_dir.expanduser()
    out = Path(args.out or Path("heads") / f"{slug}-eagle3").expanduser()
    if args.stage in ("train", "eval", "all"):
        check_out(out)
    log(f"train-eagle: model {model_path}, work dir {work_dir}, head -> {out}, "
        f"device {device_label(args.device)}, {governor.current} threads")
    stages = ("data", "train", "eval") if args.stage == "all" else (args.stage,)
    if "prompts" in stages:
        make_prompts(args, model_path, work_dir)
    if "tokens" in stages:
        export_data_tokens(args, work_dir)
    if "data" in stages and args.tokens_file:
        recapture_data(args, model_path, slug, work_dir / "data")
        release_device_memory(args.device)
    elif "data" in stages:
        make_data(args, model_path, slug, work_dir / "data", governor)
        release_device_memory(args.device)
    if "train" in stages:
        from fmserve.train_eagle.trainer import TrainConfig, train
        train(TrainConfig.from_args(args, work_dir, out), model_path, governor,
              progress=not args.no_progress)
        release_device_memory(args.device)
    if "eval" in stages:
        from fmserve.train_eagle.evaluate import evaluate_from_args
        evaluate_from_args(args, model_path, out, work_dir / "eval-data", governor)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fmserve train-eagle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
