"""Host-side checks of a StepPlan before any of it touches the device.

On a GPU an out-of-range index is a device-side assert: it surfaces later, at some other
synchronisation, names no plan field and leaves the CUDA context unusable. Checking the few
integers of a plan on the host costs microseconds and gives the same clear error everywhere.
"""

from __future__ import annotations

import numpy as np

from ipc.worker_messages import StepPlan, unpack_i32


class PlanError(ValueError):
    """A plan the worker cannot apply (a scheduler bug or a corrupted message)."""


def check_plan(plan: StepPlan, num_slots: int, num_pages: int, max_tokens_per_slot: int,
               vocab_size: int) -> None:
    """Raise PlanError naming the first field out of range. Slots are 1..num_slots-1 and
    pages 1..num_pages-1 (0 is padding in both); a slot's tokens fit its row."""
    where = f"plan for step {plan.step_id}"

    def slots_in_range(what: str, slots: np.ndarray) -> None:
        bad = slots[(slots < 1) | (slots >= num_slots)]
        if bad.size:
            raise PlanError(f"{where}: {what} slot {int(bad[0])} is outside 1..{num_slots - 1} "
                            f"(slot 0 is padding)")

    def tokens_in_vocab(what: str, ids: np.ndarray) -> None:
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise PlanError(f"{where}: {what} has token id {int(bad[0])}, outside the "
                            f"vocabulary 0..{vocab_size - 1}")

    slots_in_range("released", unpack_i32(plan.released_slots))
    slots_in_range("decode", unpack_i32(plan.decode_slots))
    slots_in_range("new request", np.array([r.slot for r in plan.new_requests], dtype=np.int64))
    for r in plan.new_requests:
        if len(r.cached_ids) % 4:
            raise PlanError(f"{where}: new request in slot {r.slot} has cached_ids of "
                            f"{len(r.cached_ids)} bytes, not whole int32 token ids")
        tokens_in_vocab(f"new request in slot {r.slot}'s cached_ids", unpack_i32(r.cached_ids))
    for g in plan.grants:
        slots_in_range("page grant", np.array([g.slot]))
        pages = unpack_i32(g.pages)
        bad = pages[(pages < 1) | (pages >= num_pages)]
        if bad.size:
            raise PlanError(f"{where}: page grant for slot {g.slot} names page {int(bad[0])}, "
                            f"outside 1..{num_pages - 1} (page 0 is padding)")
        if g.first_page_index < 0:
            raise PlanError(f"{where}: page grant for slot {g.slot} starts at page index "
                            f"{g.first_page_index} < 0")
    for e in plan.extends:
        slots_in_range("extend", np.array([e.slot]))
        ids = unpack_i32(e.token_ids)
        if e.prefix_len < 0 or e.prefix_len + len(ids) > max_tokens_per_slot:
            raise PlanError(f"{where}: extend of slot {e.slot} covers tokens {e.prefix_len}.."
                            f"{e.prefix_len + len(ids)}, outside 0..{max_tokens_per_slot}")
        tokens_in_vocab(f"extend of slot {e.slot}", ids)
