-- Worked queries over Turnstile's read models (tables episodes, turns, samples, batches, batch_outbox,
-- events, checkpoints) and the views of migration 0004 (episode_stats, reward_by_policy_version,
-- group_rewards, turn_latency_by_consumer, prefix_break_rate_by_agent, batch_staleness, terminations).
--
-- Each query is one paragraph; run one by its number, e.g. the fifth:
--   turnstile sql "$(awk -v RS= '/^-- 5\./' docs/queries.sql)"
-- add --csv or --json for scripts, --schema NAME to read the tables of a rebuild (rm_NAME) instead
-- (the views always read the live tables). Every query here runs on an empty database too.

-- 1. How is each policy doing overall? (episodes, finished, mean reward, mean turns, tokens)
SELECT policy, episodes, running, finished, mean_reward, mean_turns, tokens, mean_duration_s
FROM episode_stats
ORDER BY policy;

-- 2. How does the reward move with the policy version? (finished episodes, newest version they used)
SELECT policy, policy_version, episodes, mean_reward, stddev_reward, min_reward, max_reward
FROM reward_by_policy_version
ORDER BY policy, policy_version;

-- 3. What does the reward curve look like over time? (episodes finished in each minute)
SELECT date_trunc('minute', finished_at) AS minute, policy, count(*) AS episodes, avg(reward) AS mean_reward
FROM episodes
WHERE status = 'finished'
GROUP BY 1, 2
ORDER BY 1, 2;

-- 4. How many turns do episodes take? (distribution per policy, finished episodes)
SELECT policy, turns, count(*) AS episodes,
       round(100.0 * count(*) / sum(count(*)) OVER (PARTITION BY policy), 1) AS percent
FROM episodes
WHERE status = 'finished'
GROUP BY policy, turns
ORDER BY policy, turns;

-- 5. How often does an agent break the token prefix? (its prompt was re-rendered, not extended)
SELECT agent, episodes, turns, prefix_breaks, round((100 * prefix_break_rate)::numeric, 2) AS percent
FROM prefix_break_rate_by_agent
ORDER BY prefix_break_rate DESC, agent;

-- 6. What is the p95 latency of each inference consumer? (milliseconds per turn)
SELECT engine_id, turns, p50_latency_ms, p95_latency_ms, p99_latency_ms, p50_first_token_ms, p95_queued_ms
FROM turn_latency_by_consumer
ORDER BY p95_latency_ms DESC;

-- 7. How stale are samples when they are trained on? (versions behind the batch's newest version)
SELECT b.policy, b.newest_version - s.policy_version AS staleness, count(*) AS samples,
       count(*) FILTER (WHERE s.stale) AS flagged_stale
FROM samples s
JOIN batches b ON b.batch_id = s.batch_id
GROUP BY 1, 2
ORDER BY 1, 2;

-- 8. Which batches went out stalest, and how long did they wait to be published?
SELECT batch_id, policy, created_at, samples, newest_version, max_staleness, mean_staleness,
       stale_fraction, publish_delay_s
FROM batch_staleness
ORDER BY max_staleness DESC, created_at DESC
LIMIT 20;

-- 9. How do each agent's episodes end? (termination reasons, with their share)
SELECT agent, termination, count(*) AS episodes,
       round(100.0 * count(*) / sum(count(*)) OVER (PARTITION BY agent), 1) AS percent
FROM episodes
WHERE status = 'finished'
GROUP BY agent, termination
ORDER BY agent, episodes DESC;

-- 10. How many tokens does an episode use? (prompt + completion, per policy, finished episodes)
SELECT policy, count(*) AS episodes,
       avg(prompt_tokens + completion_tokens)::double precision AS mean_tokens,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY prompt_tokens + completion_tokens) AS p50_tokens,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY prompt_tokens + completion_tokens) AS p95_tokens,
       max(prompt_tokens + completion_tokens) AS max_tokens,
       avg(completion_tokens)::double precision AS mean_completion_tokens
FROM episodes
WHERE status = 'finished'
GROUP BY policy
ORDER BY policy;

-- 11. What did the newest group's episodes score, and what advantages did their samples get?
SELECT s.group_id, s.episode_id, e.termination, e.reward AS episode_reward, s.sample_id, s.reward,
       s.advantage, s.policy_version, s.tokens, s.batch_id
FROM samples s
JOIN episodes e ON e.episode_id = s.episode_id
WHERE s.group_id = (SELECT group_id FROM samples ORDER BY position DESC LIMIT 1)
ORDER BY s.episode_id, s.sample_id;

-- 12. What share of groups gives no learning signal? (every episode of the group got the same reward)
SELECT policy, count(*) AS n_groups, count(*) FILTER (WHERE zero_spread) AS zero_spread_groups,
       avg(zero_spread::int)::double precision AS zero_spread_share
FROM group_rewards
WHERE finished > 1
GROUP BY policy
ORDER BY policy;

-- 13. Which turns were the slowest, and where did their time go?
SELECT t.episode_id, t.turn_index, e.agent, t.engine_id, t.latency_ms, t.queued_ms, t.first_token_ms,
       t.prompt_tokens, t.completion_tokens, t.finish_reason
FROM turns t
JOIN episodes e ON e.episode_id = t.episode_id
ORDER BY t.latency_ms DESC
LIMIT 20;

-- 14. Did retries help? (each retry next to the episode it retried)
SELECT r.retry_of AS retried_episode, f.termination AS retried_termination, r.episode_id AS retry,
       r.status AS retry_status, r.termination AS retry_termination, r.reward AS retry_reward
FROM episodes r
LEFT JOIN episodes f ON f.episode_id = r.retry_of
WHERE r.retry_of IS NOT NULL
ORDER BY r.started_at;

-- 15. Which errors do agents hit most? (the last line of the traceback, per agent)
SELECT agent, regexp_replace(rtrim(error, E' \n'), '^.*\n', '') AS error, count(*) AS episodes
FROM episodes
WHERE termination = 'error'
GROUP BY 1, 2
ORDER BY episodes DESC
LIMIT 20;

-- 16. Which episodes are still running, and for how long?
SELECT episode_id, policy, agent, turns, started_at, now() - started_at AS running_for
FROM episodes
WHERE status = 'running'
ORDER BY started_at
LIMIT 50;

-- 17. Does the policy grow more confident? (mean completion logprob per policy version)
SELECT e.policy, t.policy_version, count(*) AS turns, avg(t.mean_logprob) AS mean_logprob,
       avg(t.completion_tokens)::double precision AS mean_completion_tokens
FROM turns t
JOIN episodes e ON e.episode_id = t.episode_id
GROUP BY 1, 2
ORDER BY 1, 2;

-- 18. How often do agents call tools, and how often is a reply cut off at max_tokens?
SELECT e.agent, count(*) AS turns, avg(t.tool_calls)::double precision AS tool_calls_per_turn,
       avg((t.finish_reason = 'length')::int)::double precision AS truncated_share
FROM turns t
JOIN episodes e ON e.episode_id = t.episode_id
GROUP BY 1
ORDER BY 1;

-- 19. How far behind the log is each consumer's checkpoint? (events not yet folded)
SELECT c.name, c.position, (SELECT coalesce(max(position), 0) FROM events) - c.position AS events_behind,
       c.updated_at
FROM checkpoints c
ORDER BY c.name;

-- 20. Are batches waiting in the outbox for the trainer?
SELECT batch_id, subject, length(payload) AS payload_bytes, created_at, now() - created_at AS waiting
FROM batch_outbox
WHERE published_at IS NULL
ORDER BY created_at;

-- 21. What is in the log? (events per type, and the newest of each)
SELECT type, count(*) AS events, max(recorded_at) AS newest
FROM events
GROUP BY type
ORDER BY events DESC;
