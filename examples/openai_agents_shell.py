"""An OpenAI Agents SDK agent with a shell tool, as anyone would write it: nothing in it names Turnstile. The
SDK's default model speaks the Responses API to ``OPENAI_BASE_URL`` with ``OPENAI_API_KEY``, so pointed at a
gateway session every call it makes is a recorded turn of that session's episode (README: "Clients, exactly
as configured"; ``tests/e2e/test_agent_openai_sdk.py`` runs it).

    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=ts-... OPENAI_AGENTS_DISABLE_TRACING=1 \\
        python examples/openai_agents_shell.py "Write hello to hello.txt"

``OPENAI_AGENTS_DISABLE_TRACING=1``: otherwise the SDK uploads traces to OpenAI with the session's key.
"""

import asyncio
import subprocess
import sys

from agents import Agent, Runner, function_tool


@function_tool
def run_shell(command: str) -> str:
    """Run a shell command in the current directory; returns its exit status and output."""
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    return f"exit status {done.returncode}\n{done.stdout}{done.stderr}"


async def main(prompt: str) -> None:
    agent = Agent(name="shell", instructions="Do what the user asks with shell commands.", tools=[run_shell])
    result = await Runner.run(agent, prompt)
    print(result.final_output)
    usage = result.context_wrapper.usage
    print(f"{usage.requests} model calls: {usage.input_tokens} input, {usage.output_tokens} output tokens")


if __name__ == "__main__":
    asyncio.run(main(" ".join(sys.argv[1:])))
