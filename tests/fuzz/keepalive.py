"""One HTTP/1.1 keep-alive connection on a raw socket (h11), so a test sees exactly when a server
drops it: a pooled client (httpx) would silently open a new connection instead."""

from __future__ import annotations

import socket

import h11

from tests.fuzz.harness import Answer


class ConnectionDropped(Exception):
    """The server closed the connection before it finished answering."""


class KeepAlive:
    """Requests in sequence over one TCP connection to ``host:port``; every read waits ``timeout_s``.

    ``closed`` turns true when the server ends the connection (``Connection: close`` or EOF);
    a request after that raises :class:`ConnectionDropped`.
    """

    def __init__(self, host: str, port: int, timeout_s: float = 20.0) -> None:
        self.host = host
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.conn = h11.Connection(h11.CLIENT)
        self.closed = False

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> Answer:
        """Send one request and read the whole answer. Raises ConnectionDropped, TimeoutError."""
        if self.closed:
            raise ConnectionDropped("the server closed this connection earlier")
        head = [("host", self.host), ("content-length", str(len(body))), *(headers or {}).items()]
        out = self.conn.send(h11.Request(method=method, target=path, headers=head))
        out += self.conn.send(h11.Data(data=body)) if body else b""
        out += self.conn.send(h11.EndOfMessage())
        try:
            self.sock.sendall(out)
        except OSError as err:
            self.closed = True
            raise ConnectionDropped(f"send failed: {err}") from None
        return self._read()

    def _read(self) -> Answer:
        status, headers, chunks = 0, {}, []
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as err:
                self.closed = True
                raise ConnectionDropped(f"not HTTP/1.1: {err}") from None
            if event is h11.NEED_DATA:
                try:
                    data = self.sock.recv(1 << 16)
                except ConnectionError as err:  # a timeout (TimeoutError) is not a drop: it propagates
                    self.closed = True
                    raise ConnectionDropped(f"recv failed: {err}") from None
                if not data:
                    self.closed = True
                    raise ConnectionDropped("EOF before the answer ended")
                self.conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                self.closed = True
                raise ConnectionDropped("connection closed before the answer ended")
        if self.conn.their_state is h11.MUST_CLOSE or self.conn.our_state is h11.MUST_CLOSE:
            self.closed = True
        else:
            self.conn.start_next_cycle()
        return Answer(status, headers, b"".join(chunks))

    def close(self) -> None:
        self.sock.close()
