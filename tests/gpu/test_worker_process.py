"""The worker as a real process: same tokens as the in-process engine, deaths seen promptly,
clean stops, no orphans. Model loads dominate the cost, so one handle and one Engine are shared
(loaded concurrently) by the whole module."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file

from fmserve.engine import Engine
from gpu.worker import Worker
from ipc.worker_config import worker_config
from ipc.sampling import SamplingParams
from ipc.worker_messages import (ExtendEntry, NewRequest, PageGrant, StepPlan, pack_i32,
                                 unpack_i32)
from ipc.zmq_util import ipc_path
from service.request import FinishReason
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.tokenizer import TextTokenizer
from service.worker_supervisor import WorkerDied, WorkerHandle, WorkerStartError

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(dtype="fp32", attention_backend="torch", max_kv_tokens=4096, max_running_requests=8)
# One intra-op thread on both sides of every comparison: on a shared 2-core machine a 2-thread
# OpenMP region waits a whole time slice whenever another process holds a core (30x slower),
# and equal thread counts keep the two sides' float results bit-identical.
WORKER_ENV = {"OMP_NUM_THREADS": "1"}
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           [{"role": "user", "content": "Name three colours."}], "1, 2, 3, 4,"]
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=8),
          SamplingParams(temperature=0.0, max_new_tokens=6),
          SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_new_tokens=8),
          SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)]


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # zmq.asyncio needs asyncio


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model(model_path):
    if not Path(model_path).exists():
        pytest.skip(f"model file {model_path} is missing; set FMSERVE_MODEL")
    return str(model_path)


@pytest.fixture(scope="module")
def tokenizer(model) -> TextTokenizer:
    return TextTokenizer.from_model_path(model)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama as an HF directory: a worker that starts in a second or two."""
    d = tmp_path_factory.mktemp("tiny-llama")
    hidden, inter, layers, vocab = 32, 64, 2, 64
    (d / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"vocab_size": 64, "max_position_embeddings": 256, "tie_word_embeddings": true, '
        '"eos_token_id": 2}')
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (hidden, hidden),
                   p + "self_attn.k_proj.weight": (16, hidden),
                   p + "self_attn.v_proj.weight": (16, hidden),
                   p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    save_file({k: torch.randn(shape, generator=g) for k, shape in shapes.items()},
              str(d / "model.safetensors"))
    return str(d)


TINY = dict(dtype="fp32", attention_backend="torch", max_kv_tokens=256, max_running_requests=4)


def tiny_plans() -> list[StepPlan]:
    """Two requests: prefill both (slot 1 sampling, slot 2 greedy), then three decodes each."""
    empty = pack_i32([])
    first = StepPlan(
        1, [NewRequest(1, SamplingParams(temperature=1.0, seed=7)),
            NewRequest(2, SamplingParams(temperature=0.0))],
        [PageGrant(1, 0, pack_i32([1])), PageGrant(2, 0, pack_i32([2]))],
        [ExtendEntry(1, 0, pack_i32([5, 6, 7, 8]), True),
         ExtendEntry(2, 0, pack_i32([9, 3]), True)],
        empty, empty)
    decodes = [StepPlan(k, [], [], [], pack_i32([1, 2]), empty) for k in (2, 3, 4)]
    return [first, *decodes]


@pytest.fixture(scope="module")
async def loaded(model):
    """(worker handle, in-process reference Engine), loaded at the same time."""
    handle = WorkerHandle(worker_config(model_path=model, **SMALL), ready_timeout_s=120,
                          step_timeout_s=60, env=WORKER_ENV)
    engine = None

    def build_engine():
        nonlocal engine
        engine = Engine(model=model, progress=False, **SMALL)

    async with anyio.create_task_group() as tg:
        tg.start_soon(handle.start)
        tg.start_soon(anyio.to_thread.run_sync, build_engine)
    try:
        yield handle, engine
    finally:
        await handle.stop()


@pytest.fixture
async def handle(loaded) -> WorkerHandle:
    """The shared handle, (re)started if an earlier test left it stopped or dead."""
    h = loaded[0]
    if not h.alive:
        await h.restart()
    return h


async def run_through(handle: WorkerHandle, sched: Scheduler) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while sched.has_work:
        plan = sched.plan_step()
        assert plan is not None, sched.accounting()
        for out in sched.process_result(await handle.step(plan)):
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            assert out.finish_reason != FinishReason.ERROR, out.error
    return tokens


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet (not our child)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


@pytest.mark.anyio
async def test_worker_process_matches_in_process_engine(loaded, handle, tokenizer):
    _, engine = loaded
    assert handle.info.num_layers == 30 and handle.info.vocab_size == 49152
    assert handle.info.num_slots == 9 and handle.info.dtype == "float32"
    assert handle.info == engine.info  # same capacity and model, whichever side loaded it

    expected = engine.generate(PROMPTS, PARAMS)
    sched = Scheduler(handle.info, tokenizer, SchedulerConfig())
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        sched.add_request(f"p{i}", engine.encode(prompt), params)
    got = await run_through(handle, sched)
    assert [got[f"p{i}"] for i in range(len(PROMPTS))] == [c.token_ids for c in expected]
    assert sum(len(c.token_ids) for c in expected) > 15


@pytest.mark.anyio
async def test_sigkill_during_step_raises_worker_died_then_restart_works(loaded, handle, tokenizer):
    _, engine = loaded
    if handle.info.device != "cpu":
        pytest.skip("the kill must land inside a step: a 3000-token prefill takes seconds on a "
                    "CPU but milliseconds on a GPU")
    sched = Scheduler(handle.info, tokenizer, SchedulerConfig(max_tokens_per_step=4096))
    long_prompt = (tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 400)[:3000]
    sched.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_new_tokens=4))
    plan = sched.plan_step()
    assert len(plan.extends) == 1  # one 3000-token prefill: seconds of work on a CPU

    died: list[float] = []
    old_pid = handle.pid

    async def step_until_death():
        with pytest.raises(WorkerDied, match="SIGKILL"):
            await handle.step(plan)
        died.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        tg.start_soon(step_until_death)
        await anyio.sleep(0.4)
        assert handle.num_inflight == 1 and not died, "the step ended before the kill"
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
    assert died[0] - killed < 2.0
    assert not handle.alive
    with pytest.raises(WorkerDied, match="restart"):
        await handle.step(plan)  # a dead handle refuses work clearly

    errors = sched.fail_all("worker died")
    assert [(o.rid, o.finish_reason) for o in errors] == [("long", FinishReason.ERROR)]
    assert sched.accounting()["running"] == 0

    info = await handle.restart()
    assert handle.alive and handle.pid != old_pid and info == engine.info
    prompt = engine.encode("Once upon a time")
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    sched.add_request("after", prompt, params)
    got = await run_through(handle, sched)
    assert got["after"] == engine.generate([prompt], params)[0].token_ids


@pytest.mark.anyio
@pytest.mark.parametrize("launch_ahead", ["off", "prepare", "on"])
async def test_pipelined_plans_match_an_in_process_runner(tiny_model, launch_ahead):
    # Overlap scheduling sends plan k+1 before result k: all plans go out at once here, the
    # decodes read their input tokens from the worker's own buffers, results come back in order.
    # With launch_ahead "prepare" or "on" (GPU orders, forced here on the CPU) the worker
    # prepares, or prepares and launches, plan k+1 before it finishes step k.
    plans = tiny_plans()
    reference = Worker(worker_config(model_path=tiny_model, progress=False, **TINY))
    expected = [unpack_i32(reference.run_step(p).token_ids).tolist() for p in plans]
    async with WorkerHandle(worker_config(model_path=tiny_model, launch_ahead=launch_ahead,
                                          **TINY), ready_timeout_s=60, env=WORKER_ENV) as h:
        for p in plans:
            await h.send_plan(p)
        assert h.num_inflight == len(plans)
        results = [await h.next_result() for _ in plans]
    assert [r.step_id for r in results] == [p.step_id for p in plans]
    assert [unpack_i32(r.token_ids).tolist() for r in results] == expected
    assert all(len(tokens) == 2 for tokens in expected)


@pytest.mark.anyio
async def test_step_that_fails_in_the_worker_raises_worker_died(tiny_model):
    async with WorkerHandle(worker_config(model_path=tiny_model, **TINY), ready_timeout_s=60,
                            env=WORKER_ENV) as h:
        await h.step(tiny_plans()[0])
        bad = StepPlan(2, [], [], [], pack_i32([99]), pack_i32([]))  # slot 99 of 5
        started = time.monotonic()
        with pytest.raises(WorkerDied, match=r"step 2 failed in the worker: \S*PlanError: .*decode slot 99 is outside 1\.\.4"):
            await h.step(bad)
        assert time.monotonic() - started < 5.0
        with anyio.fail_after(5):  # it exits by itself after reporting (code 1)
            while h.returncode is None:
                await anyio.sleep(0.05)
        assert h.returncode == 1


@pytest.mark.parametrize("launch_ahead", ["off", "prepare", "on"])
def test_worker_loop_takes_up_a_waiting_plan_in_the_launch_ahead_order(tiny_model, launch_ahead):
    # The worker's loop, in-process over a real PAIR socket pair, with every plan (and the
    # Shutdown) already waiting: the order of the runner's calls is what launch_ahead says.
    import zmq

    from gpu.worker_main import EXIT_OK, answer_plans
    from ipc.worker_messages import Shutdown
    from ipc.zmq_util import SchedulerSideCodec, WorkerSideCodec

    calls: list[str] = []

    class LoggingWorker(Worker):
        def prepare(self, plan):
            calls.append(f"prepare {plan.step_id}")
            return super().prepare(plan)

        def launch_prepared(self, step):
            calls.append(f"launch {step.plan.step_id}")
            return super().launch_prepared(step)

        def finish(self, pending):
            calls.append(f"send {pending.step_id}")
            return super().finish(pending)

    plans = tiny_plans()[:3]
    reference = Worker(worker_config(model_path=tiny_model, progress=False, **TINY))
    expected = [unpack_i32(reference.run_step(p).token_ids).tolist() for p in plans]
    runner = LoggingWorker(worker_config(model_path=tiny_model, progress=False,
                                         launch_ahead=launch_ahead, **TINY))
    ctx = zmq.Context()
    worker_side, scheduler_side = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        worker_side.bind("inproc://worker-loop")
        scheduler_side.connect("inproc://worker-loop")
        codec = SchedulerSideCodec()
        for msg in [*plans, Shutdown()]:
            scheduler_side.send(codec.encode(msg))

        def fail(step_id, message, exc=None):
            raise AssertionError(f"step {step_id} failed: {message}") from exc

        assert answer_plans(worker_side, WorkerSideCodec(), runner, fail) == EXIT_OK
        results = [codec.decode(scheduler_side.recv()) for _ in plans]
    finally:
        worker_side.close(0), scheduler_side.close(0), ctx.term()
    assert [r.step_id for r in results] == [1, 2, 3]
    assert [unpack_i32(r.token_ids).tolist() for r in results] == expected
    assert calls == {
        "off": ["prepare 1", "launch 1", "send 1", "prepare 2", "launch 2", "send 2",
                "prepare 3", "launch 3", "send 3"],
        "prepare": ["prepare 1", "launch 1", "prepare 2", "send 1", "launch 2", "prepare 3",
                    "send 2", "launch 3", "send 3"],
        "on": ["prepare 1", "launch 1", "prepare 2", "launch 2", "send 1", "prepare 3",
               "launch 3", "send 2", "send 3"],
    }[launch_ahead]


@pytest.mark.anyio
@pytest.mark.parametrize("launch_ahead", ["prepare", "on"])
async def test_launched_ahead_step_failure_comes_after_the_earlier_result(tiny_model,
                                                                          launch_ahead):
    # Plan 2 is prepared (and fails) while step 1 is still pending: step 1's result must still
    # arrive first, then the failure of step 2.
    async with WorkerHandle(worker_config(model_path=tiny_model, launch_ahead=launch_ahead,
                                          **TINY), ready_timeout_s=60, env=WORKER_ENV) as h:
        await h.send_plan(tiny_plans()[0])
        await h.send_plan(StepPlan(2, [], [], [], pack_i32([99]), pack_i32([])))
        first = await h.next_result()
        assert first.step_id == 1 and len(unpack_i32(first.token_ids)) == 2
        with pytest.raises(WorkerDied, match=r"step 2 failed in the worker: \S*PlanError: .*decode slot 99 is outside 1\.\.4"):
            await h.next_result()


@pytest.mark.anyio
async def test_worker_that_cannot_load_reports_why(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    h = WorkerHandle(worker_config(model_path=str(missing), **SMALL), ready_timeout_s=60,
                     env=WORKER_ENV)
    with pytest.raises(WorkerStartError) as err:
        await h.start()
    message = str(err.value)
    assert str(missing) in message and "does not exist" in message
    assert h.pid is None and not h.alive  # nothing is left running
    kept = Path(message.rpartition("is kept in ")[2])  # its log outlives the temp dir
    assert "Traceback" in kept.read_text() and "Traceback" not in message
    kept.unlink()


@pytest.mark.anyio
async def test_parent_killed_worker_exits_by_itself(model):
    # The parent is killed while its worker is starting (importing torch, loading weights):
    # the main thread is busy there, so this exercises the worker's own parent watch.
    parent_code = textwrap.dedent("""
        import sys, anyio
        from ipc.worker_config import worker_config
        from service.worker_supervisor import WorkerHandle

        async def main():
            h = WorkerHandle(worker_config(model_path=sys.argv[1], dtype="fp32"))
            async with anyio.create_task_group() as tg:
                tg.start_soon(h.start)
                while h.pid is None:
                    await anyio.sleep(0.01)
                print(h.pid, h.log_path, flush=True)
                await anyio.sleep(3600)

        anyio.run(main)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    parent = subprocess.Popen([sys.executable, "-c", parent_code, model], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        with anyio.fail_after(30):
            line = await anyio.to_thread.run_sync(parent.stdout.readline)
        worker_pid, log_path = int(line.split()[0]), Path(line.split()[1])
        await anyio.sleep(1.0)  # let the worker get going
        assert not process_gone(worker_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5.0
        while not process_gone(worker_pid) and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        if not process_gone(worker_pid):
            os.killpg(worker_pid, signal.SIGKILL)
            pytest.fail(f"worker {worker_pid} outlived its killed parent by 5 s")
        # Only the worker's parent watch removes the dir: it fired, and a dead parent leaves
        # no socket file behind.
        assert not log_path.parent.exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        if "log_path" in locals():
            shutil.rmtree(log_path.parent, ignore_errors=True)  # a killed parent can't clean up


@pytest.mark.anyio
async def test_stop_ends_the_process_and_removes_the_socket(handle):
    pid, socket_file, log_dir = handle.pid, ipc_path(handle.endpoint), handle.log_path.parent
    assert socket_file.exists()
    await handle.stop()
    assert handle.last_returncode == 0  # a clean exit on Shutdown, not a signal
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not socket_file.exists() and not log_dir.exists()
    assert handle.pid is None and not handle.alive
    await handle.stop()  # idempotent


def test_supervisor_does_not_import_the_worker_side():
    # The service never holds device state: spawning the worker must not drag torch in.
    code = ("import sys, service.worker_supervisor; "
            "print(sorted(m for m in ('torch', 'gpu') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)},
                         check=True).stdout
    assert out.strip() == "[]"
