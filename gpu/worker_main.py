"""The worker process: a Worker (gpu/worker.py) behind one ZMQ PAIR socket.

    python -m gpu.worker_main --endpoint ipc:///tmp/fmserve-x/worker.sock \
        --config '{"model": {"path": "...", "dtype": "fp32"}}' [--parent-pid N] [--cleanup-dir D]

With --standby it imports torch and the worker's modules first, then reads those arguments as a
JSON list from stdin (a process started ahead for a fast restart: service/worker_spawn.py).
With parallel.tp = N > 1 this process is rank 0 of N and starts the others with --rank R
--world-size N --master-addr A --master-port P instead of --endpoint (gpu/tp_ranks.py).

The scheduler binds the endpoint and spawns this module (service/worker_supervisor.py); the worker
connects (PAIR: one peer, ordered, both ways; see ipc/zmq_util.py). Conversation:

    worker -> WorkerReady(info)           once the model is loaded
    plan   -> StepResult                  one result per plan, in order
    GroupPlan -> GroupResult              instead, with parallel.dp_attention (gpu/group_step.py)
    Shutdown                              close and exit 0
    worker -> WorkerFailed(step_id, msg)  load (step_id None) or a step failed; then exit 1

The worker exits by itself (code 3) as soon as its parent is gone, even in the middle of loading
or of a long forward, so a killed service never leaves a process holding the device (nor, with
--cleanup-dir, its socket file). It never talks to clients and never imports `service`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
import traceback

import msgspec
import zmq

from gpu.heap import map_large_buffers
from gpu.worker_inbox import describe_exception, next_message
from ipc.process_heap import release_library_pages
from ipc.worker_config import WorkerConfig
from ipc.worker_messages import Shutdown, StepPlan, WorkerFailed, WorkerReady
from ipc.zmq_util import WorkerSideCodec, configure_socket

EXIT_OK, EXIT_FAILED, EXIT_ORPHANED = 0, 1, 3
PARENT_POLL_S = 0.25
# Our last message (WorkerFailed) must reach the scheduler before the process exits, so the
# socket lingers that long on close instead of dropping it (linger 0 elsewhere).
FINAL_LINGER_MS = 2000
# The compiled decode step is built on a thread (gpu/background_compile.py) from the first
# moment no plan waits for this long, or after this many seconds at the latest: a restarted
# worker answers the requests queued during its restart first, at full speed.
COMPILE_WHEN_IDLE_MS = 300
COMPILE_AT_THE_LATEST_S = 20.0


def watch_parent(parent_pid: int, cleanup_dir: str | None = None,
                 interval_s: float = PARENT_POLL_S) -> threading.Thread:
    """Exit the whole process once `parent_pid` is no longer our parent (it died and we were
    re-parented to init or a subreaper). A daemon thread, so it also fires while the main
    thread is busy loading weights or inside a forward, where no recv loop could look.
    `cleanup_dir` (the parent's temp dir: socket file, log) is removed first: a killed parent
    cannot do it any more."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                print(f"fmserve worker {os.getpid()}: parent process {parent_pid} is gone; "
                      f"exiting", file=sys.stderr, flush=True)
                if cleanup_dir:
                    shutil.rmtree(cleanup_dir, ignore_errors=True)
                os._exit(EXIT_ORPHANED)
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="fmserve-parent-watch", daemon=True)
    thread.start()
    return thread


def parse_worker_config(text: str) -> WorkerConfig:
    """--config: a WorkerConfig as JSON (ipc/worker_config.py), checked like config.toml; the
    load progress bar is always off here (stderr is a log file)."""
    try:
        cfg = msgspec.json.decode(text, type=WorkerConfig)
    except msgspec.DecodeError as exc:
        raise ValueError(f"--config is not a valid WorkerConfig ({exc}): {text[:200]!r}") from None
    return msgspec.structs.replace(cfg, progress=False).validate()


def serve(sock: zmq.Socket, config_json: str) -> int:
    """Load, announce, then answer plans until Shutdown. Returns the exit code."""
    codec = WorkerSideCodec()
    ranks = None

    def fail(step_id: int | None, message: str, exc: BaseException | None = None) -> int:
        # A collective that failed mid-step says only "connection reset": name the dead rank.
        dead = ranks.dead_follower(wait_s=0.5) if ranks is not None else None
        if dead is not None and dead not in message:
            message = f"the tensor-parallel group is down: {dead}; {message}"
        if exc is not None:  # the full traceback goes to the log file
            traceback.print_exception(exc)
        else:
            traceback.print_exc()
        print(f"fmserve worker: {message}", file=sys.stderr, flush=True)
        sock.setsockopt(zmq.LINGER, FINAL_LINGER_MS)
        sock.send(codec.encode(WorkerFailed(step_id, message)))
        return EXIT_FAILED

    try:
        from gpu.worker import Worker  # imports torch: after the parent watch is up

        cfg = parse_worker_config(config_json)
        if cfg.parallel.tp > 1:  # rank 0 of a tensor-parallel group: start the others
            from gpu.tp_ranks import RankDied, RelaySocket, start_ranks

            ranks = start_ranks(cfg, config_json)
        worker = Worker(cfg, background_compile=True)  # ready before its compiled step
        info = worker.info()
        # Before any thread of ours can load a library: torch's start-up code leaves the
        # resident set (ipc/process_heap.py).
        release_library_pages()
    except Exception as exc:
        code = fail(None, describe_exception(exc))
        if ranks is not None:
            ranks.stop(grace_s=1.0)  # the others fail alike, or wait in a collective
        return code
    sock.send(codec.encode(WorkerReady(info)))
    tp = f", {ranks.size} tensor-parallel ranks" if ranks is not None else ""
    print(f"fmserve worker {os.getpid()}: ready ({info.model_name}, {info.device}, "
          f"{info.dtype}, {info.attention_backend}{worker.fast_paths()}{tp})", file=sys.stderr,
          flush=True)
    if ranks is None:
        return answer_plans(sock, codec, worker, fail)
    try:  # every message also reaches the other ranks
        if cfg.parallel.dp_attention:  # a plan per rank each step (gpu/group_step.py)
            from gpu.group_step import answer_group_plans

            code = answer_group_plans(RelaySocket(sock, ranks), codec, worker, ranks, fail)
            return EXIT_OK if code is None else code
        return answer_plans(RelaySocket(sock, ranks), codec, worker, fail)
    except RankDied as exc:
        return fail(None, f"the tensor-parallel group is down: {exc}", exc)
    finally:
        ranks.stop()


def answer_plans(sock: zmq.Socket, codec: WorkerSideCodec, worker, fail) -> int:
    """Answer plans with results, in order, until Shutdown (EXIT_OK) or a failure (`fail`'s
    exit code, after sending WorkerFailed). `worker` is a loaded gpu.worker.Worker."""
    from gpu.step_types import PreparedStep

    def send_result(pending) -> int | None:
        """Finish a launched step and send its result; an exit code if that failed."""
        try:
            result = worker.finish(pending)
        except Exception as exc:
            return fail(pending.step_id, f"step {pending.step_id} failed in the worker: "
                                         f"{describe_exception(exc)}")
        sock.send(codec.encode(result))
        return None

    # One launched step may wait for its result while the next plan is taken up: with plans
    # queued (overlap), plan k+1 is prepared (launch_ahead "prepare") or prepared and launched
    # ("on") before step k's result is copied and sent, so the device waits for the host
    # between the two forwards for the sending at most, or not at all (worker.launch_ahead).
    pending = None
    compile_by = time.monotonic() + COMPILE_AT_THE_LATEST_S
    while True:
        if pending is not None and not (worker.launch_ahead != "off" and sock.poll(0)):
            code, pending = send_result(pending), None
            if code is not None:
                return code
        if worker.background_compile_pending and (time.monotonic() >= compile_by
                                                  or not sock.poll(COMPILE_WHEN_IDLE_MS)):
            worker.start_background_compile()
        msg, code = next_message(sock, codec, fail, (StepPlan, Shutdown),
                                 "StepPlan and Shutdown")
        if code is not None:
            return code
        step, failure = None, None
        if isinstance(msg, StepPlan):
            try:
                step = worker.prepare(msg)
                if pending is None or worker.launch_ahead == "on":
                    step = worker.launch_prepared(step)
            except Exception as exc:
                failure = exc
        if pending is not None:  # the earlier step's result goes first, whatever comes next
            code, pending = send_result(pending), None
            if code is not None:
                return code
        if isinstance(msg, Shutdown):
            return EXIT_OK
        if isinstance(step, PreparedStep) and failure is None:
            try:
                step = worker.launch_prepared(step)
            except Exception as exc:
                failure = exc
        if failure is not None:
            return fail(msg.step_id, f"step {msg.step_id} failed in the worker: "
                                     f"{describe_exception(failure)}", failure)
        pending = step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu.worker_main",
                                     description="fmserve worker process (spawned by the service)")
    parser.add_argument("--endpoint", default=None,
                        help="ZMQ endpoint the scheduler bound (rank 0, the default)")
    parser.add_argument("--config", default=None, help="a WorkerConfig as JSON (required)")
    parser.add_argument("--standby", action="store_true",
                        help="import torch and the worker's modules, then wait for the other "
                             "arguments as one JSON list on stdin (service/worker_spawn.py)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (default: the parent at start)")
    parser.add_argument("--cleanup-dir", default=None,
                        help="directory to remove when exiting because the parent is gone")
    # A tensor-parallel rank other than 0 (rank 0 starts them: gpu/tp_ranks.py); the names
    # are torchrun's.
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--master-addr", default=None)
    parser.add_argument("--master-port", type=int, default=None)
    args = parser.parse_args(argv)
    parent_pid = args.parent_pid if args.parent_pid is not None else os.getppid()
    watch_parent(parent_pid, args.cleanup_dir)
    map_large_buffers()  # freed prefill activations leave the resident set (gpu/heap.py)
    if args.standby:  # the slow imports now, before the service needs us (~3 s on 2 cores)
        # Not torch._dynamo and inductor (1.3 s more): they hold ~190 MB, and only a compiled
        # decode step needs them (not the C one), which imports them on its build thread.
        import gpu.worker  # noqa: F401

        release_library_pages()  # torch's start-up code, while it waits (ipc/process_heap.py)
        line = sys.stdin.readline()
        if not line:
            return EXIT_OK  # the service discarded us
        args = parser.parse_args(json.loads(line))
    if args.config is None:
        parser.error("--config is required")
    if args.rank == 0 and args.endpoint is None:
        parser.error("--endpoint is required (rank 0 talks to the service)")
    if args.rank > 0:
        from gpu.tp_ranks import follow_plans

        return follow_plans(parse_worker_config(args.config), args.rank, args.world_size,
                            args.master_addr, args.master_port)
    ctx = zmq.Context()
    sock = configure_socket(ctx.socket(zmq.PAIR))
    try:
        sock.connect(args.endpoint)
        return serve(sock, args.config)
    finally:
        sock.close()  # lingers only if fail() raised LINGER for a final message
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
