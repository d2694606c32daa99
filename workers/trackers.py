"""Deprecated: the long-running tracker pusher is ``trajstore track`` (or the
trackers part of ``trajstore worker``), installed with the package.

    python workers/trackers.py --store URL [--tensorboard DIR] [--mlflow URI] [--wandb-project P] [--interval-s 30]

still works, with the same flags as ``trajstore track`` (docs/report.md,
"Trackers"), and warns once. SIGTERM and SIGINT end it after closing each
tracker's run.
"""

from __future__ import annotations

import signal
import sys
import warnings

from trajstore.cli import main as trajstore_main


MOVED = "workers/trackers.py is deprecated; run `trajstore track` (same flags) or `trajstore worker`"


def main(argv: list[str] | None = None) -> int:
    warnings.warn(MOVED, DeprecationWarning, stacklevel=2)
    argv = list(sys.argv[1:] if argv is None else argv)
    front = []  # the store options go before the command
    for flag in ("--store", "--payload"):
        if flag in argv:
            i = argv.index(flag)
            front += argv[i:i + 2]
            del argv[i:i + 2]

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return trajstore_main([*front, "track", *argv])


if __name__ == "__main__":
    warnings.simplefilter("default", DeprecationWarning)  # shown once, on stderr
    sys.exit(main())
