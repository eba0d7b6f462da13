"""`manage.py bench_ab` for real, at a size of seconds: HEAD exported and migrated beside this
checkout, bench alternated old, new, old, new, every figure compared, everything scratch removed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from io import StringIO
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from cuesched_project.dburl import url_from_settings

pytestmark = pytest.mark.django_db

REPO = Path(settings.BASE_DIR)
# Every frame fits (the held drain waits for all of them), the caps still bind the contended farm.
TINY = [
    "--runs", "1", "--skip", "releases,accounting,fairshare,limits", "--hosts", "40", "--jobs", "4",
    "--layers", "1", "--frames-per-layer", "5", "--per-proc-seconds", "0.5", "--sub-burst", "20",
    "--folder-max-cores", "15",
]  # fmt: skip

SHAPES = ("drain-hold/batched", "drain/batched", "contended/batched", "contended/workers", "contended/per-proc")


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode == 0


def _scratch_databases() -> list[str]:
    with psycopg.connect(url_from_settings(connection.settings_dict), autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", ("%\\_ab\\_%",)).fetchall()
    return [r[0] for r in rows]


@pytest.mark.one_server
@pytest.mark.skipif(not _git_checkout(), reason="needs a git checkout with history")
def test_an_ab_run_against_head_alternates_the_sides_and_compares_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_parent))
    before = set(_scratch_databases())
    out = StringIO()
    call_command("bench_ab", "--against", "HEAD", "--rounds", "2", "--out", str(tmp_path), "--", *TINY, stdout=out)
    text = out.getvalue()
    progress = [line.split(":")[0] for line in text.splitlines() if line.startswith("round ")]
    assert progress == ["round 1/2 old", "round 1/2 new", "round 2/2 old", "round 2/2 new"], text
    assert "old: requirements.txt matches this checkout's" in text
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert f"A/B bench: old {head.strip()}, new this checkout ({head.strip()[:12]}" in text
    data = json.loads((tmp_path / "ab.json").read_text())
    assert data["rounds"] == 2 and data["bench_args"] == TINY
    figures = {f["name"]: f for f in data["figures"]}
    for shape in (
        "drain-hold/batched",
        "drain/batched",
        "contended/batched",
        "contended/workers",
        "contended/per-proc",
    ):
        for mode in ("store", "database"):
            fig = figures[f"{shape}/{mode}"]
            assert len(fig["old"]) == len(fig["new"]) == 2 and all(v and v > 0 for v in fig["old"] + fig["new"])
            assert fig["ratio"] == pytest.approx(fig["new_median"] / fig["old_median"])
            assert len(fig["round_ratios"]) == 2
            table_row = next(line for line in text.splitlines() if line.startswith(f"{shape}/{mode} "))
            assert table_row.split()[-1] == "2", table_row
    assert any(name.startswith("floor ") for name in figures)
    # Nothing scratch is left: the databases are dropped, the exported tree and logs removed.
    assert set(_scratch_databases()) == before
    assert list(scratch_parent.iterdir()) == []


def test_a_revision_that_names_no_commit_is_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match=r"'no-such-rev' names no commit .*try a sha, a branch, HEAD~1"):
        call_command("bench_ab", "--against", "no-such-rev", "--rounds", "1", "--out", str(tmp_path))


def test_benchs_out_is_the_ab_runs_own(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="bench's --out is the A/B's own"):
        call_command("bench_ab", "--against", "HEAD", "--out", str(tmp_path), "--", "--out", "/tmp/x")
