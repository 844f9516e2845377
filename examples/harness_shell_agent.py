"""A minimal shell agent on the openai SDK, as ``turnstile harness run --agent command`` runs it.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=ts-... \
        python examples/harness_shell_agent.py "Write hello to hello.txt"

The model gets one tool, ``run_shell {"command": ...}``, run in the working directory; the loop ends at the
first reply without a tool call (printed, and with ``--answer FILE`` also written to FILE for the verifier)
or after ``MAX_STEPS`` calls. The harness gives it the gateway and the session's key in the SDK's own
variables and the task's instruction as its last argument.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import openai

MAX_STEPS = 20
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the working directory: its exit status and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


def run_shell(arguments: str) -> str:
    command = json.loads(arguments)["command"]
    done = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
    return f"exit status {done.returncode}\n{done.stdout}{done.stderr}"


def main(instruction: str, answer: Path | None = None) -> int:
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY
    messages: list[dict[str, object]] = [{"role": "user", "content": instruction}]
    for _ in range(MAX_STEPS):
        completion = client.chat.completions.create(model="main", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        reply = completion.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            print(reply.content)
            if answer is not None:
                answer.write_text(reply.content or "")
            return 0
        for call in reply.tool_calls:
            output = run_shell(call.function.arguments)  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    print(f"gave up after {MAX_STEPS} model calls", file=sys.stderr)
    return 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answer", type=Path, help="also write the final reply to this file")
    options = parser.parse_args(sys.argv[1:-1])  # the instruction, last, may start with "-"
    sys.exit(main(sys.argv[-1], options.answer))
