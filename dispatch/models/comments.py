"""Cuebot's `comments` table: notes an operator or a wrangler leaves on a job or a host.

The columns are Cuebot's V1 schema's, with its types, nullability, default and index names
(no later Flyway migration changes the table): on a Cuebot database the table is Cuebot's,
and adoption (dispatch.adoption) must find nothing of cuesched's to add to it. A comment
belongs to a job or to a host (one of pk_job, pk_host); `job.b_comment` and `host.b_comment`
are true while it has one, kept by the actions of dispatch.jobs.comments as Cuebot's
CommentDaoJdbc keeps them. `ts_created` is a TIMESTAMP without time zone, as Cuebot's.
"""

from __future__ import annotations

from django.db import models

from dispatch.models.base import CuebotLocalTimestamp, CurrentTimestamp, fk, pk_field

SUBJECT_MAX = 128  # str_subject VARCHAR(128)
MESSAGE_MAX = 4000  # str_message VARCHAR(4000)
USER_MAX = 36  # str_user VARCHAR(36)


class Comment(models.Model):
    pk_comment = pk_field("pk_comment")
    job = fk("dispatch.Job", "pk_job", null=True, related_name="comments", db_index=False)
    host = fk("dispatch.Host", "pk_host", null=True, related_name="comments", db_index=False)
    ts_created = CuebotLocalTimestamp(db_default=CurrentTimestamp())
    str_user = models.CharField(max_length=USER_MAX)
    str_subject = models.CharField(max_length=SUBJECT_MAX)
    str_message = models.CharField(max_length=MESSAGE_MAX)

    class Meta:
        db_table = "comments"
        indexes = [
            models.Index(fields=["job"], name="i_comment_pk_job"),
            models.Index(fields=["host"], name="i_comment_pk_host"),
        ]

    def __str__(self) -> str:
        return self.str_subject
