"""Render a model's jinja2 chat template exactly the way transformers' `apply_chat_template` does.

Chat templates ship with models, so they are untrusted code: they run in jinja2's immutable
sandbox. The environment mirrors transformers (trim_blocks, lstrip_blocks, loop controls, a
`tojson` that does not HTML-escape, `raise_exception`, `strftime_now`, and the `{% generation %}`
tag) so a template renders here to the same string, byte for byte.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a model without a template gets: ChatML, the format most small instruct models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat template does not compile, or failed while rendering a conversation."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only
    need templates that use it to parse, so it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled template plus the special-token strings it may refer to."""

    def __init__(self, source: str, name: str = "chat template",
                 special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.name = name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{name} does not compile: {e.message} (template line "
                                    f"{e.lineno})") from e

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        # Like transformers: keys whose value is None are dropped, since templates test for
        # presence (`'tool_calls' in message`) and would otherwise print "None".
        clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {**self.special_tokens, "tools": None, "documents": None, **extra}
        try:
            return self._template.render(messages=clean,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.name} failed to render this conversation: "
                                    f"{e.message or e}") from e
        except Exception as e:  # e.g. str + None inside the template on a malformed message
            raise ChatTemplateError(f"{self.name} failed to render this conversation: "
                                    f"{type(e).__name__}: {e}") from e
