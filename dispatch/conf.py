"""Dispatch settings, read through small accessors with documented defaults.

Each reads the environment at call time (see `cuesched_project.conf`), so a test or an
operator changes a knob without monkeypatching. The loop reads them once, when it is built.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from cuesched_project.conf import env_bool, env_float, env_int, env_str


# --- what is dispatched -------------------------------------------------------------------
def dispatch_managed_only() -> bool:
    """Dispatch only scheduler-managed shows: for a database shared with a Cuebot that owns the rest."""
    return env_bool("CUESCHED_DISPATCH_MANAGED_ONLY", False)


def cuebot_proc_ping_interval() -> float:
    """Cuebot mode only: how often the procs of managed shows on live hosts get proc.ts_ping
    refreshed, so Cuebot's orphan cleanup (300 s without a ping) leaves cuesched's frames alone."""
    return max(1.0, env_float("CUESCHED_CUEBOT_PROC_PING_INTERVAL", 60.0))


def dispatch_workers() -> int:
    """Dispatch loops in the scheduler process, each with its own share of hosts and jobs (and its
    own database connection), sharing the one Store. More than one pays when the database is
    far (each loop's round trips overlap the others'); on a small machine running PostgreSQL
    too, one loop already keeps it busy. Jobs and hosts are dealt out by the hash of their ids,
    so a job runs only on its worker's hosts: with a few big jobs, keep one worker."""
    return max(1, env_int("CUESCHED_DISPATCH_WORKERS", 1))


def fair_share() -> bool:
    """Order pending work by subscription share (OpenCue's float_tier: booked cores / size on the
    allocation, lowest first), then jobs below their min cores, then priority, and book every
    show up to its size before any show borrows up to its burst. Off, the feed orders by
    priority then age across all shows, as before issue 19; a show's size is then read by
    nothing. The head-of-line filters (work that cannot book this cycle takes no place in the
    read) hold either way."""
    return env_bool("CUESCHED_FAIR_SHARE", True)


# --- batching -----------------------------------------------------------------------------
def batch_size() -> int:
    """Bookings written per database transaction (one set-based statement per table)."""
    return max(1, env_int("CUESCHED_DISPATCH_BATCH_SIZE", 500))


def feed_max_jobs() -> int:
    """Pending jobs read per cycle, first in dispatch order (fair share, then priority)."""
    return max(1, env_int("CUESCHED_DISPATCH_MAX_JOBS", 300))


def feed_frames_per_layer() -> int:
    """WAITING frames read per layer per cycle (the reference's dispatch_frames_per_layer_limit)."""
    return max(1, env_int("CUESCHED_DISPATCH_FRAMES_PER_LAYER", 20))


def feed_max_frames() -> int:
    """Upper bound of the frames read per cycle. A cycle that ends on a cap or with no host
    shrinks the next read toward what it could book; a cycle that booked all it read doubles it."""
    return max(1, env_int("CUESCHED_DISPATCH_MAX_FRAMES", 10_000))


def completion_batch_size() -> int:
    """Frame completions written per transaction."""
    return max(1, env_int("CUESCHED_COMPLETION_BATCH_SIZE", 1000))


# --- back-off (seconds) -------------------------------------------------------------------
def cluster_saturated_sleep() -> float:
    """A cluster that found work but booked nothing sleeps this long (or until a completion frees room)."""
    return env_float("CUESCHED_CLUSTER_SATURATED_SLEEP", 5.0)


def cap_retry() -> float:
    """The longest a folder the Store refused waits before it is tried again. Our own completions
    release through the listener a few milliseconds later, and the loop is woken as soon as the
    listener applies a release; this bounds the wait when nothing arrives."""
    return env_float("CUESCHED_CAP_RETRY", 0.1)


def idle_sleep() -> float:
    """The loop's pause when a cycle found nothing to do and no frame is due to complete."""
    return env_float("CUESCHED_DISPATCH_IDLE_SLEEP", 0.5)


def reconnect_backoff_max() -> float:
    """Upper bound of the doubling back-off after a database error."""
    return env_float("CUESCHED_DISPATCH_RECONNECT_MAX", 10.0)


# --- hosts --------------------------------------------------------------------------------
def host_refresh_interval() -> float:
    """How often the in-memory host view is reloaded from the database."""
    return env_float("CUESCHED_HOST_REFRESH_INTERVAL", 10.0)


def host_changes_interval() -> float:
    """How often the host view re-reads the hosts changed lately (freed by their agents, by ops):
    the longest a host freed outside the loop waits before it can be booked again."""
    return env_float("CUESCHED_HOST_CHANGES_INTERVAL", 0.5)


def lost_host_timeout() -> float:
    """A host whose host_stat.ts_ping is older than this is lost: its procs are released."""
    return env_float("CUESCHED_LOST_HOST_TIMEOUT", 300.0)


def lost_host_sweep_interval() -> float:
    return env_float("CUESCHED_LOST_HOST_SWEEP_INTERVAL", 30.0)


def host_fit_policy() -> str:
    """`scored` (the host a booking strands the least of, scoring cores, memory and GPUs as the
    Rust scheduler's E-PVM placement does), `tightest` (best fit on idle cores, the reference's
    core saturation, the default before issue 28) or `loosest`."""
    value = env_str("CUESCHED_HOST_FIT_POLICY", "scored").lower()
    if value not in {"scored", "tightest", "loosest"}:
        raise ValueError(f"CUESCHED_HOST_FIT_POLICY must be scored, tightest or loosest, got {value!r}")
    return value


def placement_candidates() -> int:
    """Scored policy: host shapes (idle cores, memory in GB, GPUs) scored per choice before the
    best so far is taken; a perfect fit ends the search sooner. The Rust scheduler scores up to
    500 hosts; one host per shape scores the same choice for far fewer."""
    return max(1, env_int("CUESCHED_PLACEMENT_CANDIDATES", 64))


def gpu_backfill() -> bool:
    """Let frames that ask no GPU use all of a host with idle GPUs. Off (the default, Cuebot's
    rule), they must leave 1 GPU, 1 core, 4 GB of memory and 4 GB of GPU memory free there. Either
    way, while a GPU frame waits that such a host could run, no new CPU frame goes to it, so the
    host drains back to GPU work (OpenCue issue #991)."""
    return env_bool("CUESCHED_GPU_BACKFILL", False)


def proc_mem_used_start() -> int:
    """proc.int_mem_used at booking, KB (the reference's mem_reserved_min, 250 MiB)."""
    return env_int("CUESCHED_PROC_MEM_USED_START", 256_000)


# --- launchers ----------------------------------------------------------------------------
def launcher_name() -> str:
    """`q2` (real frames on host agents, django-q2 on the database), `celery`, `rqd` (OpenCue RQD
    hosts) or `simulated`."""
    return env_str("CUESCHED_LAUNCHER", "q2")


def simulated_runtime_min() -> float:
    """Simulated frames run for uniform(min, max) seconds; max 0 completes at once."""
    return env_float("CUESCHED_SIM_RUNTIME_MIN", 0.05)


def simulated_runtime_max() -> float:
    return env_float("CUESCHED_SIM_RUNTIME_MAX", 0.5)


def simulated_failure_rate() -> float:
    """Share of simulated frames that exit 1 (exercises retries)."""
    return env_float("CUESCHED_SIM_FAILURE_RATE", 0.0)


def simulated_rss_fraction() -> float:
    """A simulated frame's max RSS, as a share of the memory it booked (recorded at its end)."""
    return min(10.0, max(0.0, env_float("CUESCHED_SIM_RSS_FRACTION", 0.5)))


def simulated_launch_failure_rate() -> float:
    """Share of simulated launches that fail after commit (exercises compensation)."""
    return env_float("CUESCHED_SIM_LAUNCH_FAILURE_RATE", 0.0)


def simulated_heartbeat() -> bool:
    """The simulated launcher pings every UP host (no agent does): off to let a host go silent."""
    return env_bool("CUESCHED_SIM_HEARTBEAT", True)


def simulated_seed() -> int | None:
    raw = env_str("CUESCHED_SIM_SEED", "")
    return int(raw) if raw else None


# --- host agents (q2, celery) -----------------------------------------------------------------
def agent_heartbeat_interval() -> float:
    """Seconds between an agent's pings of host_stat.ts_ping (and free memory)."""
    return env_float("CUESCHED_AGENT_HEARTBEAT", 5.0)


def agent_timeout() -> float:
    """A host whose agent has not pinged for this long has no live agent: a remote launcher
    fails its launches (the loop compensates) and marks it DOWN until its agent pings again."""
    return env_float("CUESCHED_AGENT_TIMEOUT", 15.0)


def database_slug(database: Mapping[str, Any], embedded: bool) -> str:
    """A file-name-safe name for one database: `embedded-<name>`, or `<host>-<port>-<name>`.

    Two databases often share a name (the embedded one and an external one are both
    `cuesched` in the README's examples), so the host and port are part of it.
    """
    if embedded:
        parts = ["embedded", str(database.get("NAME") or "")]
    else:
        host, port = database.get("HOST") or "localhost", database.get("PORT") or "5432"
        parts = [str(host), str(port), str(database.get("NAME") or "")]
    return "-".join(re.sub(r"[^A-Za-z0-9._]+", "_", p).strip("._") or "_" for p in parts)


def _this_database_slug() -> str:
    from django.conf import settings

    return database_slug(settings.DATABASES["default"], bool(getattr(settings, "EMBEDDED_DATABASE", False)))


def _password_name() -> str:
    return f"admin-password-{_this_database_slug()}"


def agent_log_root() -> str:
    """Frame logs go to <root>/<show>/<job>/<layer>.<frame>.log. The default root,
    `.cuesched/logs/<database>/` (see `database_slug`), is one per database: frames of two
    databases share show, job and layer names (two demo farms), and one log must never
    gather the runs of another database's frame."""
    from django.conf import settings

    return env_str("CUESCHED_AGENT_LOG_ROOT", str(settings.BASE_DIR / ".cuesched" / "logs" / _this_database_slug()))


def demo_password_file() -> str:
    """Where `manage.py demo` (`./dev run`) keeps the admin password it made on its first run,
    so later runs print the same login: `.cuesched/admin-password-<database>` by default
    (one per database, see `database_slug`; mode 0600)."""
    from django.conf import settings

    return env_str("CUESCHED_DEMO_PASSWORD_FILE", str(settings.BASE_DIR / ".cuesched" / _password_name()))


def agent_memory_interval() -> float:
    """Seconds between an agent's measures of a running frame's memory (the RSS of its whole
    process tree), each followed by the reservation (dispatch.engine.memory). At most 5 s: a
    frame can take gigabytes in that time."""
    return min(5.0, max(0.2, env_float("CUESCHED_AGENT_MEMORY_INTERVAL", 2.0)))


def memory_kill_free_fraction() -> float:
    """A host whose free memory (the smaller of what it reports and its memory less its frames'
    RSS) falls under this fraction of its memory loses the frame furthest over its reservation,
    killed as a memory failure (exit 33), before the kernel picks a victim. Cuebot kills at
    physical memory over 90 % used AND swap over 5 % used, which a host without swap never
    meets; cuesched reads physical memory only, at the same 10 %. 0 turns the kill off."""
    return min(0.9, max(0.0, env_float("CUESCHED_MEMORY_KILL_FREE_FRACTION", 0.1)))


def agent_kill_poll() -> float:
    """How often a running frame checks its proc: a kill mark, or the proc gone (released), stops it."""
    return env_float("CUESCHED_AGENT_KILL_POLL", 1.0)


def kill_poll() -> float:
    """How often the scheduler's kill sender reads the procs marked for a kill (a notification on
    cuesched_kill wakes it at once; this is the fallback when one is lost)."""
    return env_float("CUESCHED_KILL_POLL", 1.0)


def kill_resend() -> float:
    """Seconds after which a kill whose run has not ended yet is sent to its host again."""
    return env_float("CUESCHED_KILL_RESEND", 2.0)


def agent_kill_grace() -> float:
    """Seconds between SIGTERM and SIGKILL of a killed frame's process group."""
    return env_float("CUESCHED_AGENT_KILL_GRACE", 5.0)


def agent_max_runtime() -> int:
    """Longest a frame may run, seconds: the q2 task timeout (its retry, the re-delivery of an
    unacknowledged task, is set above it, so a long frame is never handed out twice)."""
    return env_int("CUESCHED_AGENT_MAX_RUNTIME", 7 * 24 * 3600)


def celery_broker_url() -> str:
    return env_str("CUESCHED_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")


# --- RQD hosts (OpenCue's render-node daemon) -------------------------------------------------
def rqd_gateway_bind() -> str:
    """Where `run_rqd_gateway` listens for RQD's reports (its CUEBOT_HOSTNAME/OVERRIDE_CUEBOT
    must reach it). All interfaces by default: render nodes are other machines."""
    return env_str("CUESCHED_RQD_GATEWAY_BIND", "0.0.0.0")


def rqd_gateway_port() -> int:
    """The gateway's gRPC port: RQD's CUEBOT_GRPC_PORT (8443 is Cuebot's and RQD's default)."""
    return env_int("CUESCHED_RQD_GATEWAY_PORT", 8443)


def rqd_gateway_tls_cert() -> str:
    """PEM certificate file for a TLS listener; empty (the default) serves plain gRPC, which is
    all RQD 1.37 speaks (its report client opens an insecure channel)."""
    return env_str("CUESCHED_RQD_GATEWAY_TLS_CERT", "")


def rqd_gateway_tls_key() -> str:
    """PEM private key of `CUESCHED_RQD_GATEWAY_TLS_CERT`."""
    return env_str("CUESCHED_RQD_GATEWAY_TLS_KEY", "")


def rqd_port() -> int:
    """The port cuesched dials an RQD on (its RQD_GRPC_PORT) unless the host advertises its own
    with an `rqdport-N` tag in RQD_TAGS (several daemons on one machine)."""
    return env_int("CUESCHED_RQD_PORT", 8444)


def rqd_default_alloc() -> str:
    """Allocation name a new RQD host joins at its first startup report (Cuebot puts it in the
    facility's default allocation); empty: an unknown host waits, answered UNAVAILABLE so RQD
    retries, until an operator admits it (`manage.py rqd_hosts admit`)."""
    return env_str("CUESCHED_RQD_DEFAULT_ALLOC", "")


def rqd_timeout() -> float:
    """Seconds a LaunchFrame / KillRunningFrame / status call to an RQD may take."""
    return env_float("CUESCHED_RQD_TIMEOUT", 5.0)


def rqd_poll_hosts() -> bool:
    """The scheduler's rqd launcher asks every UP RQD host for its status before each lost-host
    sweep (RQD's own pushes come only every 5-30 s, not configurable)."""
    return env_bool("CUESCHED_RQD_POLL", True)


def rqd_orphan_grace() -> float:
    """A proc its RQD no longer reports is released after it has been booked this long: a
    launch that is still on its way is not yet in RQD's report."""
    return env_float("CUESCHED_RQD_ORPHAN_GRACE", 30.0)


def rqd_log_dir() -> str:
    """The log_dir handed to RQD in each RunFrame (RQD writes <job>.<frame>.rqlog there, on the
    render node's own file system); {show} and {job} are substituted."""
    return env_str("CUESCHED_RQD_LOG_DIR", "/tmp/rqd/logs/{show}/{job}")
# --- adopting a Cuebot database -----------------------------------------------------------
def adopt_lock_timeout() -> float:
    """Seconds `adopt_cuebot_db --apply` waits for each table lock (its ALTER TABLE and CREATE
    TRIGGER need strong locks on Cuebot's tables). Waiting longer would queue every Cuebot
    write to that table behind it; past the timeout adoption fails whole, nothing written."""
    return max(0.1, env_float("CUESCHED_ADOPT_LOCK_TIMEOUT", 10.0))
