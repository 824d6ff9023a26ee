"""What a step is between its halves: prepared (plan applied, batch built), then pending
(launched, its result on its way to the host). Shared by PlainStep, EagleStep and the Worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.forward_batch import ForwardBatch
from gpu.step_streams import ForwardSpan, HostCopy
from ipc.worker_messages import StepPlan


@dataclass
class PreparedStep:
    """A plan applied and its batch built (`prepare`), its forward not launched yet."""

    plan: StepPlan
    prepare_s: float = 0.0  # host time spent preparing
    # None: an EAGLE step, which builds its batches in launch (unless it runs as the plain step)
    batch: ForwardBatch | None = None
    sample_rows: torch.Tensor | None = None
    sample_slots_host: np.ndarray | None = None  # the sampled slots, for a sync-free sampler


@dataclass
class PendingStep:
    """A launched step whose result is still on its way (`launch` / `finish`)."""

    step_id: int
    launch_end: float = 0.0  # host clock when launching returned
    busy_s: float = 0.0  # host time preparing and launching (on the CPU: computing)
    copy: HostCopy | None = None  # None: nothing to copy (an idle plain step)
    span: ForwardSpan | None = None  # device timing (GPU)
    parts: Any = None  # what the step class needs to pack its result (EagleStep: its parts)
    n_top: int = 0  # top logprobs per token (PlainStep)
    decode_s: float = 0.0  # host time of the decode part's forwards (EagleStep's gate)
    headless: bool = False  # an EagleStep's step run by its plain step (headless_steps.py)
    decode_compile: str = "off"  # the compiled decode step's state at launch (StepResult's)
