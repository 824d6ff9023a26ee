"""Speculative decoding settings, shared by the config, the scheduler and the worker.

`reserve_tokens` is the KV room the scheduler grants each running request beyond the length it
knows: the verify tree and the draft nodes of the step in flight plus those of the step after it
(the one-step lag of overlap scheduling), hence 2 x max(num_steps x topk, num_draft_tokens).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

SpecAlgorithm = Literal["none", "eagle3", "eagle"]  # "eagle": EAGLE-1 heads


def accept_length(accepted_drafts: int, verify_steps: int) -> float | None:
    """Mean tokens per verify step (accepted drafts + the bonus token); None without steps."""
    if not verify_steps:
        return None
    return (accepted_drafts + verify_steps) / verify_steps


class SpecSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """config.toml [spec]. Decoding checks each field's range; `validate` checks them for a
    struct built in code too, and adds the rules that tie fields together."""

    algorithm: SpecAlgorithm = "none"
    draft_model: str = ""  # HF-style head directory; "" = the shipped head for the default model
    num_steps: Annotated[int, Meta(ge=1, le=16)] = 3  # draft depth
    topk: Annotated[int, Meta(ge=1, le=8)] = 1  # children per draft node; 1 = a chain
    # tree nodes verified per step, the root included
    num_draft_tokens: Annotated[int, Meta(ge=2, le=64)] = 4
    # Decode batches with more requests than this run without drafting (0: never): on a busy
    # device verifying num_draft_tokens per request costs more than the accepted drafts save.
    # "auto": drafts per batch size where measured faster (gpu/eagle/spec_gate.py).
    disable_above_batch_size: Annotated[
        Annotated[int, Meta(ge=0, le=1 << 16)] | Literal["auto"],
        Meta(description='must be "auto" or an integer in [0, 65536]')] = "auto"

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @property
    def reserve_tokens(self) -> int:
        if not self.enabled:
            return 0
        return 2 * max(self.num_steps * self.topk, self.num_draft_tokens)

    def validate(self) -> "SpecSettings":
        """Returns self; raises ValueError (msgspec.ValidationError for a field out of range)."""
        try:  # a struct built in code skipped its fields' constraints
            msgspec.convert(msgspec.to_builtins(self), SpecSettings)
        except msgspec.ValidationError as exc:
            problem, _, field = str(exc).partition(" - at `$.")
            field = field.rstrip("`")
            problem = problem.replace("Expected `int` ", "must be ")
            raise msgspec.ValidationError(f"spec.{field} {problem} (got "
                                          f"{getattr(self, field, '?')!r})") from None
        if not self.enabled:
            if self.draft_model:  # else it would be silently ignored
                raise ValueError(f"spec.draft_model {self.draft_model!r} is given but "
                                 f"spec.algorithm is 'none', so it would be ignored: set "
                                 f"spec.algorithm to 'eagle3' or 'eagle' to use it, or leave "
                                 f"spec.draft_model empty")
            return self
        most = self.topk + (self.num_steps - 1) * self.topk ** 2  # candidates the draft makes
        if not 2 <= self.num_draft_tokens <= most + 1:
            raise ValueError(f"spec.num_draft_tokens must be 2..{most + 1} for num_steps="
                             f"{self.num_steps}, topk={self.topk} (got {self.num_draft_tokens}); "
                             f"a chain uses num_steps + 1")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"with spec.topk = 1 (a chain) spec.num_draft_tokens must be "
                             f"num_steps + 1 = {self.num_steps + 1} (got {self.num_draft_tokens})")
        return self
