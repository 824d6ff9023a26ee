"""How good is a head: mean accept length on held-out prompts (dev.jsonl, never trained on).

- ``spec`` (the number that counts): greedy generation through the Engine's real speculative
  path (EAGLE-3, a chain of ``num_steps`` drafts); accept length = tokens per verify step
  (accepted drafts + the bonus token), summed over every verify step of every request, as the
  Engine counts them: emitted tokens only (a step cut short by the length limit or a stop
  counts the drafts it kept, not those accepted past it).
- ``estimate`` (no speculative runtime needed): the target's greedy responses are captured as
  training data is, then from every response position a chain of ``num_steps`` greedy drafts is
  run teacher-forced with dense attention (while the drafts are right, the true tokens *are* the
  drafts) and its accept length is 1 + the drafts right before the first miss. It averages over
  every position, not only those a real run verifies from, so it is an estimate.

Both run on ``device`` ("auto": the GPU when present), the estimate in fp32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fmserve.train_eagle.data import DataConfig, build_dataset, log, read_prompts, select_prompts
from fmserve.train_eagle.head import draft_embed, load_target
from fmserve.train_eagle.schedule import epoch_batches
from fmserve.train_eagle.shards import load_dataset
from fmserve.train_eagle.ttt import collate, ttt_forward
from ipc.spec_settings import accept_length


@dataclass
class SpecResult:
    prompts: int
    tokens: int
    verify_steps: int
    accepted_drafts: int
    seconds: float
    per_position: list[float]  # share of verify steps that accepted a draft at each depth

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.accepted_drafts, self.verify_steps)


def eval_prompt_ids(tokenizer, prompts_file: str, num: int, max_prompt_tokens: int = 384
                    ) -> list[list[int]]:
    prompts = read_prompts(prompts_file)
    items = select_prompts(prompts, tokenizer, num, max_prompt_tokens, seed=0, shuffle=False)
    if not items:  # else an "evaluation" of 0 prompts
        raise ValueError(f"--eval-prompts: none of the {len(prompts)} prompts of {prompts_file} "
                         f"fits in {max_prompt_tokens} tokens (the chat template included)")
    return [it.prompt_ids for it in items]


def evaluate_spec(model: str, head_dir: Path, prompts_file: str, num_prompts: int,
                  max_new_tokens: int, num_steps: int = 4, dtype: str = "auto",
                  progress: bool = True, device: str = "auto", topk: int = 1,
                  num_draft_tokens: int = 0, batch: int = 64) -> SpecResult:
    """Greedy generation with speculative decoding; the accept length the Engine reports.
    topk 1 is a chain of num_steps drafts; above 1 a tree of num_draft_tokens nodes."""
    from fmserve.engine import Engine
    from ipc.sampling import SamplingParams
    from ipc.spec_settings import SpecSettings

    spec = SpecSettings(algorithm="eagle3", draft_model=str(head_dir), num_steps=num_steps,
                        topk=topk, num_draft_tokens=num_draft_tokens or num_steps + 1,
                        disable_above_batch_size=0).validate()
    engine = Engine(model=model, device=device, dtype=dtype, progress=progress, spec=spec,
                    max_running_requests=batch)
    prompts = eval_prompt_ids(engine.tokenizer, prompts_file, num_prompts)
    t0 = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    dt = time.perf_counter() - t0
    verify_steps = sum(c.spec_verify_steps for c in done)
    per_position = [0] * num_steps
    for c in done:
        for depth, n in enumerate(c.spec_accepted_per_position):
            per_position[depth] += n
    return SpecResult(len(done), sum(len(c.token_ids) for c in done), verify_steps,
                      sum(c.spec_accepted_drafts for c in done), dt,
                      [n / max(verify_steps, 1) for n in per_position])


@torch.no_grad()
def estimate_accept_length(head, data, embed: torch.Tensor, num_steps: int,
                           seqs: list[int] | None = None, max_batch_tokens: int = 4096,
                           draft_embed_: torch.Tensor | None = None
                           ) -> tuple[float, list[float], int]:
    """(mean accept length, per-step accuracy given the earlier drafts right, roots counted)
    over every chain root whose ``num_steps`` drafts all fall inside the response."""
    head.eval()
    dembed = draft_embed_ if draft_embed_ is not None else draft_embed(head, embed)
    device = dembed.device
    seqs = list(range(len(data))) if seqs is None else list(seqs)
    lengths = [data.length(j) for j in seqs]
    total, roots = 0.0, 0
    reached = torch.zeros(num_steps + 1)  # chains whose first k drafts were all right
    for batch in epoch_batches(lengths, max_batch_tokens, 0, 0):
        stats = ttt_forward(head, collate(data, [seqs[p] for p in batch], device), dembed,
                            num_steps)
        if len(stats.row_valid) < num_steps:
            continue
        full = stats.row_valid[num_steps - 1]  # the last step valid: every step is
        right = torch.stack(stats.row_correct, dim=1)[full].cpu()  # [roots, num_steps]
        run = torch.cumprod(right.long(), dim=1)
        total += float((1 + run.sum(1)).sum())
        roots += int(right.shape[0])
        reached[0] += right.shape[0]
        reached[1:] += run.sum(0).float()
    acc = [float(reached[k + 1] / reached[k]) if reached[k] else 0.0 for k in range(num_steps)]
    return total / max(1, roots), acc, roots


def evaluate_estimate(model_path: Path, head_dir: Path, prompts_file: str, num_prompts: int,
                      max_new_tokens: int, data_dir: Path, num_steps: int = 4,
                      dtype: str = "auto", progress: bool = True, governor=None,
                      device: str = "auto") -> tuple[float, list[float], int]:
    from fmserve.engine import Engine
    from gpu.device import resolve_device
    from gpu.eagle.head_io import load_draft_head

    device = resolve_device(device)
    model_cfg, embed, _, _ = load_target(model_path)
    head = load_draft_head(head_dir, model_cfg, embed, None, device, torch.float32)
    cfg = DataConfig(prompts=prompts_file, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                     sampled_fraction=0.0, shard_size=64)
    engine = Engine(model=str(model_path), device=str(device), dtype=dtype, progress=progress)
    build_dataset(engine, cfg, data_dir, head.config.capture_layers, model_path.name,
                  progress=progress, governor=governor)
    del engine
    return estimate_accept_length(head, load_dataset(data_dir), embed, num_steps)


def evaluate_from_args(args, model_path: Path, head_dir: Path, data_dir: Path,
                       governor=None) -> None:
    progress = not args.no_progress
    device = getattr(args, "device", "auto")
    if args.eval_mode in ("estimate", "both"):
        acc_len, acc, roots = evaluate_estimate(
            model_path, head_dir, args.eval_prompts, args.eval_num_prompts,
            args.eval_max_new_tokens, data_dir, args.num_steps, args.dtype, progress, governor,
            device)
        log(f"eval (ESTIMATE, teacher-forced, {roots} chain roots of {args.eval_num_prompts} "
            f"held-out prompts, on {device}): accept length {acc_len:.3f}; per-step accuracy "
            + " ".join(f"{a:.3f}" for a in acc))
    if args.eval_mode in ("spec", "both"):
        for tree, topk, draft_tokens in eval_spec_shapes(args):
            r = evaluate_spec(str(model_path), head_dir, args.eval_prompts,
                              args.eval_num_prompts, args.eval_max_new_tokens, args.num_steps,
                              args.dtype, progress, device, topk, draft_tokens, args.eval_batch)
            shape = (f"tree of {draft_tokens} tokens ({args.num_steps} steps, topk {topk})"
                     if tree else f"chain of {args.num_steps}")
            log(f"eval (speculative decoding, {r.prompts} held-out prompts, greedy, {shape}, on "
                f"{device}): mean accept length "
                f"{'-' if r.accept_length is None else f'{r.accept_length:.3f}'} over "
                f"{r.verify_steps} verify steps; accepted by draft position "
                + " ".join(f"{a:.3f}" for a in r.per_position)
                + f"; {r.tokens} tokens in {r.seconds:.1f} s "
                f"({r.tokens / max(r.seconds, 1e-9):.1f} tok/s)")


def eval_spec_shapes(args) -> list[tuple[bool, int, int]]:
    """(is a tree, topk, draft tokens) per shape of --eval-shapes; ValueError, saying which
    flag is wrong, for anything the engine could not run."""
    from ipc.spec_settings import SpecSettings

    names = [s.strip() for s in args.eval_shapes.split(",") if s.strip()]
    if not names or any(n not in ("chain", "tree") for n in names):
        raise ValueError(f"--eval-shapes {args.eval_shapes!r}: give chain, tree or chain,tree")
    if "tree" in names and args.eval_topk < 2:
        raise ValueError(f"--eval-topk {args.eval_topk}: a tree needs 2 or more children a node "
                         f"(--eval-shapes chain measures a chain)")
    shapes = [(True, args.eval_topk, args.eval_draft_tokens) if n == "tree"
              else (False, 1, args.num_steps + 1) for n in names]
    for _, topk, draft_tokens in shapes:
        try:
            SpecSettings("eagle3", "", args.num_steps, topk, draft_tokens).validate()
        except ValueError as e:
            raise ValueError(f"the eval setting (--num-steps, --eval-topk, --eval-draft-tokens) is "
                             f"not one the engine can run: {e}") from None
    return shapes
