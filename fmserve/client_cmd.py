"""`fmserve client`: talk to a running service: one prompt, a chat, or a JSONL file."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import msgspec

from fmserve.arg_types import endpoint, positive_int
from fmserve.generate_cmd import _messages, _read_jsonl, chat_loop, echo, sampling_from_args
from fmserve.jsonl import check_output_path, write_jsonl
from fmserve.keys_cmd import add_curve_args, curve_from_args
from ipc.async_client import AsyncClient
from ipc.client import Client
from ipc.client_errors import RequestFailed
from ipc.client_messages import ChatMessage, Chunk


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", type=endpoint)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message (chat template applied by the service)")
    src.add_argument("--chat", action="store_true", help="interactive multi-turn chat")
    src.add_argument("--file", help="JSONL file: each line has 'prompt' or 'messages'")
    src.add_argument("--health", action="store_true", help="print the service's stats")
    p.add_argument("--raw", action="store_true", help="send prompts as plain text")
    p.add_argument("--system", default=None)
    p.add_argument("--concurrency", type=positive_int, default=8,
                   help="requests in flight for --file")
    p.add_argument("--output", default="-", help="where --file results go (JSONL)")
    add_curve_args(p)


def _chat(msgs: list[dict]) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in msgs]


def _stream(client: Client, prompt, params) -> str:
    kwargs = {"messages": _chat(prompt)} if isinstance(prompt, list) else {"prompt": prompt}
    return echo(m.text for m in client.generate(params=params, **kwargs) if isinstance(m, Chunk))


async def _run_file(args: argparse.Namespace, params) -> int:
    prompts = _read_jsonl(args.file, args.raw)
    check_output_path(args.output)  # written at the end: a bad path must not cost the batch
    sem = asyncio.Semaphore(args.concurrency)
    results: list[dict | None] = [None] * len(prompts)
    async with AsyncClient(args.endpoint, curve=curve_from_args(args)) as client:
        await client.health()  # ServiceUnavailable after a few seconds, not a silent wait
        async def one(i: int, prompt) -> None:
            async with sem:
                kwargs = {"messages": _chat(prompt)} if isinstance(prompt, list) else {
                    "prompt": prompt}
                start = time.perf_counter()
                try:
                    c = await client.complete(params=params, **kwargs)
                    results[i] = {"index": i, "text": c.text, "finish_reason": c.finish_reason,
                                  "completion_tokens": len(c.token_ids),
                                  "latency_s": round(time.perf_counter() - start, 3)}
                except RequestFailed as exc:
                    results[i] = {"index": i, "error": exc.code, "message": str(exc)}
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    write_jsonl(args.output, results)
    return 0


def run_client(args: argparse.Namespace) -> int:
    if args.health:
        with Client(args.endpoint, curve=curve_from_args(args)) as client:
            # to_builtins: nested Structs too (Stats.replicas); the tag field is left out.
            stats = msgspec.to_builtins(client.health())
            print(json.dumps({k: v for k, v in stats.items() if k != "type"}, indent=2))
        return 0
    params = sampling_from_args(args)
    if args.file:
        return asyncio.run(_run_file(args, params))
    with Client(args.endpoint, curve=curve_from_args(args)) as client:
        client.health()  # ServiceUnavailable after a few seconds, not a silent wait
        if args.prompt is not None:
            _stream(client, args.prompt if args.raw else _messages(args.system, args.prompt), params)
            return 0
        return chat_loop(lambda history: _stream(client, history, params), args.system,
                         "fmserve client: type a message, Ctrl-D to quit.",
                         turn_errors=(RequestFailed,))
