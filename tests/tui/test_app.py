"""`fmserve top`: the Textual app headless (`App.run_test`) fed by a real ZMQ PUB socket.

Synthetic snapshots check the screen against the values that were published; a scheduler's
telemetry streams a request's text into the detail view; an end-to-end test runs it against a
live service with concurrent clients and aborts a request through it.

Beside this file: the SVG snapshots of a fixed scene (test_snapshots.py), frames that cannot be
read and service restarts (test_feed.py), untrusted text and non-finite numbers
(test_untrusted_input.py); shared helpers in helpers.py, the `pub` fixture in conftest.py.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from textual.widgets import DataTable

from ipc.client import Client
from ipc.client_messages import Chunk, Finished
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from ipc.telemetry import TEXT_TAIL_CHARS, TelemetrySnapshot
from ipc.worker_messages import StepResult, WorkerInfo, pack_i32, unpack_i32
from service.counters import ServiceCounters
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.telemetry import TelemetryPublisher
from tests.e2e.service_process import ServiceProcess, free_port
from tests.service.fake_scheduler import word_tokenizer
from tests.tui.helpers import (REFRESH_S, SIZE, Publisher, events_text, make_app, req, screen_text,
                               show, snapshot, table_rows, until)
from tui.app import ABORT_UNAVAILABLE, AdminAbort, send_admin_abort
from tui.events import request_key
from tui.widgets import NO_TEXT_YET, TEXT_NOTE, OutputText, RequestDetailScreen

pytestmark = pytest.mark.anyio  # async tests run on anyio's pytest plugin (asyncio backend)


# ----- synthetic tests ----------------------------------------------------------------------

async def test_rows_appear_update_and_leave(pub):
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        a = [req("alpha", 1, 40, 10), req("bravo", 2, 75, 25),
             req("charlie", 3, 12, 0, "prefilling")]
        s1 = snapshot(1000.0, a)
        await show(pilot, app, pub, s1)
        label = {"decoding": "decode", "prefilling": "prefill"}
        assert [row[:6] for row in table_rows(app)] == [
            [r.id, r.slot, label[r.state], r.seq_len, r.generated, r.last_accept_len] for r in a]
        # Next snapshot: alpha grows by 8 tokens in 0.5 s, bravo leaves, delta arrives.
        b = [req("alpha", 1, 48, 18), req("charlie", 3, 13, 1), req("delta", 4, 30, 0)]
        await show(pilot, app, pub, snapshot(1000.5, b, finished=1))
        rows = {row[0]: row for row in table_rows(app)}
        assert set(rows) == {"alpha", "charlie", "delta"}
        assert rows["alpha"][3:5] == [48, 18] and rows["charlie"][2] == "decode"
        assert rows["alpha"][6].value == pytest.approx((18 - 10) / 0.5)  # tokens/s
        assert rows["delta"][6].value is None  # seen once: no rate yet
        assert "1 request(s) ended: bravo (>= 25 tok)" in events_text(app)
        # The panels show the published numbers.
        kv = str(app.query_one("#kv").render())
        assert f"{(256 - 192) * 16}/{256 * 16}" in kv and "64/256 pages" in kv
        assert "waiting: 0" in str(app.query_one("#queue").render())


async def test_abort_without_an_admin_token_says_it_is_unavailable_and_sends_nothing(pub):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # where the service would be
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    app = make_app(pub.endpoint, f"tcp://127.0.0.1:{port}")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await show(pilot, app, pub, snapshot(1100.0, [req("alpha", 1, 40, 10)]))
            assert "abort needs --admin-token" in app.table.border_subtitle
            await pilot.press("a")
            await until(pilot, lambda: "abort is unavailable" in events_text(app),
                        what="the monitor to say abort is unavailable")
            assert _squash(ABORT_UNAVAILABLE) in _squash(events_text(app))
            assert "--admin-token or FMSERVE_ADMIN_TOKEN" in ABORT_UNAVAILABLE
            assert not router.poll(500)  # no AdminAbort went out
    finally:
        router.close()
        ctx.term()


async def test_sort_cycles_columns_and_keeps_selection(pub):
    app = make_app(pub.endpoint)
    running = [req("r1", 3, 90, 5), req("r2", 1, 20, 40), req("r3", 2, 55, 12)]
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(2000.0, running))
        assert [r[0] for r in table_rows(app)] == ["r2", "r3", "r1"]  # by slot
        await pilot.press("down")  # select the second row (r3)
        await pilot.press("s")
        assert app.query_one("#header").render().plain.count("sort: seq_len") == 1
        assert [r[0] for r in table_rows(app)] == [
            r.id for r in sorted(running, key=lambda r: -r.seq_len)]
        assert app.selected_key() == request_key(running[2])  # the cursor followed r3
        await pilot.press("s")
        assert [r[0] for r in table_rows(app)] == [
            r.id for r in sorted(running, key=lambda r: -r.generated)]


async def test_pause_freezes_the_screen(pub):
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(3000.0, [req("p1", 1, 10, 1)]))
        await pilot.press("p")
        assert "PAUSED" in app.query_one("#header").render().plain
        later = snapshot(3001.0, [req("p1", 1, 60, 51)])
        for _ in range(10):
            pub.send(later)
            await pilot.pause(REFRESH_S)
        assert table_rows(app)[0][3] == 10 and app.snapshot.time == 3000.0
        await pilot.press("p")
        await show(pilot, app, pub, later)
        assert table_rows(app)[0][3] == 60


async def test_detail_view_shows_the_request_over_time(pub):
    app = make_app(pub.endpoint)
    lengths = [30, 34, 38, 42]
    async with app.run_test(size=SIZE) as pilot:
        for i, n in enumerate(lengths):
            await show(pilot, app, pub, snapshot(4000.0 + i, [req("d1", 2, n, n - 26),
                                                              req("d2", 1, 5, 1)]))
        # d2 is in slot 1, so it is the first row: move to d1 and open it.
        await pilot.press("down", "enter")
        assert isinstance(app.screen, RequestDetailScreen) and app.screen.key == "c0ffee/d1"
        hist = app.screen.query_one("#detail-history", DataTable)
        seq = [hist.get_row_at(i)[3] for i in range(hist.row_count)]
        assert seq[0] == lengths[-1] and set(lengths) <= set(seq)  # newest first, all there
        summary = app.screen.query_one("#detail-summary").render().plain
        assert "request d1" in summary and "seq_len 42" in summary and "tok/s 4.0" in summary
        # These snapshots carry no text (as from an older service): the panel says so.
        assert app.screen.query_one("#detail-text", OutputText).render().plain == TEXT_NOTE
        # It keeps updating live, and says so when the request ends.
        await show(pilot, app, pub, snapshot(4010.0, [req("d2", 1, 6, 2)]))
        assert "ended: ended (last seen at 16 tokens" in app.screen.query_one(
            "#detail-summary").render().plain
        await pilot.press("escape")
        assert not isinstance(app.screen, RequestDetailScreen)


async def test_events_from_snapshot_diffs(pub):
    app = make_app(pub.endpoint)
    c = dict(finished=5, tokens=100)  # counters of a service that has been up a while
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(5000.0, [req("e1", 1, 50, 20), req("e2", 2, 9, 3)],
                                             **c))
        # e1 goes back to the queue (preemption) and the retraction counter rises.
        await show(pilot, app, pub, snapshot(5001.0, [req("e2", 2, 10, 4)],
                                             [req("e1", 0, 50, 20, "waiting")], retractions=1, **c))
        # The worker dies and is restarted: e2 disappears with it.
        await show(pilot, app, pub, snapshot(5002.0, [], [req("e1", 0, 50, 20, "waiting")],
                                             retractions=1, restarts=1, pid=5151, **c))
        await show(pilot, app, pub, snapshot(5003.0, [req("z1", 1, 7, 2)], retractions=1,
                                             restarts=1, alive=False, **c))
        # The whole service restarts: counters go back to zero, z1 is gone with it.
        await show(pilot, app, pub, snapshot(5004.0, []))
        log = events_text(app)
        assert "request e1 preempted at seq_len 50" in log
        assert "1 request(s) retracted" in log
        assert "worker restarted (restart #1, pid 4242 -> 5151)" in log
        assert "request e2 failed: the worker died" in log
        assert "worker down" in log
        assert "the service restarted" in log and "request z1 lost: the service restarted" in log
        assert "request e1 failed: the worker died" in log  # it was queued when the worker went


async def test_burst_of_snapshots_does_not_queue_up(pub):
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(6000.0, [req("b", 1, 10, 1)]))
        applied_before = app.applied
        n = 3000
        start = time.monotonic()
        for i in range(n):
            pub.send(snapshot(6001.0 + i, [req("b", 1, 10 + i, 1 + i)]))
        last = 6000.0 + n
        await until(pilot, lambda: app.snapshot.time == last, timeout_s=5,
                    what="the last snapshot of the burst")
        # The newest arrives promptly and the screen skipped most of the backlog.
        assert time.monotonic() - start < 5
        assert app.applied - applied_before < n / 10
        assert table_rows(app)[0][3] == 10 + n - 1


async def test_service_down_then_up():
    port = free_port()
    app = make_app(f"tcp://127.0.0.1:{port}", stale_after_s=0.5, reconnect_every_s=0.5)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        header = app.query_one("#header").render().plain
        assert "service down?" in header and f":{port}" in header
        p = Publisher(port)
        try:
            up = snapshot(7000.0, [req("u1", 1, 5, 1)])
            await show(pilot, app, p, up)
            # Kept coming, as from a live service: one alone can be 0.5 s old (stale_after_s)
            # by the time the header is drawn on a loaded machine.
            await until(pilot, lambda: "connected to" in app.query_one("#header").render().plain,
                        every=lambda: p.send(up), what="the header to say connected")
        finally:
            p.close()
        await until(pilot, lambda: "service down?" in app.query_one("#header").render().plain,
                    timeout_s=5, what="the header to notice the service left")
        assert "service down?" in events_text(app)


async def test_header_says_when_the_service_drains(pub):
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(7100.0, [req("d1", 1, 5, 1)]))
        assert "DRAINING" not in app.query_one("#header").render().plain
        await show(pilot, app, pub, snapshot(7101.0, [req("d1", 1, 6, 2)], draining=True))
        assert "DRAINING (shutting down)" in app.query_one("#header").render().plain


async def test_speculation_panel_shows_the_published_accept_length(pub):
    app = make_app(pub.endpoint)
    running = [req("s1", 1, 40, 10, accept=3), req("s2", 2, 30, 5, accept=1)]
    async with app.run_test(size=SIZE) as pilot:
        # A snapshot without the service-wide figures: the batch's last steps (drafts + bonus).
        await show(pilot, app, pub, snapshot(9000.0, running, speculation=True))
        assert app.tracker.accept_len[-1] == pytest.approx(3.0)  # mean of 3 + 1 and 1 + 1
        label = str(app.query_one("#accept-label").render())
        assert "mean accept length 3.00" in label and "position" not in label
        if "spec_accept_length" not in TelemetrySnapshot.__struct_fields__:
            return  # an ipc without the service-wide figures
        snap = msgspec.structs.replace(snapshot(9001.0, running, speculation=True),
                                       spec_accept_length=2.25, spec_verify_steps=40,
                                       spec_accept_rate_per_position=[0.8, 0.35, 0.1])
        await show(pilot, app, pub, snap)
        assert app.tracker.accept_len[-1] == pytest.approx(2.25)
        assert app.query_one("#accept").data[-1] == pytest.approx(2.25)
        label = str(app.query_one("#accept-label").render())
        assert "mean accept length 2.25" in label
        assert "accepted by draft position 80% 35% 10%" in label
        await show(pilot, app, pub, snapshot(9002.0, running))  # speculation off
        assert "speculation off" in str(app.query_one("#accept-label").render())


async def test_screen_text_and_svg(pub, tmp_path):
    app = make_app(pub.endpoint)
    running = [req(f"req-{i}", i + 1, 30 + 17 * i, 3 * i + 1) for i in range(5)]
    async with app.run_test(size=SIZE) as pilot:
        queued = [req("queued-1", 0, 44, 0, "waiting")]
        await show(pilot, app, pub, snapshot(8000.0, running, queued, finished=7, tokens=321))
        await pilot.pause(0.2)
        text = screen_text(app.export_screenshot())
        for expected in ["SmolLM2-135M-Instruct", "cpu fp32 attn=torch", "overlap on", "spec off",
                         "finished 7", "tokens 321", "throughput   123.5 tok/s",
                         "waiting: 1", "queued-1", "1024/4096 tokens",
                         "forward    20.0 ms", "overlap efficiency 75%", "uptime 1h02m"]:
            assert expected in text, f"{expected!r} not on screen:\n{text}"
        for r in running:  # table row and bar label per request
            assert re.search(rf"{r.id}\s+{r.slot}\s+decode\s+{r.seq_len}\s+{r.generated}", text)
        assert app.save_screenshot("main.svg", str(tmp_path)).endswith("main.svg")


# ----- request text and speculation settings, from the service's own telemetry -------------

class SchedulerTelemetry:
    """A Scheduler answered by hand (no worker; token t reads "w<t> ") and the service's
    TelemetryPublisher making snapshots of it, as `fmserve serve` publishes them."""

    def __init__(self, spec: SpecSettings = SpecSettings(), include_text: bool = True) -> None:
        info = WorkerInfo(protocol_version=1, model_name="fake", device="cpu", dtype="fp32",
                          attention_backend="torch", num_layers=2, vocab_size=1000,
                          max_context_len=4096, page_size=16, num_pages=64, num_slots=5,
                          eos_token_ids=[2])
        self.core = Scheduler(info, word_tokenizer("w{} "), SchedulerConfig())
        self.info = info
        self.ctx = zmq.Context()
        self.publisher = TelemetryPublisher(self.ctx, "tcp://127.0.0.1:0", ServiceCounters(),
                                            spec, overlap=False, include_text=include_text)
        self.streamed: dict[str, str] = {}  # the text each client received, in its chunks

    def step(self, token: int) -> None:
        """Plan a step and answer it: every sampling request gets `token`."""
        plan = self.core.plan_step()
        slots = [e.slot for e in plan.extends if e.sample] + unpack_i32(plan.decode_slots).tolist()
        result = StepResult(step_id=plan.step_id, slots=pack_i32(slots),
                            token_ids=pack_i32([token] * len(slots)), logprobs=b"",
                            top_logprobs_n=0, top_logprob_ids=b"", top_logprobs=b"",
                            forward_ms=1.0)
        for out in self.core.process_result(result):
            self.streamed[out.rid] = self.streamed.get(out.rid, "") + out.text

    def snapshot(self) -> TelemetrySnapshot:
        return self.publisher.snapshot([self.core], self.info, worker_state="ready", replicas=[])

    def close(self) -> None:
        self.publisher.close()
        self.ctx.term()


def _squash(text: str) -> str:
    return "".join(text.split())


async def test_detail_view_streams_the_request_text(pub):
    sched = SchedulerTelemetry()
    rid = "c0ffee/story"
    # "w7 " could begin the stop string, so the service holds it back until "w8 " follows.
    sched.core.add_request(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=1000,
                                                          stop=["w7 w99"]))
    app = make_app(pub.endpoint)
    try:
        async with app.run_test(size=SIZE) as pilot:
            sched.step(3)  # the prefill step samples the first token
            await show(pilot, app, pub, sched.snapshot())
            await pilot.press("enter")
            assert isinstance(app.screen, RequestDetailScreen) and app.screen.key == rid
            panel = app.screen.query_one("#detail-text", OutputText)
            assert panel.text == sched.streamed[rid] == "w3 "
            assert panel.render().plain == "w3 " and panel.border_title == "output text, live"
            # It follows the text live, as the client received it: "w7 " is held back.
            for token in (4, 5, 6, 7):
                sched.step(token)
            await show(pilot, app, pub, sched.snapshot())
            assert app.screen.query_one("#detail-text", OutputText) is panel
            assert panel.text == sched.streamed[rid] == "w3 w4 w5 w6 "
            sched.step(8)
            await show(pilot, app, pub, sched.snapshot())
            assert panel.text == sched.streamed[rid] == "w3 w4 w5 w6 w7 w8 "
            assert panel.render().plain == "w3 w4 w5 w6 w7 w8 "
            # Past TEXT_TAIL_CHARS the snapshot carries the newest characters only.
            for i in range(200):
                sched.step(10 + i % 90)
            snap = sched.snapshot()
            assert len(sched.streamed[rid]) > TEXT_TAIL_CHARS
            assert snap.running[0].text_tail == sched.streamed[rid][-TEXT_TAIL_CHARS:]
            await show(pilot, app, pub, snap)
            assert panel.text == sched.streamed[rid][-TEXT_TAIL_CHARS:]
            shown = panel.render().plain
            assert shown.startswith("…") and _squash(shown).endswith(
                _squash(sched.streamed[rid][-120:]))
            assert panel.border_title == \
                f"output text (its last {TEXT_TAIL_CHARS} characters), live"
            # When it ends, the last text seen stays.
            sched.core.abort(rid)
            await show(pilot, app, pub, sched.snapshot())
            assert panel.text == sched.streamed[rid][-TEXT_TAIL_CHARS:]
            assert panel.border_title.endswith(", as last seen")
    finally:
        sched.close()


async def test_detail_view_says_when_the_service_publishes_no_text(pub):
    sched = SchedulerTelemetry(include_text=False)  # service.telemetry_include_text's default
    rid = "c0ffee/quiet"
    sched.core.add_request(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=100))
    app = make_app(pub.endpoint)
    try:
        async with app.run_test(size=SIZE) as pilot:
            for token in (3, 4):
                sched.step(token)
            snap = sched.snapshot()
            assert sched.streamed[rid] == "w3 w4 " and snap.running[0].text_tail is None
            await show(pilot, app, pub, snap)
            await pilot.press("enter")
            panel = app.screen.query_one("#detail-text", OutputText)
            assert panel.render().plain == TEXT_NOTE
            assert "text off" in TEXT_NOTE and "service.telemetry_include_text" in TEXT_NOTE
    finally:
        sched.close()


async def test_detail_view_before_the_first_token(pub):
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(9200.0, [req("f1", 1, 40, 0, "prefilling", text="")]))
        await pilot.press("enter")
        panel = app.screen.query_one("#detail-text", OutputText)
        assert panel.render().plain == NO_TEXT_YET
        text = "line one\n\tindented\x1b[31m line\r\nthree"
        await show(pilot, app, pub, snapshot(9201.0, [req("f1", 1, 52, 12, text=text)]))
        # Control characters cannot reach the terminal; tabs become spaces.
        assert panel.render().plain == "line one\n    indented\ufffd[31m line\nthree"


async def test_header_shows_the_speculation_settings(pub):
    sched = SchedulerTelemetry(SpecSettings(algorithm="eagle3", num_steps=3, topk=2,
                                            num_draft_tokens=6))
    app = make_app(pub.endpoint)
    header = lambda: app.query_one("#header").render().plain  # noqa: E731
    try:
        async with app.run_test(size=SIZE) as pilot:
            # The service's publisher takes them from its config's [spec] section.
            await show(pilot, app, pub, sched.snapshot())
            assert ("spec eagle3 (steps 3, topk 2, draft 6, drafts where measured faster)"
                    in header())  # spec.disable_above_batch_size = "auto", the default
            limited = SchedulerTelemetry(SpecSettings(algorithm="eagle3", num_steps=3, topk=2,
                                                      num_draft_tokens=6,
                                                      disable_above_batch_size=4))
            try:
                await show(pilot, app, pub, limited.snapshot())
                assert "spec eagle3 (steps 3, topk 2, draft 6, off above batch 4)" in header()
            finally:
                limited.close()
            await show(pilot, app, pub, snapshot(9301.0, speculation=True))  # an older service
            assert "spec on (settings n/a)" in header()
            await show(pilot, app, pub, snapshot(9302.0))
            assert "spec off " in header()
    finally:
        sched.close()


# ----- live service -------------------------------------------------------------------------

ADMIN_TOKEN = "top-test-token-5f0c"


@pytest.fixture(scope="module")
def live_service(model_path):
    if not Path(model_path).exists():
        pytest.skip(f"model file {model_path} is missing; set FMSERVE_MODEL")
    svc = ServiceProcess(model_path, "--set", f"service.admin_token={ADMIN_TOKEN}",
                         "--set", "service.telemetry_include_text=true")
    yield svc
    svc.stop()


def _client(endpoint: str, prompt: str, rid: str, max_new: int, out: dict) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    with Client(endpoint) as c:
        got = list(c.generate(prompt, params=params, request_id=rid))
    out[rid] = got


@pytest.mark.skipif(AdminAbort is None, reason="ipc.client_messages has no AdminAbort: `a` "
                    "cannot abort another client's request (see tui/app.py)")
async def test_live_service_with_concurrent_clients_and_abort(live_service):
    svc = live_service
    app = make_app(f"tcp://127.0.0.1:{svc.tport}", svc.endpoint, admin_token=ADMIN_TOKEN)
    results: dict[str, list] = {}
    short = [f"short-{i}" for i in range(3)]
    threads = [threading.Thread(target=_client, args=(svc.endpoint, f"Count to {i}.", rid, 24,
                                                      results)) for i, rid in enumerate(short)]
    threads.append(threading.Thread(target=_client, args=(svc.endpoint, "Tell me everything.",
                                                          "victim", 2000, results)))
    async with app.run_test(size=SIZE) as pilot:
        for t in threads:
            t.start()
        try:
            ids = lambda: {row[0] for row in table_rows(app)}  # noqa: E731
            await until(pilot, lambda: "victim" in ids() and len(ids()) >= 2, timeout_s=60,
                        what="the live requests to show up in the batch")
            # The rows carry the live values: generated grows between snapshots.
            first = {r[0]: r[4] for r in table_rows(app)}["victim"]
            await until(pilot, lambda: {r[0]: r[4] for r in table_rows(app)}.get("victim", 0)
                        > first, timeout_s=30, what="victim to generate more tokens")
            # The service's own CPU time a step, from the growth of its snapshots'
            # service_cpu_ms over the steps between them (the line shows only while steps run).
            steps_panel = lambda: str(app.query_one("#steps").render())  # noqa: E731
            await until(pilot, lambda: (app.tracker.service_ms_per_step or 0) > 0
                        and "ms/step" in steps_panel(), timeout_s=10,
                        what="the service's CPU time a step in the step panel")
            # Select the victim and abort it through the monitor.
            table = app.query_one("#batch", DataTable)
            table.move_cursor(row=[r[0] for r in table_rows(app)].index("victim"))
            await pilot.pause(REFRESH_S)
            victim_key = app.selected_key()
            assert victim_key.endswith("/victim")
            # Its detail view streams the text the service sends it.
            await pilot.press("enter")
            panel = app.screen.query_one("#detail-text", OutputText)
            await until(pilot, lambda: panel.text and len(panel.text) > 20, timeout_s=30,
                        what="the victim's text in the detail view")
            seen_text = panel.text
            await pilot.press("escape")
            # Without the service's token the service refuses, and the victim runs on.
            wrong = await asyncio.to_thread(send_admin_abort, svc.endpoint, victim_key,
                                            "not-the-token")
            assert wrong.level == "error" and "[forbidden]" in wrong.text
            assert "victim" not in results
            # The cursor back on the victim as "a" goes (rows of finished requests have left;
            # on a loaded machine the table may take a refresh after the detail view closes).
            await until(pilot, lambda: app.selected_key() == victim_key, timeout_s=10,
                        what="the cursor back on the victim")
            await pilot.press("a")
            await until(pilot, lambda: "victim" in results, timeout_s=30,
                        what="the victim's stream to end")
            assert isinstance(results["victim"][-1], Finished)
            assert results["victim"][-1].reason == "abort"
            assert seen_text in "".join(m.text for m in results["victim"] if isinstance(m, Chunk))
            await until(pilot, lambda: "accepted by the service" in events_text(app),
                        timeout_s=10, what="the service's Aborted answer")
            await until(pilot, lambda: "victim aborted from top" in events_text(app),
                        timeout_s=10, what="the abort event")
            # A key that is not in flight is refused, and the monitor says why.
            refused = await asyncio.to_thread(send_admin_abort, svc.endpoint, "00/none",
                                              ADMIN_TOKEN)
            assert refused.level == "error" and "unknown_request" in refused.text
            for t in threads:
                await asyncio.to_thread(t.join, 60)
            for rid in short:  # the other clients finished normally
                assert results[rid][-1].reason == "length", (rid, results[rid][-1],
                                                             events_text(app))
                assert sum(len(m.token_ids) for m in results[rid] if isinstance(m, Chunk)) == 24
            await until(pilot, lambda: app.snapshot.finished_requests >= 4 and not table_rows(app),
                        timeout_s=10, what="the batch to drain")
        finally:
            for t in threads:
                t.join(timeout=60)


def test_kv_gauge_shows_the_prefix_cache_only_when_it_is_on():
    from tui.widgets import kv_gauge_text

    off = kv_gauge_text(snapshot(1.0), 40).plain
    assert "prefix cache" not in off and "64/256 pages" in off
    on = msgspec.structs.replace(snapshot(1.0), prefix_cache_hit_share=0.6, cached_pages=12)
    assert "prefix cache 12 pages, 60% of prompts reused" in kv_gauge_text(on, 40).plain


def test_replica_lines_show_a_dp_attention_ranks_idle_batches():
    from ipc.client_messages import ReplicaStatus
    from tui.widgets import replicas_text

    def rank(index: int, idle_steps: int) -> ReplicaStatus:
        return ReplicaStatus(index=index, worker_state="ready", pid=4242, restarts=0,
                             running=1 - index, waiting=0, free_pages=100, total_pages=128,
                             free_slots=7, total_slots=8, steps=30, idle_steps=idle_steps,
                             idle_forwards=idle_steps)

    text = replicas_text(msgspec.structs.replace(snapshot(1.0),
                                                 replicas=[rank(0, 0), rank(1, 12)])).plain
    lines = text.strip().splitlines()
    assert "idle" not in lines[0] and lines[1].endswith("idle 12"), lines


async def test_a_snapshot_applied_before_the_detail_view_mounts_waits_for_its_mount(pub):
    """The monitor's tick can apply a snapshot between pushing the detail view and its
    on_mount (seen under a loaded CI run: its history table had no columns yet); the view
    then shows the request once mounted."""
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        snap = snapshot(4000.0, [req("d1", 2, 30, 4)])
        await show(pilot, app, pub, snap)
        app.push_screen(RequestDetailScreen("c0ffee/d1"))
        app.apply(snap)  # before the screen has mounted
        await until(pilot, lambda: app.screen.ready, what="the detail view to mount")
        hist = app.screen.query_one("#detail-history", DataTable)
        assert hist.row_count >= 1 and hist.get_row_at(0)[3] == 30
