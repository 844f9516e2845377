"""The request bodies of the gateway's routes, as JSON Schema for its OpenAPI document (``/openapi.json``).

The routes read raw JSON and validate it themselves (each API answers in its own error shape, naming the
refused field), so FastAPI cannot derive these: they are written here. They describe what the gateway
accepts, for clients, for documentation and for fuzzing (``tests/unit/test_gateway_fuzz.py`` runs schemathesis
on them, with inputs that follow them and inputs that break them). The session bodies come from the pydantic
models that parse them.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel

_STRING: Final = {"type": "string"}
_TEXT_PART: Final = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": _STRING},
}
_FUNCTION_CALL: Final = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": _STRING,
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": _STRING, "arguments": _STRING},
        },
    },
}

OPENAI_CHAT: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "model": _STRING,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                    "content": {"anyOf": [_STRING, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
                    "name": _STRING,
                    "tool_call_id": _STRING,
                    "tool_calls": {"type": "array", "items": _FUNCTION_CALL},
                    "reasoning_content": _STRING,
                },
            },
        },
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": _STRING,
                            "description": _STRING,
                            "parameters": {"type": "object"},
                        },
                    },
                },
            },
        },
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 128},
        "seed": {"type": "integer", "minimum": 0},
        "stop": {"anyOf": [_STRING, {"type": "array", "items": _STRING}]},
        "stream": {"type": "boolean"},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    },
}

_ANTHROPIC_BLOCK: Final = {
    "anyOf": [
        _TEXT_PART,
        {
            "type": "object",
            "required": ["type", "id", "name", "input"],
            "properties": {
                "type": {"const": "tool_use"},
                "id": _STRING,
                "name": _STRING,
                "input": {"type": "object"},
            },
        },
        {
            "type": "object",
            "required": ["type", "tool_use_id"],
            "properties": {
                "type": {"const": "tool_result"},
                "tool_use_id": _STRING,
                "content": {"anyOf": [_STRING, {"type": "array", "items": _TEXT_PART}]},
                "is_error": {"type": "boolean"},
            },
        },
    ]
}

ANTHROPIC_MESSAGES: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": _STRING,
        "max_tokens": {"type": "integer", "minimum": 1},
        "system": {"anyOf": [_STRING, {"type": "array", "items": _TEXT_PART}]},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["user", "assistant", "system"]},
                    "content": {"anyOf": [_STRING, {"type": "array", "items": _ANTHROPIC_BLOCK}]},
                },
            },
        },
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "input_schema"],
                "properties": {"name": _STRING, "description": _STRING, "input_schema": {"type": "object"}},
            },
        },
        "tool_choice": {"type": "object"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": _STRING},
        "stream": {"type": "boolean"},
    },
}


ANTHROPIC_COUNT_TOKENS: Final[dict[str, Any]] = {
    **ANTHROPIC_MESSAGES,
    "required": ["model", "messages"],
}

_RESPONSES_TEXT: Final = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": _STRING},
}
_RESPONSES_ITEM: Final = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "system", "developer", "assistant"]},
                "content": {"anyOf": [_STRING, {"type": "array", "items": _RESPONSES_TEXT}]},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "name", "arguments"],
            "properties": {
                "type": {"const": "function_call"},
                "call_id": _STRING,
                "name": _STRING,
                "arguments": _STRING,
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "output"],
            "properties": {"type": {"const": "function_call_output"}, "call_id": _STRING, "output": _STRING},
        },
        {
            "type": "object",
            "required": ["type", "summary"],
            "properties": {
                "type": {"const": "reasoning"},
                "summary": {"type": "array", "items": {"type": "object"}},
                "encrypted_content": _STRING,
            },
        },
    ]
}

OPENAI_RESPONSES: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": _STRING,
        "input": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": _RESPONSES_ITEM}]},
        "instructions": _STRING,
        "previous_response_id": _STRING,
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": _STRING,
                    "name": _STRING,
                    "description": _STRING,
                    "parameters": {"type": "object"},
                    "strict": {"type": "boolean"},
                },
            },
        },
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "include": {"type": "array", "items": _STRING},
        "prompt_cache_key": _STRING,
        "metadata": {"type": "object", "additionalProperties": _STRING},
        "reasoning": {"type": "object"},
        "truncation": {"const": "disabled"},
    },
}


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON Schema of ``model`` with its ``$defs`` inlined (an OpenAPI body cannot point into its own
    ``$defs``: a ``#/...`` reference there resolves against the whole document)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            reference = node.get("$ref")
            if isinstance(reference, str) and reference.startswith("#/$defs/"):
                return inline(definitions[reference.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    inlined: dict[str, Any] = inline(schema)
    return inlined


def openapi_body(schema: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is JSON following ``schema``."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}
