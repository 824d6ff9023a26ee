"""RoPE frequency scaling, in one place: the kinds we run, their frequencies and cos/sin scale,
and their config.json form (read by the model and EAGLE head loaders, written by head export).

Kinds, as transformers names them: "llama3" (Llama 3.1+: long wavelengths slowed by `factor`,
short ones kept, a smooth blend between), "linear" (every frequency divided by `factor`) and
"yarn" (Qwen2.5/Qwen3 long context: a ramp between interpolated and original frequencies,
cos/sin scaled by `attention_factor`). "dynamic" NTK is refused: its frequencies depend on the
longest sequence of each forward, which a paged batch of many requests does not have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.loader.errors import ModelLoadError

ROPE_SCALING_KINDS = ("llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    kind: str = "llama3"
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: 0.1 ln(factor) + 1

    def cos_sin_scale(self) -> float:
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def to_hf(self) -> dict:
        """The config.json "rope_scaling" object transformers reads back as this scaling."""
        out = {"rope_type": self.kind, "factor": self.factor,
               "original_max_position_embeddings": self.original_max_position_embeddings}
        if self.kind == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor,
                    "high_freq_factor": self.high_freq_factor}
        elif self.kind == "yarn":
            out |= {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        else:
            del out["original_max_position_embeddings"]
        return out


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, scaled as `scaling` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    s = scaling
    if s.kind == "linear":
        return (inv_freq / s.factor).float()
    if s.kind == "yarn":
        def dim_for(rotations: float) -> float:  # the dim that turns `rotations` times
            return (head_dim * math.log(s.original_max_position_embeddings
                                        / (rotations * 2 * math.pi))) / (2 * math.log(theta))
        low = max(math.floor(dim_for(s.beta_fast)), 0)
        high = min(math.ceil(dim_for(s.beta_slow)), head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low)
                / max(high - low, 0.001)).clamp(0, 1)
        return (inv_freq / s.factor * ramp + inv_freq * (1 - ramp)).float()
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, scaled).float()


def rope_scaling_from_hf(params: dict, max_position_embeddings: int | None,
                         config_file: Path) -> RopeScaling | None:
    """A config.json "rope_scaling" (or transformers 5 "rope_parameters") object; None for
    plain RoPE. ModelLoadError naming the file for a kind or key we cannot use."""
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_KINDS:
        raise ModelLoadError(f"{config_file}: rope scaling type '{kind}' is not supported; "
                             f"supported: {', '.join(ROPE_SCALING_KINDS)}")
    if params.get("mscale") or params.get("mscale_all_dim") or params.get("truncate") is False:
        raise ModelLoadError(f"{config_file}: yarn's mscale, mscale_all_dim and truncate are "
                             f"not supported")
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    try:
        factor = params.get("factor")
        if factor is None and kind == "yarn" and original:
            factor = max_position_embeddings / original  # transformers' rule when it is left out
        fields = {"factor": float(factor), "kind": kind}
        if kind == "llama3":
            fields |= {"low_freq_factor": float(params["low_freq_factor"]),
                       "high_freq_factor": float(params["high_freq_factor"]),
                       "original_max_position_embeddings": int(
                           params["original_max_position_embeddings"])}
        elif kind == "yarn":
            attention = params.get("attention_factor")
            fields |= {"original_max_position_embeddings": int(original),
                       "beta_fast": float(params.get("beta_fast") or 32),
                       "beta_slow": float(params.get("beta_slow") or 1),
                       "attention_factor": None if attention is None else float(attention)}
    except KeyError as e:
        raise ModelLoadError(f"{config_file}: {kind} rope scaling lacks the key {e}") from e
    except TypeError as e:
        raise ModelLoadError(f"{config_file}: {kind} rope scaling lacks 'factor' or has a "
                             f"value of the wrong type ({e})") from e
    return RopeScaling(**fields)
