"""The OpenAI Agents SDK on the bench's stand-in model (`bench --peers`), in one of two modes.

Relay (default): an agent without tools, CONCURRENCY runs at once, each streamed to its end.
Agent (--agent-runs N): N runs one after another of an agent with one function tool, `echo`,
which the stand-in model calls in its first turn and answers after in its second.

It talks to the benchmark over stdin/stdout so that the benchmark can read this process's CPU
around the measured part:

  -> "ready"                  after one warm-up round (relay) or three warm-up runs (agent)
  <- "go"
  -> {"tokens": N}            after ROUNDS measured rounds (N: text deltas relayed), or
  -> {"runs": N}              after N measured runs (agent)
  <- "exit"
"""

import argparse
import asyncio
import json
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


async def one(agent: Agent) -> int:
    result = Runner.run_streamed(agent, "relay")
    tokens = 0
    async for event in result.stream_events():
        data = getattr(event, "data", None)
        if event.type == "raw_response_event" and getattr(data, "type", "") == "response.output_text.delta":
            tokens += 1
    return tokens


async def round_of(agent: Agent, concurrency: int) -> int:
    return sum(await asyncio.gather(*(one(agent) for _ in range(concurrency))))


@function_tool
def echo(text: str) -> str:
    """Returns its text."""
    return text


async def agent_run(agent: Agent) -> None:
    # Streamed, as the orchestrator's runs are (and the stand-in model serves only streams).
    result = Runner.run_streamed(agent, "go")
    async for _ in result.stream_events():
        pass
    if not result.final_output:
        raise RuntimeError("the agent run gave no final output")


async def agent_mode(args, model) -> None:
    agent = Agent(name="agent", instructions="Use the tool, then answer.", model=model, tools=[echo])
    for _ in range(3):
        await agent_run(agent)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    for _ in range(args.agent_runs):
        await agent_run(agent)
    print(json.dumps({"runs": args.agent_runs}), flush=True)
    sys.stdin.readline()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--agent-runs", type=int, default=0)
    args = parser.parse_args()
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url, api_key="not-checked", max_retries=0)
    model = OpenAIChatCompletionsModel(model=args.model, openai_client=client)
    if args.agent_runs:
        await agent_mode(args, model)
        return
    agent = Agent(name="relay", instructions="Relay the answer.", model=model)
    await round_of(agent, args.concurrency)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    tokens = 0
    for _ in range(args.rounds):
        tokens += await round_of(agent, args.concurrency)
    print(json.dumps({"tokens": tokens}), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    asyncio.run(main())
