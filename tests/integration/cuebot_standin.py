"""A Cuebot stand-in: Cuebot's own SQL, replayed against an adopted Cuebot database.

Why: cuesched runs beside a live Cuebot on Cuebot's database, and the tests must show that
what Cuebot writes is counted exactly once. A JVM Cuebot is not available here, so its writes
are replayed statement by statement, copied from OpenCue's cuebot sources
(cuebot/src/main/java/com/imageworks/spcue/...). This module reimplements none of cuesched's
logic: every statement below is Cuebot's, and the Python around it only plays the part of the
Java caller (which statement runs when, in one transaction per Cuebot service call).

Which DAO each statement comes from:

- `activate`: dao/postgres/FrameDaoJdbc.java INSERT_FRAME (insertFrames: frames in SETUP), then
  JobDaoJdbc.activateJob(): SETUP -> WAITING, and the layer_stat / job_stat / job counts set from
  a GROUP BY over the frames (Cuebot's frame-state trigger counts only later transitions).
- `book`: dao/postgres/ProcDaoJdbc.java, INSERT_VIRTUAL_PROC (insertVirtualProc), then
  procCreated(): host idle counters down, then subscription, layer_resource, job_resource,
  folder_resource and point up by the proc's cores and GPUs (non-local proc). Cuebot's
  DispatchQuery only dispatches shows with b_scheduler_managed = false, so the caller books
  unmanaged shows only; Cuebot's verify_* triggers refuse a booking over a cap.
- `unbook`: ProcDaoJdbc.deleteVirtualProc(): DELETE_VIRTUAL_PROC ... RETURNING, then
  procDestroyed(): host idle counters up; for a scheduler-managed show only
  AccountingNotifier.notifyRelease() (its exact payload, when `notifier=True`, i.e. Cuebot's
  accounting.notify.enabled=true), otherwise the five tables down.
- `dispatch_one`: DispatchSupportService.startFrameAndProc (one transaction): the frame picked
  as Cuebot's DispatchQuery would (a WAITING frame of a PENDING, unpaused job of a show with
  b_scheduler_managed = false; the query's ordering and host matching are left out, the stand-in
  has one host), FrameDaoJdbc.updateFrameStarted: lockFrameForUpdate (SELECT ... FOR UPDATE
  NOWAIT) and UPDATE_FRAME_STARTED verbatim, with its licence-limit subquery (Cuebot counts the
  RUNNING frames of the limit's layers from layer_stat.int_running_count, which its
  update_frame_status_counts trigger keeps, against limit_record.int_max_value) and its
  ts_start_after gate (V47); 0 rows (a full limit, a frame taken) is Cuebot's
  FrameReservationException, returned as None. Then `book`: its proc INSERT meets cuesched's
  licence trigger, which refuses a count over the max with check_violation (raised: Cuebot's
  DataAccessException, the whole startFrameAndProc rolled back).
- `create_limit` / `add_limit`: LimitDaoJdbc.createLimit, LayerDaoJdbc.addLimit (INSERT_LIMIT).
- `complete`: FrameCompleteHandler: FrameDaoJdbc.UPDATE_FRAME_STOPPED (SUCCEEDED), then `unbook`.
- `complete_with_usage`: FrameCompleteHandler for a report with any exit status: the stop and
  unbook as in `complete` (SUCCEEDED on 0, else DEAD), then, in the next transaction as its
  handlePostFrameCompleteOperations, DispatchSupportService.updateUsageCounters:
  FrameDaoJdbc.getResourceUsage (its SELECT, then ResourceUsage's Java arithmetic: float
  `corePoints / 100f`, truncated to long, at least 1), ShowDaoJdbc.updateFrameCounters,
  JobDaoJdbc.updateUsage and LayerDaoJdbc.updateUsage (their UPDATE statements).
- `orphans`: ProcDaoJdbc.GET_ORPHANED_PROC_LIST (procs whose ts_ping is older than
  ORPHANED_PROC_INTERVAL, 300 s), which Cuebot's MaintenanceManagerSupport then unbooks.
- `recalculate_subs`: the V45 plpgsql function Cuebot's maintenance task calls.
- `depend_on_job`: DependManagerService.createDepend for a JOB_ON_JOB, LAYER_ON_JOB or FRAME_ON_JOB:
  DependDaoJdbc INSERT_DEPEND, then per depending frame UPDATE_DEPEND_COUNT and UPDATE_FRAME_STATE.
- `shutdown_job`: JobManagerSupport.shutdownJob: JobDaoJdbc.UPDATE_JOB_FINISHED (jobManager.shutdownJob),
  then satisfyWhatDependsOn(job) in Java: GET_WHAT_DEPENDS_ON_JOB, and per depend
  DependManagerService.satisfyDepend: SET_INACTIVE, and only when it set the row inactive,
  FrameDaoJdbc.getDependentFrames and DECREMENT_DEPEND_COUNT for each (Cuebot's
  update_frame_dep_to_wait trigger then moves a frame at 0 from DEPEND to WAITING).
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

import psycopg

# FrameDaoJdbc.INSERT_FRAME
INSERT_FRAME = (
    "INSERT INTO frame (pk_frame, pk_layer, pk_job, str_name, str_state, int_number, int_dispatch_order, "
    "int_layer_order, ts_updated, ts_llu) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,current_timestamp,current_timestamp)"
)
# JobDaoJdbc.activateJob
ACTIVATE_FRAMES = "UPDATE frame SET str_state=%s WHERE pk_job=%s AND str_state=%s"
ACTIVATE_COUNT = "SELECT pk_layer, str_state, count(1) AS c FROM frame WHERE pk_job=%s GROUP BY pk_layer, str_state"
ACTIVATE_LAYER_DEPEND = (
    "UPDATE layer_stat SET int_depend_count=%s,int_total_count=int_total_count + %s WHERE pk_layer=%s"
)
ACTIVATE_LAYER_WAITING = (
    "UPDATE layer_stat SET int_waiting_count=%s,int_total_count=int_total_count + %s WHERE pk_layer=%s"
)
ACTIVATE_JOB_STAT = "UPDATE job_stat SET int_depend_count=%s,int_waiting_count=%s WHERE pk_job=%s"
ACTIVATE_JOB = "UPDATE job SET int_frame_count=%s, int_layer_count=%s WHERE pk_job=%s"

# DispatchQuery, reduced to its show filter (see the module docstring)
DISPATCHABLE_FRAME = (
    "SELECT f.pk_frame, f.pk_layer, f.pk_job, f.int_version, j.pk_show FROM frame f "
    "JOIN job j ON j.pk_job = f.pk_job JOIN show s ON s.pk_show = j.pk_show "
    "WHERE f.str_state = 'WAITING' AND j.str_state = 'PENDING' AND NOT j.b_paused "
    "AND s.b_scheduler_managed = false AND j.pk_job = %s LIMIT 1"
)
# FrameDaoJdbc.lockFrameForUpdate
LOCK_FRAME_FOR_UPDATE = (
    "SELECT pk_frame FROM frame WHERE pk_frame=%s AND str_state=%s AND int_version =%s FOR UPDATE NOWAIT"
)
# FrameDaoJdbc.UPDATE_FRAME_STARTED, verbatim (its string concatenation joined; ? -> %s)
UPDATE_FRAME_STARTED = (
    "UPDATE frame "
    "SET "
    "str_state = %s, "
    "str_host = %s, "
    "int_cores = %s, "
    "int_mem_reserved = %s, "
    "int_gpus = %s, "
    "int_gpu_mem_reserved = %s, "
    "ts_updated = current_timestamp, "
    "ts_started = current_timestamp, "
    "ts_stopped = null, "
    "int_version = int_version + 1 "
    "WHERE pk_frame = %s "
    "AND str_state = %s "
    "AND int_version = %s "
    "AND frame.pk_layer IN ("
    "SELECT layer.pk_layer "
    "FROM layer "
    "LEFT JOIN layer_limit ON layer_limit.pk_layer = layer.pk_layer "
    "LEFT JOIN limit_record ON limit_record.pk_limit_record = layer_limit.pk_limit_record "
    "LEFT JOIN ("
    "SELECT "
    "limit_record.pk_limit_record, "
    "SUM(layer_stat.int_running_count) AS int_sum_running "
    "FROM layer_limit "
    "LEFT JOIN limit_record ON layer_limit.pk_limit_record = limit_record.pk_limit_record "
    "LEFT JOIN layer_stat ON layer_stat.pk_layer = layer_limit.pk_layer "
    "GROUP BY limit_record.pk_limit_record) AS sum_running "
    "ON limit_record.pk_limit_record = sum_running.pk_limit_record "
    "WHERE ("
    "sum_running.int_sum_running < limit_record.int_max_value "
    "OR sum_running.int_sum_running IS NULL"
    ") "
    "AND ("
    "layer.ts_start_after IS NULL "
    "OR layer.ts_start_after <= current_timestamp"
    ") "
    ")"
)
# LimitDaoJdbc.createLimit
CREATE_LIMIT = "INSERT INTO limit_record (pk_limit_record,str_name, int_max_value) VALUES (%s,%s,%s)"
# LayerDaoJdbc.INSERT_LIMIT (addLimit)
INSERT_LIMIT = "INSERT INTO layer_limit (pk_layer_limit,pk_layer,pk_limit_record)VALUES (%s,%s,%s)"
# FrameDaoJdbc.UPDATE_FRAME_STOPPED
UPDATE_FRAME_STOPPED = (
    "UPDATE frame SET str_state=%s, int_exit_status = %s, ts_stopped = current_timestamp + interval '1' second, "
    "ts_updated = current_timestamp, int_mem_max_used = %s, int_version = int_version + 1, "
    "int_total_past_core_time = int_total_past_core_time + "
    "round(INTERVAL_TO_SECONDS(current_timestamp + interval '1' second - ts_started) * int_cores / 100), "
    "int_total_past_gpu_time = int_total_past_gpu_time + "
    "round(INTERVAL_TO_SECONDS(current_timestamp + interval '1' second - ts_started) * int_gpus) "
    "WHERE frame.pk_frame = %s AND frame.str_state = %s AND frame.int_version = %s"
)

# FrameDaoJdbc.getResourceUsage
GET_RESOURCE_USAGE = (
    "SELECT COALESCE(interval_to_seconds(current_timestamp - ts_started), 1) AS int_clock_time, "
    "COALESCE(int_cores, 100) AS int_cores,int_gpus FROM frame WHERE pk_frame = %s"
)
# ShowDaoJdbc.updateFrameCounters (the column chosen by exit status > 0)
SHOW_FRAME_SUCCESS = "UPDATE show_stats SET int_frame_success_count = int_frame_success_count + 1 WHERE pk_show=%s"
SHOW_FRAME_FAIL = "UPDATE show_stats SET int_frame_fail_count = int_frame_fail_count + 1 WHERE pk_show=%s"
# JobDaoJdbc.updateUsage
JOB_USAGE_SUCCESS = (
    "UPDATE job_usage SET int_core_time_success = int_core_time_success + %s,"
    "int_gpu_time_success = int_gpu_time_success + %s,int_clock_time_success = int_clock_time_success + %s,"
    "int_frame_success_count = int_frame_success_count + 1 WHERE pk_job = %s "
)
JOB_USAGE_HIGH = "UPDATE job_usage SET int_clock_time_high = %s WHERE pk_job = %s AND int_clock_time_high < %s"
JOB_USAGE_FAIL = (
    "UPDATE job_usage SET int_core_time_fail = int_core_time_fail + %s,"
    "int_clock_time_fail = int_clock_time_fail + %s,int_frame_fail_count = int_frame_fail_count + 1 WHERE pk_job = %s "
)
# LayerDaoJdbc.updateUsage
LAYER_USAGE_SUCCESS = (
    "UPDATE layer_usage SET int_core_time_success = int_core_time_success + %s,"
    "int_gpu_time_success = int_gpu_time_success + %s,int_clock_time_success = int_clock_time_success + %s,"
    "int_frame_success_count = int_frame_success_count + 1 WHERE pk_layer = %s "
)
LAYER_USAGE_HIGH = "UPDATE layer_usage SET int_clock_time_high = %s WHERE pk_layer = %s AND int_clock_time_high < %s"
LAYER_USAGE_LOW = (
    "UPDATE layer_usage SET int_clock_time_low = %s WHERE pk_layer = %s "
    "AND (%s < int_clock_time_low OR int_clock_time_low = 0)"
)
LAYER_USAGE_FAIL = (
    "UPDATE layer_usage SET int_core_time_fail = int_core_time_fail + %s,"
    "int_clock_time_fail = int_clock_time_fail + %s,int_frame_fail_count = int_frame_fail_count + 1 "
    "WHERE pk_layer = %s "
)

# DependDaoJdbc.INSERT_DEPEND
INSERT_DEPEND = (
    "INSERT INTO depend (pk_depend,pk_parent,pk_job_depend_er,pk_layer_depend_er,pk_frame_depend_er,"
    "pk_job_depend_on,pk_layer_depend_on,pk_frame_depend_on,str_type,b_any, str_target, b_active, "
    "str_signature, b_composite ) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
)
# DependDaoJdbc.UPDATE_DEPEND_COUNT, UPDATE_FRAME_STATE, DECREMENT_DEPEND_COUNT, SET_INACTIVE
UPDATE_DEPEND_COUNT = "UPDATE frame SET int_depend_count = int_depend_count + 1 WHERE pk_frame = %s"
UPDATE_FRAME_STATE = (
    "UPDATE frame SET str_state='DEPEND' WHERE int_depend_count != 0 AND frame.str_state NOT IN "
    "('SUCCEEDED','EATEN','RUNNING','DEPEND') AND frame.pk_frame = %s"
)
DECREMENT_DEPEND_COUNT = (
    "UPDATE frame SET int_depend_count = int_depend_count -1 WHERE pk_frame = %s AND int_depend_count > 0"
)
SET_INACTIVE = (
    "UPDATE depend SET b_active=false,ts_satisfied=current_timestamp,str_signature=pk_depend "
    "WHERE pk_depend = %s AND b_active = true AND b_composite = false"
)
# DependDaoJdbc.GET_WHAT_DEPENDS_ON_JOB (getWhatDependsOn(JobInterface))
GET_WHAT_DEPENDS_ON_JOB = (
    "SELECT depend.pk_depend,depend.str_type,depend.pk_frame_depend_er,depend.pk_layer_depend_er,"
    "depend.pk_job_depend_er FROM depend WHERE pk_job_depend_on=%s AND b_active = true "
    "AND str_type IN ('JOB_ON_JOB','LAYER_ON_JOB','FRAME_ON_JOB')"
)
# FrameDaoJdbc.getDependentFrames: GET_MINIMAL_FRAME, counted frames, keyed by the depend's type
GET_DEPENDENT_FRAMES = (
    "SELECT frame.pk_frame FROM frame,layer,job,show WHERE frame.pk_job = job.pk_job "
    "AND frame.pk_layer = layer.pk_layer AND job.pk_show = show.pk_show AND frame.int_depend_count > 0 AND {key} = %s"
)
DEPENDENT_FRAMES_KEY = {"JOB_ON_JOB": "job.pk_job", "LAYER_ON_JOB": "layer.pk_layer", "FRAME_ON_JOB": "frame.pk_frame"}
# JobDaoJdbc.UPDATE_JOB_FINISHED
UPDATE_JOB_FINISHED = (
    "UPDATE job SET str_state = %s, str_visible_name = NULL, ts_stopped = current_timestamp "
    "WHERE str_state = 'PENDING'AND pk_job = %s"
)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def resource_usage(clock_time: int, core_points: int, gpu_points: int) -> tuple[int, int, int]:
    """ResourceUsage's constructor (Java float arithmetic): (clock, core, GPU) seconds."""
    clock_time = max(clock_time, 1)
    core_time = max(int(_f32(_f32(float(clock_time)) * _f32(_f32(float(core_points)) / _f32(100.0)))), 1)
    return clock_time, core_time, clock_time * gpu_points


# ProcDaoJdbc.INSERT_VIRTUAL_PROC
INSERT_VIRTUAL_PROC = (
    "INSERT INTO proc (pk_proc, pk_host, pk_show, pk_layer, pk_job, pk_frame, int_cores_reserved, "
    "int_mem_reserved, int_mem_pre_reserved, int_mem_used, int_gpus_reserved, int_gpu_mem_reserved, "
    "int_gpu_mem_pre_reserved, int_gpu_mem_used, b_local) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
)
# ProcDaoJdbc.procCreated (non-local)
PROC_CREATED = (
    (
        "UPDATE host SET int_cores_idle = int_cores_idle - %(c)s, int_mem_idle = int_mem_idle - %(m)s, "
        "int_gpus_idle = int_gpus_idle - %(g)s, int_gpu_mem_idle = int_gpu_mem_idle - %(gm)s WHERE pk_host = %(host)s"
    ),
    "UPDATE subscription SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s "
    "WHERE pk_show = %(show)s AND pk_alloc = %(alloc)s",
    "UPDATE layer_resource SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s WHERE pk_layer = %(layer)s",
    "UPDATE job_resource SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s WHERE pk_job = %(job)s",
    "UPDATE folder_resource SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s "
    "WHERE pk_folder = (SELECT pk_folder FROM job WHERE pk_job=%(job)s)",
    "UPDATE point SET int_cores = int_cores + %(c)s, int_gpus = int_gpus + %(g)s "
    "WHERE pk_dept = (SELECT pk_dept FROM job WHERE pk_job=%(job)s) "
    "AND pk_show = (SELECT pk_show FROM job WHERE pk_job=%(job)s)",
)
# ProcDaoJdbc.DELETE_VIRTUAL_PROC
DELETE_VIRTUAL_PROC = (
    "DELETE FROM proc WHERE pk_proc=%s RETURNING int_cores_reserved, int_mem_reserved, "
    "int_gpus_reserved, int_gpu_mem_reserved"
)
PROC_DESTROYED_HOST = (
    "UPDATE host SET int_cores_idle = int_cores_idle + %(c)s, int_mem_idle = int_mem_idle + %(m)s, "
    "int_gpus_idle = int_gpus_idle + %(g)s, int_gpu_mem_idle = int_gpu_mem_idle + %(gm)s WHERE pk_host = %(host)s"
)
# ShowDaoJdbc.isSchedulerManaged
IS_SCHEDULER_MANAGED = "SELECT b_scheduler_managed FROM show WHERE pk_show=%s"
# ProcDaoJdbc.procDestroyed, unmanaged non-local
PROC_DESTROYED = tuple(s.replace("+ %(c)s", "- %(c)s").replace("+ %(g)s", "- %(g)s") for s in PROC_CREATED[1:])
# ProcDaoJdbc.GET_ORPHANED_PROC_LIST (joins as Cuebot's, ORPHANED_PROC_INTERVAL = 300 s)
ORPHANED_PROCS = (
    "SELECT proc.pk_proc FROM proc, host, host_stat, alloc, job WHERE proc.pk_host = host.pk_host "
    "AND host.pk_host = host_stat.pk_host AND host.pk_alloc = alloc.pk_alloc AND job.pk_job = proc.pk_job "
    "AND current_timestamp - proc.ts_ping > interval '300' second ORDER BY proc.ts_ping"
)


def notifier_release_payload(
    show: str, alloc: str, folder: str, job: str, layer: str, dept: str, cores: int, gpus: int
) -> str:
    """AccountingNotifier.notifyRelease's String.format, exactly (cores in centicores / 100, negated)."""
    return (
        f'{{"show":"{show}","alloc":"{alloc}","folder":"{folder}","job":"{job}",'
        f'"layer":"{layer}","dept":"{dept}","cores":{-cores // 100},"gpus":{-gpus}}}'
    )


@dataclass
class Proc:
    pk_proc: str
    host: str
    alloc: str
    show: str
    job: str
    layer: str
    frame: str
    cores: int
    gpus: int = 0
    mem: int = 1_048_576
    version: int = 0  # the frame's int_version after Cuebot started it


class CuebotStandIn:
    """One Cuebot, one connection: each method is one Cuebot service call (one transaction)."""

    def __init__(self, url: str, *, notifier: bool = False) -> None:
        self.conn = psycopg.connect(url, autocommit=True, application_name="cuebot-standin")
        self.notifier = notifier

    def close(self) -> None:
        self.conn.close()

    def activate(self, *, job: str, layer: str, layer_name: str, frames: list[tuple[str, int]]) -> None:
        """JobLauncher: FrameDaoJdbc.insertFrames (SETUP) then JobDaoJdbc.activateJob (-> WAITING)."""
        with self.conn.transaction():
            for count, (pk_frame, number) in enumerate(frames):
                # CueUtil.buildFrameName: zero-padded number, '-', layer name
                name = f"{number:04d}-{layer_name}"
                self.conn.execute(INSERT_FRAME, (pk_frame, layer, job, name, "SETUP", number, count, 0))
            self.conn.execute(ACTIVATE_FRAMES, ("WAITING", job, "SETUP"))
            depend = waiting = 0
            rows = self.conn.execute(ACTIVATE_COUNT, (job,)).fetchall()
            for pk_layer, state, c in rows:
                if state == "DEPEND":
                    depend += c
                    self.conn.execute(ACTIVATE_LAYER_DEPEND, (c, c, pk_layer))
                elif state == "WAITING":
                    waiting += c
                    self.conn.execute(ACTIVATE_LAYER_WAITING, (c, c, pk_layer))
            self.conn.execute(ACTIVATE_JOB_STAT, (depend, waiting, job))
            self.conn.execute(ACTIVATE_JOB, (depend + waiting, len(rows), job))

    def dispatch_one(self, *, host: str, host_name: str, alloc: str, job: str, cores: int) -> Proc | None:
        """startFrameAndProc for one WAITING frame of `job`, if its show is Cuebot's (unmanaged).

        None when there is no such frame, another writer took it or holds its row, or its layer's
        limit reads full to Cuebot's subquery (UPDATE_FRAME_STARTED updates 0 rows). A cap refusal
        by Cuebot's verify_* triggers (psycopg.errors.RaiseException) or by cuesched's licence
        count (psycopg.errors.CheckViolation, constraint acct_limit_max) raises; nothing is written."""
        try:
            return self._start_frame_and_proc(host=host, host_name=host_name, alloc=alloc, job=job, cores=cores)
        except psycopg.errors.LockNotAvailable:
            return None  # lockFrameForUpdate's FrameReservationException: the transaction rolled back

    def _start_frame_and_proc(self, *, host: str, host_name: str, alloc: str, job: str, cores: int) -> Proc | None:
        with self.conn.transaction():
            row = self.conn.execute(DISPATCHABLE_FRAME, (job,)).fetchone()
            if row is None:
                return None
            frame, layer, _job, version, show = row
            if self.conn.execute(LOCK_FRAME_FOR_UPDATE, (frame, "WAITING", version)).fetchone() is None:
                return None
            started = self.conn.execute(
                UPDATE_FRAME_STARTED, ("RUNNING", host_name, cores, 1_048_576, 0, 0, frame, "WAITING", version)
            )
            if started.rowcount != 1:
                return None
            proc = self._book(Proc(str(uuid.uuid4()), host, alloc, show, job, layer, frame, cores))
        proc.version = version + 1
        return proc

    def create_limit(self, name: str, max_value: int) -> str:
        """LimitDaoJdbc.createLimit (SqlUtil.genKeyRandom is a random UUID)."""
        pk = str(uuid.uuid4())
        self.conn.execute(CREATE_LIMIT, (pk, name, max_value))
        return pk

    def add_limit(self, layer: str, limit: str) -> None:
        """LayerDaoJdbc.addLimit."""
        self.conn.execute(INSERT_LIMIT, (str(uuid.uuid4()), layer, limit))

    def complete(self, proc: Proc) -> bool:
        """FrameCompleteHandler for a frame Cuebot started: frame SUCCEEDED, then its proc unbooked."""
        with self.conn.transaction():
            self.conn.execute(UPDATE_FRAME_STOPPED, ("SUCCEEDED", 0, 0, proc.frame, "RUNNING", proc.version))
            return self._unbook(proc)

    def complete_with_usage(self, proc: Proc, exit_status: int) -> bool:
        """FrameCompleteHandler for a report of `exit_status`, usage counters included."""
        state = "SUCCEEDED" if exit_status == 0 else "DEAD"
        with self.conn.transaction():
            stopped = self.conn.execute(
                UPDATE_FRAME_STOPPED, (state, exit_status, 0, proc.frame, "RUNNING", proc.version)
            ).rowcount
            self._unbook(proc)
        if stopped != 1:
            return False
        with self.conn.transaction():
            clock, cores, gpus = self.conn.execute(GET_RESOURCE_USAGE, (proc.frame,)).fetchone()
            # pgjdbc's getLong of a numeric truncates, getInt of NULL is 0
            clock_s, core_s, gpu_s = resource_usage(int(clock), int(cores), int(gpus or 0))
            self.conn.execute(SHOW_FRAME_FAIL if exit_status > 0 else SHOW_FRAME_SUCCESS, (proc.show,))
            if exit_status == 0:
                self.conn.execute(JOB_USAGE_SUCCESS, (core_s, gpu_s, clock_s, proc.job))
                self.conn.execute(JOB_USAGE_HIGH, (clock_s, proc.job, clock_s))
                self.conn.execute(LAYER_USAGE_SUCCESS, (core_s, gpu_s, clock_s, proc.layer))
                self.conn.execute(LAYER_USAGE_HIGH, (clock_s, proc.layer, clock_s))
                self.conn.execute(LAYER_USAGE_LOW, (clock_s, proc.layer, clock_s))
            else:
                self.conn.execute(JOB_USAGE_FAIL, (core_s, clock_s, proc.job))
                self.conn.execute(LAYER_USAGE_FAIL, (core_s, clock_s, proc.layer))
        return True

    def book(self, *, host: str, alloc: str, show: str, job: str, layer: str, frame: str, cores: int) -> Proc:
        """DispatchSupportService.reserveProc -> ProcDaoJdbc.insertVirtualProc (+ procCreated)."""
        with self.conn.transaction():
            return self._book(Proc(str(uuid.uuid4()), host, alloc, show, job, layer, frame, cores))

    def _book(self, proc: Proc) -> Proc:
        host, show, layer, job, frame, cores, alloc = (
            proc.host,
            proc.show,
            proc.layer,
            proc.job,
            proc.frame,
            proc.cores,
            proc.alloc,
        )
        self.conn.execute(
            INSERT_VIRTUAL_PROC,
            (proc.pk_proc, host, show, layer, job, frame, cores, proc.mem, proc.mem, 0, 0, 0, 0, 0, False),
        )
        params = {"c": cores, "m": proc.mem, "g": 0, "gm": 0, "host": host, "show": show, "alloc": alloc}
        params.update(job=job, layer=layer)
        for stmt in PROC_CREATED:
            self.conn.execute(stmt, params)
        return proc

    def unbook(self, proc: Proc) -> bool:
        """ProcDaoJdbc.deleteVirtualProc (+ procDestroyed), as FrameCompleteHandler calls it."""
        with self.conn.transaction():
            return self._unbook(proc)

    def _unbook(self, proc: Proc) -> bool:
        row = self.conn.execute(DELETE_VIRTUAL_PROC, (proc.pk_proc,)).fetchone()
        if row is None:
            return False
        cores, mem, gpus, gpu_mem = row
        params = {"c": cores, "m": mem, "g": gpus, "gm": gpu_mem, "host": proc.host}
        self.conn.execute(PROC_DESTROYED_HOST, params)
        (managed,) = self.conn.execute(IS_SCHEDULER_MANAGED, (proc.show,)).fetchone()
        if managed:
            if self.notifier:
                folder, dept = self.conn.execute(
                    "SELECT pk_folder, pk_dept FROM job WHERE pk_job=%s", (proc.job,)
                ).fetchone()
                payload = notifier_release_payload(
                    proc.show, proc.alloc, folder, proc.job, proc.layer, dept, cores, gpus
                )
                self.conn.execute("SELECT pg_notify(%s, %s)", ("acct_release", payload))
            return True
        params.update(show=proc.show, alloc=proc.alloc, job=proc.job, layer=proc.layer)
        for stmt in PROC_DESTROYED:
            self.conn.execute(stmt, params)
        return True

    def orphans(self) -> list[str]:
        """ProcDaoJdbc.findOrphanedVirtualProcs: what Cuebot's maintenance would unbook now."""
        return [r[0] for r in self.conn.execute(ORPHANED_PROCS)]

    def depend_on_job(
        self, kind: str, *, er_job: str, on_job: str, er_layer: str | None = None, er_frame: str | None = None
    ) -> str:
        """DependManagerService.createDepend of a JOB_ON_JOB, LAYER_ON_JOB or FRAME_ON_JOB (one
        transaction): the row (str_target EXTERNAL, across jobs; a fresh signature, which Cuebot
        derives from what the depend links), then each depending frame counted and, unless it
        runs or is done, DEPEND."""
        pk = str(uuid.uuid4())
        with self.conn.transaction():
            self.conn.execute(
                INSERT_DEPEND,
                (pk, None, er_job, er_layer, er_frame, on_job, None, None, kind, False, "EXTERNAL", True,
                 str(uuid.uuid4()), False),
            )  # fmt: skip
            column, key = {"JOB_ON_JOB": ("pk_job", er_job), "LAYER_ON_JOB": ("pk_layer", er_layer)}.get(
                kind, ("pk_frame", er_frame)
            )
            for (frame,) in self.conn.execute(f"SELECT pk_frame FROM frame WHERE {column} = %s", (key,)).fetchall():
                self.conn.execute(UPDATE_DEPEND_COUNT, (frame,))
                self.conn.execute(UPDATE_FRAME_STATE, (frame,))
        return pk

    def shutdown_job(self, job: str) -> bool:
        """JobManagerSupport.shutdownJob: the job FINISHED (its transaction), then what depends on
        the job satisfied by Java, one depend at a time. False when the job was not PENDING."""
        with self.conn.transaction():
            if self.conn.execute(UPDATE_JOB_FINISHED, ("FINISHED", job)).rowcount != 1:
                return False
        for pk, kind, er_frame, er_layer, er_job in self.conn.execute(GET_WHAT_DEPENDS_ON_JOB, (job,)).fetchall():
            with self.conn.transaction():
                if self.conn.execute(SET_INACTIVE, (pk,)).rowcount != 1:
                    continue
                key = {"JOB_ON_JOB": er_job, "LAYER_ON_JOB": er_layer, "FRAME_ON_JOB": er_frame}[kind]
                sql = GET_DEPENDENT_FRAMES.format(key=DEPENDENT_FRAMES_KEY[kind])
                for (frame,) in self.conn.execute(sql, (key,)).fetchall():
                    self.conn.execute(DECREMENT_DEPEND_COUNT, (frame,))
        return True

    def recalculate_subs(self) -> None:
        """Cuebot's maintenance task: SELECT recalculate_subs() (V45)."""
        self.conn.execute("SELECT recalculate_subs()")
