CREATE OR REPLACE FUNCTION turnstile_turn_text(data jsonb) RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $function$
    -- The words of what a recorded turn adds (turnstile_turn_said), for full-text search. 'simple': no
    -- stemming or stop words, since turns hold code, logs and any language.
    SELECT jsonb_to_tsvector('simple'::regconfig, public.turnstile_turn_said(data), '["string"]')
$function$
