"""A real HTTP server on 127.0.0.1 serving generated images, for the download tests and bench.

Each URL path names how it answers (`/<kind>/<name>.<ext>`):
  img      a JPEG of the size registered for it (default 96x80), distinct per name
  broken   200 with bytes that are no image
  missing  404
  slow     the image, after `slow_seconds` (longer than the client's timeout)
  huge     a PNG of huge_size pixels (small on the wire: one colour)
  flaky    503 on the first request, the image afterwards
  gate     the image, one byte every 0.2 s until release() is called, then the rest at once:
           a download in flight for as long as a test needs (a byte arrives well within any
           client timeout, so the client never gives up on it)
Every request is counted per path, so a test can prove what was (not) downloaded twice.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image


def jpeg_for(name: str, size: tuple[int, int] = (96, 80)) -> bytes:
    colour = tuple(hashlib.sha256(name.encode()).digest()[:3])
    image = Image.new("RGB", size, colour)
    image.putpixel((0, 0), (255 - colour[0], 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


class ImageServer:
    def __init__(self, slow_seconds: float = 3.0, huge_size: tuple[int, int] = (1500, 1000)):
        self.slow_seconds = slow_seconds
        self.huge_size = huge_size
        self.requests: Counter = Counter()
        self.sizes: dict[str, tuple[int, int]] = {}
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self._cache: dict[str, bytes] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server API
                server._answer(self)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            # the default listen backlog of 5 drops connections when img2dataset opens dozens at
            # once; the retransmitted SYNs would show up as timeouts that are not the client's
            request_queue_size = 512

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True  # a blocked gate or slow answer never holds shutdown
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ImageServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, kind: str, name: str, ext: str = "jpg") -> str:
        return f"{self.base}/{kind}/{name}.{ext}"

    def release(self) -> None:
        self._gate.set()

    def count(self, url: str) -> int:
        return self.requests[url.removeprefix(self.base)]

    def _image(self, name: str) -> bytes:
        with self._lock:
            if name not in self._cache:
                self._cache[name] = jpeg_for(name, self.sizes.get(name, (96, 80)))
            return self._cache[name]

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path
        with self._lock:
            self.requests[path] += 1
            seen = self.requests[path]
        _, kind, file = path.split("/", 2)
        name = file.rsplit(".", 1)[0]
        if kind == "missing" or kind not in ("img", "broken", "slow", "huge", "flaky", "gate"):
            return _send(handler, 404, b"not found", "text/plain")
        if kind == "flaky" and seen == 1:
            return _send(handler, 503, b"try again", "text/plain")
        if kind == "broken":
            return _send(
                handler, 200, b"\xff\xd8\xff\xe0 this is not really a jpeg" * 20, "image/jpeg"
            )
        if kind == "slow":
            threading.Event().wait(self.slow_seconds)
        if kind == "gate":
            return self._trickle(handler, self._image(name))
        if kind == "huge":
            buffer = io.BytesIO()
            Image.new("RGB", self.huge_size, (10, 200, 30)).save(buffer, format="PNG")
            return _send(handler, 200, buffer.getvalue(), "image/png")
        _send(handler, 200, self._image(name), "image/jpeg")

    def _trickle(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "image/jpeg")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            sent = 0
            while not self._gate.is_set() and sent < len(body) - 1:
                handler.wfile.write(body[sent : sent + 1])
                handler.wfile.flush()
                sent += 1
                self._gate.wait(0.2)
            handler.wfile.write(body[sent:])
        except (BrokenPipeError, ConnectionResetError):
            pass


def _send(handler: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
    try:
        handler.send_response(code)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client gave up (timeout, or killed mid-download): nothing to answer
