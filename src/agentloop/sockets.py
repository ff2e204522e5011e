"""The listening socket of a server this package runs (``agentloop serve``, a chat channel's
webhook), bound before the server starts: a busy port is then a clear error at once, and port 0
picks a free one the caller can read back."""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, *, backlog: int = 128) -> socket.socket:
    """A non-blocking socket listening on ``host``:``port`` (a name, or an IPv4 or IPv6 address,
    bracketed or not). SO_REUSEADDR lets a restart take the port straight back. OSError with the
    address in its message when it cannot listen there."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, IndexError) as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock
