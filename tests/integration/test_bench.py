"""`manage.py bench` end to end at toy sizes: every part runs, and the JSON and the chart are written.

The figures themselves are not asserted (speed is read from the command's output on a quiet
machine, never from a test); what is asserted is that each comparison has both sides.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.core.management import call_command

pytestmark = pytest.mark.django_db(transaction=True)


def test_bench_writes_every_figure_and_the_chart(tmp_path: Path) -> None:
    out = io.StringIO()
    call_command(
        "bench",
        out=str(tmp_path),
        runs=1,
        prefix="tbench",
        hosts=30,
        jobs=4,
        layers=2,
        frames_per_layer=3,
        sub_burst=16,
        folder_max_cores=12,  # every frame fits (layers of up to 8 cores), so each drain ends
        workers=2,
        threads=2,
        per_proc_seconds=0.5,
        agents=2,
        release_count=12,
        recompute_jobs=20,
        recompute_frames=2,
        releases=20,
        store_pairs=1000,
        stdout=out,
    )
    results = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    for workload, shape in (("drain", "batched"), ("contended", "workers"), ("contended", "per-proc")):
        for mode in ("store", "database"):
            assert results["throughput"][f"{workload}/{shape}/{mode}"]["rate"]["median"] > 0
    assert results["floor"]["rate"]["median"] > 0
    releases = results["releases"]
    assert releases["agents"] == 2
    assert releases["rate"]["store"]["median"] > 0 and releases["rate"]["database"]["median"] > 0
    assert releases["ratio"] > 0
    assert results["recompute"]["procs"] == 40
    assert "ratio Store / database-enforced, releases:" in out.getvalue()
