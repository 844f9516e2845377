-- The login users of docker compose's services, each a member of the group role that holds its privileges
-- (migrations 0004 and 0006 grant those on the tables). Run by deploy/postgres-init.sh when the postgres
-- container initialises an empty data directory, with the passwords as psql variables; safe to run again
-- (users are made once, passwords set every time).
--
--   runner, gateway, trainer  turnstile_writer        append events (never UPDATE/DELETE), leases, trained batches
--   trainer                   turnstile_trainer       also: append policy versions (PolicyVersionPublished)
--   inference                 turnstile_inference     reads the view policy_versions, nothing else
--   materializer, relay       turnstile_materializer  read models, batch outbox, checkpoints
--   analyst                   turnstile_reader        `turnstile sql` (reads only)
--
-- The migrations run as POSTGRES_USER, the database's owner: the only user that can change a recorded event.
\set ON_ERROR_STOP on

-- The group roles, made here the way the migrations make them (if missing), so the users can join them before
-- the first migration has run.
SELECT format('CREATE ROLE %I NOLOGIN', role)
FROM (VALUES ('turnstile_writer'), ('turnstile_materializer'), ('turnstile_reader'), ('turnstile_trainer'),
             ('turnstile_inference')) AS groups(role)
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role)
\gexec

SELECT format('CREATE ROLE %I LOGIN', name)
FROM (VALUES ('runner'), ('gateway'), ('trainer'), ('materializer'), ('relay'), ('analyst'), ('inference')) AS users(name)
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = name)
\gexec

SELECT format('ALTER ROLE %I PASSWORD %L', name, password)
FROM (VALUES
    ('runner', :'runner_password'),
    ('gateway', :'gateway_password'),
    ('trainer', :'trainer_password'),
    ('materializer', :'materializer_password'),
    ('relay', :'relay_password'),
    ('analyst', :'analyst_password'),
    ('inference', :'inference_password')
) AS users(name, password)
\gexec

GRANT turnstile_writer TO runner, gateway, trainer;
GRANT turnstile_materializer TO materializer, relay;
GRANT turnstile_reader TO analyst;
GRANT turnstile_trainer TO trainer;
GRANT turnstile_inference TO inference;
