"""`fmserve generate`: one prompt, an interactive chat, or a JSONL batch, in this process."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from fmserve.jsonl import check_output_path, jsonl_rows, write_jsonl
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings

if TYPE_CHECKING:  # torch: imported when a command runs the model, not by `fmserve serve`
    from fmserve.engine import Engine


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=list(args.stop))
    params.validate()
    return params


def engine_from_args(args: argparse.Namespace) -> Engine:
    from fmserve.engine import Engine

    return Engine(model=args.model, device=args.device, dtype=args.dtype,
                  attention_backend=args.attention_backend, page_size=args.page_size,
                  max_kv_tokens=args.max_kv_tokens, max_running_requests=args.max_running_requests,
                  max_tokens_per_step=args.max_tokens_per_step,
                  spec=SpecSettings(args.spec_algorithm, args.draft_model, args.spec_num_steps,
                                    args.spec_topk, args.spec_num_draft_tokens,
                                    args.spec_disable_above_batch_size))


def echo(pieces) -> str:
    """Write each piece of text to stdout as it comes, then a newline; return the whole text."""
    text = []
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        text.append(piece)
    sys.stdout.write("\n")
    return "".join(text)


def _stream_one(engine: Engine, prompt, params: SamplingParams) -> str:
    return echo(out.text for out in engine.stream([prompt], params))


def _messages(system: str | None, user: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


def _is_chat(messages: object) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages)


def _read_jsonl(path: str, raw: bool) -> list:
    prompts = []
    for lineno, row in jsonl_rows(path):
        both = isinstance(row, dict) and None not in (row.get("messages"), row.get("prompt"))
        if both:
            raise ValueError(f"{path}:{lineno}: the line has both 'prompt' and 'messages'; give "
                             "one of them (the other would be ignored)")
        if isinstance(row, dict) and row.get("messages") is not None:
            if not _is_chat(row["messages"]):  # caught here, not as a KeyError later
                raise ValueError(f"{path}:{lineno}: 'messages' must be a non-empty list of "
                                 '{"role": "...", "content": "..."} objects')
            prompts.append(row["messages"])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"] if raw else _messages(None, row["prompt"]))
        else:
            raise ValueError(f"{path}:{lineno}: each line needs a 'prompt' string or a "
                             "'messages' list")
    if not prompts:  # else nothing ran and the command exited 0
        raise ValueError(f"{path}: no prompts (the file has no rows): give a JSONL file with a "
                         "'prompt' string or a 'messages' list on each line")
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    if args.file is not None:  # the file and --output are checked before the model loads
        prompts = _read_jsonl(args.file, args.raw)
        check_output_path(args.output)
    engine = engine_from_args(args)
    if args.prompt is not None:
        _stream_one(engine, args.prompt if args.raw else _messages(args.system, args.prompt), params)
        return 0
    if args.file is not None:
        write_jsonl(args.output, ({"index": i, "text": c.text, "finish_reason":
                                   c.finish_reason.value if c.finish_reason else None,
                                   "prompt_tokens": len(c.prompt_ids),
                                   "completion_tokens": len(c.token_ids)}
                                  for i, c in enumerate(engine.generate(prompts, params))))
        return 0
    # Interactive chat: the whole conversation is re-sent each turn (no prefix cache yet).
    return chat_loop(lambda history: _stream_one(engine, history, params), args.system,
                     "fmserve chat: type a message, /reset to start over, Ctrl-D to quit.",
                     reset=True)


def chat_loop(stream, system: str | None, banner: str, reset: bool = False,
              turn_errors: tuple[type[Exception], ...] = ()) -> int:
    """Read user lines until EOF; `stream(history)` echoes the reply and returns its text. With
    `reset`, /reset starts over (keeping the system message). A turn that raises one of
    `turn_errors` is left out of the conversation, which goes on without it."""
    history = [{"role": "system", "content": system}] if system else []
    print(banner, file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if reset and user.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        try:
            reply = stream(history)
        except turn_errors as exc:
            history.pop()
            print(f"\nerror: {exc}\nThis message was left out of the conversation: send "
                  f"another (a shorter one if it was too long), or Ctrl-D to quit.",
                  file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})
