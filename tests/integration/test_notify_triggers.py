"""acct_release and acct_limit_change, as a real listener receives them after COMMIT."""

from __future__ import annotations

import io
import json
import re

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction

from accounting.models import AccountingSettings
from accounting.notify import (
    LIMIT_CHANNEL,
    RELEASE_CHANNEL,
    NotInTransactionError,
    mark_store_accounted,
)
from dispatch.models import FolderResource, JobResource, Proc, Show, Subscription
from tests.integration import farm_fixtures as ff
from tests.integration.notify_listener import Listener, as_json, database_conninfo, listening

# Transactional (NOTIFY is delivered on COMMIT only); each test flushes the database after it, which
# costs about a second, so related scenarios share a test.
pytestmark = pytest.mark.django_db(transaction=True)


def current_xid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_xact_id()::text::bigint")
        return cursor.fetchone()[0]


def release(farm: ff.Farm, cores: int, gpus: int, xid: int, seq: int = 1, layer: str | None = None) -> str:
    return (
        f'{{"show":"{farm.show.pk}","alloc":"{farm.alloc.pk}","folder":"{farm.folder.pk}",'
        f'"job":"{farm.job.pk}","layer":"{layer or farm.layer.pk}","dept":"{farm.dept.pk}",'
        f'"cores":{cores},"gpus":{gpus},"xid":{xid},"seq":{seq}}}'
    )


@pytest.fixture
def listener() -> Listener:
    with listening() as listener:
        yield listener


# --- acct_release ----------------------------------------------------------------------------


def test_commit_delivers_one_exact_release_and_rollback_none(listener: Listener) -> None:
    farm = ff.tiny_farm(managed=True)
    procs = [ff.create_proc(farm.host, farm.frames[0], cores=250, gpus=2)]
    procs.append(ff.create_proc(farm.host, farm.frames[1], cores=400, gpus=2))
    procs.append(ff.create_proc(farm.host, farm.frames[2], cores=300))
    # Procs written outside the scheduler count too, each rounded up (250 centicores: +3).
    assert [json.loads(p)["cores"] for p in listener.sent_before_sentinel(RELEASE_CHANNEL)] == [3, 4, 3]

    with transaction.atomic():
        Proc.objects.filter(pk=procs[0].pk).delete()
        xid = current_xid()
    # A release is rounded toward +infinity as well: 250 centicores are -2, not Python's floor -3.
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == [release(farm, -2, -2, xid)]

    with transaction.atomic():  # the reference's own fixture: 400 centicores, 2 GPUs
        Proc.objects.filter(pk=procs[1].pk).delete()
        xid = current_xid()
    [payload] = listener.sent_before_sentinel(RELEASE_CHANNEL)
    assert payload == release(farm, -4, -2, xid)
    assert list(as_json([payload])[0]) == [
        *("show", "alloc", "folder", "job", "layer", "dept", "cores", "gpus", "xid", "seq")
    ]

    with pytest.raises(RuntimeError, match="abort"), transaction.atomic():
        Proc.objects.filter(pk=procs[2].pk).delete()
        raise RuntimeError("abort")
    assert Proc.objects.filter(pk=procs[2].pk).exists()
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []


def test_bulk_delete_aggregates_per_key_and_equal_deletes_are_not_collapsed(listener: Listener) -> None:
    farm = ff.tiny_farm(managed=True)
    other_layer = ff.create_layer(farm.job)
    other_frames = ff.create_frames(other_layer, 2)
    for frame in farm.frames[:3]:
        ff.create_proc(farm.host, frame, cores=250, gpus=1)
    ff.create_proc(farm.host, other_frames[0], cores=100)
    ff.create_proc(farm.host, other_frames[1], cores=100, local=True)
    listener.sent_before_sentinel(RELEASE_CHANNEL)  # the inserts' own deltas
    with transaction.atomic():
        assert Proc.objects.filter(job=farm.job).delete()[0] == 5
        xid = current_xid()
    expected = {
        farm.layer.pk: release(farm, -7, -3, xid),  # 750 centicores summed, then truncated once
        other_layer.pk: release(farm, -1, 0, xid, layer=other_layer.pk),  # the local proc is left out
    }
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == [expected[k] for k in sorted(expected)]

    # PostgreSQL drops a NOTIFY that repeats a payload of the same transaction; seq prevents it.
    first, second = (ff.create_proc(farm.host, f, cores=100) for f in farm.frames[3:5])
    listener.sent_before_sentinel(RELEASE_CHANNEL)
    with transaction.atomic():
        first.delete()
        second.delete()
        xid = current_xid()
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == [
        release(farm, -1, 0, xid, seq=1),
        release(farm, -1, 0, xid, seq=2),
    ]


def test_no_release_for_local_procs_or_unmanaged_shows(listener: Listener) -> None:
    managed = ff.tiny_farm(managed=True)
    ff.create_proc(managed.host, managed.frames[0], cores=100, local=True).delete()
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []

    farm = ff.tiny_farm(managed=False)
    proc = ff.create_proc(farm.host, farm.frames[0], cores=300, gpus=1)
    assert farm.job_resource().int_cores == 300
    proc.delete()
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []
    # ... but its accounting columns moved, in the deleting transaction.
    subscription = Subscription.objects.get(pk=farm.subscription.pk)
    assert (subscription.int_cores, subscription.int_gpus) == (0, 0)
    assert (farm.job_resource().int_cores, farm.folder_resource().int_cores, farm.point().int_cores) == (0, 0, 0)


def test_kill_switch_off_silences_releases_for_every_connection_at_once(listener: Listener) -> None:
    # Off silences releases only: a lost release reads high. Cap changes still go out (a missed
    # decrease is the drift that over-books), and so do positive deltas (see test_integrity_review).
    farm = ff.tiny_farm(managed=True)
    procs = [ff.create_proc(farm.host, frame, cores=100) for frame in farm.frames[:3]]
    listener.sent_before_sentinel(LIMIT_CHANNEL)  # the set-up's insert messages
    listener.sent_before_sentinel(RELEASE_CHANNEL)
    with psycopg.connect(database_conninfo(), autocommit=True) as writer:
        writer.execute("SELECT 1")  # a session that exists before the switch flips

        AccountingSettings.set_notifications_enabled(False)
        proc_ids = [p.pk for p in procs]
        Proc.objects.filter(pk=proc_ids[0]).delete()
        writer.execute("DELETE FROM proc WHERE pk_proc = %s", (proc_ids[1],))
        JobResource.objects.filter(job=farm.job).update(int_max_cores=500)
        writer.execute("UPDATE subscription SET int_burst = 900 WHERE pk_subscription = %s", (farm.subscription.pk,))
        assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []
        assert [m["vertex"] for m in as_json(listener.sent_before_sentinel(LIMIT_CHANNEL))] == ["job", "sub"]

        AccountingSettings.set_notifications_enabled(True)
        writer.execute("DELETE FROM proc WHERE pk_proc = %s", (proc_ids[2],))
        writer.execute("UPDATE job_resource SET int_max_cores = 700 WHERE pk_job = %s", (farm.job.pk,))
        assert len(listener.sent_before_sentinel(RELEASE_CHANNEL)) == 1
        assert as_json(listener.sent_before_sentinel(LIMIT_CHANNEL))[0]["max_cores"] == 7


def test_suppression_marker_covers_only_its_own_transaction(listener: Listener) -> None:
    farm = ff.tiny_farm(managed=True)
    mine, theirs, later, via_psycopg = (ff.create_proc(farm.host, f, cores=100) for f in farm.frames[:4])
    listener.sent_before_sentinel(RELEASE_CHANNEL)  # the inserts' own deltas
    with psycopg.connect(database_conninfo()) as other, transaction.atomic():
        # A concurrent transaction deletes while the marker is set here: it still releases.
        mark_store_accounted(connection)
        other.execute("DELETE FROM proc WHERE pk_proc = %s", (theirs.pk,))
        other.commit()
        mine.delete()
    assert [m["seq"] for m in as_json(listener.sent_before_sentinel(RELEASE_CHANNEL))] == [1]

    with transaction.atomic():
        later.delete()  # the next transaction on this connection releases again
        xid = current_xid()
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == [release(farm, -1, 0, xid)]

    with psycopg.connect(database_conninfo()) as conn:  # a plain psycopg transaction works too
        mark_store_accounted(conn)
        conn.execute("DELETE FROM proc WHERE pk_proc = %s", (via_psycopg.pk,))
        conn.commit()
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []

    # Outside a transaction the marker would be gone before the DELETE: refused.
    with pytest.raises(NotInTransactionError):
        mark_store_accounted(connection)
    with psycopg.connect(database_conninfo(), autocommit=True) as conn, pytest.raises(NotInTransactionError):
        mark_store_accounted(conn)


# --- acct_limit_change -----------------------------------------------------------------------


_GENERATION = re.compile(r'(,"show":"[^"]*")?,"gen_from":\d+,"gen":\d+}$')


def plain(payloads: list[str]) -> list[str]:
    """The payloads without the generation a lowering's last message carries (see test_generation)."""
    return [_GENERATION.sub("}", p) for p in payloads]


def sub_msg(sub: Subscription, burst: int, xid: int, seq: int = 1) -> str:
    return f'{{"vertex":"sub","show":"{sub.show_id}","alloc":"{sub.alloc_id}","burst":{burst},"xid":{xid},"seq":{seq}}}'


def cap_msg(vertex: str, ident: str, xid: int, *, cores: int | None = None, gpus: int | None = None) -> str:
    fields = "" if cores is None else f',"max_cores":{cores}'
    fields += "" if gpus is None else f',"max_gpus":{gpus}'
    return f'{{"vertex":"{vertex}","id":"{ident}"{fields},"xid":{xid},"seq":1}}'


@pytest.fixture
def managed_farm(listener: Listener) -> ff.Farm:
    farm = ff.tiny_farm(managed=True)
    listener.sent_before_sentinel(LIMIT_CHANNEL)  # drop the insert messages of the set-up
    return farm


def update_in_transaction(queryset: object, **values: int) -> int:
    with transaction.atomic():
        queryset.update(**values)  # type: ignore[attr-defined]
        return current_xid()


def test_subscription_burst_single_and_bulk_updates(listener: Listener, managed_farm: ff.Farm) -> None:
    farm = managed_farm
    xid = update_in_transaction(Subscription.objects.filter(pk=farm.subscription.pk), int_burst=1599)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [sub_msg(farm.subscription, 15, xid)]

    second = ff.create_subscription(farm.show, ff.create_alloc(farm.facility), int_burst=500)
    plain(listener.sent_before_sentinel(LIMIT_CHANNEL))
    xid = update_in_transaction(Subscription.objects.filter(show=farm.show), int_burst=500)
    # The second subscription already had 500: only the first one changed.
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [sub_msg(farm.subscription, 5, xid)]
    xid = update_in_transaction(Subscription.objects.filter(show=farm.show), int_burst=-250)
    subs = sorted([farm.subscription, second], key=lambda s: (s.show_id, s.alloc_id))
    # No sentinel for a burst: -250 truncates to -2 (reject all), as the reference's reseed does.
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [sub_msg(s, -2, xid) for s in subs]


def test_folder_caps_single_and_bulk_updates(listener: Listener, managed_farm: ff.Farm) -> None:
    folder = FolderResource.objects.filter(folder=managed_farm.folder)
    fid = managed_farm.folder.pk
    # Both caps of the row in every message: a Store that does not hold the folder can only
    # create it from both (a missing folder fails closed).
    xid = update_in_transaction(folder, int_max_cores=800)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [cap_msg("folder", fid, xid, cores=8, gpus=-1)]
    xid = update_in_transaction(folder, int_max_cores=-100)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [cap_msg("folder", fid, xid, cores=-1, gpus=-1)]
    xid = update_in_transaction(folder, int_max_gpus=3)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [cap_msg("folder", fid, xid, cores=-1, gpus=3)]
    xid = update_in_transaction(folder, int_max_cores=1250, int_max_gpus=-1)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [cap_msg("folder", fid, xid, cores=12, gpus=-1)]

    folders = [managed_farm.folder, *(ff.create_folder(managed_farm.show) for _ in range(2))]
    plain(listener.sent_before_sentinel(LIMIT_CHANNEL))
    xid = update_in_transaction(FolderResource.objects.filter(folder__show=managed_farm.show), int_max_gpus=4)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [
        cap_msg("folder", f, xid, cores=12 if f == fid else -1, gpus=4) for f in sorted(f.pk for f in folders)
    ]


def test_job_caps_single_and_bulk_updates(listener: Listener, managed_farm: ff.Farm) -> None:
    farm = managed_farm
    job = JobResource.objects.filter(job=farm.job)
    jid = farm.job.pk
    xid = update_in_transaction(job, int_max_cores=1600)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [cap_msg("job", jid, xid, cores=16, gpus=100)]
    xid = update_in_transaction(job, int_max_cores=-100)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [cap_msg("job", jid, xid, cores=-1, gpus=100)]
    xid = update_in_transaction(job, int_max_gpus=4)
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [cap_msg("job", jid, xid, cores=-1, gpus=4)]
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []

    # "Set the max of every job in the folder": one statement, one message per changed row.
    jobs = [farm.job, *(ff.create_job(farm.show, farm.folder, farm.dept, farm.facility) for _ in range(3))]
    JobResource.objects.filter(job=jobs[3]).update(int_max_cores=2000)
    plain(listener.sent_before_sentinel(LIMIT_CHANNEL))
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE job_resource SET int_max_cores = 2000 WHERE pk_job = ANY(%s)", ([j.pk for j in jobs],))
        xid = current_xid()
    changed = sorted(j.pk for j in jobs[:3])  # jobs[3] already had 2000
    assert plain(listener.sent_before_sentinel(LIMIT_CHANNEL)) == [
        cap_msg("job", j, xid, cores=20, gpus=4 if j == jid else 100) for j in changed
    ]

    # Set back and forth in one transaction: every step arrives (seq keeps the payloads distinct).
    with transaction.atomic():
        for value in (200, 100, 200):
            job.update(int_max_cores=value)
    assert [m["max_cores"] for m in as_json(plain(listener.sent_before_sentinel(LIMIT_CHANNEL)))] == [2, 1, 2]


def test_cap_changes_of_every_show_are_sent_and_non_cap_updates_are_not(listener: Listener) -> None:
    # Unmanaged shows' cap changes are sent too: a cap write that read "unmanaged" just before
    # a flip to managed committed would otherwise be missed by the flip's seed.
    farm = ff.tiny_farm(managed=False)
    listener.sent_before_sentinel(LIMIT_CHANNEL)
    Subscription.objects.filter(pk=farm.subscription.pk).update(int_burst=1)
    JobResource.objects.filter(job=farm.job).update(int_max_cores=100)
    FolderResource.objects.filter(folder=farm.folder).update(int_max_gpus=1)
    assert [m["vertex"] for m in as_json(listener.sent_before_sentinel(LIMIT_CHANNEL))] == ["sub", "job", "folder"]
    Show.objects.filter(pk=farm.show.pk).update(b_scheduler_managed=True)  # a flip alone sends nothing
    assert listener.sent_before_sentinel(LIMIT_CHANNEL) == []
    assert listener.sent_before_sentinel(RELEASE_CHANNEL) == []

    managed = ff.tiny_farm(managed=True)
    listener.sent_before_sentinel(LIMIT_CHANNEL)
    sub = Subscription.objects.filter(pk=managed.subscription.pk)
    sub.update(int_burst=managed.subscription.int_burst)
    sub.update(int_cores=500, int_size=100)
    JobResource.objects.filter(job=managed.job).update(int_max_cores=10000, int_max_gpus=100, int_priority=9)
    FolderResource.objects.filter(folder=managed.folder).update(int_max_cores=-1, int_cores=300)
    assert listener.sent_before_sentinel(LIMIT_CHANNEL) == []


def test_inserts_send_their_caps_for_every_show(listener: Listener) -> None:
    ff.tiny_farm(managed=False)
    assert {m["vertex"] for m in as_json(listener.sent_before_sentinel(LIMIT_CHANNEL))} == {"sub", "folder", "job"}

    farm = ff.tiny_farm(managed=True)
    listener.sent_before_sentinel(LIMIT_CHANNEL)
    with transaction.atomic():
        sub = ff.create_subscription(farm.show, ff.create_alloc(farm.facility), int_burst=2550)
        xid = current_xid()
    assert listener.sent_before_sentinel(LIMIT_CHANNEL) == [sub_msg(sub, 25, xid)]

    with transaction.atomic():
        folder = ff.create_folder(farm.show)  # its folder_resource row comes from the fan-out trigger
        xid = current_xid()
    assert listener.sent_before_sentinel(LIMIT_CHANNEL) == [cap_msg("folder", folder.pk, xid, cores=-1, gpus=-1)]

    with transaction.atomic():
        job = ff.create_job(farm.show, folder, farm.dept, farm.facility)
        xid = current_xid()
    # job_resource defaults: 10000 centicores, 100 GPUs.
    assert listener.sent_before_sentinel(LIMIT_CHANNEL) == [cap_msg("job", job.pk, xid, cores=100, gpus=100)]


def test_bench_triggers_measures_every_variant_and_leaves_nothing_behind() -> None:
    out = io.StringIO()
    call_command("bench_triggers", procs=40, runs=1, jobs=2, layers_per_job=2, stdout=out)
    rows = {line[:58].strip(): re.findall(r"(\d+) msgs", line) for line in out.getvalue().splitlines()[2:]}
    # releases delivered: (one statement, one by one); the statement-level trigger sends one per key.
    assert rows == {
        "managed, notifications on (statement-level, installed)": ["4", "40"],
        "managed, kill switch off": ["0", "0"],
        "managed, Store-accounted (the scheduler's own)": ["0", "0"],
        "unmanaged (database-enforced accounting)": ["0", "0"],
        "no triggers at all": ["0", "0"],
    }
    assert not Show.objects.filter(str_name__startswith="bt-").exists()
    assert not Proc.objects.exists()
    assert AccountingSettings.notifications_enabled() is True
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'pgtrigger_acct_release_row%'")
        assert cursor.fetchone()[0] == 0
        cursor.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'proc'::regclass AND tgenabled <> 'O'")
        assert cursor.fetchone()[0] == 0
