"""The offline engine: the service's scheduler core and the worker (gpu/worker.py) in one process.

    engine = Engine(model="default", dtype="auto")
    for out in engine.stream(["Hello"], SamplingParams(max_new_tokens=32)):
        print(out.text, end="")

Prompts are text (encoded as is), token ids, or chats (lists of {"role", "content"} dicts,
rendered with the model's chat template). No sockets: plans go straight to the worker.
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from fmserve.default_model import resolve_draft_model, resolve_model_path
from gpu.worker import Worker
from ipc.sampling import SamplingParams
from ipc.spec_settings import accept_length
from ipc.worker_config import WorkerConfig, worker_config
from service.request import FinishReason, RequestOutput
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.tokenizer import TextTokenizer

Prompt = str | Sequence[int] | Sequence[dict]


@dataclass
class Completion:
    rid: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list = field(default_factory=list)
    spec_verify_steps: int = 0  # speculative decoding: verify steps and accepted drafts
    spec_accepted_drafts: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)  # verify steps that
    # accepted the draft at depth i+1, one entry per draft position

    @property
    def spec_accept_length(self) -> float | None:
        """Tokens per verify step (accepted drafts + the bonus token)."""
        return accept_length(self.spec_accepted_drafts, self.spec_verify_steps)


def _finish_builds(worker: "weakref.ref[Worker]") -> None:
    if (alive := worker()) is not None:
        alive.finish_background_compile()


class Engine:
    def __init__(self, model: str | None = None, *, config: WorkerConfig | None = None,
                 overlap: bool = False, prefix_cache: bool = False,
                 background_compile: bool = False, **settings) -> None:
        """`model` is what --model takes ("default", a .gguf, a model directory; None: the
        config's). `config` (default: every default) is the worker's, with any setting also
        given by its flat name (ipc/worker_config.py: dtype="fp32", spec=SpecSettings(...)).
        `overlap` and `prefix_cache` are the scheduler's, as in config.toml [scheduling].
        `background_compile`: return before the compiled decode step is built, as the worker
        process does (gpu/background_compile.py); decode steps run eagerly until it is."""
        cfg = worker_config(config, **settings)
        if cfg.parallel.dp != 1:
            raise ValueError(f"parallel.dp = {cfg.parallel.dp}: the offline engine runs one "
                             f"worker in this process; data-parallel replicas are for `fmserve "
                             f"serve --dp {cfg.parallel.dp}`")
        model = model if model is not None else cfg.model.path
        path = resolve_model_path(model)
        spec = cfg.spec
        if spec.enabled:
            spec = msgspec.structs.replace(spec, draft_model=str(resolve_draft_model(
                spec.algorithm, spec.draft_model, model)))
        cfg = worker_config(cfg, model_path=str(path), spec=spec)
        self.tokenizer = TextTokenizer.from_model_path(path)
        self.worker = Worker(cfg, background_compile)
        self.worker.start_background_compile()
        # A bucket still building at exit is waited for: its thread killed inside the
        # compiler aborted the interpreter ("terminate called without an active exception").
        atexit.register(_finish_builds, weakref.ref(self.worker))
        self.info = self.worker.info()
        self.scheduler = Scheduler(self.info, self.tokenizer, SchedulerConfig(
            max_tokens_per_step=cfg.runtime.max_tokens_per_step, prefix_cache=prefix_cache))
        self._ids = itertools.count()
        # With overlap, plan k+1 is made and launched before step k's result is processed,
        # exactly as the service does. On a GPU the device runs step k while plan k+1 is built
        # and enqueued; on the CPU it runs the same logic without parallelism.
        self.overlap = overlap

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):  # with the model's BOS where it has one, as the service
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return self.tokenizer.encode_chat(items, add_generation_prompt=True)
        return [int(t) for t in items]

    def submit(self, prompts: Iterable[Prompt],
               params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
               ) -> list[tuple[str, list[int]]]:
        """Queue prompts; returns (request id, prompt ids) per prompt. Bad ones raise."""
        prompts = list(prompts)
        per_request = params if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_request)} sampling params")
        submitted = []
        for prompt, p in zip(prompts, per_request):
            rid, ids = f"r{next(self._ids)}", self.encode(prompt)
            self.scheduler.add_request(rid, ids, p)
            submitted.append((rid, ids))
        return submitted

    def run(self) -> Iterator[RequestOutput]:
        """Step until every queued request has finished, yielding outputs as they come."""
        depth = 2 if self.overlap else 1
        inflight: deque = deque()  # results of plans sent but not yet processed
        while self.scheduler.has_work or inflight:
            if len(inflight) < depth and self.scheduler.has_work:
                plan = self.scheduler.plan_step()
                if plan is not None:
                    inflight.append(self.worker.launch(plan))
                    continue
            if not inflight:
                raise RuntimeError("the scheduler has requests but could plan nothing: "
                                   f"{self.scheduler.accounting()}")
            yield from self.scheduler.process_result(self.worker.finish(inflight.popleft()))

    def stream(self, prompts: Iterable[Prompt],
               params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
               ) -> Iterator[RequestOutput]:
        """Run the prompts as one continuous batch, yielding outputs as steps produce them."""
        self.submit(prompts, params)
        yield from self.run()

    def generate(self, prompts: Iterable[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
                 ) -> list[Completion]:
        """Like `stream`, but collected: one Completion per prompt, in prompt order."""
        submitted = self.submit(prompts, params)
        done = {rid: Completion(rid, ids) for rid, ids in submitted}
        for out in self.run():
            c = done[out.rid]
            c.token_ids += out.token_ids
            c.text += out.text
            if out.logprobs:
                c.logprobs += out.logprobs
            if out.finished:
                c.finish_reason = out.finish_reason
                c.spec_verify_steps = out.spec_verify_steps
                c.spec_accepted_drafts = out.spec_accepted_drafts
                c.spec_accepted_per_position = out.spec_accepted_per_position
        return [done[rid] for rid, _ in submitted]
