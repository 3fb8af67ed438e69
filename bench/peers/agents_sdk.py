"""The OpenAI Agents SDK relaying the bench's paced stream (`bench --peers`).

Runs an agent without tools on the stand-in model (chat completions), CONCURRENCY runs at once,
each streamed to its end, and talks to the benchmark over stdin/stdout so that the benchmark can
read this process's CPU around the measured rounds:

  -> "ready"                  after one warm-up round
  <- "go"
  -> {"tokens": N}            after ROUNDS measured rounds (N: text deltas relayed)
  <- "exit"
"""

import argparse
import asyncio
import json
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
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


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    args = parser.parse_args()
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url, api_key="not-checked", max_retries=0)
    model = OpenAIChatCompletionsModel(model=args.model, openai_client=client)
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
