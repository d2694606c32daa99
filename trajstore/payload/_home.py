"""Where a store's payload lives: recorded in the store, found by every process.

The location is one row of ``store_settings`` (``payload_location``), written
when the store is created. A process opening the store reads it there; a
location the process was given (``payload=``, ``--payload``,
``$TRAJSTORE_PAYLOAD_DIR``) must name the same place, or the open fails with
``PayloadLocationError`` before anything is read from or written to the
payload. A given location still matters when it agrees: it may carry what the
record leaves out (credentials in an object-store URI).

What is recorded:
* a local path: absolute; where the backend has a base directory
  (``payload_base_dir``: SQLite's database file's directory) a path inside it
  is recorded relative to it (the embedded default, ``<db>.payload``, follows
  the database when both are moved together);
* a URI: scheme, bucket/host and path, and the query options that say
  *where* (``endpoint_override``, ``scheme``, ``region``); never credentials,
  never per-process options.

A store created before the record existed (migration 0010) gets it from the
first process that opens it with migrations on: that process's location is
recorded if the newest segment the index names is there (or the index names
none); otherwise it refuses, and ``trajstore payload set LOCATION`` records
the right one. Moving the payload is ``trajstore payload move`` (``move``).

The marker (``MARKER``, ``trajstore-store.json`` in the payload root) says
whose payload a location holds: the store's id (``store_settings`` row
``store_id``, made once), the recorded location and the index it belongs to.
It is written when the location is recorded (creating the root: the only time
opening a store creates it), by ``set_location`` and by ``move`` (at the
target). Opening a store with a recorded location reads it first, and never
creates the root: a missing root or marker (a node without the shared mount,
whose local directory of that name is not the payload) is refused in one
line naming the recorded location, and so is another store's marker. A
store recorded before markers existed has none: it gets one from a process
allowed to record (migrations on) when the location holds the newest segment
the index names (or the index names none and the root exists).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlparse

import pyarrow.fs as pafs
from sqlalchemy import Engine, func, inspect, select, update

from trajstore._util.backoff import Backoff
from trajstore.errors import PayloadLocationError, StoreUnavailable, first_line
from trajstore.log._errors import ServerRecovering, driver_errors
from trajstore.log._registry import backend_of
from trajstore.log.base import StaleState
from trajstore.payload._durable import fsync_path, replace_durably
from trajstore.payload._errors import payload_errors
from trajstore.payload._filesystem import _no_secret, filesystem_of, is_uri, join
from trajstore.payload._format import SegmentKind
from trajstore.schema import segments, store_settings

log = logging.getLogger(__name__)

__all__ = ["LOCATION", "ENV", "MARKER", "STORE_ID", "recorded_form", "opened_form", "same_place", "read_recorded",
           "resolve", "holds", "set_location", "move", "count_segments", "ephemeral", "read_marker", "write_marker"]

LOCATION = "payload_location"
ENV = "TRAJSTORE_PAYLOAD_DIR"
STORE_ID = "store_id"  # the store_settings row of the store's id (the marker names it)
MARKER = "trajstore-store.json"  # the marker file in the payload root (not a segment: GC never takes it)
# query options of a filesystem URI that say where the files are (the rest are process options)
_WHERE_OPTIONS = ("endpoint_override", "scheme", "region")


def recorded_form(location: str, url: str) -> str:
    """What the store records for ``location`` (see the module docstring)."""
    if is_uri(location):
        p = urlparse(location)
        host = p.hostname or ""
        if p.port:
            host += f":{p.port}"
        query = sorted((k, v) for k, v in parse_qsl(p.query) if k in _WHERE_OPTIONS)
        return f"{p.scheme}://{host}{p.path.rstrip('/')}" + (f"?{urlencode(query)}" if query else "")
    path = filesystem_of(location)[1]
    base = backend_of(url).payload_base_dir(url)
    if base is not None:
        rel = os.path.relpath(path, base)
        if not rel.startswith(os.pardir):
            return rel
    return path


def opened_form(recorded: str, url: str) -> str:
    """The location to open for a recorded one (a relative path is the SQLite file's directory's)."""
    if is_uri(recorded) or os.path.isabs(recorded):
        return recorded
    base = backend_of(url).payload_base_dir(url) or os.getcwd()
    return os.path.normpath(os.path.join(base, recorded))


def same_place(a: str, b: str, url: str) -> bool:
    return opened_form(recorded_form(a, url), url) == opened_form(recorded_form(b, url), url)


def _has_settings(engine: Engine) -> bool:
    return inspect(engine).has_table(store_settings.name)


# A server that answers "starting up / in recovery / shutting down" (SQLSTATE class 57P)
# is waited for this long, as an append's commit outcome is: opening a store must not
# fail on a restart that a running appender would ride out.
_RECOVERY_WAIT_S = 60.0


def read_recorded(engine: Engine) -> str | None:
    """The recorded location (as recorded), None when none is."""
    backoff = Backoff(first_s=0.05, max_s=1.0)
    while True:
        try:
            with driver_errors("reading the store's payload location", mode="opening"):
                if not _has_settings(engine):
                    return None
                with engine.connect() as conn:
                    return conn.execute(select(store_settings.c.value).where(store_settings.c.name == LOCATION)
                                        ).scalar_one_or_none()
        except ServerRecovering:
            if backoff.elapsed() >= _RECOVERY_WAIT_S:
                raise
            backoff.pause()


def resolve(url: str, write_engine: Engine, read_engine: Engine, given: str | None,
            default: Callable[[], str], *, record: bool) -> str:
    """The payload location this process opens (see the module docstring), its
    marker checked (a recorded location) or written (one recorded now).

    ``given``: what the process was told (None: nothing). ``default``: the
    location a new store gets when nothing is given. ``record``: may this
    process record a location (it runs migrations; read-only openers don't)."""
    source = "--payload / payload="
    if given is None and os.environ.get(ENV) and backend_of(url).payload_dir_from_env:
        given, source = os.environ[ENV], f"${ENV}"
    for _ in range(3):
        rec = read_recorded(read_engine)
        if rec is not None:
            if given is not None and not same_place(given, opened_form(rec, url), url):
                raise PayloadLocationError(
                    f"payload location {given!r} (from {source}) disagrees with {opened_form(rec, url)!r}, the "
                    "one this store recorded; leave it out, or move the payload with `trajstore payload move`")
            location = given if given is not None else opened_form(rec, url)
            _check_marker(url, write_engine, read_engine, location, rec, record=record)
            return location
        candidate = given if given is not None else default()
        if not record or not _has_settings(write_engine):
            # a read-only opener of an unrecorded store: as before the record existed
            _make_root(candidate)
            return candidate
        newest = _check_holds_segments(write_engine, candidate, given is not None, source)
        marker = read_marker(candidate)
        # a store whose settings were lost takes its id back from its payload's marker
        ident = _store_id(write_engine, read_engine, make=str(marker.get("store_id")) if marker and newest else None)
        if marker is not None and marker.get("store_id") != ident:
            raise PayloadLocationError(
                f"payload location {_no_secret(candidate)!r} holds another store's payload (its {MARKER} names store "
                f"{marker.get('store_id')!r}, index {marker.get('index')!r}); give this store its own location")
        if marker is None:
            write_marker(candidate, ident, recorded_form(candidate, url), url)  # creates the root
        try:
            with driver_errors("recording the store's payload location", mode="opening", races=True), \
                    write_engine.begin() as conn:
                conn.execute(store_settings.insert().values(name=LOCATION, value=recorded_form(candidate, url),
                                                            updated_at=time.time()))
            log.info("recorded the store's payload location: %s", recorded_form(candidate, url))
            return candidate
        except StaleState:
            continue  # another process recorded one first: compare with it
    raise StoreUnavailable("could not read or record the store's payload location")


def ephemeral(location: str) -> bool:
    """A location whose every opening is a new, empty filesystem (pyarrow's
    ``mock://``, in this process's memory): nothing there to check or strand."""
    return urlparse(location).scheme == "mock"


def _make_root(location: str) -> None:
    fs, root, _ = filesystem_of(location)
    with payload_errors("cannot create payload directory", _no_secret(location)):
        fs.create_dir(root, recursive=True)


def _index_name(url: str) -> str:
    """The index a marker names: its URL without credentials."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True).replace(":***@", "@")


def read_marker(location: str) -> dict[str, Any] | None:
    """The marker of ``location`` (None: there is none). Raises StoreUnavailable."""
    fs, root, _ = filesystem_of(location)
    path = join(root, MARKER)
    data = None
    with payload_errors("cannot read the marker of payload location", _no_secret(location), absent_ok=True):
        with fs.open_input_stream(path) as f:
            data = f.read()
    if data is None:  # no marker there
        return None
    try:
        marker = json.loads(data)
        if not isinstance(marker, dict):
            raise ValueError("not an object")
        return marker
    except ValueError as e:
        raise PayloadLocationError(f"payload location {_no_secret(location)!r} has an unreadable {MARKER}: {e}"
                                   ) from None


def write_marker(location: str, ident: str, recorded: str, url: str) -> None:
    """Write the marker of ``location`` (creating the root): this store's id, the
    recorded location and the index. Atomic and durable on a local disk."""
    body = json.dumps({"store_id": ident, "location": recorded, "index": _index_name(url),
                       "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1).encode()
    fs, root, local = filesystem_of(location)
    path = join(root, MARKER)
    with payload_errors("cannot write the marker of payload location", _no_secret(location)):
        fs.create_dir(root, recursive=True)
        if local:
            def write(target: str) -> None:
                with open(target, "wb") as f:
                    f.write(body)
                fsync_path(target)

            replace_durably(path, root, write)
        else:
            with fs.open_output_stream(path) as out:
                out.write(body)
    log.info("marked payload location %s as store %s's", recorded, ident)


def _store_id(write_engine: Engine, read_engine: Engine, *, make: str | None | bool = None) -> str | None:
    """The store's id (``store_settings`` row ``store_id``). When it has none: made
    now (``make`` a string: that one; True or None: a new one), or None when
    ``make`` is False. Concurrent makers agree (the first insert wins)."""
    for _ in range(3):
        try:
            with driver_errors("reading the store's id", mode="opening", races=True):
                ident = _read_or_make_id(write_engine, read_engine, make)
        except StaleState:
            continue  # another process made it first: read it
        if ident is not _MADE:
            return ident
    raise StoreUnavailable("could not read or record the store's id")


_MADE = object()  # an id was inserted now: read it back


def _read_or_make_id(write_engine: Engine, read_engine: Engine, make: str | None | bool) -> Any:
    if _has_settings(read_engine):
        with read_engine.connect() as conn:
            ident = conn.execute(select(store_settings.c.value).where(store_settings.c.name == STORE_ID)
                                 ).scalar_one_or_none()
        if ident is not None or make is False:
            return ident
    elif make is False:
        return None
    with write_engine.begin() as conn:
        conn.execute(store_settings.insert().values(
            name=STORE_ID, value=make if isinstance(make, str) else uuid.uuid4().hex, updated_at=time.time()))
    return _MADE


def _check_marker(url: str, write_engine: Engine, read_engine: Engine, location: str, recorded: str, *,
                  record: bool) -> None:
    """Refuse ``location`` (this store's recorded one) unless it is marked as this
    store's payload; creates nothing, except a missing marker of a store recorded
    before markers existed, where its payload is found (see the module docstring)."""
    if ephemeral(location):
        return
    shown = opened_form(recorded, url)  # (never credentials)
    marker = read_marker(location)
    ident = _store_id(write_engine, read_engine, make=False)
    if marker is not None:
        if ident is not None and marker.get("store_id") != ident:
            raise PayloadLocationError(
                f"payload location {shown!r} holds another store's payload (its {MARKER} names store "
                f"{marker.get('store_id')!r}, index {marker.get('index')!r}, not this store {ident!r})")
        if ident is None and record:
            _store_id(write_engine, read_engine, make=str(marker.get("store_id")))
        return
    fs, root, _ = filesystem_of(location)
    with payload_errors("payload location", shown):
        exists = fs.get_file_info(root).type == pafs.FileType.Directory
    newest = _newest_segment(read_engine)
    if not exists or (newest is not None and not holds(location, newest)):
        what = "does not exist here" if not exists else f"does not hold its newest segment {newest!r}"
        raise PayloadLocationError(
            f"the payload location this store recorded, {shown!r}, has no {MARKER} and {what}: is the shared "
            "storage mounted on this machine? Nothing was written there. If the store's payload really is there "
            "(or lost), `trajstore payload set LOCATION` marks it")
    # a store recorded before markers existed, its payload found: marked now
    if record:
        write_marker(location, _store_id(write_engine, read_engine), recorded, url)


def _newest_segment(engine: Engine) -> str | None:
    with driver_errors("reading the store's segments", mode="opening"), engine.connect() as conn:
        return conn.execute(select(segments.c.name).order_by(segments.c.created_at.desc()).limit(1)
                            ).scalar_one_or_none()


def holds(location: str, name: str) -> bool:
    fs, root, _ = filesystem_of(location)
    with payload_errors("payload location", location):
        return fs.get_file_info(f"{root.rstrip('/')}/{name}").type != pafs.FileType.NotFound


def _check_holds_segments(engine: Engine, location: str, given: bool, source: str) -> str | None:
    """The newest segment the index names (None: none), which must be at ``location``."""
    newest = _newest_segment(engine)
    if newest is not None and not holds(location, newest):
        what = f"{location!r} (from {source})" if given else f"{location!r} (this process's default)"
        raise PayloadLocationError(
            f"this store has no recorded payload location and its newest segment {newest!r} is not under "
            f"{what}: record the right one with `trajstore payload set LOCATION`")
    return newest


def set_location(url: str, engine: Engine, location: str, *, force: bool = False) -> str:
    """Record ``location`` as the store's payload location without moving anything
    (a store whose record is missing or wrong); return what was recorded. Unless
    ``force``, the newest segment the index names must be there, and a marker
    there must be this store's. The location is marked as this store's (its root
    created if missing)."""
    newest = None if force else _check_holds_segments(engine, location, True, "the command line")
    value = recorded_form(location, url)
    marker = read_marker(location)
    # a store whose settings were lost takes its id back from the marker beside its newest segment
    ident = _store_id(engine, engine, make=str(marker.get("store_id")) if marker and newest else None)
    if marker is not None and marker.get("store_id") != ident and not force:
        raise PayloadLocationError(
            f"payload location {_no_secret(location)!r} holds another store's payload (its {MARKER} names store "
            f"{marker.get('store_id')!r}, index {marker.get('index')!r}); --force marks it as this store's")
    write_marker(location, ident, value, url)
    with driver_errors("recording the store's payload location", mode="opening"), engine.begin() as conn:
        done = conn.execute(update(store_settings).where(store_settings.c.name == LOCATION)
                            .values(value=value, updated_at=time.time())).rowcount
        if not done:
            conn.execute(store_settings.insert().values(name=LOCATION, value=value, updated_at=time.time()))
    return value


def move(store: Any, target: str, *, delete_old: bool = False,
         progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Copy every payload file of ``store`` to ``target``, then record ``target``.

    Stop every writer and materializer of the store first: a process that
    opened the store before the move keeps writing to the old location (its
    files are copied by a second pass, but one still running after the move
    would write where nobody looks). The old files are deleted only with
    ``delete_old``, after the new location is recorded. Copies are checked by
    size; a file that cannot be copied leaves the record unchanged."""
    url = store.url
    old = store.payload.location
    if same_place(old, target, url):
        raise PayloadLocationError(f"the payload is already at {target!r}")
    dst_fs, dst_root, _ = filesystem_of(target)
    with payload_errors("cannot create payload directory", target):
        dst_fs.create_dir(dst_root, recursive=True)
    copied: dict[str, int] = {}

    def copy_pass() -> int:
        n = 0
        for name, _ in store.payload.list_names():
            if SegmentKind.of(name) is SegmentKind.TEMPORARY or name in copied:
                continue
            src = store.payload.path(name)
            dst = f"{dst_root.rstrip('/')}/{name}"
            size_src = size_dst = None
            with payload_errors(f"copying payload file {name!r} to", target, absent_ok=True):
                pafs.copy_files(src, dst, source_filesystem=store.payload.fs, destination_filesystem=dst_fs)
                size_src = store.payload.fs.get_file_info(src).size
                size_dst = dst_fs.get_file_info(dst).size
            if size_src is None:
                continue  # collected meanwhile: nothing names it
            if size_src != size_dst:
                raise StoreUnavailable(f"copy of payload file {name!r} to {target!r} has {size_dst} bytes, "
                                       f"not {size_src}; nothing recorded")
            copied[name] = size_src
            n += 1
            if progress:
                progress(1)
        return n

    copy_pass()
    engine = store.log.db.write_engine
    value = recorded_form(target, url)
    write_marker(target, _store_id(engine, engine), value, url)  # before the record names it
    with driver_errors("recording the store's payload location", mode="opening"), engine.begin() as conn:
        done = conn.execute(update(store_settings).where(store_settings.c.name == LOCATION)
                            .where(store_settings.c.value == recorded_form(old, url))
                            .values(value=value, updated_at=time.time())).rowcount
    if done != 1:
        raise PayloadLocationError("the store's recorded payload location changed during the move; "
                                   "nothing recorded (the copies stay at the target)")
    late = copy_pass()  # files a process that still had the old location wrote meanwhile
    if late:
        log.warning("%d payload file(s) appeared at the old location during the move; copied", late)
    missing = [n for n in _named_segments(engine) if n not in copied and not holds(target, n)]
    removed = 0
    if delete_old:
        for name in copied:
            store.payload.delete(name)
            removed += 1
        try:  # the old place is nobody's payload now
            with payload_errors(f"cannot delete the {MARKER} of", old, absent_ok=True):
                store.payload.fs.delete_file(store.payload.path(MARKER))
        except StoreUnavailable as e:  # the payload moved all the same
            log.warning("the old payload location's %s was not deleted: %s", MARKER, first_line(e))
    return {"from": old, "to": target, "recorded": value, "files": len(copied),
            "bytes": sum(copied.values()), "late_files": late, "missing": missing, "deleted_old": removed}


def _named_segments(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(segments.c.name).where(segments.c.retired_at.is_(None))).scalars())


def count_segments(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(segments)).scalar_one())
