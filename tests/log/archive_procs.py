"""``trajstore archive`` that stops for good at a chosen point, so a test can
kill -9 it exactly there (``python -m tests.log.archive_procs URL PAYLOAD DIR WHERE MARKER``).

The pause is real code in the real process: ``after_file`` once the archive
file is durable (renamed, directory fsynced) and before the index transaction
begins; ``in_transaction`` inside the transaction that drops the rows, after
every statement ran and before COMMIT."""

from __future__ import annotations

import functools
import sys
import time


def _pause(marker: str) -> None:
    with open(marker, "w") as f:
        f.write("paused\n")
    time.sleep(600)


def main(url: str, payload: str, out_dir: str, where: str, marker: str) -> None:
    from trajstore._upkeep import retention as _retention
    from trajstore.cli import main as cli
    from trajstore.log._transaction import Database

    if where == "after_file":
        write = _retention._write_part

        @functools.wraps(write)
        def paused_write(*a, **kw):
            path = write(*a, **kw)
            _pause(marker)
            return path

        _retention._write_part = paused_write
    else:
        transaction = Database.transaction

        @functools.wraps(transaction)
        def paused_transaction(self, what, body, landed=None, **kw):
            if not what.startswith("dropping archived events"):
                return transaction(self, what, body, landed, **kw)

            def body_then_pause(conn, dialect):
                result = body(conn, dialect)
                _pause(marker)
                return result

            return transaction(self, what, body_then_pause, landed, **kw)

        Database.transaction = paused_transaction
    code = cli(["--store", url, "--payload", payload, "archive", out_dir, "--older-than-s", "0"])
    open(marker + ".done", "w").write(str(code))


if __name__ == "__main__":
    main(*sys.argv[1:6])
