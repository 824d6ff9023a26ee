"""An OpenAI request body -> the service's own `Generate` messages, one per answer
(`decode_body`, then `to_generates`).

`n` answers of each prompt are `n` ordinary requests (ids `<base>-<choice index>`); with a
seed, answer i samples with seed + i, so the answers differ and each is reproducible.
Parameters are checked here, so a refusal names the OpenAI parameter (`max_tokens`), not the
service's field it maps to (`max_new_tokens`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.client_messages import ChatMessage, Generate
from ipc.codec import UNREADABLE
from ipc.sampling import MAX_SEED, SamplingParams
from service.http.errors import ApiError
from service.http.openai_types import (NO_OP_VALUES, ChatCompletionRequest, ChatMessageIn,
                                       CompletionRequest, SamplingFields)

MAX_CHOICES = 64  # n times the number of prompts: each answer is one request in the batch
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# SamplingParams' field names as an OpenAI client knows them, for error messages.
OPENAI_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def decode_body(body: bytes, kind: type[SamplingFields]) -> SamplingFields:
    """A request body as `kind`; anything wrong with it is an ApiError (a 400)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text, _, where = str(exc).partition(" - at `$.")
        param = where.rstrip("`") or None
        raise ApiError("invalid_params", f"{text}" + (f" (at {param})" if param else ""),
                       param) from None
    except UNREADABLE as exc:  # invalid UTF-8 and deep nesting were 500s
        raise ApiError("invalid_json", f"the request body is not valid JSON: {exc}") from None


def refuse_unsupported(body: msgspec.Struct, where: str = "") -> None:
    for name, no_ops in NO_OP_VALUES.items():
        value = getattr(body, name, None)
        if value is not None and value not in no_ops:
            raise ApiError("unsupported_parameter", f"{where}{name} is not supported by fmserve "
                           f"(it serves plain text generation): leave it out", where + name)


def _chat_message(i: int, m: ChatMessageIn) -> ChatMessage:
    where = f"messages[{i}]."
    refuse_unsupported(m, where)
    if m.role not in ROLES:
        raise ApiError("invalid_params", f"{where}role {m.role!r} is not supported: use "
                       f"system, developer, user or assistant", where + "role")
    if isinstance(m.content, list):
        for part in m.content:
            if part.type != "text":
                raise ApiError("unsupported_parameter", f"{where}content has a {part.type!r} "
                               f"part: this model reads text parts only", where + "content")
        text = "".join(part.text for part in m.content)
    else:
        text = m.content or ""
    return ChatMessage(ROLES[m.role], text)


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    """A completions `prompt`: a string, strings, token ids, or lists of token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [list(p)]
    if p and all(isinstance(s, str) for s in p):
        return list(p)
    if p and all(isinstance(s, list) and s and all(
            isinstance(t, int) and not isinstance(t, bool) for t in s) for s in p):
        return [list(s) for s in p]
    raise ApiError("invalid_params", "prompt must be a string, a non-empty list of strings, a "
                   "list of token ids, or a list of non-empty lists of token ids", "prompt")


def sampling_params(req: SamplingFields, logprobs: int | None, max_tokens: int | None,
                    default_max_tokens: int, vocab_size: int, seed: int | None
                    ) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    given = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                 min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                 frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                 min_new_tokens=req.min_tokens)
    params = SamplingParams(
        **{k: v for k, v in given.items() if v is not None}, seed=seed, logprobs=logprobs,
        max_new_tokens=default_max_tokens if max_tokens is None else max_tokens, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos)
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        field = str(exc).removeprefix("sampling parameter ").partition("=")[0]
        # a chat's logprobs are a flag; how many top ones it asks for is top_logprobs
        name = ("top_logprobs" if field == "logprobs" and isinstance(req, ChatCompletionRequest)
                else OPENAI_NAME.get(field, field))
        message = str(exc).replace(field, name, 2)
        for ours, theirs in OPENAI_NAME.items():  # a limit named after another parameter
            message = message.replace(ours, theirs)
        raise ApiError("invalid_params", message, name) from None
    return params


def to_generates(req: ChatCompletionRequest | CompletionRequest, base_id: str,
                 default_max_tokens: int, vocab_size: int) -> list[Generate]:
    """The request's answers in choice-index order: prompt 0's n answers, then prompt 1's."""
    refuse_unsupported(req)
    if req.n < 1:
        raise ApiError("invalid_params", f"n={req.n} is out of range: it must be >= 1", "n")
    if req.seed is not None and not 0 <= req.seed < MAX_SEED:
        raise ApiError("invalid_params", f"seed={req.seed} is out of range: it must be in "
                       f"[0, 2**63)", "seed")
    if isinstance(req, ChatCompletionRequest):
        if not req.messages:
            raise ApiError("invalid_params", "messages is empty: give at least one message",
                           "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError("invalid_params", "top_logprobs needs logprobs: true", "top_logprobs")
        chat = [_chat_message(i, m) for i, m in enumerate(req.messages)]
        prompts: list[Any] = [chat]
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    else:
        prompts, logprobs, max_tokens = _prompts(req), req.logprobs, req.max_tokens
        if req.echo:
            raise ApiError("unsupported_parameter", "echo is not supported by fmserve: leave "
                           "it out (prepend the prompt yourself)", "echo")
    if req.n * len(prompts) > MAX_CHOICES:
        raise ApiError("invalid_params", f"n times the number of prompts is "
                       f"{req.n * len(prompts)}; at most {MAX_CHOICES} answers per request", "n")
    out = []
    for p, prompt in enumerate(prompts):
        for i in range(req.n):
            index = p * req.n + i
            seed = None if req.seed is None else (req.seed + i) % MAX_SEED
            params = sampling_params(req, logprobs, max_tokens, default_max_tokens, vocab_size,
                                     seed)
            kind = ("messages" if isinstance(prompt, list) and prompt
                    and isinstance(prompt[0], ChatMessage) else
                    "text" if isinstance(prompt, str) else "token_ids")
            out.append(Generate(f"{base_id}-{index}", params=params, stream=True,
                                **{kind: prompt}))
    return out
