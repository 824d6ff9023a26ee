"""argparse types that refuse nonsense while the command line is parsed, before a model loads or
a benchmark starts: argparse then names the flag, prints the usage and exits with status 2.

    p.add_argument("--concurrency", type=positive_int, default=8)
    p.add_argument("--batch-sizes", type=positive_int_list, default="1,8,32")
"""

from __future__ import annotations

import argparse
import math


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be at least {least}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def batch_limit(text: str) -> int | str:
    """spec.disable_above_batch_size on a command line: "auto" or an integer >= 0."""
    return "auto" if text.strip() == "auto" else _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number above 0 (a rate, a duration)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


def non_negative_float(text: str) -> float:
    """0 (off) or a finite number above 0 (a period)."""
    try:
        return 0.0 if float(text) == 0 else positive_float(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 (off) or a finite number "
                                         f"above 0") from None


def fraction(text: str) -> float:
    """A number from 0 to 1 (a probability: top-p, min-p)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} must be a number from 0 to 1")
    return value


def positive_int_list(text: str) -> str:
    """Comma-separated positive integers ("1,8,32"), handed on as the text: the commands split it
    themselves (and the reports print it as given)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give numbers separated by commas, e.g. 1,8,32")
    for part in text.split(","):
        try:
            positive_int(part.strip())
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}; give numbers of at least 1 "
                                             f"separated by commas, e.g. 1,8,32") from None
    return text


DTYPES = ["auto", "bf16", "fp32", "fp16"]


def add_runtime_args(p, dtype: str | None = "auto", attention: bool = True, checked: bool = True,
                     model_help: str = "a .gguf file, a Hugging Face model directory, "
                                       "'default' (SmolLM2-135M-Instruct) or 'gemma3-270m' "
                                       "(Google's Gemma 3 270M base model, Gemma terms); both "
                                       "fetched on first use",
                     device_help: str = "auto, cpu, cuda or cuda:N",
                     dtype_help: str = "auto: bf16 on a GPU or a CPU with native bf16 (AMX, "
                                       "AVX512-BF16), else fp32") -> None:
    """--model, --device, --dtype (none where `dtype` is None) and --attention-backend: the
    flags of every command that loads a model, with its own defaults and help where they differ.
    checked=False: no choices, the values are checked later by the config they go into."""
    p.add_argument("--model", default="default", help=model_help)
    p.add_argument("--device", default="auto", help=device_help)
    if dtype is not None:
        p.add_argument("--dtype", default=dtype, choices=DTYPES if checked else None,
                       help=dtype_help)
    if attention:
        p.add_argument("--attention-backend", default="auto",
                       choices=["auto", "torch", "triton"] if checked else None,
                       help="auto: triton on CUDA (its kernels read no host lengths, so "
                            "decode batches replay CUDA graphs), torch on a CPU")


def endpoint(text: str) -> str:
    """A ZMQ endpoint, by the config's rule (ZMQ's own error for a bad one is a traceback)."""
    from service.config import ConfigError, check_endpoint

    try:
        return check_endpoint(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
