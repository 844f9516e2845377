CREATE OR REPLACE FUNCTION turnstile_turn_search() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $function$
-- After each statement that adds turns to public.turn_rows (the materializer's COPY): those turns into the
-- search index (turnstile_index_turns, which reads their words from the log by position). SECURITY DEFINER:
-- the materializer writes turn_rows and, through this and turnstile_index_turns alone, turn_search; no role
-- writes it directly. The live materializer indexes a turn as it tails the log (migration 0024), before its
-- episode finishes and its row reaches turn_rows, and a turn indexed already is passed over before its words
-- are computed. This catches the rest: turns written into turn_rows by anything else, such as a
-- materializer of a release before 0024.
BEGIN
    PERFORM public.turnstile_index_turns(ARRAY(SELECT t.position FROM new_rows t));
    RETURN NULL;
END
$function$
