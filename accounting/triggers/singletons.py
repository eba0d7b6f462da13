"""The single rows (settings, epoch, generation, flip): never deleted, bumped only by triggers."""

from __future__ import annotations

import pgtrigger

from accounting.triggers.common import GENERATION_TABLE
from accounting.triggers.definer import DefinerProtect, DefinerTrigger

# --- the single rows -------------------------------------------------------------------------


def settings_triggers() -> list[pgtrigger.Trigger]:
    """Deleting the row would silently turn the switch into its default; refuse it."""
    return [DefinerProtect(name="acct_settings_keep_row", operation=pgtrigger.Delete)]


# A generation row only ever moves forward by a bump (bump_generation: int_prev_generation takes
# the old value, int_generation a new one from the sequence, str_reason and ts_bumped say why and
# when). Any other UPDATE, whoever writes it (the triggers' bumps run in the outside writer's own
# transaction, so no role can tell them apart), is refused: putting a generation back, or moving
# it anywhere but forward, would let a Store that applied an older generation book under a cap
# change it never saw. A generation that only grows can never come back to a value a Store holds.
# A sequence set back below a row's generation makes the next bump of that row fail here, loudly,
# rather than repeat a value.
GENERATION_BUMP_ONLY = "acct_show_generation_bump_only"
_REAL_BUMP = (
    "COALESCE(NEW.pk_show = OLD.pk_show AND NEW.int_generation > OLD.int_generation "
    "AND NEW.int_prev_generation = OLD.int_generation, false)"
)


def show_generation_triggers() -> list[pgtrigger.Trigger]:
    """A deleted generation row would start its show's chain again from 0, a generation put back
    would hide the change its bump stood for: refuse both."""
    return [
        DefinerProtect(name="acct_show_generation_keep_rows", operation=pgtrigger.Delete),
        DefinerTrigger(
            name=GENERATION_BUMP_ONLY,
            when=pgtrigger.Before,
            operation=pgtrigger.Update,
            level=pgtrigger.Row,
            condition=pgtrigger.Condition(f"NOT {_REAL_BUMP}"),
            func=f"""
    RAISE EXCEPTION USING
        MESSAGE = format('cuesched: the accounting generation of show %s only moves forward by a bump '
                         '(generation %s, previous %s: refused %s, previous %s)', OLD.pk_show,
                         OLD.int_generation, OLD.int_prev_generation, NEW.int_generation, NEW.int_prev_generation),
        HINT = 'Nothing was written. {GENERATION_TABLE} is written by the accounting triggers only: change '
               'the caps, keys or flags it stands for and their triggers bump it in the same transaction.',
        ERRCODE = 'check_violation', CONSTRAINT = '{GENERATION_BUMP_ONLY}';
""",
        ),
    ]


def show_flip_triggers() -> list[pgtrigger.Trigger]:
    """A deleted generation row would read as generation 0 again: refuse it."""
    return [DefinerProtect(name="acct_show_flip_keep_rows", operation=pgtrigger.Delete)]


def epoch_triggers() -> list[pgtrigger.Trigger]:
    """The epoch row is the REPEATABLE READ writers' flip and move guard; refuse deleting it."""
    return [DefinerProtect(name="acct_epoch_keep_row", operation=pgtrigger.Delete)]
