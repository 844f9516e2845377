CREATE OR REPLACE FUNCTION turnstile_episode_rollups_sql(target_schema text, changes text) RETURNS text
LANGUAGE sql IMMUTABLE AS $function$
    -- One statement (data-modifying CTEs run once each) that adds the rows of `changes` (episodes rows
    -- with a leading `sign`: 1 added, -1 taken away) to the rollups of `target_schema`. Rows are upserted in
    -- key order so that two transactions lock shared rollup rows in the same order (no deadlock).
    SELECT format($sql$
        WITH changes AS MATERIALIZED (%2$s),
        runs AS (
            INSERT INTO %1$I.run_rollups AS r (
                policy, policy_version, status, termination, episodes, rewarded, reward_sum, reward_sumsq,
                reward_min, reward_max, counted_turns, turns, prompt_tokens, completion_tokens, timed,
                duration_sum, first_started_at, last_finished_at)
            SELECT policy, max_policy_version, status, termination, sum(sign),
                   coalesce(sum(sign) FILTER (WHERE reward IS NOT NULL), 0),
                   coalesce(sum(sign * reward), 0), coalesce(sum(sign * reward * reward), 0),
                   min(reward) FILTER (WHERE sign > 0), max(reward) FILTER (WHERE sign > 0),
                   coalesce(sum(sign) FILTER (WHERE turns IS NOT NULL), 0), coalesce(sum(sign * turns), 0),
                   coalesce(sum(sign * prompt_tokens), 0), coalesce(sum(sign * completion_tokens), 0),
                   coalesce(sum(sign) FILTER (WHERE duration_s IS NOT NULL), 0), coalesce(sum(sign * duration_s), 0),
                   min(started_at) FILTER (WHERE sign > 0), max(finished_at) FILTER (WHERE sign > 0)
            FROM changes
            GROUP BY policy, max_policy_version, status, termination
            ORDER BY policy, max_policy_version, status, termination
            ON CONFLICT (policy, policy_version, status, termination) DO UPDATE SET
                episodes = r.episodes + excluded.episodes,
                rewarded = r.rewarded + excluded.rewarded,
                reward_sum = r.reward_sum + excluded.reward_sum,
                reward_sumsq = r.reward_sumsq + excluded.reward_sumsq,
                reward_min = least(r.reward_min, excluded.reward_min),
                reward_max = greatest(r.reward_max, excluded.reward_max),
                counted_turns = r.counted_turns + excluded.counted_turns,
                turns = r.turns + excluded.turns,
                prompt_tokens = r.prompt_tokens + excluded.prompt_tokens,
                completion_tokens = r.completion_tokens + excluded.completion_tokens,
                timed = r.timed + excluded.timed,
                duration_sum = r.duration_sum + excluded.duration_sum,
                first_started_at = least(r.first_started_at, excluded.first_started_at),
                last_finished_at = greatest(r.last_finished_at, excluded.last_finished_at)
            RETURNING 1
        ),
        throughput AS (
            INSERT INTO %1$I.throughput_rollups AS r (policy, width_s, bucket, episodes, turns)
            SELECT policy, width_s,
                   to_timestamp(floor(extract(epoch FROM finished_at) / width_s) * width_s) AS bucket,
                   sum(sign), coalesce(sum(sign * turns), 0)
            FROM changes CROSS JOIN (VALUES (1), (60)) AS widths (width_s)
            WHERE status = 'finished' AND finished_at IS NOT NULL
            GROUP BY policy, width_s, bucket
            ORDER BY policy, width_s, bucket
            ON CONFLICT (policy, width_s, bucket) DO UPDATE SET
                episodes = r.episodes + excluded.episodes,
                turns = r.turns + excluded.turns
            RETURNING 1
        ),
        groups AS (
            INSERT INTO %1$I.group_rollups AS r (
                policy, group_id, episodes, finished, rewarded, reward_sum, reward_sumsq, reward_min, reward_max,
                last_finished_at)
            SELECT policy, group_id, sum(sign), coalesce(sum(sign) FILTER (WHERE status = 'finished'), 0),
                   coalesce(sum(sign) FILTER (WHERE reward IS NOT NULL), 0),
                   coalesce(sum(sign * reward), 0), coalesce(sum(sign * reward * reward), 0),
                   min(reward) FILTER (WHERE sign > 0), max(reward) FILTER (WHERE sign > 0),
                   max(finished_at) FILTER (WHERE sign > 0)
            FROM changes
            WHERE group_id IS NOT NULL
            GROUP BY policy, group_id
            ORDER BY policy, group_id
            ON CONFLICT (policy, group_id) DO UPDATE SET
                episodes = r.episodes + excluded.episodes,
                finished = r.finished + excluded.finished,
                rewarded = r.rewarded + excluded.rewarded,
                reward_sum = r.reward_sum + excluded.reward_sum,
                reward_sumsq = r.reward_sumsq + excluded.reward_sumsq,
                reward_min = least(r.reward_min, excluded.reward_min),
                reward_max = greatest(r.reward_max, excluded.reward_max),
                last_finished_at = greatest(r.last_finished_at, excluded.last_finished_at)
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM throughput) + (SELECT count(*) FROM groups)
    $sql$, target_schema, changes)
$function$
