"""Long-running tracker pusher: the store's figures to TensorBoard, MLflow or W&B.

    python workers/trackers.py --store URL [--tensorboard DIR] [--mlflow URI] [--wandb-project P] [--interval-s 30]

The same flags as ``trajstore track`` (docs/report.md, "Trackers"). SIGTERM and
SIGINT end it after closing each tracker's run.
"""

from __future__ import annotations

import signal
import sys

from trajstore.cli import main as trajstore_main


def main(argv: list[str] | None = None) -> int:
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
    sys.exit(main())
