
        CREATE OR REPLACE FUNCTION events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('turnstile_events', '');
            RETURN NULL;
        END
        $$
        