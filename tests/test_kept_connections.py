"""A re-forming cuts the sockets its groups opened, found as those that appeared in the
process while a group was made; a store or keeper connection another thread opened
meanwhile is not one of them (unickpt.kept_connections). Real sockets, a real TCPStore."""

from __future__ import annotations

import socket

from torch.distributed import TCPStore

from unickpt import store_client
from unickpt.dist import open_sockets, opened_since, shut_down


def test_a_store_connection_opened_while_a_group_is_made_survives_the_cut():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        before = open_sockets()
        # in the window where a group is made: the live watcher connects to its store (another
        # thread), and the group connects to a peer (a plain connection stands for gloo's)
        client = store_client.connect(f"127.0.0.1:{server.port}", timeout_s=5)
        to_peer = socket.create_connection(listener.getsockname())
        from_peer, _ = listener.accept()
        seen = opened_since(before)
        assert to_peer.fileno() in seen and from_peer.fileno() in seen and len(seen) >= 3
        assert shut_down(seen) == 2  # both ends of the peer's connection, not the store's
        assert from_peer.recv(1) == b""  # the peer got the FIN
        assert client.add("beats", 1) == 1  # the store connection still works
    finally:
        for s in ("to_peer", "from_peer"):
            if s in locals():
                locals()[s].close()
        listener.close()
