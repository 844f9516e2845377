CREATE OR REPLACE FUNCTION turnstile_turn_said(data jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $function$
    -- What a recorded turn adds, as one JSON array whose strings are its words: its new messages' text and
    -- its reply (text, reasoning, tool call arguments). The one list of those fields that search reads
    -- (turnstile_turn_text, turnstile_turn_words).
    SELECT jsonb_build_array(
        jsonb_path_query_array(data, '$.request.messages[*].content'),
        data -> 'reply' -> 'text',
        data -> 'reply' -> 'reasoning',
        jsonb_path_query_array(data, '$.reply.tool_calls[*].function.arguments')
    )
$function$
