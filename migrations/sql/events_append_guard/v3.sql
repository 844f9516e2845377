
        CREATE OR REPLACE FUNCTION events_append_guard() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            first_new        bigint;
            last_new         bigint;
            added            bigint;
            previous         bigint;
            bad_stream       text;
            bad_last         integer;
            bad_first        integer;
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
            IF EXISTS (SELECT FROM appended WHERE stream LIKE 'policy-%' OR type = 'PolicyVersionPublished')
               AND NOT turnstile_may_publish_versions(current_user) THEN
                RAISE EXCEPTION 'only the trainer''s role (turnstile_trainer) appends policy versions; % may not',
                                current_user
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = 'publish versions as a login that is a member of turnstile_trainer';
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
            
            SELECT stream, last_before, first_new_version INTO bad_stream, bad_last, bad_first
            FROM (
                SELECT n.*, coalesce((SELECT max(e.version) FROM events e
                                      WHERE e.stream = n.stream AND e.version < n.first_new_version), 0)
                            AS last_before
                FROM (SELECT a.stream, min(a.version) AS first_new_version,
                             max(a.version) AS last_new_version, count(*) AS new_versions
                      FROM appended a GROUP BY a.stream) AS n
            ) AS checked
            WHERE first_new_version <> last_before + 1
               OR last_new_version - first_new_version + 1 <> new_versions
            LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION 'events of a stream must take the versions right after its last one, without '
                                'gaps: % is at version %, got version %', bad_stream, bad_last, bad_first
                    USING ERRCODE = 'check_violation';
            END IF;

            RETURN NULL;
        END
        $$
    