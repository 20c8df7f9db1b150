"""The keepers' small TCP protocol (JSON headers, raw byte payloads, no pickle).

A message is a 4-byte big-endian header length, a JSON header, then ``header["nbytes"]``
bytes of payload. Requests (``op``): ``stripe`` (a data stripe for the receiver's parity),
``have`` (a keeper holds its data and parity of a step), ``read`` (a byte range of a file
under the keeper's job directory), ``blob`` (a byte range of a node's blob of a step),
``reset`` (drop snapshots newer than a step), ``flush`` (copy this node's files of a
step into a durable checkpoint's staging directory) and ``flushed`` (a keeper's report
to the flush's coordinator), ``ping`` and ``stop``. Every reply has ``ok``; a failed
one carries ``error``.

Every connection starts with a challenge: the keeper sends a random nonce, the client
answers with HMAC-SHA256 of it under the job's secret, and the keeper serves the
connection only when that is right (:func:`challenge`, :func:`answer_challenge`). The
payloads are not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
from typing import Any

from ..errors import SnapshotError
from ..kept_connections import keep
from .paths import json_object

_LEN = struct.Struct(">I")
TIMEOUT = 30.0
CHALLENGE_LIMIT = 4096  # bytes of the answer to a challenge at most
HEADER_LIMIT = 1 << 24  # bytes of any other message's header at most (a stripe's lists its node's files)


def send(sock: socket.socket, header: dict[str, Any], payload: memoryview | bytes | None = None) -> None:
    """Send one message."""
    header = dict(header, nbytes=0 if payload is None else memoryview(payload).nbytes)
    doc = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(doc)) + doc)
    if payload is not None and header["nbytes"]:
        sock.sendall(payload)


def send_file_parts(sock: socket.socket, header: dict[str, Any], parts: list[tuple[str, int, int]]) -> None:
    """Send one message whose payload is byte ranges of files (path, offset, count), with
    ``sendfile`` (no copy through user space). A file shorter than its range is an error
    before anything is sent."""
    files = []
    try:
        for path, offset, count in parts:
            f = open(path, "rb")
            files.append(f)
            if os.fstat(f.fileno()).st_size < offset + count:
                raise SnapshotError(f"{os.path.basename(path)} is shorter than asked")
        total = sum(c for _, _, c in parts)
        doc = json.dumps(dict(header, nbytes=total)).encode()
        sock.sendall(_LEN.pack(len(doc)) + doc)
        for f, (_, offset, count) in zip(files, parts):
            if count:
                sock.sendfile(f, offset, count)
    finally:
        for f in files:
            f.close()


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; a closed connection is a SnapshotError."""
    view = view.cast("B")
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise SnapshotError("keeper connection closed mid-message")
        view = view[n:]


def recv_header(sock: socket.socket, limit: int = HEADER_LIMIT) -> dict[str, Any] | None:
    """The next message's header (its payload is still to be read), None at a clean end.
    Bytes from the network are untrusted: a header longer than ``limit`` bytes (nothing
    allocated for it), not a JSON object, or announcing a payload size that is not a
    count, is a SnapshotError."""
    head = bytearray(_LEN.size)
    n = sock.recv_into(head)
    if n == 0:
        return None
    if n < _LEN.size:
        recv_exact(sock, memoryview(head)[n:])
    (size,) = _LEN.unpack(head)
    if limit is not None and size > limit:
        raise SnapshotError(f"a header of {size} bytes, above the {limit} expected")
    doc = bytearray(size)
    recv_exact(sock, memoryview(doc))
    header = json_object(doc, "a message header that is ")
    nbytes = header.get("nbytes", 0)
    if type(nbytes) is not int or nbytes < 0:
        raise SnapshotError(f"a message announcing {nbytes!r:.40} bytes of payload")
    return header


def recv_payload(sock: socket.socket, header: dict[str, Any], into: memoryview | None = None) -> memoryview:
    """The payload announced by ``header`` (into ``into`` when given, of the right size)."""
    n = int(header.get("nbytes", 0))
    out = memoryview(bytearray(n)) if into is None else memoryview(into).cast("B")
    if out.nbytes != n:
        raise SnapshotError(f"keeper sent {n} bytes, {out.nbytes} expected")
    recv_exact(sock, out)
    return out


def _mac(secret: bytes, nonce: bytes) -> str:
    return hmac.new(secret, nonce, hashlib.sha256).hexdigest()


def challenge(sock: socket.socket, secret: bytes | None) -> str | None:
    """The keeper's side of a new connection: send a nonce, check the answer against
    ``secret`` (None: the job's secret is not stored yet, nobody is let in) and say so.
    Returns None when the client proved the secret, else why it was refused."""
    nonce = secrets.token_bytes(16)
    send(sock, {"nonce": nonce.hex()})
    answer = recv_header(sock, CHALLENGE_LIMIT)  # nobody unauthenticated makes the keeper allocate more
    if answer is None:
        return "closed before answering"
    if secret is None:
        why = "this keeper holds no job secret yet"
    elif answer.get("op") == "auth" and hmac.compare_digest(str(answer.get("mac", "")), _mac(secret, nonce)):
        why = None
    else:
        why = "wrong job secret"
    send(sock, {"ok": why is None} if why is None else {"ok": False, "error": f"refused: {why}"})
    return why


def answer_challenge(sock: socket.socket, secret: bytes) -> None:
    """The client's side: prove ``secret`` to the keeper; a refusal is a SnapshotError."""
    nonce = recv_header(sock, CHALLENGE_LIMIT)
    try:
        challenge_bytes = bytes.fromhex(str((nonce or {})["nonce"]))
    except (KeyError, ValueError):
        raise SnapshotError("no challenge from the keeper (not a unickpt keeper, or an older one)") from None
    send(sock, {"op": "auth", "mac": _mac(secret, challenge_bytes)})
    reply = recv_header(sock, CHALLENGE_LIMIT)
    if reply is None or not reply.get("ok"):
        raise SnapshotError((reply or {}).get("error") or "refused")


class Connection:
    """A client connection to one keeper, which it proves the job's ``secret`` to
    (thread-safe: one request at a time)."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = TIMEOUT) -> None:
        self.address = (host, port)
        keep(host, port)  # a re-forming's cut of the groups never takes it for a group's
        try:
            self.sock = socket.create_connection(self.address, timeout=timeout)
        except OSError as e:
            raise SnapshotError(f"cannot reach the snapshot keeper at {host}:{port}: {e}") from None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            answer_challenge(self.sock, secret)
        except (OSError, SnapshotError) as e:
            self.sock.close()
            raise SnapshotError(f"snapshot keeper at {host}:{port}: {e}") from None
        self.lock = threading.Lock()

    def request(self, header: dict[str, Any], payload=None, into: memoryview | None = None) -> tuple[dict[str, Any], memoryview]:
        """Send a request, return the reply's header and payload; a failed reply raises."""
        with self.lock:
            try:
                send(self.sock, header, payload)
                reply = recv_header(self.sock)
                if reply is None:
                    raise SnapshotError("keeper closed the connection")
                if not reply.get("ok"):
                    raise SnapshotError(f"keeper at {self.address[0]}:{self.address[1]}: {reply.get('error')}")
                return reply, recv_payload(self.sock, reply, into)
            except OSError as e:
                raise SnapshotError(f"keeper at {self.address[0]}:{self.address[1]}: {e}") from None

    def read(self, path: str, offset: int, into: memoryview) -> None:
        """Fill ``into`` with bytes ``offset..`` of ``path`` (relative to the keeper's job directory)."""
        self.read_views({"op": "read", "path": path, "offset": offset}, [into])

    def read_views(self, header: dict[str, Any], views: list[memoryview]) -> None:
        """One ranged request (``read`` or ``blob``) for the total length of ``views``,
        its reply received straight into them, one after the other."""
        views = [memoryview(v).cast("B") for v in views]
        self.start_read(header, sum(v.nbytes for v in views))
        self.finish_read(views)

    def start_read(self, header: dict[str, Any], total: int) -> None:
        """Send a ranged request for ``total`` bytes without waiting for its reply, which
        :meth:`finish_read` receives: requests to several keepers are then in flight at
        once. The connection is the caller's until then."""
        self.lock.acquire()
        try:
            send(self.sock, dict(header, length=total))
        except OSError as e:
            self.lock.release()
            raise SnapshotError(f"keeper at {self.address[0]}:{self.address[1]}: {e}") from None

    def finish_read(self, views: list[memoryview]) -> None:
        """Receive the reply to the request :meth:`start_read` sent, straight into
        ``views``, one after the other."""
        views = [memoryview(v).cast("B") for v in views]
        total = sum(v.nbytes for v in views)
        try:
            reply = recv_header(self.sock)
            if reply is None:
                raise SnapshotError("keeper closed the connection")
            if not reply.get("ok"):
                raise SnapshotError(f"keeper at {self.address[0]}:{self.address[1]}: {reply.get('error')}")
            if int(reply.get("nbytes", 0)) != total:
                raise SnapshotError(f"keeper sent {reply.get('nbytes')} bytes, {total} asked")
            for v in views:
                recv_exact(self.sock, v)
        except OSError as e:
            raise SnapshotError(f"keeper at {self.address[0]}:{self.address[1]}: {e}") from None
        finally:
            self.lock.release()

    def close(self) -> None:
        """Close the connection."""
        try:
            self.sock.close()
        except OSError:
            pass
