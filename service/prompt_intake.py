"""A Generate's prompt to token ids without stalling the service's event loop.

Tokenizing is the one cost on the event loop that grows with what a client sends: tokenizers'
`encode` holds the GIL, 6 s for an 8 MB text (the largest frame by default), and no other client
was answered meanwhile, not even a Ping. So:
- a text that cannot fit is refused at once, untokenized: no token stands for more than so
  many bytes (`TextTokenizer.min_tokens`), so its bytes alone prove it too long;
- a text above `INLINE_MAX_BYTES` is tokenized on a thread (`encode_batch` releases the GIL),
  one at a time, while the loop serves everyone else. service/server.py keeps such a request in
  flight meanwhile: an abort, a silent client or a shutdown ends it like any other.
A chat is rendered on the loop first (Jinja, ~50 ms for 8 MB of messages): the bound applies
to the text the model would read.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from ipc.client_messages import Generate
from service.scheduler_core import RequestRejected
from service.tokenizer import TextTokenizer

INLINE_MAX_BYTES = 64 << 10  # ~50 ms of tokenizing on the loop; larger texts go to a thread


@dataclass(frozen=True)
class LargeText:
    """A prompt to tokenize off the loop (`PromptIntake.encode`)."""

    text: str
    add_special_tokens: bool  # a raw text: yes; a rendered chat holds its own BOS


class PromptIntake:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        _ = tokenizer.token_bound  # computed now (~0.1 s), not on the first request
        # One thread: a burst of large prompts queues here rather than taking every core from
        # the event loop and the worker.
        self._limiter = anyio.CapacityLimiter(1)

    def prepare(self, msg: Generate, max_tokens: int) -> list[int] | LargeText:
        """On the event loop: the prompt's token ids, or its text when that is to be tokenized
        with `encode` (off the loop). Raises RequestRejected for a text that certainly has
        `max_tokens` tokens or more, and whatever the chat template raises. A raw text gets
        the model's own prefix (its BOS where the tokenizer adds one, as transformers'
        `tokenizer(text)` and llama.cpp give it: Gemma continues badly without)."""
        if msg.messages is None and msg.text is None:
            return list(msg.token_ids or [])
        special = msg.messages is None
        text = msg.text if msg.messages is None else self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in msg.messages])
        at_least = self.tokenizer.min_tokens(text)
        if at_least >= max_tokens:
            per_token = self.tokenizer.token_bound[0]
            raise RequestRejected(
                "prompt_too_long",
                f"the prompt is {len(text.encode()):,} bytes of text and no token of this "
                f"model stands for more than {per_token} bytes, so it has at least "
                f"{at_least:,} tokens; this service takes prompts shorter than {max_tokens:,} "
                f"tokens (refused without tokenizing): shorten it")
        if len(text) <= INLINE_MAX_BYTES // 4 or len(text.encode()) <= INLINE_MAX_BYTES:
            return self.tokenizer.encode(text, add_special_tokens=special)
        return LargeText(text, special)

    async def encode(self, prompt: LargeText) -> list[int]:
        """Tokenize on a worker thread. Cancelling the caller (a shutdown) abandons the thread,
        which runs its course: the refusal above bounds that to about a second."""
        return await anyio.to_thread.run_sync(
            self.tokenizer.encode_in_thread, prompt.text, prompt.add_special_tokens,
            abandon_on_cancel=True, limiter=self._limiter)
