"""host's triggers: a host moved to another allocation moves its running procs' subscription."""

from __future__ import annotations

import pgtrigger

from accounting.triggers.deltas import HOST_MOVE_KEYED
from accounting.triggers.moves import _HOST_MOVED, _keys_lock_trigger, _move_trigger, _move_wait_bound_triggers


def host_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_move_wait_bound_triggers("acct_host_move", pgtrigger.UpdateOf("pk_alloc")),
        _keys_lock_trigger(
            "acct_host_keys_lock",
            pgtrigger.UpdateOf("pk_alloc"),
            _HOST_MOVED,
            "host",
            "pk_host",
            "moving a host to another allocation",
        ),
        _move_trigger(
            "acct_host_move",
            pgtrigger.UpdateOf("pk_alloc"),
            _HOST_MOVED,
            HOST_MOVE_KEYED,
            "moving a host to another allocation",
        ),
    ]
