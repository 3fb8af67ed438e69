// Calls an A2A agent with the A2A project's JavaScript client (@a2a-js/sdk, npm) and prints what
// it saw as JSON lines, for the orchestrator's tests (tests/surfaces/clients.rs):
//
//   NODE_EXTRA_CA_CERTS=ca.pem node a2a_caller.mjs URL TOKEN TEXT [REPLY]
//
// It reads the agent card at URL's /.well-known/agent-card.json, streams a task started with
// TEXT, printing each event as {"event": {"case", "state", "text"}}; with REPLY, once the task
// waits for its caller it sends REPLY on the task (after a {"replied": REPLY} line) and streams
// what follows; then {"task": {"id", "state", "text"}} (getTask). A refusal prints
// {"error": "..."} and exits 3.

import { randomUUID } from "node:crypto";

import { ClientFactory, ClientFactoryOptions, JsonRpcTransportFactory } from "@a2a-js/sdk/client";

const [url, token, text, reply] = process.argv.slice(2);
const say = (line) => process.stdout.write(`${JSON.stringify(line)}\n`);

const withToken = (input, init = {}) => {
  const headers = new Headers(init.headers ?? {});
  headers.set("authorization", `Bearer ${token}`);
  return fetch(input, { ...init, headers });
};

const message = (parts, ids = {}) => ({
  messageId: randomUUID(),
  contextId: ids.contextId ?? "",
  taskId: ids.taskId ?? "",
  role: 1, // ROLE_USER
  parts: parts.map((t) => ({ content: { $case: "text", value: t }, metadata: undefined, filename: "", mediaType: "" })),
  metadata: undefined,
  extensions: [],
  referenceTaskIds: [],
});

/** Streams `request`, printing each event; the task's ids. */
async function stream(client, request) {
  let ids = {};
  for await (const event of client.sendMessageStream(request)) {
    const { $case, value } = event.payload ?? {};
    const state = value?.status?.state ?? value?.state;
    const parts = value?.artifact?.parts ?? value?.status?.message?.parts ?? [];
    const said = parts.map((p) => (p.content?.$case === "text" ? p.content.value : "")).join("");
    say({ event: { case: $case, state, text: said } });
    if ($case === "task") ids = { taskId: value.id, contextId: value.contextId };
    if ($case === "statusUpdate" || $case === "artifactUpdate") ids = { taskId: value.taskId, contextId: value.contextId };
  }
  return ids;
}

async function main() {
  const options = ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new JsonRpcTransportFactory({ fetchImpl: withToken })],
  });
  const client = await new ClientFactory(options).createFromUrl(url);
  const request = (m) => ({ tenant: "", message: m, configuration: undefined, metadata: undefined });
  let ids = await stream(client, request(message([text])));
  if (reply) {
    say({ replied: reply });
    ids = { ...ids, ...(await stream(client, request(message([reply], ids)))) };
  }
  const task = await client.getTask({ tenant: "", id: ids.taskId });
  const answer = (task.artifacts ?? []).flatMap((a) => a.parts).map((p) => p.content?.value ?? "").join("");
  say({ task: { id: task.id, state: task.status?.state, text: answer } });
  return 0;
}

main()
  .then((code) => {
    process.exitCode = code;
  })
  .catch((e) => {
    say({ error: `${e?.constructor?.name}: ${e?.message}` });
    process.exitCode = 3;
  });
