"""The bodies of OpenAI's /v1/chat/completions and /v1/completions, as msgspec Structs.

Every field an OpenAI client may send is declared. Those fmserve honours map onto
SamplingParams (service/http/openai_params.py); those that do not change a result here are
accepted (`user`, `metadata`, `store`, ...); those fmserve cannot honour are declared as
`Unsupported` and refused by name when set to anything but their no-op value, rather than
silently ignored. A field nobody declared is refused too (a typo is an error).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Unsupported = Any  # declared so a request naming it gets a 400 that says so, not "unknown field"


class TextPart(msgspec.Struct, frozen=True):
    # Only "text" is accepted; other parts (image_url, input_audio, file) decode, to be refused
    # by their type (service/http/openai_params.py), hence no forbid_unknown_fields here.
    type: str
    text: str = ""


class ChatMessageIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str  # system, developer (= system), user, assistant
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: Unsupported = None
    tool_call_id: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # an OpenAI-side padding option: nothing to do here


class SamplingFields(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What chat and completions requests share: the model, sampling, output length, stream."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    # The extensions llama.cpp's server and vLLM accept.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # No effect on the result here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Cannot be honoured: refused unless empty.
    logit_bias: Unsupported = None
    best_of: Unsupported = None


class ChatCompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True):
    messages: list[ChatMessageIn] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    tool_choice: Unsupported = None  # "none" is accepted: it asks for no tools
    response_format: Unsupported = None  # {"type": "text"} is accepted
    tools: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None
    prediction: Unsupported = None
    reasoning_effort: Unsupported = None
    web_search_options: Unsupported = None


class CompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True):
    # a string, strings, token ids, or lists of token ids (msgspec takes one list type in a
    # union: the list is checked in service/http/openai_params.py)
    prompt: str | list[Any] = ""
    logprobs: int | None = None  # completions: the number of alternatives, 0-5 at OpenAI
    echo: bool = False
    suffix: Unsupported = None


NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    # field -> the values that ask for nothing fmserve lacks
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
    "tools": (None, []), "functions": (None, []), "logit_bias": (None, {}), "best_of": (None, 1),
    "tool_calls": (None, []),
}
