"""subscription's triggers: burst and size changes, the usage guard, the outside ledger."""

from __future__ import annotations

import pgtrigger

from accounting.triggers.limits import _SUB, _limit_triggers
from accounting.triggers.outside import counter_outside_triggers
from accounting.triggers.usage import usage_guard_triggers


def subscription_triggers() -> list[pgtrigger.Trigger]:
    return [
        *_limit_triggers("sub", "subscription", _SUB),
        *usage_guard_triggers("subscription"),
        *counter_outside_triggers("subscription"),
    ]
