"""Counter-based random numbers for sampling: a draw hashes (seed, position, token id) into a
uniform, so a seeded request draws the same tokens alone or in any batch (see gpu/sampler.py).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu.sync_guard import expected_sync

# ---------------------------------------------------------------------------------------------
# Counter-based random numbers. A draw (seed, position, stream) gets a 64-bit key from two
# rounds of splitmix64 in int64 ([bs] elements: cheap); each token then mixes its id with the
# key's low 32 bits through murmur3's fmix32 in int32, because the per-token work runs over up
# to [bs, vocab] elements and 32-bit ops cost half as much. Integer multiplication wraps.


def _wrap(x: int, bits: int) -> int:
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >= 1 << (bits - 1) else x


# splitmix64's constants, unsigned (numpy's uint64 on the host) and as int64 (torch's ops)
_GOLDEN64_BITS, _MIX64_1_BITS, _MIX64_2_BITS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                0x94D049BB133111EB)
_GOLDEN64 = _wrap(_GOLDEN64_BITS, 64)
_MIX64_1 = _wrap(_MIX64_1_BITS, 64)
_MIX64_2 = _wrap(_MIX64_2_BITS, 64)
_GOLDEN32 = _wrap(0x9E3779B9, 32)
_FMIX32_1 = _wrap(0x85EBCA6B, 32)
_FMIX32_2 = _wrap(0xC2B2AE35, 32)


def _shr(z: torch.Tensor, s: int, bits: int) -> torch.Tensor:
    """Logical right shift: torch's ``>>`` is arithmetic, so mask the sign copies off."""
    return (z >> s).bitwise_and_((1 << (bits - s)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, in place on int64."""
    z.bitwise_xor_(_shr(z, 30, 64)).mul_(_MIX64_1)
    z.bitwise_xor_(_shr(z, 27, 64)).mul_(_MIX64_2)
    return z.bitwise_xor_(_shr(z, 31, 64))


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser, in place on int32."""
    h.bitwise_xor_(_shr(h, 16, 32)).mul_(_FMIX32_1)
    h.bitwise_xor_(_shr(h, 13, 32)).mul_(_FMIX32_2)
    return h.bitwise_xor_(_shr(h, 16, 32))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One int64 key per draw. `stream` separates independent uses of the same (seed,
    position): token sampling is stream 0; speculative acceptance can use stream 1. On the CPU
    in numpy's uint64, which wraps as the hash wants: the same keys as torch's ~15 int64 ops,
    in a third of the time (57 us of a sampled one-stream step, ~1% of SmolLM2's)."""
    if seeds.device.type == "cpu" and positions.device.type == "cpu":
        with expected_sync():  # host tensors: nothing waits for a device
            seeds, positions = seeds.numpy(), positions.numpy()
        return torch.from_numpy(_row_keys_host(seeds, positions, stream))
    return _row_keys_device(seeds, positions, stream)


def _row_keys_device(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    z = seeds.long() + _wrap((stream + 1) * _GOLDEN64_BITS, 64)
    _mix64_(z)
    z += (positions.long() + 1) * _GOLDEN64
    return _mix64_(z)


def _mix64_host(z: np.ndarray) -> np.ndarray:
    """_mix64_ on uint64 arrays (numpy's array arithmetic wraps silently)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX64_1_BITS)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX64_2_BITS)
    return z ^ (z >> np.uint64(31))


def _row_keys_host(seeds: np.ndarray, positions: np.ndarray, stream: int) -> np.ndarray:
    z = seeds.astype(np.int64).view(np.uint64) + np.uint64((stream + 1) * _GOLDEN64_BITS
                                                            & (2**64 - 1))
    z = _mix64_host(z)
    z += (positions.astype(np.int64).view(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN64_BITS)
    return _mix64_host(z).view(np.int64)


def token_terms(token_ids: torch.Tensor) -> torch.Tensor:
    return (token_ids.int() + 1).mul_(_GOLDEN32)


def uniform_from_terms(keys: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [2**-24, 1 - 2**-24] (so -log(-log u) is finite), one per term."""
    h = _fmix32_(terms ^ keys.to(torch.int32)[:, None])  # the key's low 32 bits
    # The top 23 bits, signed: [-2**22, 2**22) -> exact in float32 -> centred in (0, 1).
    return (h >> 9).float().add_(2.0**22 + 0.5).mul_(2.0**-23)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
                   stream: int = 0) -> torch.Tensor:
    """Uniform(0, 1) per (row, column), a pure function of (seed, position, token id, stream).
    seeds, positions: [bs]; token_ids: [bs, n] or [n]. Returns float32 [bs, n]."""
    return uniform_from_terms(row_keys(seeds, positions, stream), token_terms(token_ids))


def gumbel_(u: torch.Tensor) -> torch.Tensor:
    return u.log_().neg_().log_().neg_()
