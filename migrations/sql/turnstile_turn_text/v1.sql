CREATE OR REPLACE FUNCTION turnstile_turn_text(data jsonb) RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $function$
    -- The words of what a recorded turn adds (its new messages' text and its reply: text, reasoning, tool
    -- call arguments), for full-text search. 'simple': no stemming or stop words, since turns hold code,
    -- logs and any language. Used both by the index and by the query (the same expression, or no index).
    SELECT jsonb_to_tsvector(
        'simple'::regconfig,
        jsonb_build_array(
            jsonb_path_query_array(data, '$.request.messages[*].content'),
            data -> 'reply' -> 'text',
            data -> 'reply' -> 'reasoning',
            jsonb_path_query_array(data, '$.reply.tool_calls[*].function.arguments')
        ),
        '["string"]'
    )
$function$
