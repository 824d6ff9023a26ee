"""Plans are checked on the host before they touch the device: each bad field is named."""

import pytest

from gpu.plan_check import PlanError, check_plan
from ipc.sampling import SamplingParams
from ipc.worker_messages import ExtendEntry, NewRequest, PageGrant, StepPlan, pack_i32

LIMITS = dict(num_slots=5, num_pages=9, max_tokens_per_slot=64, vocab_size=100)
EMPTY = pack_i32([])


def plan(**fields) -> StepPlan:
    base = dict(step_id=7, new_requests=[], grants=[], extends=[], decode_slots=EMPTY,
                released_slots=EMPTY)
    return StepPlan(**(base | fields))


def test_a_good_plan_passes():
    check_plan(plan(new_requests=[NewRequest(1, SamplingParams())],
                    grants=[PageGrant(1, 0, pack_i32([1, 8]))],
                    extends=[ExtendEntry(1, 0, pack_i32([5, 99]), True)],
                    decode_slots=pack_i32([2, 4]), released_slots=pack_i32([3])), **LIMITS)


@pytest.mark.parametrize("fields, message", [
    (dict(decode_slots=pack_i32([2, 5])), "decode slot 5 is outside 1..4"),
    (dict(released_slots=pack_i32([0])), "released slot 0 is outside 1..4"),
    (dict(new_requests=[NewRequest(9, SamplingParams())]), "new request slot 9"),
    (dict(grants=[PageGrant(1, 0, pack_i32([3, 9]))]), "names page 9, outside 1..8"),
    (dict(grants=[PageGrant(1, -1, pack_i32([3]))]), "starts at page index -1"),
    (dict(extends=[ExtendEntry(2, 60, pack_i32([1] * 5), True)]), "tokens 60..65, outside"),
    (dict(extends=[ExtendEntry(2, 0, pack_i32([1, 100]), True)]), "token id 100"),
    (dict(new_requests=[NewRequest(1, SamplingParams(), 3, pack_i32([4, -1]))]),
     "slot 1's cached_ids has token id -1"),
    (dict(new_requests=[NewRequest(1, SamplingParams(), 3, b"\x01\x02")]),
     "cached_ids of 2 bytes"),
])
def test_bad_fields_are_named(fields, message):
    with pytest.raises(PlanError, match="plan for step 7: .*" + message.replace(".", r"\.")):
        check_plan(plan(**fields), **LIMITS)
