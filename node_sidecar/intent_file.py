"""``--state-file``: what the cluster asked of the node (:class:`~node_sidecar.intent.ClusterIntent`), kept on disk
so that it survives a restart of the sidecar.

Written whole after every change (a temporary file in the same folder, fsync, rename: a sidecar killed mid-write
leaves the previous intent or the new one, never half of one); read once at start. A missing file is a fresh start;
one that cannot be read, is over :data:`MAX_STATE_BYTES` or is not of the intent's shape is logged at WARNING and
ignored (the node starts with nothing remembered, as without the flag), never a failed start. Nothing is ever
written through a link put in the folder (:func:`_open_own`).

The writes are a few hundred bytes, made by a thread of their own (:class:`IntentWriter`): the change is taken as
it is when it is made and written in the order made, but an fsync on a slow or stalled disk does not stall the
event loop (health, generation, the other calls) meanwhile. A change made while an earlier one is still being
written supersedes any not yet begun (the file only ever holds the latest). A control call that changed the
intent answers once the write is done (or failed), waiting for it off the event loop for a bounded time (the
sidecar's ``STATE_WRITE_WAIT_S``): a disk stalled longer delays its answer by that, and nothing else.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
from pathlib import Path

from handoff.service.peer_json import PeerJSONError, loads_bounded
from node_sidecar.intent import ClusterIntent, IntentShapeError

MAX_STATE_BYTES = 64 * 1024

log = logging.getLogger(__name__)


_claimed: dict[Path, int] = {}  # state file -> the open lock file this process holds for it, while it lives


class StateFileInUse(RuntimeError):
    """Another process keeps its intent in the state file."""


def claim(path: Path) -> Path:
    """Take ``path`` for this process (the file a link names, if it is one): a lock on ``.NAME.lock`` beside it,
    held until the process ends. Raises :class:`StateFileInUse` if another process holds it: two sidecars
    writing one file would each overwrite the other's intent. Claiming it again in this process is a no-op."""
    real = Path(os.path.realpath(path))
    if real in _claimed:
        return real
    try:
        fd = os.open(real.with_name(f".{real.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:  # the folder cannot be written: so neither can the file, which is logged at each change
        log.warning("--state-file %s cannot be locked (%s)", path, exc.strerror or exc)
        return real
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise StateFileInUse(f"--state-file {path}: another process keeps its state there (two sidecars must not "
                             "share a file)") from exc
    _claimed[real] = fd
    return real


def load_intent(path: Path | None) -> tuple[ClusterIntent, IntentWriter | None]:
    """The intent stored at ``path``, kept there at every change from now on by the writer returned (None: no state
    file, nothing kept). Raises :class:`StateFileInUse` (:func:`claim`)."""
    if path is None:
        return ClusterIntent(), None
    store = IntentFile(claim(path))
    intent = store.read()
    writer = IntentWriter(store)
    intent.on_change = writer.submit
    return intent, writer


class IntentWriter:
    """Writes the intent to its :class:`IntentFile` on a thread of its own, in the order of the changes; a change
    not yet begun when a newer one comes is superseded by it."""

    def __init__(self, store: IntentFile) -> None:
        self.store = store
        self._changed = threading.Condition()
        self._pending: bytes | None = None  # the latest change, not yet begun
        self._writing = False
        self._kept = True  # the last write done left the file holding what it was given
        self._thread = threading.Thread(target=self._run, name=f"state-file {store.path.name}", daemon=True)
        self._thread.start()

    def submit(self, intent: ClusterIntent) -> None:
        """The intent's ``on_change``: taken as it is now (the caller's thread owns it), written soon after."""
        data = json.dumps(intent.to_json(), separators=(",", ":")).encode()
        with self._changed:
            self._pending = data
            self._changed.notify_all()

    @property
    def is_idle(self) -> bool:
        """Every change submitted so far is written (or its write failed)."""
        with self._changed:
            return self._pending is None and not self._writing

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every change submitted so far is written (or its write failed, logged); False if
        ``timeout`` seconds passed first (a stalled disk)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending is None and not self._writing, timeout)

    def kept(self, timeout: float | None = None) -> bool:
        """:meth:`flush`, and True only if the file then holds every change submitted so far (False: the write
        failed, was cut to fit the bounds, or is still stalled after ``timeout`` seconds)."""
        with self._changed:
            done = self._changed.wait_for(lambda: self._pending is None and not self._writing, timeout)
            return done and self._kept

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None)
                data, self._pending, self._writing = self._pending, None, True
            kept = False
            try:
                kept = self.store.write(data)
            finally:
                with self._changed:
                    self._writing, self._kept = False, kept
                    self._changed.notify_all()


class IntentFile:
    """One state file: :meth:`read` at start, :meth:`write` (by its :class:`IntentWriter`) after every change.
    ``path`` is the file itself, not a link to it (:func:`claim`): a rename over a link would replace the link."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: bytes | None = None  # what the file holds now, as far as this process knows

    def read(self) -> ClusterIntent:
        """The stored intent, or a fresh one when there is none or it cannot be used (logged)."""
        path = self.path
        try:
            if path.exists() and not path.is_file():
                raise OSError("not a regular file")  # a FIFO would block the open
            with open(path, "rb") as f:
                raw = f.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            log.info("--state-file %s: none yet; the node starts with nothing remembered", path)
            return ClusterIntent()
        except OSError as exc:
            log.warning("--state-file %s cannot be read (%s): ignored; the node starts with nothing remembered",
                        path, exc.strerror or exc)
            return ClusterIntent()
        try:
            intent = ClusterIntent.from_json(loads_bounded(raw, max_bytes=MAX_STATE_BYTES, max_depth=4))
        except (PeerJSONError, IntentShapeError) as exc:
            log.warning("--state-file %s is not a stored intent (%s): ignored; the node starts with nothing "
                        "remembered", path, str(exc)[:300])
            return ClusterIntent()
        self._written = raw
        log.info("--state-file %s read: engine process %s, released %s, weights updated %s, weight groups %s",
                 path, intent.engine, sorted(intent.released), intent.weights_updated or intent.stale is not None,
                 sorted(intent.joined_groups | intent.lost_groups))
        return intent

    def write(self, data: bytes) -> bool:
        """Store ``data`` (the intent as :meth:`ClusterIntent.to_json` gives it, encoded) if it changed; True if the
        file holds it now. One that would not be read back (past the bounds: more weight groups than kept, say) is
        cut to the engine process and the adapter's record of its tags (:func:`_within_bounds`), so a restart
        remembers what SGLang holds released and nothing older (False); a write that fails is logged at ERROR
        (False; the node goes on, but a memory call whose record is not kept is not sent)."""
        if data == self._written:
            return True
        try:
            _check(data)
        except IntentShapeError as exc:
            cut = _within_bounds(data)
            log.error("the node's intent cannot be kept in --state-file %s (%s): only the engine process and its "
                      "record of the engine's tags are kept; a restart of the sidecar remembers nothing else",
                      self.path, exc)
            self._replace(cut)
            return False
        return self._replace(data)

    def _replace(self, data: bytes) -> bool:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with open(_open_own(tmp), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            _sync_folder(self.path.parent)
        except OSError as exc:
            self._written = None  # unknown now: the next change writes again
            log.error("--state-file %s cannot be written (%s): a restart of the sidecar may read an older intent",
                      self.path, exc.strerror or exc)
            return False
        self._written = data
        return True


def _check(data: bytes) -> None:
    """IntentShapeError unless ``data`` would be read back."""
    if len(data) > MAX_STATE_BYTES:
        raise IntentShapeError(f"{len(data)} bytes, over {MAX_STATE_BYTES}")
    ClusterIntent.from_json(json.loads(data))


def _within_bounds(data: bytes) -> bytes:
    """A fresh intent holding only ``data``'s engine process and engine record (each within its own bounds)."""
    whole = json.loads(data)
    cut = json.dumps({**ClusterIntent().to_json(), "engine": whole.get("engine"),
                      "engine_memory": whole.get("engine_memory")}, separators=(",", ":")).encode()
    try:
        _check(cut)
    except IntentShapeError:
        return json.dumps(ClusterIntent().to_json(), separators=(",", ":")).encode()
    return cut


def _open_own(path: Path) -> int:
    """``path`` opened for writing and emptied, a file of its own: in a folder others can write (``/tmp``) a link
    put there under its name must not have the write truncate and overwrite the file it names, so a symbolic link
    is never followed and a file with another hard link is replaced by a new one."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd: int | None = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # a symbolic link
            raise
        fd = None
    if fd is not None:
        try:
            if os.fstat(fd).st_nlink <= 1:
                os.ftruncate(fd, 0)  # a FIFO (a stalled disk in the tests) refuses it: the write fails, logged
                return fd
        except OSError:
            os.close(fd)
            raise
        os.close(fd)
    path.unlink()
    return os.open(path, flags | os.O_EXCL, 0o644)


def _sync_folder(folder: Path) -> None:
    """The rename itself is durable once its folder is synced (a node rebooting right after keeps it)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
