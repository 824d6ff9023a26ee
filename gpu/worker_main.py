"""The worker process: a ModelRunner behind one ZMQ PAIR socket.

    python -m gpu.worker_main --endpoint ipc:///tmp/fmserve-x/worker.sock \
        --config '{"model_path": "...", "dtype": "fp32"}' [--parent-pid N] [--cleanup-dir D]

The scheduler binds the endpoint and spawns this module (service/worker_supervisor.py); the worker
connects (PAIR: one peer, ordered, both ways; see ipc/zmq_util.py). Conversation:

    worker -> WorkerReady(info)           once the model is loaded
    plan   -> StepResult                  one result per plan, in order
    Shutdown                              close and exit 0
    worker -> WorkerFailed(step_id, msg)  load (step_id None) or a step failed; then exit 1

The worker exits by itself (code 3) as soon as its parent is gone, even in the middle of loading
or of a long forward, so a killed service never leaves a process holding the device (nor, with
--cleanup-dir, its socket file). It never talks to clients and never imports `service`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import threading
import time
import traceback

import zmq

from ipc.worker_messages import Shutdown, StepPlan, WorkerFailed, WorkerReady
from ipc.zmq_util import WorkerSideCodec, configure_socket

EXIT_OK, EXIT_FAILED, EXIT_ORPHANED = 0, 1, 3
PARENT_POLL_S = 0.25
# Our last message (WorkerFailed) must reach the scheduler before the process exits, so the
# socket lingers that long on close instead of dropping it (linger 0 elsewhere).
FINAL_LINGER_MS = 2000


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


def parse_runner_config(text: str):
    """JSON of RunnerConfig fields -> RunnerConfig; the load progress bar is always off here
    (stderr is a log file)."""
    from gpu.model_runner import RunnerConfig  # imports torch: after the parent watch is up

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config is not valid JSON ({exc}): {text[:200]!r}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--config must be a JSON object of RunnerConfig fields, "
                         f"got {text[:200]!r}")
    known = {f.name for f in dataclasses.fields(RunnerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"--config has unknown RunnerConfig fields {unknown}; "
                         f"known fields are {sorted(known)}")
    if "model_path" not in fields:
        raise ValueError("--config lacks model_path")
    fields["progress"] = False
    if isinstance(fields.get("spec"), dict):
        import msgspec

        from ipc.spec_settings import SpecSettings
        fields["spec"] = msgspec.convert(fields["spec"], SpecSettings)
    return RunnerConfig(**fields)


def describe_exception(exc: BaseException) -> str:
    """One line for people: the error and the innermost frame it came from."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        text += f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"
    return text


def serve(sock: zmq.Socket, config_json: str) -> int:
    """Load, announce, then answer plans until Shutdown. Returns the exit code."""
    codec = WorkerSideCodec()

    def fail(step_id: int | None, message: str, exc: BaseException | None = None) -> int:
        if exc is not None:  # the full traceback goes to the log file
            traceback.print_exception(exc)
        else:
            traceback.print_exc()
        print(f"fmserve worker: {message}", file=sys.stderr, flush=True)
        sock.setsockopt(zmq.LINGER, FINAL_LINGER_MS)
        sock.send(codec.encode(WorkerFailed(step_id, message)))
        return EXIT_FAILED

    try:
        from gpu.model_runner import ModelRunner

        runner = ModelRunner(parse_runner_config(config_json))
        info = runner.info()
    except Exception as exc:
        return fail(None, describe_exception(exc))
    sock.send(codec.encode(WorkerReady(info)))
    q4 = runner.model.q4_projections
    q4_note = (f", {q4} projections on the file's 4-bit codes up to "
               f"{runner.cfg.q4_max_tokens} tokens" if q4 else "")
    from gpu.q4_linear import Q4Linear
    if isinstance(runner.model.lm_head, Q4Linear):
        q4_note += f", the lm_head up to {runner.model.lm_head.max_tokens}"
    if runner.decode_graphs is not None:
        q4_note += f", CUDA graphs for decode batches up to {runner.decode_graphs.max_batch}"
    elif runner.cfg.cuda_graph_max_batch:
        q4_note += ", no CUDA graphs (they need a CUDA device and no speculative decoding)"
    print(f"fmserve worker {os.getpid()}: ready ({info.model_name}, {info.device}, "
          f"{info.dtype}, {info.attention_backend}{q4_note})", file=sys.stderr, flush=True)

    return answer_plans(sock, codec, runner, fail)


def answer_plans(sock: zmq.Socket, codec: WorkerSideCodec, runner, fail) -> int:
    """Answer plans with results, in order, until Shutdown (EXIT_OK) or a failure (`fail`'s
    exit code, after sending WorkerFailed). `runner` is a loaded ModelRunner."""
    from gpu.model_runner import PreparedStep

    def send_result(pending) -> int | None:
        """Finish a launched step and send its result; an exit code if that failed."""
        try:
            result = runner.finish(pending)
        except Exception as exc:
            return fail(pending.step_id, f"step {pending.step_id} failed in the worker: "
                                         f"{describe_exception(exc)}")
        sock.send(codec.encode(result))
        return None

    # One launched step may wait for its result while the next plan is taken up: with plans
    # queued (overlap), plan k+1 is prepared (launch_ahead "prepare") or prepared and launched
    # ("on") before step k's result is copied and sent, so the device waits for the host
    # between the two forwards for the sending at most, or not at all (runner.launch_ahead).
    pending = None
    while True:
        if pending is not None and not (runner.launch_ahead != "off" and sock.poll(0)):
            code, pending = send_result(pending), None
            if code is not None:
                return code
        data = sock.recv()
        try:
            msg = codec.decode(data)
        except Exception as exc:
            return fail(None, f"the worker received a message it cannot decode: "
                              f"{describe_exception(exc)}")
        if not isinstance(msg, (StepPlan, Shutdown)):
            return fail(None, f"the worker received a {type(msg).__name__}, which it does not "
                              f"handle (it takes StepPlan and Shutdown)")
        step, failure = None, None
        if isinstance(msg, StepPlan):
            try:
                step = runner.prepare(msg)
                if pending is None or runner.launch_ahead == "on":
                    step = runner.launch_prepared(step)
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
                step = runner.launch_prepared(step)
            except Exception as exc:
                failure = exc
        if failure is not None:
            return fail(msg.step_id, f"step {msg.step_id} failed in the worker: "
                                     f"{describe_exception(failure)}", failure)
        pending = step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu.worker_main",
                                     description="fmserve worker process (spawned by the service)")
    parser.add_argument("--endpoint", required=True, help="ZMQ endpoint the scheduler bound")
    parser.add_argument("--config", required=True, help="JSON object of RunnerConfig fields")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone (default: the parent at start)")
    parser.add_argument("--cleanup-dir", default=None,
                        help="directory to remove when exiting because the parent is gone")
    args = parser.parse_args(argv)

    parent_pid = args.parent_pid if args.parent_pid is not None else os.getppid()
    watch_parent(parent_pid, args.cleanup_dir)
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
