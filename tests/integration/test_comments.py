"""Comments on jobs and hosts (issue 30), as Cuebot keeps them: Cuebot's `comments` table,
job.b_comment / host.b_comment true exactly while there is one, and each add, save and delete
one audited action. Bad input is refused with the field named, and writes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import connection

from dispatch.jobs.action_base import JobNotFound
from dispatch.jobs.comments import (
    add_host_comment,
    add_job_comment,
    comments_on_host,
    comments_on_job,
    delete_comment,
    save_comment,
)
from dispatch.models import Comment, FarmAction, Host, Job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def job() -> Job:
    from dispatch.jobs.submit import submit_job
    from tests.integration.submit_support import simple_spec, submit_farm

    submit_farm(hosts=1)
    return Job.objects.get(pk=submit_job(simple_spec("demo-sh010-note_v1", frames=2), user="alice").job_id)


def rows() -> tuple[int, int, list[bool], list[bool]]:
    return (
        Comment.objects.count(),
        FarmAction.objects.count(),
        list(Job.objects.order_by("pk").values_list("b_comment", flat=True)),
        list(Host.objects.order_by("pk").values_list("b_comment", flat=True)),
    )


def test_a_job_comment_is_cuebots_row_sets_b_comment_and_is_audited(job: Job) -> None:
    before = datetime.now(UTC) - timedelta(seconds=5)
    done = add_job_comment(job.str_name, "retake", "the hair sim pops at 1040", user="bob", actor="wrangler")
    (c,) = comments_on_job(job.pk)
    assert (c.pk, c.job_id, c.host_id, c.str_user, c.str_subject, c.str_message) == (
        done.comment_id,
        job.pk,
        None,
        "bob",
        "retake",
        "the hair sim pops at 1040",
    )
    # Cuebot's TIMESTAMP without time zone, written in UTC (Django's session zone), read back aware.
    assert before <= c.ts_created <= datetime.now(UTC) + timedelta(seconds=5)
    with connection.cursor() as cur:
        cur.execute("SELECT ts_created AT TIME ZONE 'UTC' FROM comments")
        assert abs(cur.fetchone()[0] - c.ts_created) < timedelta(seconds=1)
    job.refresh_from_db()
    assert job.b_comment is True
    (row,) = FarmAction.objects.filter(str_action="add_comment")
    assert (row.str_target_kind, row.str_target, row.str_target_name, row.int_changed, row.str_username) == (
        "job",
        job.pk,
        job.str_name,
        1,
        "wrangler",
    )
    assert row.detail == {"comment": c.pk, "user": "bob", "subject": "retake", "message": "the hair sim pops at 1040"}


def test_b_comment_stays_true_until_the_last_comment_is_deleted(job: Job) -> None:
    first = add_job_comment(job.pk, "one", "", user="bob").comment_id
    second = add_job_comment(job.pk, "two", "x", user="bob").comment_id
    assert [c.str_subject for c in comments_on_job(job.pk)] == ["one", "two"]  # oldest first
    delete_comment(first, actor="wrangler")
    job.refresh_from_db()
    assert job.b_comment is True and [c.pk for c in comments_on_job(job.pk)] == [second]
    done = delete_comment(second, actor="wrangler")
    job.refresh_from_db()
    assert job.b_comment is False and comments_on_job(job.pk) == []
    # The audit row keeps what was deleted.
    assert done.detail == {"comment": second, "user": "bob", "subject": "two", "message": "x"}
    deletes = FarmAction.objects.filter(str_action="delete_comment", str_target=job.pk)
    assert sorted(d.detail["subject"] for d in deletes) == ["one", "two"]
    # Deleting it again: not found, nothing written.
    before = rows()
    with pytest.raises(ObjectDoesNotExist):
        delete_comment(second, actor="wrangler")
    assert rows() == before


def test_a_save_changes_subject_and_message_and_keeps_the_old_text_on_record(job: Job) -> None:
    pk = add_job_comment(job.pk, "retake", "pops", user="bob").comment_id
    done = save_comment(pk, "retake v2", "pops at 1040", actor="wrangler")
    c = Comment.objects.get(pk=pk)
    assert (c.str_subject, c.str_message, c.str_user) == ("retake v2", "pops at 1040", "bob")
    assert done.changed == 1
    assert done.detail == {
        "comment": pk,
        "from": {"subject": "retake", "message": "pops"},
        "to": {"subject": "retake v2", "message": "pops at 1040"},
    }
    assert save_comment(pk, "retake v2", "pops at 1040", actor="wrangler").changed == 0
    assert list(
        FarmAction.objects.filter(str_action="save_comment").order_by("id").values_list("str_target", "int_changed")
    ) == [(job.pk, 1), (job.pk, 0)]
    job.refresh_from_db()
    assert job.b_comment is True


def test_host_comments_keep_host_b_comment(job: Job) -> None:
    host = Host.objects.get()
    pk = add_host_comment(host.str_name, "fan", "loud fan, check Monday", user="it", actor="ops").comment_id
    host.refresh_from_db()
    assert host.b_comment is True
    (c,) = comments_on_host(host.pk)
    assert (c.pk, c.host_id, c.job_id) == (pk, host.pk, None)
    (row,) = FarmAction.objects.filter(str_action="add_comment")
    assert (row.str_target_kind, row.str_target, row.str_target_name) == ("host", host.pk, host.str_name)
    delete_comment(pk, actor="ops")
    host.refresh_from_db()
    assert host.b_comment is False
    job.refresh_from_db()
    assert job.b_comment is False  # a host's comment is not its jobs'


@pytest.mark.parametrize(
    ("subject", "message", "user", "words"),
    [
        ("", "m", "bob", "subject: a comment needs a subject"),
        ("   ", "m", "bob", "subject: a comment needs a subject"),
        ("s" * 129, "m", "bob", "subject: 129 characters, more than the 128"),
        ("s", "m" * 4001, "bob", "message: 4001 characters, more than the 4000"),
        ("s", "m", "u" * 37, "user: 37 characters, more than the 36"),
        ("s", "m", "", "user: name who writes the comment"),
        ("s", "nul\x00", "bob", "message: contains a NUL character"),
        (None, "m", "bob", "subject: give text"),
    ],
)
def test_bad_input_is_refused_with_the_field_named_and_writes_nothing(
    job: Job, subject: object, message: object, user: object, words: str
) -> None:
    before = rows()
    with pytest.raises(ValidationError, match=words):
        add_job_comment(job.pk, subject, message, user=user)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=words):
        add_host_comment(Host.objects.get().pk, subject, message, user=user)  # type: ignore[arg-type]
    assert rows() == before


def test_the_longest_subject_and_message_cuebot_holds_are_kept_whole(job: Job) -> None:
    pk = add_job_comment(job.pk, "s" * 128, "m" * 4000, user="u" * 36).comment_id
    c = Comment.objects.get(pk=pk)
    assert (len(c.str_subject), len(c.str_message), len(c.str_user)) == (128, 4000, 36)
    before = rows()
    with pytest.raises(ValidationError, match="subject"):
        save_comment(pk, "", "m", actor="ops")
    with pytest.raises(ValidationError, match="message"):
        save_comment(pk, "s", "m" * 4001, actor="ops")
    assert rows() == before


def test_an_unknown_job_host_or_comment_is_not_found_and_writes_nothing(job: Job) -> None:
    before = rows()
    with pytest.raises(JobNotFound):
        add_job_comment("no-such-job", "s", "m", user="bob")
    with pytest.raises(Host.DoesNotExist):
        add_host_comment("no-such-host", "s", "m", user="bob")
    with pytest.raises(Comment.DoesNotExist):
        save_comment("no-such-comment", "s", "m")
    with pytest.raises(Comment.DoesNotExist):
        delete_comment("no-such-comment")
    assert rows() == before


def test_purging_a_seeded_farm_deletes_the_comments_on_its_jobs_and_hosts() -> None:
    from dispatch.lab.seeding import FarmSpec, purge_farm, seed_farm

    seed_farm(FarmSpec(prefix="note", hosts=2, jobs=1, layers=1, frames_per_layer=1))
    add_job_comment(Job.objects.get().pk, "s", "m", user="bob")
    add_host_comment(Host.objects.order_by("pk").first().pk, "s", "m", user="bob")
    deleted = purge_farm("note")
    assert deleted["comments"] == 2 and deleted["job"] == 1
    assert Comment.objects.count() == 0


def test_two_deletes_of_a_jobs_last_two_comments_run_one_after_the_other(job: Job) -> None:
    """Each delete locks the job's row before it counts what is left: two deletes at once of the
    job's last two comments cannot each see the other's comment and leave b_comment true."""
    import threading

    from django.db import connections

    from tests.integration.dispatch_support import autocommit, scalar, wait_for

    pks = [add_job_comment(job.pk, subject, "m", user="bob").comment_id for subject in ("one", "two")]
    errors: list[BaseException] = []

    def delete(pk: str) -> None:
        try:
            delete_comment(pk, actor="wrangler")
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        finally:
            connections.close_all()

    waiting = """SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'Lock'"""
    with autocommit() as conn, autocommit() as watch:
        conn.execute("BEGIN")
        conn.execute("SELECT 1 FROM job WHERE pk_job = %s FOR UPDATE", [job.pk])
        threads = [threading.Thread(target=delete, args=(pk,)) for pk in pks]
        for t in threads:
            t.start()
        try:
            # Read from another session: pg_stat_activity is one snapshot per transaction.
            wait_for(lambda: scalar(watch, waiting) == 2, what="both deletes waiting for the job's row")
        finally:
            conn.execute("COMMIT")
            for t in threads:
                t.join(30)
    assert errors == []
    job.refresh_from_db()
    assert (job.b_comment, Comment.objects.count()) == (False, 0)
