"""The sampler's Gumbel noise and draws in C on a CPU (gpu/csrc/gumbel.c, sample_cut.c).

torch computes a draw's noise (gpu/seeded_random.py: a hash of seed, position and token id,
a uniform, -log(-log u)) as ~20 passes over [rows, vocab]; at 32 rows of SmolLM2's 49,152
tokens that is ~4 ms a decode step. Here the noise is one pass (`gumbel_noise`), and a draw
writes none of it: `cut_draw` gathers the tokens near each row's best (those its top-k, top-p
or min-p keep, or any noise can lift to the top), and draws argmax(logit / T + noise) over
them. Where the lm_head is 8-bit codes, a batch that only scales by temperature
(`BatchFlags.noise_only`) is drawn without writing the logits either (`lm_head_draw`: the
lm_head's tiles draw as they go, and skip the noise of a tile whose largest logit is further
below the row's best score than any noise reaches). On a CPU the sampler takes all its noise
from here, so every path of a batch draws the same tokens for a seeded request; elsewhere (a
GPU, no C compiler) it stays torch's.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache

import torch

from gpu.codes_layout import Q8Rows
from gpu.cpu_q4_kernel import library


@cache
def _library(isa: str = "native") -> ctypes.CDLL | None:
    """The library, its sampling functions typed; `isa` as gpu/cpu_q4_kernel.py's (the tests
    run the AVX2 and plain-C builds too)."""
    lib = library(isa)
    if lib is None:
        return None
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.gumbel_noise.restype = None
    lib.gumbel_noise.argtypes = [P, I, P, I, P, I]
    lib.cut_draw.restype = ctypes.c_int
    lib.cut_draw.argtypes = [P, I, I] + [P] * 7 + [I]
    lib.q8_matmul_draw.restype = ctypes.c_int
    lib.q8_matmul_draw.argtypes = [P, I, I, P, P] + [I] * 5 + [P] * 4 + [I]
    return lib


def available(device: torch.device) -> bool:
    """Whether the sampler takes its noise from C: on a CPU with the library built."""
    return device.type == "cpu" and _library() is not None


def gumbel_noise(keys: torch.Tensor, ids: torch.Tensor | None, n: int) -> torch.Tensor:
    """float32 [rows, n]: the noise of row r's draw (keys [rows] int64, from
    `seeded_random.row_keys`) for token ids[r, j], or for token j where ids is None; the values
    of `seeded_random.gumbel_(uniform_from_terms(keys, token_terms(ids)))` to ~1 ulp."""
    keys = keys.to(torch.int64).contiguous()
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        if ids.shape != (keys.shape[0], n):  # the C loop reads rows x n ids
            raise ValueError(f"ids of shape {tuple(ids.shape)} for {keys.shape[0]} keys and "
                             f"n={n}: give [keys, n] token ids")
    out = torch.empty(keys.shape[0], n, dtype=torch.float32)
    _library().gumbel_noise(keys.data_ptr(), keys.shape[0],
                            None if ids is None else ids.data_ptr(), n, out.data_ptr(),
                            torch.get_num_threads())
    return out


def _per_row(rows: int, draw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperatures, keys, greedy) as the C functions read them, one of each per row."""
    if any(t.shape != (rows,) for t in draw):
        raise ValueError(f"a draw wants one temperature, key and greedy flag per row ({rows}); "
                         f"got shapes {[tuple(t.shape) for t in draw]}")
    return (draw[0].to(torch.float32).contiguous(), draw[1].to(torch.int64).contiguous(),
            draw[2].to(torch.uint8).contiguous())


def cut_draw(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor,
             greedy: torch.Tensor, cuts: tuple[torch.Tensor, ...] | None = None,
             isa: str = "native") -> torch.Tensor:
    """int64 [rows]: each row's draw, argmax(logits / T + gumbel_noise(keys, None, vocab)) over
    the tokens its cuts keep (gpu/csrc/sample_cut.c; the sampler's rules), or the logits'
    argmax where `greedy`, from float32 logits [rows, vocab]; neither the noise nor a scaled
    copy is written. `cuts`: (top_k, top_p, log_min_p) per row, where top_k <= 0, top_p = inf
    and log_min_p = -inf mean no such cut; None: no row cuts."""
    logits = logits.contiguous()
    if logits.dtype != torch.float32:
        raise TypeError(f"cut_draw takes float32 logits, not {logits.dtype}")
    rows, vocab = logits.shape
    temperatures, keys, greedy = _per_row(rows, (temperatures, keys, greedy))
    if cuts is None:
        cuts = (torch.zeros(rows), torch.full((rows,), math.inf),
                torch.full((rows,), -math.inf))
    if any(t.shape != (rows,) for t in cuts):
        raise ValueError(f"a cut wants one top_k, top_p and log_min_p per row ({rows}); got "
                         f"shapes {[tuple(t.shape) for t in cuts]}")
    cuts = (cuts[0].to(torch.int32).contiguous(), cuts[1].to(torch.float32).contiguous(),
            cuts[2].to(torch.float32).contiguous())
    tokens = torch.empty(rows, dtype=torch.int64)
    if _library(isa).cut_draw(logits.data_ptr(), rows, vocab, temperatures.data_ptr(),
                           *(t.data_ptr() for t in cuts), keys.data_ptr(), greedy.data_ptr(),
                           tokens.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError(f"the C sampler could not allocate for a row of {vocab} tokens")
    return tokens


def lm_head_draw(x: torch.Tensor, w: Q8Rows,
                 draw: tuple[torch.Tensor, torch.Tensor, torch.Tensor], isa: str = "native"
                 ) -> torch.Tensor:
    """int64 [rows]: cut_draw(x @ w^T, *draw) for draw = (temperatures, keys, greedy),
    the same tokens, from fp32 x [rows, width], without writing the product."""
    x = x.float().contiguous()
    rows, width = x.shape
    if width != w.codes.shape[1]:
        raise ValueError(f"input width {width} does not match the weight's {w.codes.shape[1]}")
    temperatures, keys, greedy = _per_row(rows, draw)
    tokens = torch.empty(rows, dtype=torch.int64)
    if _library(isa).q8_matmul_draw(
            x.data_ptr(), rows, width, w.codes.data_ptr(), w.scale.data_ptr(), w.fp16,
            w.halves, w.narrow, w.codes.shape[0], w.out, temperatures.data_ptr(),
            keys.data_ptr(), greedy.data_ptr(), tokens.data_ptr(),
            torch.get_num_threads()) != 0:
        raise MemoryError(f"the C 8-bit kernel could not allocate for {rows} x {width}")
    return tokens
