"""The endpoints whose connections a re-forming never cuts: the job's stores, the snapshot
keepers (no torch at import: the keepers import it too).

A re-forming shuts down the sockets each process group opened, found as the sockets that
appeared in this process while the group was made (:func:`unickpt.dist.track_group_sockets`).
Another thread may connect meanwhile (the live watcher to its store, a snapshot to a
keeper): that connection would be taken for the group's and cut with it. Each such
connection's endpoint is recorded here when it is opened, and the cut leaves alone every
socket whose peer is one (a listening endpoint is unique, so no gloo connection has it),
and the server's end of it when the server runs in this process."""

from __future__ import annotations

import socket

__all__ = ["is_kept", "keep"]

_KEPT: set[tuple[str, int]] = set()


def _plain(ip: str) -> str:
    """``ip`` without an IPv4-mapped IPv6 prefix or a zone, lower-cased."""
    ip = ip.split("%", 1)[0].lower()
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def keep(host: str, port: int) -> None:
    """Connections to ``host:port`` (every address it resolves to) are never cut."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # not resolvable: no connection to it can exist either
    for info in infos:
        _KEPT.add((_plain(str(info[4][0])), port))


def is_kept(sock: socket.socket) -> bool:
    """True when ``sock`` is connected to an endpoint :func:`keep` named (or is a
    connection that endpoint's server accepted, hosted in this process)."""
    for end in (sock.getpeername, sock.getsockname):
        try:
            address = end()
        except OSError:
            continue
        if isinstance(address, tuple) and (_plain(str(address[0])), int(address[1])) in _KEPT:
            return True
    return False
