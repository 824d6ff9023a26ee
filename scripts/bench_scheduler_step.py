"""The scheduler's own Python per decode step, in process and without a worker: plan_step,
process_result (the core and the output text, with the default model's real tokenizer) and the
service's step counters, N requests decoding together. Tokens are replayed from the dev
prompts' text, so detokenizing sees ordinary words.

    .venv/bin/python scripts/bench_scheduler_step.py 1 8 32

Beside `fmserve bench serve`'s "service CPU ms/step" (the service process's whole CPU time a
step) it says how much of that is scheduling and how much the plumbing around it: the
replies, ZMQ and the event loop (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from fmserve.bench import DEV_PROMPTS
from fmserve.default_model import default_model_path
from fmserve.jsonl import read_prompts
from ipc.sampling import SamplingParams
from ipc.worker_messages import StepResult, WorkerInfo, pack_i32, unpack_i32
from service.counters import ServiceCounters
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.tokenizer import TextTokenizer

NEW_TOKENS, PROMPT_TOKENS, RUNS = 96, 40, 7


def decode_step_times(tokenizer: TextTokenizer, info: WorkerInfo, stream: list[int],
                      n: int) -> list[float]:
    """One batch of n requests from admission to the end: the seconds of each step whose
    every request decoded (prefill steps left out)."""
    sched, counters = Scheduler(info, tokenizer, SchedulerConfig()), ServiceCounters()
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    for i in range(n):
        sched.add_request(f"r{i}", stream[i * 50:i * 50 + PROMPT_TOKENS], params)
    times, step = [], 0
    while sched.has_work:
        start = time.perf_counter()
        plan = sched.plan_step()
        if plan is None:
            break
        slots = [e.slot for e in plan.extends if e.sample] + unpack_i32(plan.decode_slots).tolist()
        tokens = [stream[(step + 7 * k) % len(stream)] for k in range(len(slots))]
        result = StepResult(step_id=plan.step_id, slots=pack_i32(slots),
                            token_ids=pack_i32(tokens), logprobs=b"", top_logprobs_n=0,
                            top_logprob_ids=b"", top_logprobs=b"", forward_ms=1.0)
        sched.process_result(result)
        counters.record_step(plan, result, start, True)
        if not plan.extends and len(slots) == n:
            times.append(time.perf_counter() - start)
        step += 1
    return times


def main(levels: list[int]) -> None:
    tokenizer = TextTokenizer.from_model_path(str(default_model_path()))
    texts = [str(p) for p in itertools.islice(read_prompts(str(DEV_PROMPTS)), 64)]
    stream = [t for text in texts for t in tokenizer.encode(text)
              if t not in tokenizer.eos_token_ids]
    info = WorkerInfo(protocol_version=1, model_name="bench", device="cpu", dtype="fp32",
                      attention_backend="torch", num_layers=30, vocab_size=49152,
                      max_context_len=8192, page_size=16, num_pages=4096, num_slots=65,
                      eos_token_ids=list(tokenizer.eos_token_ids))
    for n in levels:
        # The first run warms up; the median step of each later run, then their median.
        runs = [statistics.median(decode_step_times(tokenizer, info, stream, n)) * 1e6
                for _ in range(RUNS)][1:]
        per_step = statistics.median(runs)
        print(f"{n:3d} requests: {per_step:7.0f} us a decode step ({per_step / n:5.1f} us a "
              f"token); runs {[round(r) for r in runs]}")


def request_count(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if not 1 <= n <= 64:  # the made-up worker holds 64 requests
        raise argparse.ArgumentTypeError(f"{text!r} is not a request count from 1 to 64")
    return n


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("levels", nargs="*", type=request_count, default=[1, 8, 32],
                        help="requests decoding together, one run per level (default 1 8 32)")
    main(parser.parse_args().levels)
