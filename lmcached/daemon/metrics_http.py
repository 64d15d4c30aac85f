"""The HTTP server of the metrics endpoint, bounded against hostile local processes.

Why this file exists: prometheus_client's `start_http_server` starts one thread per
connection, with no limit and no timeout. Any local process can open the port, so
idle connections alone could take a thread and a file descriptor each until the daemon
has no descriptor left to accept its clients with, and a flood of scrapes or of
oversized headers would take the GIL from the daemon's loop. `ScrapeServer` is that
same server (socketserver's `ThreadingMixIn` + wsgiref, serving prometheus_client's
WSGI app) with bounds (docs/metrics.md, "Limits"):

    listen queue --(at most MAX_SCRAPES_PER_S a second)--> accept
      at MAX_SCRAPE_CONNECTIONS open: close the oldest connection still sending its
      request (idle, half-open, slow); none: close the new one
      -> a thread per connection: request line and headers <= MAX_REQUEST_BYTES,
         every read and write <= SCRAPE_IO_TIMEOUT_S, one request, then a lingering
         close: FIN after the reply, the rest of the client's input read and dropped
         (<= LINGER_BYTES, <= LINGER_S), then close
"""

import http.client
import socket
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

MAX_SCRAPE_CONNECTIONS = 8  # HTTP connections open at once, one thread each
SCRAPE_IO_TIMEOUT_S = 5.0  # one read or write on a scrape connection, then it is closed
MAX_REQUEST_BYTES = 8192  # request line and headers; Prometheus sends a few hundred bytes
MAX_SCRAPES_PER_S = 20  # connections taken per second; more wait in the listen queue
# A socket closed with unread input sends a reset, which makes the client's kernel drop
# the reply it has not read yet (and fail its shutdown, ENOTCONN): after the reply, the
# input a refused request left is read and dropped first, as Apache's lingering close.
LINGER_BYTES = 64 << 10
LINGER_S = 2.0


class _BoundedReader:
    """A scrape connection's input that ends at MAX_REQUEST_BYTES: a longer request is
    refused (431) before the header parser spends the GIL on it (http.client would
    otherwise read and parse up to 100 header lines of 64 KiB each)."""

    def __init__(self, rfile, limit_bytes: int) -> None:
        self._rfile = rfile
        self._left = limit_bytes

    def readline(self, size: int = -1) -> bytes:
        return self._take(self._rfile.readline, size)

    def read(self, size: int = -1) -> bytes:
        return self._take(self._rfile.read, size)

    def _take(self, read: Callable[[int], bytes], size: int) -> bytes:
        if self._left <= 0:
            raise http.client.LineTooLong(f"a request over {MAX_REQUEST_BYTES} bytes")
        data = read(self._left if size < 0 else min(size, self._left))
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._rfile.close()


class _ScrapeHandler(WSGIRequestHandler):
    """One connection, one request (wsgiref answers HTTP/1.0): reads and writes time
    out, the input is bounded, nothing is logged per request."""

    timeout = SCRAPE_IO_TIMEOUT_S  # StreamRequestHandler sets it on the socket

    def setup(self) -> None:
        super().setup()
        self.rfile = _BoundedReader(self.rfile, MAX_REQUEST_BYTES)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.request_read(self.request)
        return parsed

    def log_message(self, format: str, *args) -> None:
        """Log nothing: a scrape is not an event."""


class ScrapeServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's threaded WSGI server with bounds (see the module docstring).

    At MAX_SCRAPE_CONNECTIONS, a new connection closes the oldest one that has not
    finished sending its request (a scraper sends it at once), as the daemon sheds a
    silent client at max_clients; when every open connection is being answered, the
    new one is closed. Serve with `set_app(app)` then `serve_forever()` on a thread.

    Args:
        host: address to listen on (e.g. "127.0.0.1", "::").
        port: TCP port (0: one the kernel picks; see `server_port`).

    Raises:
        OSError: the address cannot be bound (errno EADDRINUSE: the port is in use).
    """

    daemon_threads = True  # a connection stuck in a read never delays the daemon's exit
    request_queue_size = 32  # listen backlog: connections wait here while over the rate

    def __init__(self, host: str, port: int) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self.address_family = family
        self._lock = threading.Lock()
        self._open: dict[socket.socket, bool] = {}  # connection -> request read; oldest first
        self._next_accept_at = 0.0
        super().__init__((sockaddr[0], port), _ScrapeHandler)

    def process_request(self, request: socket.socket, client_address) -> None:
        """Take an accepted connection (server thread): wait out the rate, make room,
        start its thread."""
        wait_s = self._next_accept_at - time.monotonic()
        if wait_s > 0:
            time.sleep(wait_s)
        self._next_accept_at = time.monotonic() + 1.0 / MAX_SCRAPES_PER_S
        with self._lock:
            if len(self._open) >= MAX_SCRAPE_CONNECTIONS:
                oldest = next((conn for conn, read in self._open.items() if not read), None)
                if oldest is None:
                    logger.debug("metrics: %d scrapes being answered: closed a new "
                                 "connection", len(self._open))
                    super().shutdown_request(request)
                    return
                del self._open[oldest]
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends
                except OSError:
                    pass
                logger.debug("metrics: at %d connections: closed the oldest one still "
                             "sending its request", MAX_SCRAPE_CONNECTIONS)
            self._open[request] = False
        super().process_request(request, client_address)

    def request_read(self, request: socket.socket) -> None:
        """The request of `request` was read; it is answered now, never shed (called on
        its thread)."""
        with self._lock:
            if request in self._open:
                self._open[request] = True

    def shutdown_request(self, request: socket.socket) -> None:
        """Forget, then close, a finished connection (its thread): FIN after the reply,
        then the client's unread input drained (at most LINGER_BYTES for LINGER_S) so that
        the close does not reset the connection before the client read the reply."""
        with self._lock:
            self._open.pop(request, None)
        try:
            request.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_S
            left = LINGER_BYTES
            while left > 0 and (wait_s := deadline - time.monotonic()) > 0:
                request.settimeout(wait_s)
                chunk = request.recv(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:  # reset, timed out: nothing left to save
            pass
        self.close_request(request)

    def handle_error(self, request: socket.socket, client_address) -> None:
        """A connection failed (timed out, reset): one debug line, not socketserver's
        traceback on stderr for every connection."""
        logger.debug("metrics: connection from %s failed", client_address, exc_info=True)
