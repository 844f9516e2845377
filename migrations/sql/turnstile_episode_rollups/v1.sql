CREATE OR REPLACE FUNCTION turnstile_episode_rollups() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $function$
-- After each statement that writes episodes: its rows (the statement's transition tables) added to the
-- rollups, the rows it replaced or deleted taken away. SECURITY DEFINER: the materializer writes episodes
-- and, through this alone, the rollups; no role writes them directly.
DECLARE
    changes text := CASE TG_OP
        WHEN 'INSERT' THEN 'SELECT 1 AS sign, * FROM new_rows'
        WHEN 'DELETE' THEN 'SELECT -1 AS sign, * FROM old_rows'
        ELSE 'SELECT 1 AS sign, * FROM new_rows UNION ALL SELECT -1 AS sign, * FROM old_rows'
    END;
BEGIN
    EXECUTE public.turnstile_episode_rollups_sql(TG_TABLE_SCHEMA, changes);
    IF TG_OP <> 'INSERT' THEN
        -- A minimum or maximum cannot be taken away: where a reward left (a deleted episode, a changed
        -- reward; never the materializer's own writes, which give a running episode its reward when it
        -- finishes) it is found again among the episodes that remain.
        EXECUTE format($sql$
            UPDATE %1$I.run_rollups r SET reward_min = m.low, reward_max = m.high
            FROM (SELECT o.policy, o.max_policy_version, o.status, o.termination,
                         min(e.reward) AS low, max(e.reward) AS high
                  FROM (SELECT DISTINCT policy, max_policy_version, status, termination
                        FROM old_rows WHERE reward IS NOT NULL) o
                  LEFT JOIN %1$I.episodes e ON e.policy = o.policy
                      AND e.max_policy_version IS NOT DISTINCT FROM o.max_policy_version
                      AND e.status = o.status AND e.termination IS NOT DISTINCT FROM o.termination
                  GROUP BY 1, 2, 3, 4) m
            WHERE r.policy = m.policy AND r.policy_version IS NOT DISTINCT FROM m.max_policy_version
              AND r.status = m.status AND r.termination IS NOT DISTINCT FROM m.termination;
        $sql$, TG_TABLE_SCHEMA);
        EXECUTE format($sql$
            UPDATE %1$I.group_rollups r SET reward_min = m.low, reward_max = m.high
            FROM (SELECT o.policy, o.group_id, min(e.reward) AS low, max(e.reward) AS high
                  FROM (SELECT DISTINCT policy, group_id FROM old_rows
                        WHERE reward IS NOT NULL AND group_id IS NOT NULL) o
                  LEFT JOIN %1$I.episodes e ON e.group_id = o.group_id AND e.policy = o.policy
                  GROUP BY 1, 2) m
            WHERE r.policy = m.policy AND r.group_id = m.group_id;
        $sql$, TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$function$
