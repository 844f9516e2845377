
CREATE OR REPLACE FUNCTION append_events(
    streams text[], versions int4[], event_ids uuid[], types text[], data text[], tokens bytea[],
    metadata text[], content_hashes bytea[]
) RETURNS int8 LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    head       int8;
    bad_stream text;
    bad_last   integer;
    bad_first  integer;
BEGIN
    -- session_user: the caller's login (current_user is this function's owner, turnstile_appender).
    IF ('PolicyVersionPublished' = ANY(types) OR EXISTS (SELECT FROM unnest(streams) AS s WHERE s LIKE 'policy-%'))
       AND NOT turnstile_may_publish_versions(session_user) THEN
        RAISE EXCEPTION 'only the trainer''s role (turnstile_trainer) appends policy versions; % may not',
                        session_user
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'publish versions as a login that is a member of turnstile_trainer';
    END IF;
    PERFORM pg_advisory_xact_lock(32780231638217836);
    SELECT coalesce(max(position), 0) INTO head FROM events;
    SELECT stream, last_before, first_new_version INTO bad_stream, bad_last, bad_first
    FROM (
        SELECT n.*,
               coalesce((SELECT max(e.version) FROM events e WHERE e.stream = n.stream), 0) AS last_before
        FROM (SELECT a.stream, min(a.version) AS first_new_version, max(a.version) AS last_new_version,
                     count(*) AS new_versions
              FROM unnest(streams, versions) AS a(stream, version) GROUP BY a.stream) AS n
    ) AS checked
    WHERE first_new_version IS DISTINCT FROM last_before + 1
       OR last_new_version - first_new_version + 1 <> new_versions
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'events of a stream must take the versions right after its last one, without '
                        'gaps: % is at version %, got version %', bad_stream, bad_last, bad_first
            USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO events (position, stream, version, event_id, type, data, tokens, metadata, content_hash)
    SELECT head + new.n, new.stream, new.version, new.event_id, new.type, new.data::jsonb, new.tokens,
           new.metadata::jsonb, new.content_hash
    FROM unnest(streams, versions, event_ids, types, data, tokens, metadata, content_hashes)
         WITH ORDINALITY AS new(stream, version, event_id, type, data, tokens, metadata, content_hash, n);
    RETURN head;
END
$$
