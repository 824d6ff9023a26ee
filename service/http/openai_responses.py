"""The service's replies as OpenAI response objects: whole answers, and stream chunks for SSE.

`Answers` gathers the replies of one HTTP request (one `Generate` per choice) and renders them
as /v1/chat/completions or /v1/completions expect, with `usage` counted as OpenAI does: the
prompt once per prompt (not once per answer of it), completions summed.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import msgspec

from ipc.client_messages import Chunk, Finished


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Answers:
    def __init__(self, chat: bool, base_id: str, model: str, n: int,
                 token_text: Callable[[int], str]) -> None:
        self.chat, self.base_id, self.model, self.n = chat, base_id, model, n
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.token_text = token_text
        self.text: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.finished: dict[int, Finished] = {}
        self.role_sent: set[int] = set()  # stream: the first chat delta of a choice says its role

    def index_of(self, request_id: str) -> int:
        return int(request_id.rpartition("-")[2])

    # -- pieces ---------------------------------------------------------------------------

    def _logprobs(self, chunk: Chunk, offset: int) -> Any:
        """The chunk's logprobs in the endpoint's format (None when not asked for)."""
        if chunk.logprobs is None:
            return None
        tops = chunk.top_logprobs or [[] for _ in chunk.token_ids]
        if self.chat:
            def entry(tid: int, lp: float) -> dict:
                text = self.token_text(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in top])
                    for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops)]
        texts = [self.token_text(t) for t in chunk.token_ids]
        offsets = [offset + sum(len(s) for s in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": list(chunk.logprobs),
                "top_logprobs": [{self.token_text(a): b for a, b in top} for top in tops],
                "text_offset": offsets}

    def _merge(self, parts: list[Any]) -> Any:
        if not parts:
            return None
        if self.chat:
            return {"content": [e for p in parts for e in p]}
        return {k: [v for p in parts for v in p[k]] for k in parts[0]}

    def usage(self) -> dict:
        prompt = sum(f.usage.prompt_tokens for i, f in self.finished.items() if i % self.n == 0)
        completion = sum(f.usage.completion_tokens for f in self.finished.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _head(self, object_name: str, choices: list) -> dict:
        return {"id": self.base_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices, "system_fingerprint": "fmserve"}

    # -- whole answers --------------------------------------------------------------------

    def add(self, msg: Chunk | Finished) -> None:
        i = self.index_of(msg.id)
        if isinstance(msg, Finished):
            self.finished[i] = msg
            return
        offset = sum(len(s) for s in self.text.get(i, []))
        self.text.setdefault(i, []).append(msg.text)
        lp = self._logprobs(msg, offset)
        if lp is not None:
            self.logprobs.setdefault(i, []).append(lp)

    def response(self) -> dict:
        choices = []
        for i in sorted(self.finished):
            text = "".join(self.text.get(i, []))
            choice: dict[str, Any] = {"index": i, "finish_reason": self.finished[i].reason,
                                      "logprobs": self._merge(self.logprobs.get(i, []))}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return dict(self._head(self.object, choices), usage=self.usage())

    # -- stream chunks --------------------------------------------------------------------

    def chunk_event(self, msg: Chunk | Finished, include_usage: bool) -> bytes:
        """One SSE event for a reply (a first chat chunk carries the role, as OpenAI's)."""
        i = self.index_of(msg.id)
        choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": None}
        if isinstance(msg, Finished):
            self.finished[i] = msg
            choice["finish_reason"] = msg.reason
            text = ""
        else:
            offset = sum(len(s) for s in self.text.get(i, []))
            self.text.setdefault(i, []).append(msg.text)
            lp = self._logprobs(msg, offset)
            choice["logprobs"] = {"content": lp} if self.chat and lp is not None else lp
            text = msg.text
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if text and i not in self.role_sent:
                self.role_sent.add(i)
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = text
        event = self._head(self.object + (".chunk" if self.chat else ""), [choice])
        if include_usage:
            event["usage"] = None
        return sse(event)

    def usage_event(self) -> bytes:
        """The last chunk of a stream with stream_options.include_usage: no choices, usage."""
        return sse(dict(self._head(self.object + (".chunk" if self.chat else ""), []),
                        usage=self.usage()))
