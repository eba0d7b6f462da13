"""Comments on jobs and hosts, as Cuebot keeps them (its CommentDaoJdbc and CommentManager):
add one to a job or a host, edit (save) one, delete one; `job.b_comment` / `host.b_comment`
true exactly while the job or host has a comment, which is what CueGUI's comment icon reads.

One durable transaction each, with one `FarmAction` row in it. The row's target is the job or
host the comment is on (so a job's audit trail shows what was said and deleted on it), and its
detail keeps the comment's id and text: a deleted comment, or a comment's text before a save,
is then still on record. Every action first locks the job's or host's row (FOR NO KEY UPDATE,
which a booking's insert of a proc does not wait for), so two actions on one job's comments run
one after the other: two deletes of its last two comments cannot each see the other's comment
left and leave b_comment true on a job with none.

The OpenCue client API (opencue_api) calls these; who may act is the caller's check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from accounting.actions import audit_context
from dispatch.jobs import audit
from dispatch.jobs.action_base import job_id_of, retry_on_deadlock
from dispatch.models import Comment, Host, Job
from dispatch.models.comments import MESSAGE_MAX, SUBJECT_MAX, USER_MAX


@dataclass
class CommentResult:
    """What a comment action did: the comment, and the job or host it is on."""

    action: str
    comment_id: str
    kind: str  # "job" or "host"
    target: str  # the job's or host's id
    changed: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


def add_job_comment(job: Job | str, subject: str, message: str, *, user: str, actor: Any = None) -> CommentResult:
    """A comment on the job (by id or name), written by `user` (Cuebot's str_user, the name the
    client says it runs for); the job's b_comment is true from then on."""
    text = _text(subject, message)
    author = _user(user)
    job_id = job_id_of(job)
    return retry_on_deadlock(lambda: _add_once("job", job_id, text, author, actor), f"comment on job {job_id}")


def add_host_comment(host: str, subject: str, message: str, *, user: str, actor: Any = None) -> CommentResult:
    """A comment on the host (by id or name); the host's b_comment is true from then on."""
    if not isinstance(host, str) or not host:
        raise ValidationError("host: name the host (its id or name)")
    text = _text(subject, message)
    author = _user(user)
    return retry_on_deadlock(lambda: _add_once("host", host, text, author, actor), f"comment on host {host}")


def save_comment(comment: str, subject: str, message: str, *, actor: Any = None) -> CommentResult:
    """A comment's new subject and message (Cuebot's CommentInterface.Save: the author and the
    time it was made stay as they were)."""
    text = _text(subject, message)
    ref = _comment_ref(comment)
    return retry_on_deadlock(lambda: _save_once(ref, text, actor), f"save of comment {ref}")


def delete_comment(comment: str, *, actor: Any = None) -> CommentResult:
    """The comment deleted; its job's or host's b_comment false if it was the last one."""
    ref = _comment_ref(comment)
    return retry_on_deadlock(lambda: _delete_once(ref, actor), f"delete of comment {ref}")


def comments_on_job(job_id: str) -> list[Comment]:
    """The job's comments, oldest first (Cuebot's GET_JOB_COMMENTS order; the id breaks ties)."""
    return list(Comment.objects.filter(job_id=job_id).order_by("ts_created", "pk_comment"))


def comments_on_host(host_id: str) -> list[Comment]:
    """The host's comments, oldest first (Cuebot's GET_HOST_COMMENTS order)."""
    return list(Comment.objects.filter(host_id=host_id).order_by("ts_created", "pk_comment"))


# --- validation ----------------------------------------------------------------------------


def _clean(value: Any, what: str, most: int) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{what}: give text, not {type(value).__name__}")
    if len(value) > most:
        raise ValidationError(f"{what}: {len(value)} characters, more than the {most} a comment's {what} holds")
    if "\x00" in value:
        raise ValidationError(f"{what}: contains a NUL character, which PostgreSQL cannot store")
    return value


def _text(subject: Any, message: Any) -> tuple[str, str]:
    """(subject, message), checked against Cuebot's columns before anything is written."""
    subject = _clean(subject, "subject", SUBJECT_MAX)
    if not subject.strip():
        raise ValidationError("subject: a comment needs a subject")
    return subject, _clean(message, "message", MESSAGE_MAX)


def _user(user: Any) -> str:
    user = _clean(user, "user", USER_MAX).strip()
    if not user:
        raise ValidationError("user: name who writes the comment")
    return user


def _comment_ref(comment: Any) -> str:
    if not isinstance(comment, str) or not comment:
        raise ValidationError("comment: name the comment by its id")
    return comment


# --- the transactions ----------------------------------------------------------------------


def _lock_owner(kind: str, ref: str) -> tuple[str, str]:
    """Lock the job's or host's row (the order every comment action takes its locks in: owner,
    then comment); its (id, name)."""
    model = Job if kind == "job" else Host
    row = (
        model.objects.select_for_update(no_key=True)
        .filter(Q(pk=ref) | Q(str_name=ref))
        .values_list("pk", "str_name")
        .first()
    )
    if row is None:
        raise model.DoesNotExist(f"no {kind} {ref!r}")
    return row


def _owner_of(comment: Comment) -> tuple[str, str]:
    if comment.job_id:
        return "job", comment.job_id
    if comment.host_id:
        return "host", comment.host_id
    raise ValidationError(f"comment {comment.pk!r} is on no job and no host")


def _set_flag(kind: str, pk: str, value: bool) -> None:
    model = Job if kind == "job" else Host
    model.objects.filter(pk=pk).exclude(b_comment=value).update(b_comment=value)


def _record(kind: str, pk: str, name: str, action: str, changed: int, actor: Any, detail: dict[str, Any]) -> None:
    if kind == "job":
        audit.record("job", pk, action, changed, actor, detail)
    else:
        audit.record_host(action, pk, name, changed, actor, detail)


def _add_once(kind: str, ref: str, text: tuple[str, str], user: str, actor: Any) -> CommentResult:
    subject, message = text
    with transaction.atomic(durable=True), audit_context(actor, "add_comment"):
        pk, name = _lock_owner(kind, ref)
        owner = {"job_id": pk} if kind == "job" else {"host_id": pk}
        comment = Comment.objects.create(**owner, str_user=user, str_subject=subject, str_message=message)
        _set_flag(kind, pk, True)
        detail = {"comment": comment.pk, "user": user, "subject": subject, "message": message}
        _record(kind, pk, name, "add_comment", 1, actor, detail)
    return CommentResult("add_comment", comment.pk, kind, pk, 1, detail)


def _locked_comment(ref: str) -> tuple[Comment, str, str, str]:
    """The comment, locked after its owner: (comment, kind, owner id, owner name)."""
    found = Comment.objects.filter(pk=ref).first()
    if found is None:
        raise Comment.DoesNotExist(f"no comment {ref!r}")
    kind, owner = _owner_of(found)
    pk, name = _lock_owner(kind, owner)
    comment = Comment.objects.select_for_update().filter(pk=ref).first()
    if comment is None:  # deleted by another action between the read and the owner's lock
        raise Comment.DoesNotExist(f"no comment {ref!r}")
    return comment, kind, pk, name


def _save_once(ref: str, text: tuple[str, str], actor: Any) -> CommentResult:
    subject, message = text
    with transaction.atomic(durable=True), audit_context(actor, "save_comment"):
        comment, kind, pk, name = _locked_comment(ref)
        before = {"subject": comment.str_subject, "message": comment.str_message}
        changed = (
            Comment.objects.filter(pk=comment.pk)
            .exclude(str_subject=subject, str_message=message)
            .update(str_subject=subject, str_message=message)
        )
        detail = {"comment": comment.pk, "from": before, "to": {"subject": subject, "message": message}}
        _record(kind, pk, name, "save_comment", changed, actor, detail)
    return CommentResult("save_comment", comment.pk, kind, pk, changed, detail)


def _delete_once(ref: str, actor: Any) -> CommentResult:
    with transaction.atomic(durable=True), audit_context(actor, "delete_comment"):
        comment, kind, pk, name = _locked_comment(ref)
        Comment.objects.filter(pk=comment.pk).delete()
        left = Comment.objects.filter(**({"job_id": pk} if kind == "job" else {"host_id": pk})).exists()
        if not left:
            _set_flag(kind, pk, False)
        detail = {
            "comment": comment.pk,
            "user": comment.str_user,
            "subject": comment.str_subject,
            "message": comment.str_message,
        }
        _record(kind, pk, name, "delete_comment", 1, actor, detail)
    return CommentResult("delete_comment", comment.pk, kind, pk, 1, detail)
