#!/usr/bin/env python3
"""Calls an A2A agent with the A2A project's own Python client (a2a-sdk, PyPI) and prints what it
saw as JSON lines, for the orchestrator's tests (tests/a2a.rs):

    python a2a_caller.py --url https://127.0.0.1:PORT[/agents/NAME] --ca ca.pem --token T \
        --text "..." --mode stream|block|immediate [--context ID] [--cancel] [--get ID] [--list] \
        [--reply TEXT] [--binding jsonrpc|grpc] [--subscribe] [--follow TASK_ID] \
        [--push URL --push-token TOKEN]

The client reads the agent card at the URL's /.well-known/agent-card.json and calls the
JSON-RPC interface it names. Each streamed event is printed as {"event": StreamResponse}; then
{"task": Task} (GetTask of the task it started); {"canceled": Task} with --cancel; {"listed":
[ids]} with --list. With --reply, once the task waits for its caller (INPUT_REQUIRED) the reply
is sent on the task (a follow-up message: "approve", "reject REASON") after a {"replied": TEXT}
line, and what follows is printed the same way. --binding grpc calls the gRPC interface the card
names instead (its TLS with --ca, the token as call credentials). --subscribe follows the task
it started again (SubscribeToTask), printing {"subscribed": StreamResponse} lines; --follow
TASK_ID does so for a task started elsewhere (then --reply answers it). --push URL asks for push
notifications to URL with the task's message (token --push-token), then creates a second config
with credentials ({"pushed": config}), lists both ({"pushes": [ids]}), reads the second back
({"push": config}), deletes it and lists again ({"pushes_after": [ids]}). A refusal prints
{"error": "<class>: <message>"} and exits 3.
"""

import argparse
import asyncio
import json
import ssl
import sys
import uuid

import httpx
from a2a.client import ClientConfig, create_client
from a2a.types.a2a_pb2 import (
    AuthenticationInfo,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
)
from google.protobuf import json_format


def grpc_channel(url, args):
    """A channel to `url` (the card's `https://HOST:PORT`) over TLS with the CA of --ca, the token
    sent with each call."""
    import grpc  # the a2a-sdk[grpc] extra

    target = url.split("://", 1)[-1]
    with open(args.ca, "rb") as f:
        tls = grpc.ssl_channel_credentials(root_certificates=f.read())
    credentials = grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(args.token))
    return grpc.aio.secure_channel(target, credentials)


async def reply_to(client, task_id, context_id, text):
    """Sends `text` on the task (a reply), printing {"replied": text} and what follows."""
    say(replied=text)
    reply = Message(
        message_id=str(uuid.uuid4()),
        role=Role.ROLE_USER,
        parts=[Part(text=text)],
        task_id=task_id,
        context_id=context_id,
    )
    async for event in client.send_message(SendMessageRequest(message=reply)):
        say(event=as_dict(event))


async def push_configs(client, task_id, args):
    """A second config of the task, with credentials; listed, read back, deleted."""
    second = TaskPushNotificationConfig(
        task_id=task_id,
        url=args.push,
        token=args.push_token + "-second",
        authentication=AuthenticationInfo(scheme="Bearer", credentials="receivers-own-secret"),
    )
    pushed = await client.create_task_push_notification_config(second)
    say(pushed=as_dict(pushed))
    listed = await client.list_task_push_notification_configs(ListTaskPushNotificationConfigsRequest(task_id=task_id))
    say(pushes=[c.id for c in listed.configs])
    got = await client.get_task_push_notification_config(GetTaskPushNotificationConfigRequest(task_id=task_id, id=pushed.id))
    say(push=as_dict(got))
    await client.delete_task_push_notification_config(DeleteTaskPushNotificationConfigRequest(task_id=task_id, id=pushed.id))
    listed = await client.list_task_push_notification_configs(ListTaskPushNotificationConfigsRequest(task_id=task_id))
    say(pushes_after=[c.id for c in listed.configs])


def say(**line):
    print(json.dumps(line), flush=True)


def as_dict(message):
    return json_format.MessageToDict(message)


async def call(args):
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    verify = ssl.create_default_context(cafile=args.ca) if args.ca else True
    async with httpx.AsyncClient(headers=headers, timeout=60, verify=verify) as http:
        config = ClientConfig(httpx_client=http, streaming=args.mode == "stream", polling=args.mode == "immediate")
        if args.push:
            config.push_notification_config = TaskPushNotificationConfig(url=args.push, token=args.push_token)
        if args.binding == "grpc":
            config.supported_protocol_bindings = ["GRPC"]
            config.grpc_channel_factory = lambda url: grpc_channel(url, args)
        client = await create_client(args.url, client_config=config)
        if args.get:
            say(task=as_dict(await client.get_task(GetTaskRequest(id=args.get))))
            return 0
        if args.follow:
            task_id, context_id = args.follow, ""
            follower = await create_client(args.url, client_config=ClientConfig(httpx_client=http, streaming=True))
            async for event in follower.subscribe(SubscribeToTaskRequest(id=task_id)):
                say(subscribed=as_dict(event))
                if event.HasField("task"):
                    context_id = event.task.context_id
            if args.reply:
                await reply_to(client, task_id, context_id, args.reply)
            say(task=as_dict(await client.get_task(GetTaskRequest(id=task_id))))
            return 0
        if args.list:
            listed = await client.list_tasks(ListTasksRequest())
            say(listed=[task.id for task in listed.tasks])
            return 0
        message = Message(
            message_id=str(uuid.uuid4()),
            role=Role.ROLE_USER,
            parts=[Part(text=args.text)],
            context_id=args.context or "",
        )
        task_id, context_id = None, None
        async for event in client.send_message(SendMessageRequest(message=message)):
            say(event=as_dict(event))
            if event.HasField("task"):
                task_id, context_id = event.task.id, event.task.context_id
            elif event.HasField("status_update"):
                task_id, context_id = event.status_update.task_id, event.status_update.context_id
            if args.cancel and task_id:
                break
        if args.push:
            await push_configs(client, task_id, args)
        if args.subscribe:
            # A client that streams (resubscribing needs one), whatever --mode started the task.
            follower = await create_client(args.url, client_config=ClientConfig(httpx_client=http, streaming=True))
            async for event in follower.subscribe(SubscribeToTaskRequest(id=task_id)):
                say(subscribed=as_dict(event))
        if args.reply:
            await reply_to(client, task_id, context_id, args.reply)
        if args.cancel:
            say(canceled=as_dict(await client.cancel_task(CancelTaskRequest(id=task_id))))
        say(task=as_dict(await client.get_task(GetTaskRequest(id=task_id))))
        return 0


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--token", default="")
    p.add_argument("--ca", default="", help="PEM CA of the server's certificate (TLS)")
    p.add_argument("--text", default="hello")
    p.add_argument("--mode", choices=["stream", "block", "immediate"], default="stream")
    p.add_argument("--context", default="")
    p.add_argument("--cancel", action="store_true")
    p.add_argument("--get", default="")
    p.add_argument("--list", action="store_true")
    p.add_argument("--reply", default="")
    p.add_argument("--subscribe", action="store_true")
    p.add_argument("--follow", default="")
    p.add_argument("--binding", choices=["jsonrpc", "grpc"], default="jsonrpc")
    p.add_argument("--push", default="", help="URL for the task's push notifications")
    p.add_argument("--push-token", default="")
    args = p.parse_args(argv)
    try:
        return asyncio.run(call(args))
    except Exception as e:  # the client's refusals, as the test reads them
        say(error=f"{type(e).__name__}: {e}")
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
