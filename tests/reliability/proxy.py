"""A TCP proxy on 127.0.0.1 that a test can cut and restore: a network partition between one
process and another, while both keep running."""

from __future__ import annotations

import contextlib
import socket
import threading

from benchmarks.processes import free_port


class TcpProxy:
    """Forwards connections from ``port`` to ``target_port``. ``cut()`` closes every connection and
    stops listening (new connections are refused); ``restore()`` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.port, self.target_port = free_port(), target_port
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restore(self) -> TcpProxy:
        listener = socket.create_server(("127.0.0.1", self.port))  # sets SO_REUSEADDR
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def cut(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._close(self._listener)
                self._listener = None
            for s in list(self._sockets):
                self._close(s)
            self._sockets.clear()

    def _close(self, s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    client.close(), upstream.close()
                    return
                self._sockets |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._sockets.discard(src)

