"""A scheduler with no worker and no model: a word-level tokenizer whose text is easy to predict,
a made-up WorkerInfo, and `run`, which answers every planned step with the next of some tokens.
Shared by the scheduler, prefix-cache, spec-stats and TUI tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models

from ipc.worker_messages import StepResult, WorkerInfo, pack_i32, unpack_i32
from service.request import RequestOutput, TokenOutput
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig, SchedulerCore
from service.tokenizer import TextTokenizer


def word_tokenizer(spelling: str = "<{}>", vocab_size: int = 1000) -> TextTokenizer:
    """A real TextTokenizer whose token t reads spelling.format(t): text is easy to predict."""
    words = {spelling.format(i): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(words, unk_token=spelling.format(0)))
    backend.decoder = decoders.Fuse()  # "<1>" "<2>" -> "<1><2>", no space between
    return TextTokenizer(backend, bos_token=None, eos_tokens=[], eos_token_ids=[],
                         chat_template=None, source=Path("word-level"))


def fake_info(num_pages: int = 128, page_size: int = 4) -> WorkerInfo:
    return WorkerInfo(protocol_version=1, model_name="fake", device="cpu", dtype="fp32",
                      attention_backend="torch", num_layers=2, vocab_size=1000,
                      max_context_len=512, page_size=page_size, num_pages=num_pages,
                      num_slots=5, eos_token_ids=[2])


def make_core(num_pages: int = 128, page_size: int = 4) -> SchedulerCore:
    return SchedulerCore(fake_info(num_pages, page_size), SchedulerConfig())


def make_scheduler(num_pages: int = 128, page_size: int = 4) -> Scheduler:
    """The core with the output text of its requests: token t reads "<t>"."""
    return Scheduler(fake_info(num_pages, page_size), word_tokenizer(), SchedulerConfig())


def run(core: SchedulerCore | Scheduler, tokens: list[int],
        max_steps: int = 500) -> list[RequestOutput | TokenOutput]:
    """Plan and answer steps until nothing can be planned; every sample of a step is the next
    of `tokens` (cycling)."""
    outs: list[RequestOutput] = []
    for step in range(max_steps):
        plan = core.plan_step()
        if plan is None:
            return outs
        sampled = [e.slot for e in plan.extends if e.sample] + unpack_i32(plan.decode_slots).tolist()
        outs += core.process_result(StepResult(
            step_id=plan.step_id, slots=pack_i32(sampled),
            token_ids=pack_i32([tokens[step % len(tokens)]] * len(sampled)), logprobs=b"",
            top_logprobs_n=0, top_logprob_ids=b"", top_logprobs=b"", forward_ms=1.0))
    raise AssertionError(f"still planning after {max_steps} steps")
