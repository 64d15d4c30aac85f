"""A client connection's bytes in the daemon's loop: read, answer, send, flush.

Why this file exists: moving frames between a non-blocking socket and `CacheService`
(one receive buffer, PASS_BUDGET per pass, replies batched into one send, descriptors
sent with their reply's first byte, parked requests resumed) is the transport half of
the loop (Redis's `networking.c`), apart from the life cycle (`server.py`) and from
admitting and dropping connections (`server_clients.py`). `ClientIO` is a part of
`Server`: its state is the server's.
"""

import selectors
import socket
import time

from lmcached.daemon.connection import (
    MAX_OUTBUF_BYTES,
    OUTBUF_PAUSE_BYTES,
    PASS_BUDGET,
    READ_AHEAD_BYTES,
    ClientConnection,
    answer_frame,
    encode_reply,
)
from lmcached.wire.protocol import MAX_FRAME_BYTES
from lmcached.daemon.replies import Deferred


class ClientIO:
    """Reading, answering and sending for `Server` (a part of it, no state of its own)."""

    def _on_readable(self, conn: ClientConnection) -> None:
        try:
            num_bytes = conn.sock.recv_into(self._recv_buf)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if not num_bytes:  # EOF: the client closed or died; answer what it sent first
            if conn.next_frame_end() == 0 and conn.parked is None:
                self._close_at_eof(conn)
            else:
                conn.eof = True
                self._update_events(conn)
            return
        conn.inbuf += self._recv_view[:num_bytes]
        self._buffered_bytes += num_bytes
        if self._buffered_bytes > self.config.buffer_budget_bytes:
            self._enforce_buffer_budget()
            if conn.closed:
                return
        self._ready[conn] = None

    def _serve(self, conn: ClientConnection) -> None:
        """Answer up to PASS_BUDGET of `conn`'s waiting frames, in order, then update
        what the selector watches for it."""
        if conn.closed:  # dropped earlier in this pass (e.g. over the buffer budget)
            return
        if conn.parked is not None:  # a request waits for an L2 fetch; the next ones too
            self._ready.pop(conn, None)
            return
        service, session = self.service, conn.session
        replies = []
        with_fds = False  # some reply carries descriptors: (frame, fds) among the frames
        budget = PASS_BUDGET
        with memoryview(conn.inbuf) as view:
            while budget > 0 and len(conn.outbuf) < OUTBUF_PAUSE_BYTES:
                end = conn.next_frame_end()
                if end == 0:
                    break
                if end < 0:
                    length = int.from_bytes(view[conn.inpos : conn.inpos + 4], "little")
                    view.release()
                    self._drop(conn, "frame_too_large",
                               f"sent a {length}-byte frame (limit {MAX_FRAME_BYTES})")
                    return
                with view[conn.inpos + 4 : end] as payload:
                    frame, cost = answer_frame(service, session, payload)
                conn.inpos = end
                conn.served_frames += 1
                budget -= cost
                if type(frame) is Deferred:
                    conn.parked = frame
                    self._parked[conn] = None
                    break
                if session.reply_fds:  # OPEN_TIER: the descriptor goes with this reply
                    replies.append((frame, session.reply_fds))
                    session.reply_fds = []
                    with_fds = True
                elif frame is not None:
                    replies.append(frame)
        if conn.served_frames:
            self._silent.pop(conn, None)
        if conn.inpos:
            del conn.inbuf[: conn.inpos]
            self._buffered_bytes -= conn.inpos
            conn.inpos = 0
        if replies:
            if with_fds:
                self._send_replies(conn, replies)
            else:  # the hot path: one send of every reply of this pass
                self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))
            if conn.closed:
                return
        has_frame = conn.next_frame_end() != 0
        conn.partial_since = (
            None if has_frame or not conn.inbuf else (conn.partial_since or time.monotonic())
        )
        if not has_frame or len(conn.outbuf) >= OUTBUF_PAUSE_BYTES or conn.parked is not None:
            self._ready.pop(conn, None)
        if conn.eof and not has_frame and not conn.outbuf and conn.parked is None:
            self._close_at_eof(conn)
            return
        self._update_events(conn)

    def _resume_parked(self, now: float) -> None:
        """Answer the parked requests whose L2 fetch ended or whose wait passed, then
        serve what their clients sent after them."""
        for conn in list(self._parked):
            deferred = conn.parked
            if deferred is None:  # closed while an earlier one was resumed (buffer budget)
                self._parked.pop(conn, None)
                continue
            if not deferred.job.done and now < deferred.deadline:
                continue
            del self._parked[conn]
            conn.parked = None
            reply = self.service.resume(conn.session, deferred)
            if reply is not None:
                self._send(conn, encode_reply(self.service, conn.session, reply))
                if conn.closed:
                    continue
            has_frame = conn.next_frame_end() != 0
            if has_frame and len(conn.outbuf) < OUTBUF_PAUSE_BYTES:
                self._ready[conn] = None
            if conn.eof and not has_frame and not conn.outbuf:
                self._close_at_eof(conn)
                continue
            self._update_events(conn)

    def _update_events(self, conn: ClientConnection) -> None:
        """Watch for input only while the client has room (few frames waiting, replies
        flowing): a client that pipelines without reading is throttled by its own socket,
        not by the daemon's memory. Watch for output while replies are unsent."""
        unread = len(conn.inbuf) - conn.inpos
        want_read = not conn.eof and len(conn.outbuf) < OUTBUF_PAUSE_BYTES and (
            unread < READ_AHEAD_BYTES or conn.next_frame_end() == 0
        )
        events = (selectors.EVENT_READ if want_read else 0) | (
            selectors.EVENT_WRITE if conn.outbuf else 0
        )
        if events == conn.events:
            return
        if not events:
            self._selector.unregister(conn.sock)
        elif not conn.events:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _send_replies(self, conn: ClientConnection, replies: list) -> None:
        """Send reply frames in order, one `_send` each; a (frame, fds) entry sends its
        descriptors with the frame's first byte."""
        for reply in replies:
            if type(reply) is tuple:
                self._send(conn, *reply)
            else:
                self._send(conn, reply)
            if conn.closed:
                return

    def _send(self, conn: ClientConnection, data: bytes, fds: list[int] | None = None) -> None:
        """Send `data` now as far as the socket takes it, and buffer the rest; `fds` go
        with its first byte (the daemon keeps its own copies)."""
        if not conn.outbuf:
            try:
                sent = socket.send_fds(conn.sock, [data], fds) if fds else conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(data):
                return
            if sent:
                fds = None  # they went with the first bytes
            data = memoryview(data)[sent:]
        if fds:
            conn.fd_marks.append([len(conn.outbuf), fds])
        conn.outbuf += data
        self._buffered_bytes += len(data)
        if len(conn.outbuf) > MAX_OUTBUF_BYTES:
            self._drop(conn, "output_buffer", "does not read its replies")
        elif self._buffered_bytes > self.config.buffer_budget_bytes:
            self._enforce_buffer_budget()

    def _flush(self, conn: ClientConnection) -> None:
        """Send buffered replies as far as the socket takes them. Descriptors go with
        the first byte of their reply: a sendmsg that carries them starts there and ends
        before the next reply with descriptors, so a client that reads reply by reply
        receives them with that reply's first read, never with an earlier one's."""
        marks = conn.fd_marks
        try:
            if not marks:
                sent = conn.sock.send(conn.outbuf)
            elif marks[0][0]:  # send up to the reply that carries descriptors
                with memoryview(conn.outbuf)[: marks[0][0]] as chunk:
                    sent = conn.sock.send(chunk)
            else:  # that reply, with its descriptors, up to the next such reply
                end = marks[1][0] if len(marks) > 1 else len(conn.outbuf)
                with memoryview(conn.outbuf)[:end] as chunk:
                    sent = socket.send_fds(conn.sock, [chunk], marks[0][1])
                if sent:  # any byte sent took the descriptors with it
                    marks.pop(0)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        for mark in marks:
            mark[0] -= sent
        del conn.outbuf[:sent]
        self._buffered_bytes -= sent
        has_frame = conn.next_frame_end() != 0
        if len(conn.outbuf) < OUTBUF_PAUSE_BYTES and has_frame:
            self._ready[conn] = None
        if conn.eof and not has_frame and not conn.outbuf and conn.parked is None:
            self._close_at_eof(conn)
            return
        self._update_events(conn)
