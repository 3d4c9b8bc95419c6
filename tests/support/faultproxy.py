"""A loopback TCP proxy for network failures: lost answers and a server that goes away.

For the first ``drop`` connections it forwards the request, waits until the server starts
answering (so the server has processed the request and committed), then closes the client's
socket without passing a byte on. Later connections are forwarded untouched. ``close()`` cuts
every connection and refuses new ones, as if the server behind it went down.

Two faults leave the client waiting instead, for a test to kill it at a known point (``faulted``
is set when the point is reached): the first ``hold`` connections have their request read and
kept, never forwarded (the server never hears of it); the first ``withhold`` connections are
forwarded, and the answer is swallowed once the server starts it (the server has executed).
"""

from __future__ import annotations

import contextlib
import socket
import threading


class FaultProxy:
    """Forward 127.0.0.1:<port> to an upstream port, dropping the first answers."""

    def __init__(
        self, upstream_port: int, *, drop: int = 0, hold: int = 0, withhold: int = 0
    ) -> None:
        if sum(1 for count in (drop, hold, withhold) if count) > 1:
            raise ValueError("one fault per proxy: drop, hold or withhold")
        self.upstream_port = upstream_port
        self.drop = drop
        self.hold = hold
        self.withhold = withhold
        self.faulted = threading.Event()
        self.connections = 0
        self.requests: list[bytes] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                dropping = self.connections <= self.drop
                holding = self.connections <= self.hold
                withholding = self.connections <= self.withhold
            if holding:
                target, args = self._hold, (client,)
            elif withholding:
                target, args = self._withhold, (client,)
            else:
                target, args = self._serve, (client, dropping)
            threading.Thread(target=target, args=args, daemon=True).start()

    def _hold(self, client: socket.socket) -> None:
        """Read the whole request, forward nothing, and keep the client waiting until it goes."""
        with self._lock:
            self._sockets.append(client)
        received = bytearray()
        with client, contextlib.suppress(OSError):
            while not _complete(received) and (chunk := client.recv(65536)):
                received.extend(chunk)
            with self._lock:
                self.requests.append(bytes(received))
            self.faulted.set()
            while client.recv(65536):
                pass

    def _withhold(self, client: socket.socket) -> None:
        """Forward the request, swallow the answer, and keep the client waiting until it goes."""
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
        with self._lock:
            self._sockets += [client, upstream]
        received = bytearray()
        with client, upstream, contextlib.suppress(OSError):
            while not _complete(received) and (chunk := client.recv(65536)):
                received.extend(chunk)
            upstream.sendall(received)
            upstream.recv(1)  # the server finished the request: its answer never reaches
            with self._lock:
                self.requests.append(bytes(received))
            self.faulted.set()
            while client.recv(65536):
                pass

    def _serve(self, client: socket.socket, dropping: bool) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
        client.settimeout(None if not dropping else 30)
        with self._lock:
            self._sockets += [client, upstream]
        received = bytearray()
        with contextlib.ExitStack() as stack:
            stack.enter_context(client)
            stack.enter_context(upstream)
            forward = threading.Thread(
                target=self._pump, args=(client, upstream, received), daemon=True
            )
            forward.start()
            if dropping:
                # The first answer byte means the server finished the request: lose it all.
                with contextlib.suppress(OSError):
                    upstream.recv(1)
                with self._lock:
                    self.requests.append(bytes(received))
                return
            self._pump(upstream, client, bytearray())
            with self._lock:
                self.requests.append(bytes(received))

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket, seen: bytearray) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                seen.extend(chunk)
                target.sendall(chunk)


def _complete(received: bytearray) -> bool:
    """Whether ``received`` holds a whole HTTP request with a ``Content-Length`` body."""
    head, separator, body = bytes(received).partition(b"\r\n\r\n")
    if not separator:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True
