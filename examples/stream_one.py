"""Stream one chat reply from a running fmserve service to stdout (blocking client).

Start the service first, in another terminal:

    fmserve serve

then:

    python examples/stream_one.py "Write a haiku about the sea."
    python examples/stream_one.py --temperature 0.7 --max-new-tokens 200 "Tell me a story."
"""

from __future__ import annotations

import argparse
import sys

from ipc.client import Client
from ipc.client_errors import ClientError
from ipc.client_request import DEFAULT_ENDPOINT
from ipc.client_messages import Chunk, Finished
from ipc.sampling import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="Write a haiku about the sea.")
    parser.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = parser.parse_args()

    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)

    with Client(args.endpoint) as client:
        try:
            client.health(timeout_s=5.0)  # fail fast, with advice, when nothing is listening
            for msg in client.generate(messages=messages, params=params):
                if isinstance(msg, Chunk):
                    print(msg.text, end="", flush=True)
                elif isinstance(msg, Finished):
                    u = msg.usage
                    ttft = f", first token after {u.ttft_ms:.0f} ms" if u.ttft_ms else ""
                    print(f"\n[{msg.reason}: {u.prompt_tokens} prompt + "
                          f"{u.completion_tokens} generated tokens{ttft}]", file=sys.stderr)
        except ClientError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
