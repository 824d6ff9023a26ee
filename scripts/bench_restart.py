"""Worker restart after a crash, as a client sees it: start `fmserve serve` (default model and
config), answer one request, then `--runs` times SIGKILL the worker, send a request at once
(sent again if it reached the dying worker; else it waits in the queue during the restart) and
time until it is answered; then how long the
replacement took to switch to its compiled decode step (Stats.decode_compile, polled with
one-token requests). Run it with the compile on (the default "auto") and off:

    python scripts/bench_restart.py
    FMSERVE_COMPILE=off python scripts/bench_restart.py

docs/benchmarks.md ("Worker restart after a crash") has the figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

from fmserve.bench.serve import start_service
from fmserve.bench.soak import worker_pid
from fmserve.default_model import resolve_model_path
from ipc.client import Client
from ipc.client_errors import RequestFailed
from ipc.sampling import SamplingParams

STANDBY_IMPORTS_S = 8.0  # a standby's imports on 2 cores, with margin
PROMPT = [{"role": "user", "content": "Name three colours."}]


def answer(client: Client, max_new_tokens: int) -> None:
    client.complete(messages=PROMPT, params=SamplingParams(temperature=0.0,
                                                           max_new_tokens=max_new_tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config.toml setting for the service, e.g. worker.standby=false")
    args = ap.parse_args()
    args.device, args.attention_backend = "cpu", "torch"
    start = time.monotonic()
    log = tempfile.NamedTemporaryFile(prefix="fmserve-restart-", suffix=".log", delete=False)
    proc, endpoint = start_service(args, resolve_model_path(args.model), True,
                                   ["--log-level", "INFO", *(f for kv in args.set for f in ("--set", kv))],
                                   4, log=log)
    try:
        with Client(endpoint) as client:
            answer(client, args.max_new_tokens)
            print(f"first start: answered {time.monotonic() - start:.1f} s after the launch, "
                  f"decode_compile {client.health().decode_compile}", flush=True)
            for run in range(1, args.runs + 1):
                while client.health().decode_compile == "building":  # the previous switch
                    answer(client, 2)
                    time.sleep(0.5)  # idle moments: the worker starts its compile in one
                if "worker.standby=true" in args.set:  # started STANDBY_DELAY_S after ready,
                    while client.health().replicas[0].standby_pid is None:
                        time.sleep(0.5)
                    time.sleep(STANDBY_IMPORTS_S)  # then its imports
                pid = worker_pid(endpoint)
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                while True:  # one sent before the service noticed the death fails: again
                    try:
                        answer(client, args.max_new_tokens)
                        break
                    except RequestFailed as exc:
                        if exc.code != "worker_died":
                            raise
                answered = time.monotonic() - killed
                state = client.health().decode_compile
                while client.health().decode_compile == "building":
                    answer(client, 2)
                    time.sleep(0.5)
                print(f"run {run}: worker {pid} killed, a request answered {answered:.2f} s "
                      f"later (decode_compile then {state}); compiled step in use "
                      f"{time.monotonic() - killed:.1f} s after the kill "
                      f"({client.health().decode_compile})", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        # the service's own figure: the worker's start, from spawning it to its WorkerReady
        print("".join(line for line in open(log.name) if "worker restarted in" in line))
        print(f"the service's log: {log.name}")


if __name__ == "__main__":
    main()
