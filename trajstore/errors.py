"""The whole trajstore exception tree.

::

    TrajstoreError                  base of everything trajstore raises on purpose
    ├── ValidationError             an event or argument breaks a docs/reference.md rule; nothing was stored
    │   └── ConflictError           an event's identity is already stored with other content
    ├── StoreUnavailable            the database or payload storage cannot be reached; retry
    │   ├── ContentionError         writers kept racing on the same trajectories; retry
    │   └── CommitUnknownError      the connection was lost during COMMIT and whether the
    │                               append landed could not be found out; retry (idempotent)
    ├── CorruptStoreError           the index points at payload that is missing or unreadable
    │   └── PayloadMissingError     a payload file the index names is not at the store's location
    ├── PayloadLocationError        a payload location given to a process disagrees with the
    │                               one the store recorded; nothing was read or written
    ├── IndexInvariantError         the index refused a write trajstore should never make (a bug)
    └── ResumeStateError            a reader state_dict does not fit the reader it is loaded into

Every message is one line that names the offending value and where it was found.
"""

from __future__ import annotations

__all__ = [
    "CommitUnknownError",
    "ConflictError",
    "ContentionError",
    "CorruptStoreError",
    "IndexInvariantError",
    "PayloadLocationError",
    "ProjectionChangedError",
    "PayloadMissingError",
    "ResumeStateError",
    "StoreUnavailable",
    "TrajstoreError",
    "ValidationError",
    "first_line",
]


class TrajstoreError(Exception):
    """Base class of every error trajstore raises on purpose."""


class ValidationError(TrajstoreError, ValueError):
    """An event (or an argument) breaks a rule of the contract; nothing was stored.

    ``index`` is the position of the event in the append call (None when not
    about an event), ``trajectory_id`` the trajectory it names, ``rule`` a short
    machine-readable name of the broken rule.
    """

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        trajectory_id: str | None = None,
        rule: str = "invalid",
    ) -> None:
        self.reason = message
        self.index = index
        self.trajectory_id = trajectory_id
        self.rule = rule
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.index is not None:
            where.append(f"event {self.index}")
        if self.trajectory_id is not None:
            where.append(f"trajectory {self.trajectory_id!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        return f"{prefix}{self.reason} [{self.rule}]"

    def at(self, index: int, trajectory_id: str | None = None) -> "ValidationError":
        """The same error, located at event ``index`` of an append call."""
        err = type(self)(
            self.reason,
            index=index,
            trajectory_id=trajectory_id if trajectory_id is not None else self.trajectory_id,
            rule=self.rule,
        )
        return err


class ConflictError(ValidationError):
    """The event's identity is already stored with different content."""

    def __init__(self, message: str, **kwargs) -> None:
        kwargs.setdefault("rule", "conflict")
        super().__init__(message, **kwargs)


class StoreUnavailable(TrajstoreError):
    """The SQL database or the payload storage cannot be reached; retriable."""


class ContentionError(StoreUnavailable):
    """Writers kept advancing the same trajectories first, attempt after attempt.

    Nothing of the append was stored and nothing is wrong with it: retry later."""


class CommitUnknownError(StoreUnavailable):
    """The connection was lost while the database committed an append, and
    whether it landed could not be found out. Its payload is kept (the garbage
    collector removes it if the commit did not land); retrying the same events
    is safe, appends being idempotent."""


class IndexInvariantError(TrajstoreError):
    """The SQL index refused a write that admission should never produce (a
    constraint other than an identity race, an unexpected SQL error): a
    trajstore bug. Nothing was stored; retrying will not help."""


class CorruptStoreError(TrajstoreError):
    """The index points at payload that is missing or unreadable."""


class PayloadMissingError(CorruptStoreError):
    """A payload file the index names is not at the store's payload location.
    The materializer quarantines the trajectories that need it (never skips
    them for good): ``trajstore materialize --refold-quarantined`` folds them
    once the file is back (docs/materializer.md, "Quarantine")."""


class PayloadLocationError(TrajstoreError):
    """The payload location given to a process (``--payload``, ``payload=``,
    ``$TRAJSTORE_PAYLOAD_DIR``) disagrees with the one the store recorded, or
    the store has none recorded and its segments are not where this process
    would look. Raised before anything is read or written."""


class ProjectionChangedError(TrajstoreError):
    """The named projection a reader reads was dropped, or dropped and created
    again under the same name, since the reader (or the state it resumed from)
    began: its samples are another sequence. A projection's identity is its
    name and the token it was created with (``projections.token``)."""


class ResumeStateError(TrajstoreError, ValueError):
    """A reader ``state_dict`` does not match the reader it is loaded into."""


def first_line(e: BaseException | str, limit: int | None = None) -> str:
    """The first non-blank line of an error's message — of the driver error a
    SQLAlchemy error wraps (``e.orig``) — for one-line messages; cut to
    ``limit`` characters when given."""
    if isinstance(e, str):
        text, fallback = e, "unknown error"
    else:
        text, fallback = str(getattr(e, "orig", None) or e), type(e).__name__
    line = next((part.strip() for part in text.splitlines() if part.strip()), fallback)
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."
