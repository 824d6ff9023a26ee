"""The stages of `fmserve train-eagle` that build an Engine on the target: synthesized
prompts, exported tokens, and the training data (generated, or recaptured from tokens).
Training and evaluation have their own modules (trainer.py, evaluate.py)."""

from __future__ import annotations

from pathlib import Path

from fmserve.train_eagle import GEN_BATCH, MIN_GEN_KV_TOKENS
from fmserve.train_eagle.data import log


def gen_engine_sizes(args) -> tuple[int, int]:
    """(max running requests, KV pool tokens) of the data stage's Engine."""
    batch = args.gen_batch_size or GEN_BATCH[args.device]
    if batch < 1:
        raise SystemExit(f"train-eagle: --gen-batch-size must be >= 1, got {batch}")
    if args.gen_kv_tokens is not None and args.gen_kv_tokens < 1:
        raise SystemExit(f"train-eagle: --gen-kv-tokens must be >= 1, got {args.gen_kv_tokens}")
    page = 16  # the Engine's page size: each request rounds up to whole pages
    longest = args.max_prompt_tokens + args.max_new_tokens + page
    return batch, args.gen_kv_tokens or max(MIN_GEN_KV_TOKENS, batch * longest)


def make_prompts(args, model_path: Path, work_dir: Path) -> Path:
    from fmserve.engine import Engine
    from fmserve.train_eagle.synth_prompts import (SynthConfig, read_seed_instructions,
                                                   synthesize, write_prompts)

    if args.synth_prompts < 1:
        raise SystemExit(f"train-eagle: --synth-prompts must be >= 1, got {args.synth_prompts}")
    try:
        seeds = read_seed_instructions(args.prompts)
    except (OSError, ValueError) as e:
        raise SystemExit(f"train-eagle: --prompts: {e}") from e
    cfg = SynthConfig(seed_file=args.prompts, num_prompts=args.synth_prompts, seed=args.seed,
                      batch_size=args.gen_batch_size or GEN_BATCH[args.device])
    engine = Engine(model=str(model_path), device=args.device, dtype=args.dtype,
                    max_running_requests=cfg.batch_size, progress=not args.no_progress)
    log(f"prompts: the target writes {cfg.num_prompts} instructions from {len(seeds)} seed "
        f"tasks of {args.prompts}")
    tasks = synthesize(engine, cfg, progress=not args.no_progress)
    try:
        out = write_prompts(args.synth_out or work_dir / "synth-prompts.jsonl", tasks, seeds)
    except OSError as e:
        raise SystemExit(f"train-eagle: cannot write the prompts (--synth-out): {e}") from e
    log(f"prompts: {len(tasks)} new + {len(seeds)} seed instructions -> {out}; make data from "
        f"them with --stage data --prompts {out}")
    return out


def export_data_tokens(args, work_dir: Path) -> None:
    from fmserve.train_eagle.portable import export_tokens

    own = work_dir / "data"  # the work dir's own data, when it has any
    dirs = [own] * (own / "manifest.json").exists() + [Path(d) for d in args.extra_data]
    out = Path(args.tokens_file or work_dir / "tokens.safetensors").expanduser()
    n_seq, n_tok = export_tokens(dirs, out)
    log(f"tokens: {n_seq} sequences, {n_tok} tokens of {', '.join(map(str, dirs))} -> {out} "
        f"({out.stat().st_size / 1e6:.1f} MB); capture them elsewhere with --stage data "
        f"--tokens-file {out}")


def recapture_data(args, model_path: Path, slug: str, data_dir: Path) -> None:
    from fmserve.engine import Engine
    from fmserve.train_eagle.portable import recapture
    from gpu.eagle.draft_head import default_aux_layer_ids

    batch_tokens = 32768 if args.device == "cuda" else 4096
    engine = Engine(model=str(model_path), device=args.device, dtype=args.dtype,
                    max_running_requests=GEN_BATCH[args.device],
                    max_kv_tokens=max(MIN_GEN_KV_TOKENS, 2 * batch_tokens),
                    progress=not args.no_progress)
    mc = engine.worker.state.model_config
    capture_layers = tuple(i + 1 for i in default_aux_layer_ids(mc.num_layers))
    log(f"data: capturing the sequences of {args.tokens_file} on {args.device} "
        f"({engine.info.dtype}), up to {batch_tokens} tokens a prefill")
    recapture(engine.worker.state, args.tokens_file, data_dir, capture_layers, slug,
              shard_size=args.shard_size, max_batch_tokens=batch_tokens,
              progress=not args.no_progress)
    del engine


def make_data(args, model_path: Path, slug: str, data_dir: Path, governor) -> None:
    from fmserve.engine import Engine
    from fmserve.train_eagle.data import DataConfig, build_dataset
    from gpu.eagle.draft_head import default_aux_layer_ids

    batch, kv_tokens = gen_engine_sizes(args)
    engine = Engine(model=str(model_path), device=args.device, dtype=args.dtype,
                    max_running_requests=batch, max_kv_tokens=kv_tokens,
                    progress=not args.no_progress)
    log(f"data: the target generates on {args.device} ({engine.info.dtype}), {batch} requests "
        f"at once, KV pool {kv_tokens} tokens")
    mc = engine.worker.state.model_config
    capture_layers = tuple(i + 1 for i in default_aux_layer_ids(mc.num_layers))
    cfg = DataConfig(prompts=args.prompts, num_prompts=args.num_prompts,
                     max_prompt_tokens=args.max_prompt_tokens,
                     max_new_tokens=args.max_new_tokens,
                     sampled_fraction=args.sampled_fraction, shard_size=args.shard_size,
                     seed=args.seed)
    # Several shards per Engine run only when asked for or on a GPU (the CPU as it always ran).
    group = batch if args.gen_batch_size or args.device == "cuda" else None
    build_dataset(engine, cfg, data_dir, capture_layers, slug, progress=not args.no_progress,
                  governor=governor, gen_batch_size=group)
    del engine
