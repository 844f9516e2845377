CREATE OR REPLACE FUNCTION turnstile_turn_search() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $function$
-- After each statement that adds turns to public.turn_rows (the materializer's COPY): the words of each
-- turn's TurnCompleted event, read from the log by position, into the search index. SECURITY DEFINER: the
-- materializer writes turn_rows and, through this and turnstile_index_turns alone, turn_search; no role
-- writes it directly. The live materializer indexes a turn as it tails the log (turnstile_index_turns,
-- migration 0024), before its episode finishes and its row reaches turn_rows: a turn indexed already is
-- passed over before its words are computed (the event it reads never changes). This catches the rest:
-- turns written into turn_rows by anything else, such as a materializer of a release before 0024.
BEGIN
    BEGIN
        INSERT INTO public.turn_search (position, episode_id, words)
        SELECT e.position, substr(e.stream, length('episode-') + 1), public.turnstile_turn_text(e.data)
        FROM new_rows t JOIN public.events e ON e.position = t.position
        WHERE NOT EXISTS (SELECT FROM public.turn_search s WHERE s.position = t.position)
        ON CONFLICT (position) DO NOTHING;
    EXCEPTION WHEN program_limit_exceeded THEN
        -- a turn with more different words than a tsvector holds: that one by its start
        INSERT INTO public.turn_search (position, episode_id, words)
        SELECT e.position, substr(e.stream, length('episode-') + 1), public.turnstile_turn_words(e.data)
        FROM new_rows t JOIN public.events e ON e.position = t.position
        WHERE NOT EXISTS (SELECT FROM public.turn_search s WHERE s.position = t.position)
        ON CONFLICT (position) DO NOTHING;
    END;
    RETURN NULL;
END
$function$
