"""A tiny fake service for the client library and `fmserve client`: a real ZMQ ROUTER on a
random tcp port in a thread, speaking the protocol by hand (plain msgpack maps, not our codec)."""

import threading
import time

import msgspec
import zmq

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

STATS = {"type": "stats", "model": "fake", "device": "cpu", "worker_alive": True, "running": 0,
         "waiting": 0, "free_pages": 10, "total_pages": 10, "free_slots": 4, "total_slots": 4,
         "steps": 0, "output_tokens": 0}


class FakeService(threading.Thread):
    """Echo service: a Generate's reply is its prompt's words, one Chunk each, then Finished.

    It holds Generates until `batch` have arrived, then answers them interleaved (one word of
    each in turn, latest request first), so a client that routed by arrival order would mix
    them up. A prompt "error" gets an Error; `delay_s` delays every Generate's replies."""

    def __init__(self, batch: int = 1, delay_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.batch, self.delay_s = batch, delay_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.received: list[tuple[float, dict]] = []  # (time, message) of every frame
        self._pending: list[tuple[bytes, dict]] = []
        self._scheduled: list[tuple[float, bytes, dict]] = []
        self._stopping = threading.Event()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self._stopping.set()
        self.join(5)
        self.sock.close()
        self.ctx.term()

    def of_type(self, tag: str) -> list[dict]:
        return [m for _, m in list(self.received) if m.get("type") == tag]

    def ids_of(self, tag: str, timeout_s: float = 5.0) -> list[str]:
        """The ids of the messages of this type, once one has come (on a loaded machine a
        frame sent just now can take a while to reach this thread), or [] after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self.of_type(tag) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # a second one, wrongly sent, would have come by now too
        return [m["id"] for m in self.of_type(tag)]

    def run(self) -> None:
        while not self._stopping.is_set():
            if self.sock.poll(10):
                ident, frame = self.sock.recv_multipart()
                msg = unpack(frame)
                self.received.append((time.monotonic(), msg))
                self._handle(ident, msg)
            now = time.monotonic()
            due = [s for s in self._scheduled if s[0] <= now]
            self._scheduled = [s for s in self._scheduled if s[0] > now]
            for _, ident, reply in due:
                self.sock.send_multipart([ident, pack(reply)])

    def _handle(self, ident: bytes, msg: dict) -> None:
        tag = msg["type"]
        if tag == "health":
            self.sock.send_multipart([ident, pack(STATS)])
        elif tag == "ping":
            self.sock.send_multipart([ident, pack({"type": "pong"})])
        elif tag == "generate":
            self._pending.append((ident, msg))
            if len(self._pending) >= self.batch:
                self._answer(self._pending[::-1])
                self._pending = []

    def _answer(self, requests: list[tuple[bytes, dict]]) -> None:
        at = time.monotonic() + self.delay_s
        for _, m in requests:  # a chat request echoes its last message
            m["text"] = m.get("text") or m["messages"][-1]["content"]
        words = {m["id"]: m["text"].split() for _, m in requests}
        for ident, m in requests:
            if m["text"] == "error":
                self._scheduled.append((at, ident, {"type": "error", "id": m["id"],
                                                    "code": "prompt_too_long",
                                                    "message": "too long"}))
        requests = [(i, m) for i, m in requests if m["text"] != "error"]
        for k in range(max((len(w) for w in words.values()), default=0)):
            for ident, m in requests:
                if k < len(words[m["id"]]):
                    self._scheduled.append((at, ident, {
                        "type": "chunk", "id": m["id"], "token_ids": [k],
                        "text": (" " if k else "") + words[m["id"]][k]}))
        for ident, m in requests:
            usage = {"prompt_tokens": len(words[m["id"]]),
                     "completion_tokens": len(words[m["id"]])}
            self._scheduled.append((at, ident, {"type": "finished", "id": m["id"],
                                                "reason": "stop", "usage": usage}))


def free_endpoint() -> str:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(linger=0)
    return f"tcp://127.0.0.1:{port}"
