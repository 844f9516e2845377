CREATE OR REPLACE FUNCTION turnstile_index_turns(positions bigint[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $function$
-- The words of the turns at these log positions into the search index, called by the live materializer
-- as it tails the log (migration 0024): a running episode's turns are found before it finishes.
-- SECURITY DEFINER, as the trigger on turn_rows: the caller picks which TurnCompleted events are indexed
-- and when, never what they say (the words come from the log, and any other event is passed over). A
-- turn indexed already keeps its row, tested before its words are computed: the event never changes.
BEGIN
    BEGIN
        INSERT INTO public.turn_search (position, episode_id, words)
        SELECT e.position, substr(e.stream, length('episode-') + 1), public.turnstile_turn_text(e.data)
        FROM public.events e
        WHERE e.position = ANY(positions) AND e.type = 'TurnCompleted'
          AND NOT EXISTS (SELECT FROM public.turn_search s WHERE s.position = e.position)
        ON CONFLICT (position) DO NOTHING;
    EXCEPTION WHEN program_limit_exceeded THEN
        -- a turn with more different words than a tsvector holds: that one by its start
        INSERT INTO public.turn_search (position, episode_id, words)
        SELECT e.position, substr(e.stream, length('episode-') + 1), public.turnstile_turn_words(e.data)
        FROM public.events e
        WHERE e.position = ANY(positions) AND e.type = 'TurnCompleted'
          AND NOT EXISTS (SELECT FROM public.turn_search s WHERE s.position = e.position)
        ON CONFLICT (position) DO NOTHING;
    END;
END
$function$
