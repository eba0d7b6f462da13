"""Phase `drain`: throughput and exactness when capacity exceeds demand (>= 90% must book)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from accounting import db
from dispatch.engine.launcher import get_launcher
from dispatch.lab.seeding import FarmSeed
from dispatch.lab.stress.config import StressConfig
from dispatch.lab.stress.harness import run_inprocess, sim_launcher
from dispatch.lab.stress.report import PhaseReport


def phase_drain(cfg: StressConfig) -> PhaseReport:
    spec = cfg.drain_spec()
    if cfg.launcher == "rqd":
        # Every layer must fit one of the few hosts: one allocation, no manual tag, hosts big
        # enough for the largest layer, but not so big that a 2-core machine forks hundreds of frames.
        spec = replace(spec, hosts=cfg.rqd_daemons, allocs=1, manual_tags=0, host_cores_choices=(8, 16))
        report = run_inprocess(cfg, "drain", spec, launcher=get_launcher("rqd"), prepare=_rqd_hosts)
    elif cfg.launcher == "simulated":
        report = run_inprocess(cfg, "drain", spec, launcher=sim_launcher(cfg, runtime=False))
    else:
        raise ValueError(f"the drain phase runs on the simulated or the rqd launcher, not {cfg.launcher!r}")
    if report.booked < 0.9 * report.frames:
        report.failed.append(f"only {report.booked} of {report.frames} frames booked (< 90%)")
    return report


HOSTS_OF_FARM_SQL = """
SELECT h.str_name, h.int_cores, h.int_mem,
       (SELECT array_agg(t.str_tag ORDER BY t.str_tag) FROM host_tag t
        WHERE t.pk_host = h.pk_host AND t.str_tag_type NOT IN ('ALLOC', 'HOSTNAME'))
FROM host h WHERE h.pk_host = ANY(%s::text[]) ORDER BY h.str_name
"""


def _rqd_hosts(seed: FarmSeed) -> Callable[[], None]:
    """Real RQD daemons as the seeded hosts (same names, cores, memory and tags, so each startup
    report updates its host in place), a gateway for their reports, and `true` as every layer's
    command. Returns what stops them."""
    import tempfile

    from dispatch.hosts.rqd_gateway import start_gateway
    from dispatch.lab.rqdfarm import start_daemons, wait_registered

    tmp = Path(tempfile.mkdtemp(prefix="stress-rqd-"))
    gateway = start_gateway("127.0.0.1", 0, workers=16)
    daemons: dict[str, Any] = {}
    try:
        with db.connect(autocommit=True, application_name="cuesched-stress-rqd") as conn:
            # Not threadable: told CUE_THREADABLE=1 (as Cuebot tells it), RQD pins a threadable frame
            # to physical cores, which these daemons, claiming the seeded hosts' cores on a small
            # machine, do not have; a refused launch would stand for a machine this is not.
            conn.execute(
                "UPDATE layer SET str_cmd = 'true', b_threadable = false WHERE pk_job = ANY(%s::text[])",
                (list(seed.job_ids),),
            )
            for name, cores, mem, tags in conn.execute(HOSTS_OF_FARM_SQL, (list(seed.host_ids),)).fetchall():
                daemons.update(
                    start_daemons(
                        [name], gateway.port, tmp, tags=list(tags or []), cores=int(cores) // 100, memory_kb=int(mem)
                    )
                )
            for d in daemons.values():
                wait_registered(conn, d, 60)
    except BaseException:
        for d in daemons.values():
            d.stop()
        gateway.stop()
        raise

    def stop() -> None:
        for d in daemons.values():
            d.stop()
        gateway.stop()

    return stop
