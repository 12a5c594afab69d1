"""What a scheduler must not forget across a restart, in one sqlite file under ``state_dir``.

Members, published policies, bindings and the job's layout are each committed before the answer that
depends on them leaves, so a restarted scheduler answers exactly as before. A write the disk refuses is
kept in memory and retried until the file catches up (``behind``); docs/ARCHITECTURE.md, *Coming back*.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sqlite3
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import msgspec

from netstorm.errors import ConfigError
from scheduler.membership import Row

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FILE_NAME = "scheduler.sqlite3"
KEEP_BINDINGS = 4096
"""Bindings kept in the file (the consistency core's window); older ones are deleted as new ones come."""
_UNWRITABLE = (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)
"""Primary sqlite result codes of a write the disk could not take now (full, or an I/O error)."""


def unwritable(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is the disk refusing a write (to be retried), not a bug or a corrupt file."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _UNWRITABLE

_SCHEMA = """
CREATE TABLE IF NOT EXISTS job (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (node_id INTEGER PRIMARY KEY, host TEXT NOT NULL, port INTEGER NOT NULL,
                                    workers INTEGER NOT NULL, dead TEXT);
CREATE TABLE IF NOT EXISTS policies (version INTEGER PRIMARY KEY, wire BLOB NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS bindings (iteration INTEGER PRIMARY KEY, version INTEGER NOT NULL,
                                     joining TEXT NOT NULL DEFAULT '[]');
"""


@dataclasses.dataclass
class Saved:
    """Everything a restarted scheduler resumes from."""

    complete: bool = False
    members: list[Row] = dataclasses.field(default_factory=list)
    policies: list[tuple[int, dict[str, Any], str]] = dataclasses.field(default_factory=list)
    """(version, wire form, why it was planned), oldest first."""
    bindings: dict[int, int] = dataclasses.field(default_factory=dict)
    joining: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    layout: tuple[str, int] | None = None
    """(layout hash, the node that registered it first)."""

    @property
    def empty(self) -> bool:
        return not self.complete and not self.members and not self.policies


class StateStore:
    """The scheduler's state file. ``open`` checks that the directory belongs to this job."""

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._db = connection
        self.path = path
        self._pending: dict[Hashable, Callable[[], None]] = {}
        """Writes the disk refused, by what they write (the newest of each), oldest first."""
        self.refused = 0
        """Writes held back so far, refused by the disk or queued behind one it refused."""

    @property
    def behind(self) -> bool:
        """Some decisions are not in the file yet (the disk refused them); they are retried."""
        return bool(self._pending)

    def catch_up(self) -> bool:
        """Retry what the disk refused, oldest first; True once the file holds everything."""
        while self._pending:
            key, write = next(iter(self._pending.items()))
            try:
                write()
            except sqlite3.Error as exc:
                if not unwritable(exc):
                    raise
                return False
            del self._pending[key]
            if not self._pending:
                log.warning("state %s caught up: every decision is written again", self.path)
        return True

    def _write(self, key: Hashable, write: Callable[[], None]) -> None:
        """Run ``write`` after every earlier refused one; if the disk refuses, keep it for later (a newer
        write of the same ``key`` replaces it, in place, since it supersedes it)."""
        if key in self._pending or not self.catch_up():
            self.refused += 1
            self._pending[key] = write
            return
        try:
            write()
        except sqlite3.Error as exc:
            if not unwritable(exc):
                raise
            self.refused += 1
            if not self._pending:
                log.warning("state %s: cannot write (%s); the job goes on and the state catches up when the "
                            "disk takes writes again", self.path, exc)
            self._pending[key] = write

    @classmethod
    def open(cls, state_dir: str | Path, job: dict[str, Any]) -> StateStore:
        """Open (creating it and the directory if missing) the state of the job described by ``job``;
        ConfigError when the directory holds another job's state."""
        directory = Path(state_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / FILE_NAME
            db = sqlite3.connect(path, isolation_level=None)  # autocommit: every write is durable at once
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"state_dir {directory}: cannot open the scheduler's state: {exc}") from None
        store = cls(db, path)
        identity = json.dumps({"schema": SCHEMA_VERSION, **job}, sort_keys=True)
        held = store._get("identity")
        if held is None:
            store._set("identity", identity)
        elif held != identity:
            db.close()
            raise ConfigError(f"state_dir {directory} holds the state of another job (a different scenario, "
                              f"nodes, topology or options); use another directory or remove {path}")
        return store

    def close(self) -> None:
        self._db.close()

    # --- reads -----------------------------------------------------------------------------------

    def load(self) -> Saved:
        saved = Saved(complete=self._get("complete") == "1")
        layout = self._get("layout")
        if layout is not None:
            value = json.loads(layout)
            saved.layout = (str(value[0]), int(value[1]))
        saved.members = [Row(int(n), str(h), int(p), int(w), d) for n, h, p, w, d in
                         self._db.execute("SELECT node_id, host, port, workers, dead FROM members ORDER BY node_id")]
        saved.policies = [(int(v), msgspec.msgpack.decode(w), str(r)) for v, w, r in
                          self._db.execute("SELECT version, wire, reason FROM policies ORDER BY version")]
        for iteration, version, joining in self._db.execute("SELECT iteration, version, joining FROM bindings"):
            saved.bindings[int(iteration)] = int(version)
            joiners = tuple(int(j) for j in json.loads(joining))
            if joiners:
                saved.joining[int(iteration)] = joiners
        return saved

    # --- writes ----------------------------------------------------------------------------------

    def save_complete(self) -> None:
        self._write(("job", "complete"), lambda: self._set("complete", "1"))

    def save_layout(self, layout_hash: str, node_id: int) -> None:
        value = json.dumps([layout_hash, node_id])
        self._write(("job", "layout"), lambda: self._set("layout", value))

    def save_members(self, rows: list[Row]) -> None:
        values = [(r.node_id, r.host, r.port, r.workers, r.dead) for r in rows]

        def write() -> None:
            with self._transaction():
                self._db.execute("DELETE FROM members")
                self._db.executemany("INSERT INTO members VALUES (?, ?, ?, ?, ?)", values)
        self._write(("members",), write)

    def save_policy(self, version: int, wire: dict[str, Any], reason: str) -> None:
        row = (version, msgspec.msgpack.encode(wire), reason)

        def write() -> None:
            self._db.execute("INSERT OR REPLACE INTO policies VALUES (?, ?, ?)", row)
        self._write(("policy", version), write)

    def save_binding(self, iteration: int, version: int, joining: tuple[int, ...] = ()) -> None:
        row = (iteration, version, json.dumps(list(joining)))

        def write() -> None:
            with self._transaction():
                self._db.execute("INSERT OR REPLACE INTO bindings VALUES (?, ?, ?)", row)
                self._db.execute("DELETE FROM bindings WHERE iteration <= ?", (iteration - KEEP_BINDINGS,))
        self._write(("binding", iteration), write)

    # --- internals -------------------------------------------------------------------------------

    def _get(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM job WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO job VALUES (?, ?)", (key, value))

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN ... COMMIT (ROLLBACK on error) on an autocommit connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error:
                self._rollback()
                raise
        else:
            self._rollback()

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):  # sqlite may have rolled back already (a full disk)
            self._db.execute("ROLLBACK")
