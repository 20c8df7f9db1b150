"""A member lost while its generation's group forms (tests/test_live_membership.py): run
under ``unickpt.run`` on a store this script hosts, with no launcher. Generation 0 has two
members; the other one says it arrived and never rendezvouses (killed between its arrival
and its group's rendezvous). ``--publish-after`` seconds later this script publishes
generation 1 without it, as the coordinator does. Prints one JSON line: the world ``fn``
was called with and when."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch.distributed as dist

import unickpt
from unickpt.live import control
from unickpt.live.control import Cause, Generation, key
from unickpt.store_client import LIVE_PG_TIMEOUT_ENV, LIVE_STORE_ENV, LIVE_WORKER_ENV


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--publish-after", type=float, default=1.0)
    args = p.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    os.environ.update({LIVE_STORE_ENV: f"127.0.0.1:{store.port}", LIVE_WORKER_ENV: "0.0", LIVE_PG_TIMEOUT_ENV: "60"})
    control.publish(store, Generation(0, ["0.0", "0.1"]))
    store.add(key("g", 0, "arrived"), 1)  # 0.1 arrived, then died before its rendezvous
    lost = [{"rank": 1, "worker": "0.1", "why": "exit -9", "at": time.time()}]
    threading.Timer(args.publish_after, control.publish, (store, Generation(1, ["0.0"], Cause.LOST, lost))).start()
    start = time.monotonic()

    def fn(world: unickpt.World) -> dict:
        return {"generation": world.generation, "size": world.size, "rank": world.rank,
                "after_s": round(time.monotonic() - start, 3)}

    print(json.dumps(unickpt.run(fn, backend="gloo")), flush=True)


if __name__ == "__main__":
    main()
