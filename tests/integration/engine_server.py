"""A tiny OpenAI-compatible server for ``engine: command`` tests (standard library only).

``python engine_server.py PORT MODEL [--child]``: GET /v1/models lists MODEL; POST
/v1/chat/completions answers "hello from engine" (streamed as SSE when asked). ``--child``
first starts a ``sleep`` in its process group that the node's exec shim does not cover (no
PR_SET_PDEATHSIG), like Ollama's runners: only the node's pid-file clean-up kills it. Its pid is
printed as ``child PID``; ``--child-group`` starts it in a process group of its own (still in the
server's session). ``--slow`` streams one event every half second (a run still going when its route
is removed). ``--exit-after S`` exits S seconds after it first listed its model (a crash loop), ``--stop-after
S`` stops itself (SIGSTOP: a hang) likewise;
``--bad-list`` answers ``{"data": 5}`` as its model lists. GET /api/tags lists MODEL the way Ollama does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, MODEL = int(sys.argv[1]), sys.argv[2]
SLOW = "--slow" in sys.argv
EXIT_AFTER = float(sys.argv[sys.argv.index("--exit-after") + 1]) if "--exit-after" in sys.argv else None
STOP_AFTER = float(sys.argv[sys.argv.index("--stop-after") + 1]) if "--stop-after" in sys.argv else None
WORDS = ["hello", " from", " engine"]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path in ("/v1/models", "/api/tags") and "--bad-list" in sys.argv:
            self._send(200, b'{"data": 5}')
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())
            if EXIT_AFTER is not None:
                threading.Timer(EXIT_AFTER, os._exit, [0]).start()
            if STOP_AFTER is not None:
                threading.Timer(STOP_AFTER, os.kill, [os.getpid(), signal.SIGSTOP]).start()
        elif self.path == "/api/tags":
            self._send(200, json.dumps({"models": [{"name": MODEL}]}).encode())
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not request.get("stream"):
            message = {"role": "assistant", "content": "".join(WORDS)}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            usage = {"prompt_tokens": 3, "completion_tokens": 3}
            self._send(200, json.dumps({"choices": [choice], "usage": usage}).encode())
            return
        chunks = [{"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]} for word in WORDS]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        events = [b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks] + [b"data: [DONE]\n\n"]
        if not SLOW:
            self._send(200, b"".join(events), "text/event-stream")
            return
        self.send_response(200)  # --slow: one event every half second, chunked
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            time.sleep(0.5)
        self.wfile.write(b"0\r\n\r\n")


if "--child" in sys.argv or "--child-group" in sys.argv:
    child = subprocess.Popen(["sleep", "300"], process_group=0 if "--child-group" in sys.argv else None)
    print(f"child {child.pid}", flush=True)
print(f"serving {MODEL} on {PORT}", flush=True)
ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
