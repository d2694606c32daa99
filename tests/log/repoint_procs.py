"""A materializer or a compaction that stops for good at a chosen point, so a
test can kill -9 it exactly there (run with ``python -m tests.log.repoint_procs``).

The pause is real code running in the real process: after the payload file
is written and fsynced, or inside the index transaction after every
statement ran and before COMMIT. The parent waits for the marker file, then
sends SIGKILL."""

from __future__ import annotations

import functools
import sys
import time


def _pause(marker: str) -> None:
    with open(marker, "w") as f:
        f.write("paused\n")
    time.sleep(600)


def main(url: str, payload: str, job: str, where: str, nth: int, marker: str) -> None:
    import trajstore
    from trajstore.log._transaction import Database
    from trajstore.payload import PayloadStore

    seen = {"n": 0}

    def due() -> bool:
        seen["n"] += 1
        return seen["n"] == nth

    if where == "after_file":
        prefix = "samples-" if job == "materialize" else "events-"
        def paused(write):
            @functools.wraps(write)
            def paused_write(self, name, *a, **kw):
                size = write(self, name, *a, **kw)
                if name.startswith(prefix) and due():
                    _pause(marker)
                return size
            return paused_write

        # log segments, compaction's output; write_samples: the materializer's sample segments
        for attr in ("write", "write_samples"):
            setattr(PayloadStore, attr, paused(getattr(PayloadStore, attr)))
    elif where == "in_transaction":
        what_prefix = "committing samples" if job == "materialize" else "compacting"
        transaction = Database.transaction

        @functools.wraps(transaction)
        def paused_transaction(self, what, body, landed=None, **kw):
            if not what.startswith(what_prefix):
                return transaction(self, what, body, landed, **kw)

            def body_then_pause(conn, dialect):
                result = body(conn, dialect)
                if due():
                    _pause(marker)
                return result

            return transaction(self, what, body_then_pause, landed, **kw)

        Database.transaction = paused_transaction
    else:
        raise SystemExit(f"unknown pause point {where!r}")
    store = trajstore.connect(url, payload=payload)
    if job == "materialize":
        from trajstore.materializer import Materializer

        Materializer(store, max_trajectories=4).run()
    else:
        store.compact(target_bytes=64 << 10)
    _pause(marker + ".done")  # never reached the pause: say so, and wait for the kill anyway


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
