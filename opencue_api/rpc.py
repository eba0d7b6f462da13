"""How every call is served: one database session per call, and Cuebot's error codes.

pycue turns NOT_FOUND into EntityNotFoundException and shows INVALID_ARGUMENT's text to the
user, so the codes are the interface as much as the messages. A call that fails writes nothing:
the actions it calls are each one durable transaction.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.db import DatabaseError, close_old_connections

from dispatch.jobs.action_base import JobNotFound
from ops.setup_actions import NotFound

logger = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])
# The user a call is made for: pycue sends none, so every call is this one (docs/opencue-clients.md).
API_ACTOR = "opencue-api"


def actor(said_user: str = "") -> str:
    """Who the audit row names: this API, and the user the client says it runs for (unverified:
    Cuebot's protocol carries no credentials, so the name is recorded as said, never trusted)."""
    said = (said_user or "").strip()[:64]
    return f"{API_ACTOR} (as {said})" if said else API_ACTOR


class BadRequest(ValueError):
    """The request names a field wrongly (INVALID_ARGUMENT); the message names the field."""


def _message(exc: ValidationError) -> str:
    return "; ".join(exc.messages) if hasattr(exc, "messages") else str(exc)


def unary(fn: _F) -> _F:
    """Serve one unary call: a fresh database session, and the error mapped to Cuebot's status code."""

    @functools.wraps(fn)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        close_old_connections()
        try:
            return fn(self, request, context)
        except (NotFound, JobNotFound, ObjectDoesNotExist) as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc) or "not found")
        except ValidationError as exc:
            # pycue raises EntityAlreadyExistsException for ALREADY_EXISTS, as Cuebot answers a duplicate.
            code = grpc.StatusCode.ALREADY_EXISTS if getattr(exc, "code", None) == "exists" else None
            context.abort(code or grpc.StatusCode.INVALID_ARGUMENT, _message(exc))
        except BadRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DatabaseError as exc:
            logger.warning("%s failed in the database: %s", fn.__name__, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc).strip().splitlines()[0])
        finally:
            close_old_connections()

    return call  # type: ignore[return-value]
