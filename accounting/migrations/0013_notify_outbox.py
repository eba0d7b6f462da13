"""The accounting outbox: what the listener applies, in a table only the trigger functions write.

PostgreSQL has no privilege on NOTIFY: any session may send any payload on `acct_release` or
`acct_limit_change`. So the trigger functions write each message as a row of
`cuesched_acct_outbox` too (`cuesched_acct_emit`, which also sends the notification, now a
doorbell), and the scheduler's listener applies the rows it consumes, never a payload from a
channel (accounting.notify, "The outbox").

Nobody but the table's owner (the migrating role, which owns the trigger functions, SECURITY
DEFINER) may write it; members of cuesched_writer (the scheduler) may read and consume it. A
statement trigger refuses everyone else whatever the GRANTs say: a `GRANT ... ON ALL TABLES`
given to an outside tool reaches this table too, and a consumer outside the scheduler could hide
a message (a licence's growing use) by deleting its row. The names are qualified
with the schema the migration runs in, so a session's own `pg_temp` table of the same name
cannot stand in for it inside a trigger.

`cuesched_announce_job_caps(pk_job)` re-sends a job's caps when a finished job is opened again
(dispatch.jobs.actions.retry_frames). It runs with its owner's rights so that a console role
outside cuesched_writer can call it, and it says nothing the table does not: it reads the row
under FOR SHARE, so no cap change can commit between its read and its own commit (a later
lowering is delivered after it).

Hand-written and kept apart from pgtrigger's trigger migrations, so that regenerating those
leaves it alone.
"""

from django.db import migrations

FORWARD = r"""
CREATE TABLE cuesched_acct_outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    str_channel text NOT NULL,
    str_payload text NOT NULL
);
REVOKE ALL ON TABLE cuesched_acct_outbox FROM PUBLIC;
GRANT SELECT, DELETE ON TABLE cuesched_acct_outbox TO cuesched_writer;

-- Whatever a GRANT says (a `GRANT ... ON ALL TABLES` to an outside tool reaches this table too):
-- rows are written by the table's owner only (the trigger functions run as their owner) and
-- consumed by members of cuesched_writer (the scheduler's listener) or the owner.
CREATE FUNCTION cuesched_acct_outbox_guard() RETURNS trigger LANGUAGE plpgsql AS $body$
BEGIN
    IF pg_catalog.pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID), 'USAGE') THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'DELETE' AND COALESCE(pg_catalog.pg_has_role(current_user, pg_catalog.to_regrole('cuesched_writer')::oid, 'MEMBER'), false) THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION USING
        MESSAGE = format('cuesched: %s may not %s the accounting outbox: only the accounting triggers write it and only the scheduler consumes it',
                         current_user, lower(TG_OP)),
        HINT = 'Nothing was written. Each accounting message is written there by the trigger functions in the writing transaction; the scheduler''s listener (a member of cuesched_writer) applies and deletes the rows.',
        ERRCODE = 'insufficient_privilege';
END
$body$;
CREATE TRIGGER cuesched_acct_outbox_guard BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON cuesched_acct_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION cuesched_acct_outbox_guard();

DO $outer$
BEGIN
    EXECUTE format($f$
CREATE FUNCTION %1$I.cuesched_acct_emit(p_channel text, p_payload text) RETURNS void
LANGUAGE plpgsql AS $body$
BEGIN
    INSERT INTO %1$I.cuesched_acct_outbox (str_channel, str_payload) VALUES (p_channel, p_payload);
    PERFORM pg_catalog.pg_notify(p_channel, p_payload);
END
$body$;
$f$, current_schema());

    EXECUTE format($f$
CREATE FUNCTION %1$I.cuesched_announce_job_caps(p_job text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = %1$I, pg_catalog, pg_temp AS $body$
DECLARE v_xid bigint; v_seq bigint;
BEGIN
    v_xid := pg_current_xact_id()::text::bigint;
    v_seq := set_config('cuesched.notify_seq', (COALESCE(NULLIF(current_setting('cuesched.notify_seq', true), ''), '0')::bigint + 1)::text, true)::bigint;
    PERFORM %1$I.cuesched_acct_emit('acct_limit_change',
        '{"vertex":"job","id":' || to_json(n.pk_job)::text
        || ',"max_cores":' || (CASE WHEN (n.int_max_cores) < 0 OR (n.int_max_cores) >= 2147483647 THEN -1 ELSE (n.int_max_cores)::bigint / 100 END)
        || ',"max_gpus":' || (CASE WHEN (n.int_max_gpus) < 0 OR (n.int_max_gpus) >= 2147483647 THEN -1 ELSE (n.int_max_gpus)::bigint END)
        || ',"xid":' || v_xid || ',"seq":' || v_seq || '}')
    FROM %1$I.job_resource n WHERE n.pk_job = p_job FOR SHARE OF n;
END
$body$;
$f$, current_schema());
END
$outer$;
"""

REVERSE = """
DROP FUNCTION IF EXISTS cuesched_announce_job_caps(text);
DROP TABLE IF EXISTS cuesched_acct_outbox;
DROP FUNCTION IF EXISTS cuesched_acct_outbox_guard();
DROP FUNCTION IF EXISTS cuesched_acct_emit(text, text);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("accounting", "0012_definer_written_by_triggers"),
        ("dispatch", "0028_definer_written_by_triggers"),
    ]

    operations = [
        migrations.RunSQL(FORWARD, reverse_sql=REVERSE),
    ]
