"""Deadlines on reading a request, in uvicorn's h11 protocol: a client that trickles its headers or its body
cannot hold a connection (and the memory behind it) forever.

uvicorn bounds an idle keep-alive connection (timeout_keep_alive) and the size of a request's head (h11's
max_incomplete_event_size), but not the time a request takes to arrive: one byte every few seconds keeps a
connection open indefinitely. Two deadlines close that gap, both on the request being read, never on the
response being written, so that a long stream is not cut:

- headers: from the connection's opening, or the end of the previous response on it, until the request's
  headers are complete;
- body: from the end of the headers until the whole body has arrived. A deadline for the whole body rather
  than for the gap between two chunks: a gap timeout is renewed by every byte, so a client sending one byte
  every (timeout - 1) seconds would hold the connection for days on a 1 MiB body.

When one passes, a client that has started its request gets 408 (while no response has begun) and the
connection closes; one that sent nothing of a next request is closed silently, as an idle keep-alive is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

logger = logging.getLogger(__name__)


class ReadTimeoutConfig(uvicorn.Config):
    """uvicorn's Config, serving HTTP/1.1 through `ReadTimeoutH11Protocol` with these deadlines (seconds)."""

    def __init__(self, app: Any, *, header_read_timeout: float, body_read_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, http=ReadTimeoutH11Protocol, **kwargs)
        self.header_read_timeout = header_read_timeout
        self.body_read_timeout = body_read_timeout


def timeout_body(message: str) -> bytes:
    """An OpenAI-style error body (the shape of every other error of the server)."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()


class ReadTimeoutH11Protocol(H11Protocol):
    """H11Protocol with the header and body deadlines of `ReadTimeoutConfig`. The deadlines follow h11's state
    of the client's side: IDLE (a request's head awaited) arms the header deadline, SEND_BODY the body
    deadline; any other state (the request read, a response being written) has none."""

    def __init__(self, config: ReadTimeoutConfig, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_read_timeout = config.header_read_timeout
        self.body_read_timeout = config.body_read_timeout
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow_client_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadlines()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        # Called on every chunk received, and when a response completes (the next request may then begin).
        super().handle_events()
        self._follow_client_state()

    def _follow_client_state(self) -> None:
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or upgraded
            self._cancel_deadlines()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(self.header_read_timeout, self._headers_timed_out)
        elif self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        if state is h11.SEND_BODY:
            if self._body_deadline is None:
                self._body_deadline = self.loop.call_later(self.body_read_timeout, self._body_timed_out)
        elif self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _cancel_deadlines(self) -> None:
        for handle in (self._header_deadline, self._body_deadline):
            if handle is not None:
                handle.cancel()
        self._header_deadline = self._body_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        received, _ = self.conn.trailing_data
        if received.strip():
            # h11 has no request to answer (its side of the server is IDLE): the response is written as is.
            body = timeout_body(f"the request's headers did not arrive within {self.header_read_timeout:g} s "
                                "(header_read_timeout); send the whole head at once.")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body))
            logger.info("%s: request headers incomplete after %g s (header_read_timeout): 408, closed",
                        self._peer(), self.header_read_timeout)
        self._close()

    def _body_timed_out(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            body = timeout_body(f"the request's body did not arrive within {self.body_read_timeout:g} s "
                                "(body_read_timeout); send it at once after the headers.")
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                output = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
                output += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                output = b""
            self.transport.write(output)
            cycle.response_started = cycle.response_complete = True
            logger.info("%s: request body incomplete after %g s (body_read_timeout): 408, closed",
                        self._peer(), self.body_read_timeout)
        if cycle is not None:
            # The app reading the body sees the client gone, and whatever it answers is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self._close()

    def _close(self) -> None:
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "client"
