CREATE OR REPLACE FUNCTION turnstile_turn_search() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $function$
-- After each statement that adds turns to public.turn_rows (the materializer's COPY): the words of each
-- turn's TurnCompleted event, read from the log by position, into the search index. SECURITY DEFINER: the
-- materializer writes turn_rows and, through this alone, turn_search; no role writes it directly. A turn
-- indexed already (the read models dropped and folded again) keeps its row: the event it reads never
-- changes.
BEGIN
    INSERT INTO public.turn_search (position, episode_id, words)
    SELECT e.position, substr(e.stream, length('episode-') + 1), public.turnstile_turn_text(e.data)
    FROM new_rows t JOIN public.events e ON e.position = t.position
    ON CONFLICT (position) DO NOTHING;
    RETURN NULL;
END
$function$
