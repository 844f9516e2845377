CREATE OR REPLACE FUNCTION turnstile_turn_words(data jsonb) RETURNS tsvector
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $function$
-- turnstile_turn_text(data); or, for a turn that says more different words than a tsvector holds (1 MB of
-- them: a dump of hashes, say), the words of its first 250,000 characters (at most 1 MB): such a turn is
-- found by its start instead of stopping the materializer's step. Called only after turnstile_turn_text
-- failed on a statement's turns: the exception block costs a subtransaction a call.
BEGIN
    RETURN public.turnstile_turn_text(data);
EXCEPTION WHEN program_limit_exceeded THEN
    RETURN to_tsvector('simple'::regconfig, left(array_to_string(ARRAY(
        SELECT said #>> '{}'
        FROM jsonb_path_query(public.turnstile_turn_said(data), 'strict $.** ? (@.type() == "string")') AS said
    ), ' '), 250000));
END
$function$
