"""uvicorn around the application: the socket bound (and listening) before the line that announces it, a
stop on SIGTERM / SIGINT that ends the in-flight answers cleanly and exits 0."""
from __future__ import annotations

import contextlib
import signal
import socket
import threading

import uvicorn

GRACE_S = 10  # in-flight responses' time to end after a stop signal (each ends at its next round)


class _Server(uvicorn.Server):
    """A uvicorn server whose stop signal first tells the worker (waiting requests refused, the running one
    ends at its next round), then stops as uvicorn does, and returns instead of re-raising the signal
    (uvicorn re-raises it after a graceful stop, which would end the process with the signal's status)."""

    def __init__(self, config, on_stop):
        super().__init__(config)
        self.on_stop = on_stop

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self.on_stop()
        super().handle_exit(sig, frame)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: one the system picks); connections wait in its backlog until served."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run(app, sock: socket.socket, on_stop) -> None:
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=GRACE_S)
    _Server(config, on_stop).run(sockets=[sock])
