
        CREATE OR REPLACE FUNCTION events_append_guard() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            first_new bigint;
            last_new  bigint;
            added     bigint;
            previous  bigint;
        BEGIN
            IF NOT EXISTS (
                SELECT FROM pg_locks
                WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1
                  AND classid = (32780231638217836 >> 32)::oid AND objid = (32780231638217836 & 4294967295)::oid
            ) THEN
                RAISE EXCEPTION 'events are appended only while holding the append lock'
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = 'append through the event store (pipeline.log.EventStore), which takes '
                                 || 'pg_advisory_xact_lock(32780231638217836) first';
            END IF;
            SELECT min(position), max(position), count(*) INTO first_new, last_new, added FROM appended;
            IF added = 0 THEN
                RETURN NULL;
            END IF;
            SELECT coalesce(max(position), 0) INTO previous FROM events WHERE position < first_new;
            IF first_new <> previous + 1 OR last_new - first_new + 1 <> added
               OR EXISTS (SELECT FROM events WHERE position > last_new) THEN
                RAISE EXCEPTION 'events must take the positions right after the head (%), without gaps; '
                                'got % rows at % .. %', previous, added, first_new, last_new
                    USING ERRCODE = 'insufficient_privilege';
            END IF;
            RETURN NULL;
        END
        $$
        