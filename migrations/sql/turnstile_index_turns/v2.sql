CREATE OR REPLACE FUNCTION turnstile_index_turns(positions bigint[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $function$
-- The words of the turns at these log positions into the search index, called by the live materializer
-- as it tails the log (migration 0024), and by the trigger on turn_rows (turnstile_turn_search): a running
-- episode's turns are found before it finishes. SECURITY DEFINER, as that trigger: the caller picks which
-- TurnCompleted events are indexed and when, never what they say (the words come from the log, and any
-- other event is passed over). A turn indexed already keeps its row, tested before its words are computed:
-- the event never changes. Each turn's words are turnstile_turn_text's; if that fails on a turn with more
-- different words than a tsvector holds, the statement runs again with turnstile_turn_words, which indexes
-- such a turn by its start (only then: its exception block costs a subtransaction a turn).
DECLARE
    by_start boolean := false;
BEGIN
    LOOP
        BEGIN
            INSERT INTO public.turn_search (position, episode_id, words)
            SELECT e.position, substr(e.stream, length('episode-') + 1),
                   CASE WHEN by_start THEN public.turnstile_turn_words(e.data)
                        ELSE public.turnstile_turn_text(e.data) END
            FROM public.events e
            WHERE e.position = ANY(positions) AND e.type = 'TurnCompleted'
              AND NOT EXISTS (SELECT FROM public.turn_search s WHERE s.position = e.position)
            ON CONFLICT (position) DO NOTHING;
            RETURN;
        EXCEPTION WHEN program_limit_exceeded THEN
            IF by_start THEN
                RAISE;
            END IF;
            by_start := true;
        END;
    END LOOP;
END
$function$
