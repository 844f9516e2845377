CREATE OR REPLACE FUNCTION turnstile_may_publish_versions(who name) RETURNS boolean
LANGUAGE sql STABLE SET search_path = public, pg_temp AS $$
    -- A member of turnstile_trainer, or of the role that owns events (the migrating owner; superusers are
    -- members of every role).
    SELECT pg_has_role(who, 'turnstile_trainer', 'MEMBER')
        OR pg_has_role(who, (SELECT relowner FROM pg_class WHERE oid = 'public.events'::regclass), 'MEMBER')
$$
