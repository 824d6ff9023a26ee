"""FutureMap invariants: the write/read alternation check fails loudly on WW and read-before-write."""

from __future__ import annotations

import pytest
import torch

from gpu.future_map import EMPTY, FutureMap, FutureMapInvariantError


def slots(*s: int) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.long)


@pytest.fixture
def fm() -> FutureMap:
    return FutureMap(num_slots=6, device=torch.device("cpu"), wrwr_check=True)


def test_buffer_starts_empty(fm):
    assert torch.all(fm.output_tokens_buf == EMPTY)


def test_write_read_write_read_passes_and_clears(fm):
    for step in range(3):
        fm.stash(slots(1, 3), torch.tensor([10 + step, 20 + step]))
        assert fm.resolve_future(slots(3, 1)).tolist() == [20 + step, 10 + step]
        assert fm.output_tokens_buf[[1, 3]].tolist() == [EMPTY, EMPTY]


def test_double_write_fails(fm):
    fm.stash(slots(2), torch.tensor([5]))
    with pytest.raises(FutureMapInvariantError, match="double write"):
        fm.stash(slots(2), torch.tensor([6]))


def test_read_before_write_fails(fm):
    with pytest.raises(FutureMapInvariantError, match="read before write"):
        fm.resolve_future(slots(4))
    fm.stash(slots(4), torch.tensor([7]))
    fm.resolve_future(slots(4))
    with pytest.raises(FutureMapInvariantError, match="read before write"):
        fm.resolve_future(slots(4))  # the second read of one write


def test_release_forgets_an_unread_token(fm):
    fm.stash(slots(5), torch.tensor([9]))
    fm.release(slots(5))
    fm.stash(slots(5), torch.tensor([11]))  # a new request in the slot: no WW
    assert fm.resolve_future(slots(5)).tolist() == [11]


def test_resolved_lengths_must_be_positive(fm):
    fm.publish(slots(1, 2), torch.tensor([4, 9]))
    assert fm.resolve_seq_lens(slots(2, 1)).tolist() == [9, 4]
    with pytest.raises(FutureMapInvariantError, match="length <= 0"):
        fm.resolve_seq_lens(slots(3))


def test_cpu_lengths_only_when_a_backend_needs_them():
    lens = torch.tensor([3, 5])
    assert FutureMap.resolve_seq_lens_cpu(lens, needs_cpu=False) == (None, None)
    cpu, total = FutureMap.resolve_seq_lens_cpu(lens, needs_cpu=True)
    assert cpu.tolist() == [3, 5] and total == 8


def test_check_off_does_not_police(fm):
    loose = FutureMap(num_slots=4, device=torch.device("cpu"), wrwr_check=False)
    loose.stash(slots(1), torch.tensor([1]))
    loose.stash(slots(1), torch.tensor([2]))
    assert loose.resolve_future(slots(1)).tolist() == [2]
