"""Where a frame's log is, and reading it from a byte offset (the API's and the console's log).

Two launchers write frame logs, each in its own place:

* `run_agent` (the local, q2 and Celery launchers): `<agent log root>/<show>/<job>/<layer>.<frame
  number, 4 digits>.log`, the root being `CUESCHED_AGENT_LOG_ROOT` (`.cuesched/logs/<database>/`
  by default). Every run appends to the same file under a header line, so the file holds every
  try of the frame.
* OpenCue's RQD: `<CUESCHED_RQD_LOG_DIR>/<job>.<frame name>.rqlog`, on the render node's disk
  (`{show}` and `{job}` substituted). The web process reads it only where that directory is
  shared with it (the same path mounted, NFS for example); otherwise there is no log here and
  the answer says where RQD wrote it.

The web process only reads: a log is never created, moved or truncated here. One log read is
capped (`MAX_READ_BYTES`) so a renderer's multi-gigabyte log does not fill a response; a
client tails by asking again from the offset the last answer ended at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dispatch import conf

# The agent's own rule for path parts (dispatch.hosts.agent.log_path uses this function).
_SAFE_PATH = re.compile(r"[^A-Za-z0-9._+=@,-]")
MAX_READ_BYTES = 1 << 20


def path_part(text: str) -> str:
    """A show, job or layer name as one safe path component (no separators, no leading dot)."""
    return _SAFE_PATH.sub("_", text).lstrip(".") or "_"


def agent_log_path(root: Path, show: str, job: str, layer: str, number: int) -> Path:
    return root / path_part(show) / path_part(job) / f"{path_part(layer)}.{number:04d}.log"


def rqd_log_path(show: str, job: str, frame_name: str) -> Path:
    return Path(conf.rqd_log_dir().format(show=show, job=job)) / f"{job}.{frame_name}.rqlog"


@dataclass(frozen=True)
class FrameLog:
    """The log found for a frame (path None: none), and every place that was looked at."""

    path: Path | None
    looked_at: tuple[Path, ...]

    @property
    def size(self) -> int:
        if self.path is None:
            return 0
        try:
            return self.path.stat().st_size
        except OSError:
            return 0


def _plain(*names: str) -> bool:
    """Names that stay one path component: RQD's path uses them raw, so one with a separator or
    a leading dot could point the web process outside the log directory; such a log is not read."""
    return all(name and "/" not in name and "\\" not in name and not name.startswith(".") for name in names)


def find_log(show: str, job: str, layer: str, number: int, frame_name: str) -> FrameLog:
    """The agent's log if it exists, else RQD's; the most recently written when both do."""
    candidates: tuple[Path, ...] = (agent_log_path(Path(conf.agent_log_root()), show, job, layer, number),)
    if _plain(show, job, frame_name):
        candidates += (rqd_log_path(show, job, frame_name),)
    found = []
    for path in candidates:
        try:
            if path.is_file():
                found.append((path.stat().st_mtime, path))
        except OSError:  # an unreadable directory is no log here, not an error page
            continue
    best = max(found)[1] if found else None
    return FrameLog(best, candidates)


@dataclass(frozen=True)
class LogChunk:
    data: bytes
    offset: int  # where `data` starts
    end: int  # where the next read should start
    size: int  # the file's size at the read


def read_from(path: Path, offset: int, limit: int = MAX_READ_BYTES) -> LogChunk:
    """Up to `limit` bytes from byte `offset`. An offset past the end (the log was rotated or
    rewritten) reads from the start again, so a tail never hangs on a shrunk file."""
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        start = offset if 0 <= offset <= size else 0
        fh.seek(start)
        data = fh.read(max(0, limit))
    return LogChunk(data, start, start + len(data), size)
