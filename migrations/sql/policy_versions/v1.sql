CREATE OR REPLACE VIEW policy_versions AS
SELECT stream,
       substr(stream, length('policy-') + 1) AS policy,
       (data ->> 'version')::bigint AS version,
       data ->> 'checkpoint' AS checkpoint,
       position,
       recorded_at
FROM events
WHERE stream LIKE 'policy-%' AND type = 'PolicyVersionPublished'
