CREATE OR REPLACE FUNCTION turnstile_read_model_views(target text) RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    EXECUTE format($view$
        CREATE OR REPLACE VIEW %1$I.turns AS
        SELECT t.turn_id,
               e.episode_id,
               t.turn_index,
               t.parent_turn_id,
               (ev.data ->> 'parent_turn_id')::uuid                                     AS recorded_parent,
               t.prompt_tokens,
               t.completion_tokens,
               ev.data -> 'reply' ->> 'finish_reason'                                  AS finish_reason,
               t.policy_version,
               ev.data ->> 'engine_id'                                                 AS engine_id,
               coalesce((ev.data -> 'timings' ->> 'queued_ms')::double precision, 0)      AS queued_ms,
               coalesce((ev.data -> 'timings' ->> 'first_token_ms')::double precision, 0) AS first_token_ms,
               coalesce((ev.data -> 'timings' ->> 'total_ms')::double precision, 0)       AS latency_ms,
               t.mean_logprob,
               t.reward,
               t.discounted_return,
               t.prefix_break,
               CASE WHEN jsonb_typeof(ev.data -> 'reply' -> 'tool_calls') = 'array'
                    THEN jsonb_array_length(ev.data -> 'reply' -> 'tool_calls') ELSE 0 END AS tool_calls,
               ev.recorded_at,
               t.position,
               t.render_drift,
               ev.data ->> 'chat_template'                                             AS chat_template,
               CASE WHEN jsonb_typeof(ev.data -> 'train') = 'boolean' THEN (ev.data ->> 'train')::boolean END AS train,
               t.delivered,
               t.trained,
               t.lineage,
               t.root_reason,
               ev.data ->> 'model'                                                     AS model,
               ev.data -> 'edit'                                                       AS edit
        FROM %1$I.turn_rows t
        LEFT JOIN %1$I.episodes e ON e.started_position = t.episode
        LEFT JOIN public.events ev ON ev.position = t.position
    $view$, target);
    EXECUTE format($view$
        CREATE OR REPLACE VIEW %1$I.samples AS
        SELECT s.turn_id::text || CASE WHEN s.path THEN '\:path' ELSE '' END   AS sample_id,
               e.episode_id,
               e.policy,
               coalesce(nullif(e.group_id, ''), e.episode_id)                AS group_id,
               s.slot,
               coalesce(s.turn_ids, ARRAY[s.turn_id])                        AS turn_ids,
               coalesce(s.policy_version, t.policy_version)                  AS policy_version,
               coalesce(s.tokens, t.prompt_tokens + t.completion_tokens)     AS tokens,
               coalesce(s.model_tokens, t.completion_tokens)                 AS model_tokens,
               coalesce(s.reward, t.discounted_return)                       AS reward,
               s.advantage,
               s.stale,
               s.arrays,
               s.ready_position,
               s.batch_id,
               e.finished_position                                           AS position
        FROM %1$I.sample_rows s
        JOIN %1$I.turn_rows t ON t.turn_id = s.turn_id
        JOIN %1$I.episodes e ON e.started_position = t.episode
    $view$, target);
    EXECUTE format('COMMENT ON VIEW %1$I.turns IS %2$L', target,
        'one row per folded turn: turn_rows (what the materializer derives) with its episode and the '
        'fields of its TurnCompleted event (events.data at position)');
    EXECUTE format('COMMENT ON VIEW %1$I.samples IS %2$L', target,
        'one row per training sample: sample_rows with its episode, and the values of its turn where the '
        'sample has the same (NULL in sample_rows)');
END
$fn$
