"""The draws' per-row keys (gpu/seeded_random.py row_keys): splitmix64 of (seed, position,
stream), against the same two rounds written here with Python's unbounded ints."""

from __future__ import annotations

import pytest
import torch

from gpu import seeded_random

MASK = 2**64 - 1


def splitmix_key(seed: int, position: int, stream: int) -> int:
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)
    z = mix((seed + (stream + 1) * 0x9E3779B97F4A7C15) & MASK)
    z = mix((z + (position + 1) * 0x9E3779B97F4A7C15) & MASK)
    return z - 2**64 if z >= 2**63 else z  # as int64


SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 12345678901234, -987654321]
POSITIONS = [0, 5, 2**31 - 1, 7, 100000, 3, 1]


@pytest.mark.parametrize("stream", [0, 1])
@pytest.mark.parametrize("position_dtype", [torch.int32, torch.int64])
def test_row_keys_are_splitmix64_of_seed_and_position_on_the_host_and_the_device_path(
        stream, position_dtype):
    """The host path (numpy uint64, what a CPU runs) and the device path (torch int64 ops, a
    GPU's) give the reference's keys, int64 wrap-around included; the seeds come as a column
    of the sampler's int table (a strided view), as the sampler passes them."""
    table = torch.zeros(len(SEEDS), 3, dtype=torch.int64)
    table[:, 1] = torch.tensor(SEEDS)
    seeds, positions = table[:, 1], torch.tensor(POSITIONS, dtype=position_dtype)
    want = [splitmix_key(s, p, stream) for s, p in zip(SEEDS, POSITIONS)]
    host = seeded_random.row_keys(seeds, positions, stream)
    assert host.dtype == torch.int64 and host.tolist() == want
    assert seeded_random._row_keys_device(seeds, positions, stream).tolist() == want
    assert table[:, 1].tolist() == SEEDS  # the table is not written
