"""The SchedulerCore (tokens, KV pages, slots) and the OutputText of its requests, joined: what
the service (service/server.py) and the offline Engine (fmserve/engine.py) drive.

The one hand-off between the two: when the text of a token completes a stop string,
`SchedulerCore.end_at_stop_string` ends the request there, within the same result, before any
later plan is made.
"""

from __future__ import annotations

from ipc.sampling import SamplingParams
from ipc.worker_messages import StepPlan, StepResult, WorkerInfo
from service.output_text import OutputText, StepLogprobs
from service.request import RequestOutput
from service.scheduler_core import SchedulerConfig, SchedulerCore
from service.tokenizer import TextTokenizer


class Scheduler:
    def __init__(self, info: WorkerInfo, tokenizer: TextTokenizer, cfg: SchedulerConfig) -> None:
        self.core = SchedulerCore(info, cfg)
        self.text = OutputText(tokenizer)

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def accounting(self) -> dict[str, int]:
        return self.core.accounting()

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.core.add_request(rid, prompt_ids, params)  # RequestRejected: nothing is kept
        self.text.open(rid, params)

    def abort(self, rid: str) -> RequestOutput | None:
        """End a request now. Returns its terminal output, or None if the id is unknown."""
        end = self.core.abort(rid)
        return None if end is None else self.text.output(end, "", None)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The worker died: every request ends with an error; accounting returns to empty."""
        return [self.text.output(end, "", None) for end in self.core.fail_all(message)]

    def plan_step(self) -> StepPlan | None:
        return self.core.plan_step()

    def process_result(self, result: StepResult) -> list[RequestOutput]:
        logprobs = StepLogprobs.of(result)
        outputs = []
        for out in self.core.process_result(result):
            text, keep = self.text.push(out)
            if keep is not None:
                out = self.core.end_at_stop_string(out, keep)
            outputs.append(self.text.output(out, text, logprobs))
        return outputs
