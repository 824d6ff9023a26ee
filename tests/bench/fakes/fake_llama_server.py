#!/usr/bin/env python3
"""A stand-in for llama.cpp's `llama-server` that speaks its /health and streaming /completion
protocol, for testing fmserve's llama-server peer driver where the real binary is not built.
It streams `n_predict` tokens (ids 0, 1, ...) one per server-sent event (FAKE_LLAMA_HOLD=1:
every third one held back into the next event, as the real server does with a token that ends
inside a UTF-8 character), and records the most
requests it had in flight at once in $FAKE_LLAMA_STATS. FAKE_LLAMA_CACHE_RAM=1: it has newer
builds' --cache-ram flag (listed by --help, its value recorded)."""

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("-np", type=int)
if os.environ.get("FAKE_LLAMA_CACHE_RAM") == "1":
    parser.add_argument("--cache-ram", type=int)
args, _ = parser.parse_known_args()
lock = threading.Lock()
stats = {"in_flight": 0, "max_in_flight": 0, "requests": 0, "slots": args.np,
         "cache_ram": getattr(args, "cache_ram", None)}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *_):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and isinstance(body["prompt"], list), body
        with lock:
            stats["in_flight"] += 1
            stats["requests"] += 1
            stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
            stats["sampling"] = {k: body[k] for k in ("temperature", "top_k", "top_p", "min_p")
                                 if k in body}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["n_predict"] - int(os.environ.get("FAKE_LLAMA_SHORT", "0"))
        hold = os.environ.get("FAKE_LLAMA_HOLD") == "1"
        for i in range(n):
            time.sleep(0.002)
            if hold and i % 3 == 0 and i < n - 1:
                continue  # as llama-server holds a token ending inside a UTF-8 character:
                # the next event carries its text but lists only its own token
            self.wfile.write(b"data: " + json.dumps({"content": "x", "tokens": [i],
                                                     "stop": False}).encode() + b"\n\n")
        with lock:  # recorded before the last event, so a client that got it reads it
            stats["in_flight"] -= 1
            path = os.environ["FAKE_LLAMA_STATS"]
            with open(path + ".tmp", "w") as f:
                json.dump(stats, f)
            os.replace(path + ".tmp", path)
        self.wfile.write(b"data: " + json.dumps({"content": "", "tokens": [], "stop": True,
                                                 "stop_type": "limit",
                                                 "tokens_predicted": n}).encode() + b"\n\n")


ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
