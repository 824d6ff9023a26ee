"""Send N concurrent requests (prompts from the dev set) to a running fmserve service over one
asyncio client, and print each request's latency and the total throughput.

Start the service first, in another terminal:

    fmserve serve

then:

    python examples/many_clients.py -n 16 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ipc.async_client import AsyncClient
from ipc.client_errors import ClientError
from ipc.client_request import DEFAULT_ENDPOINT
from ipc.client_messages import Chunk, Finished
from ipc.sampling import SamplingParams

DEV_PROMPTS = Path(__file__).resolve().parents[1] / "fmserve" / "bench" / "dev_prompts.jsonl"
FALLBACK_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about autumn leaves.",
    "List three uses of a paperclip.",
    "What is the capital of France, and what is it known for?",
]


@dataclass
class Timing:
    index: int
    ttft_s: float
    e2e_s: float
    tokens: int
    reason: str


def load_prompts(path: Path, n: int) -> list[str]:
    if path.is_file():
        with open(path) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    else:
        print(f"({path} not found: using {len(FALLBACK_PROMPTS)} built-in prompts)",
              file=sys.stderr)
        prompts = FALLBACK_PROMPTS
    return [prompts[i % len(prompts)] for i in range(n)]


async def one_request(client: AsyncClient, index: int, prompt: str,
                      params: SamplingParams) -> Timing:
    start = time.perf_counter()
    ttft, tokens = None, 0
    async for msg in client.generate(messages=[{"role": "user", "content": prompt}],
                                     params=params):
        if isinstance(msg, Chunk):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            tokens += len(msg.token_ids)
        elif isinstance(msg, Finished):
            return Timing(index, ttft or 0.0, time.perf_counter() - start, tokens, msg.reason)
    raise AssertionError("stream ended without Finished")


async def run(args: argparse.Namespace) -> int:
    prompts = load_prompts(Path(args.prompts), args.n)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    async with AsyncClient(args.endpoint) as client:
        try:
            stats = await client.health(timeout_s=5.0)
            print(f"service: {stats.model} on {stats.device}, {stats.running} running, "
                  f"{stats.waiting} waiting")
            start = time.perf_counter()
            timings = await asyncio.gather(*(one_request(client, i, p, params)
                                             for i, p in enumerate(prompts)))
            wall = time.perf_counter() - start
        except ClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(f"{'req':>4} {'ttft ms':>9} {'e2e ms':>9} {'tokens':>7} {'tok/s':>7}  finish")
    for t in timings:
        rate = t.tokens / t.e2e_s if t.e2e_s > 0 else 0.0
        print(f"{t.index:>4} {t.ttft_s * 1e3:>9.0f} {t.e2e_s * 1e3:>9.0f} {t.tokens:>7} "
              f"{rate:>7.1f}  {t.reason}")
    total = sum(t.tokens for t in timings)
    print(f"{len(timings)} requests, {total} tokens in {wall:.2f} s: "
          f"{total / wall:.1f} output tokens/s overall")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=16, help="concurrent requests")
    parser.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    parser.add_argument("--prompts", default=str(DEV_PROMPTS), help="JSONL with 'prompt'")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
