"""Per-request sampling parameters and stop conditions, as they travel on the wire.

Semantics follow HF / vLLM / OpenAI where they agree:
- ``temperature`` 0 means greedy (argmax), and so does one below 1e-5 or a ``top_p`` below
  1e-8; ``top_k`` 0 or -1 means no top-k cut.
- Filters run in the order top-k -> top-p -> min-p (HF and SGLang); min-p keeps tokens whose
  probability is at least ``min_p`` times the most likely token's.
- ``repetition_penalty`` (HF/vLLM) divides positive and multiplies negative logits of every
  token seen in the prompt or the output so far; ``frequency_penalty`` and
  ``presence_penalty`` (OpenAI/vLLM) subtract ``count * f + (count > 0) * p`` over generated
  tokens only.
- ``seed`` makes sampling reproducible and independent of batch composition; without one the
  worker draws a random seed when the request is admitted.
"""

from __future__ import annotations

import math

import msgspec

MAX_LOGPROBS = 20  # top-n alternatives a request may ask for (OpenAI's limit)
MAX_SEED = 2**63  # seeds live in an int64 on the device
MAX_NEW_TOKENS = 2**63  # min_new_tokens lives in an int64 on the device (so it is < this)
# Stop conditions are checked for every token on the service's event loop, which all clients
# share: bounded so one request cannot stall the others (OpenAI allows 4 stop strings).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512  # per stop string
MAX_STOP_TOKEN_IDS = 256
# Below these a request is greedy: that is what such values mean (a top_p under 1 / vocab keeps
# only the most likely token), and the worker's float32 copies would break on them (logits / T
# overflows to inf and samples token 0; a top_p that rounds to 0 keeps no token and crashed it).
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM
GREEDY_BELOW_TOP_P = 1e-8  # < 1 / vocab for any vocabulary under 10^8 tokens


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + generated tokens; 1 = off
    frequency_penalty: float = 0.0  # over generated tokens; 0 = off
    presence_penalty: float = 0.0  # over generated tokens; 0 = off
    seed: int | None = None
    logprobs: int | None = None  # None = off; 0 = sampled token only; n = also the top n
    max_new_tokens: int = 256
    min_new_tokens: int = 0  # eos and stop_token_ids are suppressed until this many tokens
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (or nearly), or a top-k of 1 or a top-p so small
        that only the argmax is left."""
        return (self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
                or self.top_p < GREEDY_BELOW_TOP_P)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field, its value and the allowed range."""

        def bad(field: str, value, allowed: str) -> ValueError:
            return ValueError(f"sampling parameter {field}={value!r} is invalid: {allowed}")

        t = self.temperature
        if not (math.isfinite(t) and t >= 0.0):
            raise bad("temperature", t, "must be a finite number >= 0 (0 means greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", self.top_p, "must be in (0, 1] (1 means off)")
        if self.top_k < -1:
            raise bad("top_k", self.top_k, "must be >= 1, or 0 / -1 for off")
        if vocab_size is not None and self.top_k > vocab_size:
            raise bad("top_k", self.top_k, f"must be <= the vocabulary size {vocab_size}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", self.min_p, "must be in [0, 1] (0 means off)")
        rp = self.repetition_penalty
        if not (math.isfinite(rp) and rp > 0.0):
            raise bad("repetition_penalty", rp, "must be a finite number > 0 (1 means off)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise bad(name, value, "must be in [-2, 2] (0 means off)")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", self.logprobs,
                      f"must be in [0, {MAX_LOGPROBS}], or null for off")
        if not (1 <= self.max_new_tokens < MAX_NEW_TOKENS):
            raise bad("max_new_tokens", self.max_new_tokens, "must be in [1, 2**63)")
        if not (0 <= self.min_new_tokens <= self.max_new_tokens):
            raise bad("min_new_tokens", self.min_new_tokens,
                      f"must be in [0, max_new_tokens={self.max_new_tokens}]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"<{len(self.stop)} strings>",
                      f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not s:
                raise bad("stop", self.stop, "stop strings must be non-empty")
            if len(s) > MAX_STOP_CHARS:
                raise bad("stop", f"<a string of {len(s)} characters>",
                          f"each stop string must be at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"<{len(self.stop_token_ids)} ids>",
                      f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        for tid in self.stop_token_ids:
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                rng = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise bad("stop_token_ids", self.stop_token_ids, f"every id must be in {rng}")
        if self.seed is not None and not (0 <= self.seed < MAX_SEED):
            raise bad("seed", self.seed, "must be in [0, 2**63), or null for a random seed")
