CREATE OR REPLACE FUNCTION turnstile_drop_rebuild(rebuild text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF rebuild = 'main' THEN
        RAISE EXCEPTION 'the live materializer ''main'' is not a rebuild; it cannot be replaced'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    EXECUTE format('DROP SCHEMA IF EXISTS %I CASCADE', 'rm_' || rebuild);
    DELETE FROM materializers WHERE name = rebuild;
    DELETE FROM checkpoints WHERE name = 'materializer:' || rebuild;
END
$$;
