"""Where a frame's log is found and how it is read from an offset (dispatch.jobs.logs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatch.jobs import logs


def test_a_read_starts_at_its_offset_and_a_shrunk_log_reads_from_the_start(tmp_path: Path) -> None:
    log = tmp_path / "f.log"
    log.write_bytes(b"0123456789")
    chunk = logs.read_from(log, 4, limit=3)
    assert (chunk.data, chunk.offset, chunk.end, chunk.size) == (b"456", 4, 7, 10)
    assert logs.read_from(log, 10).data == b""  # at the end: nothing new yet
    log.write_bytes(b"new")  # rewritten shorter than the last offset
    again = logs.read_from(log, 7)
    assert (again.data, again.offset) == (b"new", 0)


def test_the_agents_log_or_rqds_is_found_and_unsafe_names_never_leave_the_log_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUESCHED_AGENT_LOG_ROOT", str(tmp_path / "agent"))
    monkeypatch.setenv("CUESCHED_RQD_LOG_DIR", str(tmp_path / "rqd" / "{show}" / "{job}"))
    assert logs.find_log("sh", "j1", "render", 7, "0007-render").path is None
    rqd = tmp_path / "rqd" / "sh" / "j1" / "j1.0007-render.rqlog"
    rqd.parent.mkdir(parents=True)
    rqd.write_text("rqd")
    assert logs.find_log("sh", "j1", "render", 7, "0007-render").path == rqd
    agent = tmp_path / "agent" / "sh" / "j1" / "render.0007.log"
    agent.parent.mkdir(parents=True)
    agent.write_text("agent")
    found = logs.find_log("sh", "j1", "render", 7, "0007-render")
    assert found.path in (agent, rqd) and len(found.looked_at) == 2
    # A job named with a separator: the agent's path is sanitised; RQD's raw path is not tried.
    odd = logs.find_log("sh", "../../etc", "render", 7, "0007-render")
    assert all(str(p).startswith(str(tmp_path / "agent")) for p in odd.looked_at)
    assert logs.agent_log_path(tmp_path, "a/b", "..x", "l", 1) == tmp_path / "a_b" / "x" / "l.0001.log"
