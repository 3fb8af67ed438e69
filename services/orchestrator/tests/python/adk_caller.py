#!/usr/bin/env python3
"""Drives a task of an A2A agent from an agent framework that calls remote A2A agents: Google
ADK's RemoteA2aAgent (google-adk, PyPI) run by ADK's Runner, for the orchestrator's tests
(tests/surfaces/clients.rs):

    python adk_caller.py --card https://HOST:PORT/agents/NAME/.well-known/agent-card.json \
        --ca ca.pem --token T "first message" "second message" ...

Each message is one turn of the same ADK session (so the same remote task and context); each
event the remote agent yields is printed as {"turn": N, "text": ..., "task": TASK_ID}. A
failure prints {"error": ...} and exits 3.
"""

import argparse
import asyncio
import json
import ssl
import sys
import warnings

import httpx
from google.adk.agents.remote_a2a_agent import RemoteA2aAgent
from google.adk.runners import Runner
from google.adk.sessions import InMemorySessionService
from google.genai import types


def say(**line):
    print(json.dumps(line), flush=True)


async def drive(args):
    verify = ssl.create_default_context(cafile=args.ca) if args.ca else True
    headers = {"Authorization": f"Bearer {args.token}"}
    async with httpx.AsyncClient(headers=headers, timeout=60, verify=verify) as http:
        agent = RemoteA2aAgent(name="remote", agent_card=args.card, httpx_client=http)
        sessions = InMemorySessionService()
        runner = Runner(agent=agent, app_name="orchestrator-tests", session_service=sessions)
        session = await sessions.create_session(app_name="orchestrator-tests", user_id="tester")
        for turn, text in enumerate(args.messages, start=1):
            message = types.Content(role="user", parts=[types.Part(text=text)])
            async for event in runner.run_async(user_id="tester", session_id=session.id, new_message=message):
                if event.error_message:
                    say(error=event.error_message)
                    return 3
                parts = event.content.parts if event.content and event.content.parts else []
                said = "".join(p.text for p in parts if p.text)
                task = (event.custom_metadata or {}).get("a2a:task_id", "")
                say(turn=turn, text=said, task=task)
    return 0


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--card", required=True)
    p.add_argument("--ca", default="")
    p.add_argument("--token", default="")
    p.add_argument("messages", nargs="+")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # ADK marks its A2A support experimental, on stderr
    try:
        return asyncio.run(drive(args))
    except Exception as e:  # the framework's refusals, as the test reads them
        say(error=f"{type(e).__name__}: {e}")
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
