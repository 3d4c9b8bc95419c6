"""A loopback TCP proxy for network failures: lost answers and a server that goes away.

For the first ``drop`` connections it forwards the request, waits until the server starts
answering (so the server has processed the request and committed), then closes the client's
socket without passing a byte on. Later connections are forwarded untouched. ``close()`` cuts
every connection and refuses new ones, as if the server behind it went down.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class FaultProxy:
    """Forward 127.0.0.1:<port> to an upstream port, dropping the first answers."""

    def __init__(self, upstream_port: int, *, drop: int = 0) -> None:
        self.upstream_port = upstream_port
        self.drop = drop
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
            threading.Thread(target=self._serve, args=(client, dropping), daemon=True).start()

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
