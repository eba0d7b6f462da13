"""Comments: JobInterface and HostInterface AddComment / GetComments, and CommentInterface's
Delete and Save, as Cuebot serves them (servant/ManageJob, ManageHost, ManageComment).

A new comment's author is the user the request's comment names (pycue sends $USER), as Cuebot
records it, else this API; its audit row names the API and that user, unverified as every name
this protocol carries (opencue_api.rpc.actor). A delete or save names the API only: the comment
it sends carries its author, not who deletes or edits it. Each change is one action of
dispatch.jobs.comments: one transaction, one audit row, b_comment kept.
"""

from __future__ import annotations

from typing import Any

from opencue_proto import comment_pb2, comment_pb2_grpc

from dispatch.jobs.comments import add_host_comment, add_job_comment, delete_comment, save_comment
from dispatch.models import Comment
from opencue_api.rpc import API_ACTOR, actor, unary


def comment_message(comment: Comment) -> comment_pb2.Comment:
    """Cuebot's COMMENT_MAPPER: the timestamp in epoch seconds."""
    return comment_pb2.Comment(
        id=comment.pk,
        timestamp=int(comment.ts_created.timestamp()),
        user=comment.str_user,
        subject=comment.str_subject,
        message=comment.str_message,
    )


def comment_seq(comments: list[Comment]) -> comment_pb2.CommentSeq:
    return comment_pb2.CommentSeq(comments=[comment_message(c) for c in comments])


def add_comment(kind: str, owner: str, new: comment_pb2.Comment) -> None:
    """The request's comment on the job or host `owner` (an id), by its user else this API."""
    add = add_job_comment if kind == "job" else add_host_comment
    add(owner, new.subject, new.message, user=new.user.strip() or API_ACTOR, actor=actor(new.user))


class CommentServicer(comment_pb2_grpc.CommentInterfaceServicer):
    @unary
    def Delete(self, request: Any, context: Any) -> comment_pb2.CommentDeleteResponse:
        # The request's comment.user is the comment's author (as GetComments answered it), not
        # who deletes or edits it: the audit row names this API only, as for a job's pause.
        delete_comment(request.comment.id, actor=API_ACTOR)
        return comment_pb2.CommentDeleteResponse()

    @unary
    def Save(self, request: Any, context: Any) -> comment_pb2.CommentSaveResponse:
        c = request.comment
        save_comment(c.id, c.subject, c.message, actor=API_ACTOR)
        return comment_pb2.CommentSaveResponse()
