"""What a fresh store costs the test suite: a first connect that runs every migration
against one made from the suite's migrated template (tests/conftest.py), per backend.

    python bench/bench_suite_fixtures.py [--rounds 10] [--no-postgres]

Interleaved, one round of each case after the other, on a throwaway PostgreSQL
(tests/pg_cluster.py, one cluster for all cases):

* ``sqlite migrate``: ``trajstore.connect`` of a new file (every migration runs);
* ``sqlite template``: a copy of a migrated file, then ``trajstore.connect``;
* ``postgres migrate``: ``CREATE DATABASE``, then ``trajstore.connect`` (every migration);
* ``postgres template``: ``CREATE DATABASE ... TEMPLATE`` of a migrated database, then
  ``trajstore.connect``.

Each round ends with the store closed (and its database dropped, not timed). Reported:
median wall and process CPU milliseconds (this process only: the PostgreSQL server's
own work shows in the wall time). The machine is shared: compare the cases of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import trajstore  # noqa: E402
from conftest import migrate_new_store  # noqa: E402
from pg_cluster import PgCluster  # noqa: E402


def timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-postgres", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-suite-fixtures-"))
    cluster = None if args.no_postgres else PgCluster()
    try:
        template = work / "template.db"
        migrate_new_store(f"sqlite:///{template}")
        if cluster is not None:
            cluster.start()
            migrate_new_store(cluster.create_database("template_db"))
        results: dict[str, list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            d = work / f"r{r}"
            d.mkdir()

            def sqlite_migrate():
                trajstore.connect(f"sqlite:///{d / 'a.db'}", payload=str(d / "pa")).close()

            def sqlite_template():
                shutil.copyfile(template, d / "b.db")
                trajstore.connect(f"sqlite:///{d / 'b.db'}", payload=str(d / "pb")).close()

            cases = {"sqlite migrate": sqlite_migrate, "sqlite template": sqlite_template}
            if cluster is not None:
                def pg(template_name=None, tag=""):
                    def run():
                        url = cluster.create_database(f"{tag}{r}", template=template_name)
                        trajstore.connect(url, payload=str(d / f"p{tag}")).close()
                    return run

                cases["postgres migrate"] = pg(None, "m")
                cases["postgres template"] = pg("template_db", "t")
            for name, fn in cases.items():
                results.setdefault(name, []).append(timed(fn))
            if cluster is not None:
                cluster.drop_database(f"m{r}")
                cluster.drop_database(f"t{r}")
        load = os.getloadavg()[0]
        print(f"{args.rounds} rounds, load average {load:.1f}")
        for name, rows in results.items():
            print(f"{name:18} wall {statistics.median(w for w, _ in rows):7.1f} ms   "
                  f"cpu {statistics.median(c for _, c in rows):7.1f} ms")
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
