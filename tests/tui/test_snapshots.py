"""SVG snapshot tests of `fmserve top` (pytest-textual-snapshot): the main screen and the detail
view drawn from a fixed scene. Baselines in tests/tui/__snapshots__/test_snapshots/.

After a deliberate change of the look: `pytest tests/tui/test_snapshots.py --snapshot-update`
rewrites the baselines, and FMSERVE_TOP_SCREENSHOTS=docs on the same run rewrites
docs/top-main.svg and docs/top-detail.svg from the same scene.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

import pytest

from ipc.telemetry import (TEXT_TAIL_CHARS, RequestTelemetry, SpecConfigTelemetry, StepTelemetry,
                           TelemetrySnapshot, WorkerTelemetry)
from tests.tui.helpers import REFRESH_S, ROOT, until
from tui.app import TopApp
from tui.telemetry_feed import FeedStatus
from tui.widgets import RequestDetailScreen


# ----- SVG snapshots (pytest-textual-snapshot) of a fixed scene -----------------------------

SCENE_T0 = 1767225600.0  # 2026-01-01 00:00:00 UTC: event time stamps are drawn in UTC
SCENE_SIZE = (150, 44)
SCENE_SPEC = SpecConfigTelemetry(algorithm="eagle3", num_steps=4, topk=1, num_draft_tokens=5)
SCENE_TEXT = {
    "chat-7f3a": (
        "Paged attention stores each request's keys and values in fixed-size pages, so memory "
        "is handed out in small blocks instead of one long buffer per request. The scheduler "
        "keeps a page table for every slot; when a request grows past its last page it is "
        "granted another, and when the pool runs dry the newest request is retracted and "
        "recomputed later. Continuous batching mixes prefill chunks with decode steps, which "
        "keeps the worker busy while short requests come and go. With speculative decoding a "
        "small draft head proposes a few tokens ahead and the target model verifies them in "
        "one forward, accepting the longest prefix it agrees with plus a bonus token."),
    "code-19": (
        "Here is a merge step and a test:\n\n"
        "def merge_sorted(a, b):\n"
        "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
        "    out, i, j = [], 0, 0\n"
        "    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n"
        "            out.append(a[i])\n"
        "            i += 1\n"
        "        else:\n"
        "            out.append(b[j])\n"
        "            j += 1\n"
        "    return out + a[i:] + b[j:]\n\n"
        "def test_merge_sorted():\n"
        "    assert merge_sorted([1, 4, 9], [2, 3, 10]) == [1, 2, 3, 4, 9, 10]\n"
        "    assert merge_sorted([], [5]) == [5]\n"
        "    assert merge_sorted([7], []) == [7]\n"),
    "summarise-22": "The report makes three points. First, latency under load is dominated by",
    "story-4": "Once upon a time, in a lighthouse at the edge of the map, a keeper counted",
    "qa-8": "The capital of Australia is Canberra.",
    "translate-5": "Le cache de clés et de valeurs est découpé en pages de taille fixe, et",
    "json-11": '{"name": "fmserve", "features": ["paged KV cache", "overlap scheduling", "',
}


def _scene_request(rid: str, slot: int, prompt: int, generated: int, state: str = "decoding",
                   accept: int = 0, age: float = 3.0) -> RequestTelemetry:
    text = SCENE_TEXT.get(rid, "")[:round(generated * 4.3)][-TEXT_TAIL_CHARS:]
    return RequestTelemetry(id=rid, slot=slot, state=state, prompt_len=prompt,
                            seq_len=prompt + generated, generated=generated,
                            last_accept_len=accept, age_s=age, key=f"5a17/{rid}",
                            accept_length=2.1 + 0.1 * slot if generated > 1 else None,
                            text_tail=text)


def scene() -> list[TelemetrySnapshot]:
    """Six snapshots a quarter of a second apart: a batch with speculation on; qa-8 finishes
    after the third, story-4 is retracted to the queue at the fourth."""
    snaps = []
    for i in range(6):
        t = SCENE_T0 + 0.25 * i
        running = [_scene_request("chat-7f3a", 1, 212, 120 + 9 * i, accept=(i + 1) % 4),
                   _scene_request("code-19", 2, 96, 60 + 8 * i, accept=(i + 2) % 4),
                   _scene_request("summarise-22", 3, 1480, max(0, 7 * i - 13),
                                  "prefilling" if i < 2 else "decoding", accept=i % 3),
                   _scene_request("translate-5", 6, 340, 14 + 8 * i, accept=(i + 3) % 4),
                   _scene_request("json-11", 7, 150, 9 + 9 * i, accept=i % 4)]
        waiting = [_scene_request("batch-31", 0, 2048, 0, "waiting", age=1.5 + 0.25 * i),
                   _scene_request("batch-32", 0, 900, 0, "waiting", age=0.75 + 0.25 * i)]
        if i < 3:
            running.append(_scene_request("story-4", 4, 64, 30 + 6 * i, accept=1))
            running.append(_scene_request("qa-8", 5, 48, 5 + 3 * i, accept=2))
        else:
            waiting.insert(0, _scene_request("story-4", 0, 64, 42, "waiting", age=4.0))
        pages = sum(-(-r.seq_len // 16) for r in running)
        steps = [StepTelemetry(step_id=400 + 6 * i - 15 + k, batch_size=len(running),
                               num_tokens=5 * len(running), forward_ms=31.5 + (k % 3) * 0.8,
                               wall_ms=35.9 + (k % 3) * 0.8, idle_ms=1.2) for k in range(16)]
        snaps.append(TelemetrySnapshot(
            time=t, uptime_s=3725.0 + 0.25 * i, model="SmolLM2-135M-Instruct", overlap=True,
            speculation=True, running=running, waiting=waiting, free_pages=512 - pages,
            total_pages=512, page_size=16, free_slots=8 - len(running), total_slots=8,
            output_tokens_per_s=[88.0, 97.5, 104.2, 99.1, 111.8, 118.3][i],
            total_output_tokens=5000 + 30 * i, finished_requests=12 + (i >= 3),
            retractions=2 + (i >= 3), recent_steps=steps, worker_idle_share=0.06,
            worker=WorkerTelemetry(alive=True, pid=31337, restarts=0, device="cpu",
                                   dtype="bf16", attention_backend="torch"),
            spec_accept_length=2.4 + 0.05 * i, spec_verify_steps=1200 + 30 * i,
            spec_accept_rate_per_position=[0.78, 0.55, 0.34, 0.19], spec_config=SCENE_SPEC))
    return snaps


class SceneFeed:
    """Stands in for TelemetryFeed: hands over the scene one snapshot per take() and reports
    the same connection every time, so nothing on screen depends on sockets or timing."""

    endpoint = "tcp://127.0.0.1:5558"

    def __init__(self, snaps: list[TelemetrySnapshot]) -> None:
        self._snaps = deque(snaps)
        self._stop = threading.Event()

    def run(self) -> None:
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()

    def take(self) -> TelemetrySnapshot | None:
        return self._snaps.popleft() if self._snaps else None

    def status(self) -> FeedStatus:
        return FeedStatus(self.endpoint, connected=True, silent_s=0.1, frames=6,
                          decode_errors=0, last_error=None)


@pytest.fixture
def utc():
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def scene_app() -> TopApp:
    return TopApp(client_endpoint="tcp://127.0.0.1:5557", refresh_s=REFRESH_S,
                  admin_token="scene-token", feed=SceneFeed(scene()),
                  clock=lambda: SCENE_T0 - 2.0)


async def play_scene(pilot) -> None:
    await until(pilot, lambda: pilot.app.applied == 6, what="the scene's six snapshots")


def save_doc_screenshot(app: TopApp, name: str) -> None:
    """With FMSERVE_TOP_SCREENSHOTS=docs: the same screen as docs/<name>."""
    if shots := os.environ.get("FMSERVE_TOP_SCREENSHOTS"):
        (ROOT / shots / name).write_text(app.export_screenshot(simplify=True))


@pytest.mark.timeout(120)
def test_main_screen_svg_snapshot(snap_compare, utc):
    app = scene_app()

    async def run_before(pilot):
        await play_scene(pilot)
        save_doc_screenshot(app, "top-main.svg")

    assert snap_compare(app, terminal_size=SCENE_SIZE, run_before=run_before)


@pytest.mark.timeout(120)
def test_detail_view_svg_snapshot(snap_compare, utc):
    app = scene_app()

    async def run_before(pilot):
        await play_scene(pilot)
        await pilot.press("down", "enter")  # code-19, slot 2
        await until(pilot, lambda: isinstance(app.screen, RequestDetailScreen),
                    what="the detail view")
        await pilot.pause(0.2)
        assert app.screen.key == "5a17/code-19"
        save_doc_screenshot(app, "top-detail.svg")

    assert snap_compare(app, terminal_size=SCENE_SIZE, run_before=run_before)
