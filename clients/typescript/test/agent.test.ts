/**
 * End to end: this client against `agent-server serve` (its built-in local model) in a process
 * of its own: a thread, a streamed turn, an interrupt, tools, and ErrorInfo from bad requests.
 */
import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { after, before, test } from "node:test";

import { Code, ConnectError } from "@connectrpc/connect";

import {
  type AgentConnection,
  connectAgent,
  errorInfo,
  type ThreadEvent,
  ThreadStatus,
  TurnStatus,
} from "../src/index.js";

const traces = mkdtempSync(join(tmpdir(), "rollout-ts-"));
let server: ChildProcess;
let serverLog = "";
let agent: AgentConnection;

before(async () => {
  const binary = process.env.AGENT_SERVER ?? resolve("../../.venv/bin/agent-server");
  // Words 20 ms apart: an interrupt lands mid-reply.
  server = spawn(
    binary,
    ["serve", "--listen", "127.0.0.1:0", "--local-word-delay", "0.02", "--trace-root", traces],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  server.stderr!.on("data", (chunk: Buffer) => (serverLog += chunk.toString()));
  const address = await new Promise<string>((resolveAddress, reject) => {
    createInterface({ input: server.stdout! }).on("line", (line) => {
      if (line.startsWith("listening on ")) resolveAddress(line.slice("listening on ".length));
    });
    server.on("exit", (code) => reject(new Error(`agent-server exited with ${code}: ${serverLog}`)));
  });
  agent = connectAgent(address);
});

after(async () => {
  agent.close();
  server.kill("SIGTERM");
  if (server.exitCode === null) await once(server, "exit");
  assert.equal(server.exitCode, 0, serverLog);
  rmSync(traces, { recursive: true, force: true });
});

function text(value: string) {
  return { content: { case: "text" as const, value } };
}

/** The thread's events from the first, until `done` says stop (after that event). */
async function eventsUntil(
  threadId: string,
  done: (event: ThreadEvent) => boolean | Promise<boolean>,
): Promise<ThreadEvent[]> {
  const seen: ThreadEvent[] = [];
  for await (const { event } of agent.client.streamEvents({ threadId })) {
    if (!event) continue;
    seen.push(event);
    if (await done(event)) break;
  }
  return seen;
}

test("a thread, a streamed turn, then closed with its bundle", async () => {
  const { thread } = await agent.client.startThread({
    instructions: "Be brief.",
    metadata: { from: "typescript" },
  });
  assert.ok(thread);
  assert.equal(thread.model, "local-echo-1");
  const { turn } = await agent.client.startTurn({
    threadId: thread.id,
    input: [text("hello from TypeScript")],
  });
  assert.equal(turn?.status, TurnStatus.IN_PROGRESS);
  const events = await eventsUntil(
    thread.id,
    (event) => event.kind.case === "turnCompleted" && event.turnId === turn?.id,
  );
  assert.deepEqual(
    events.map((event) => event.index),
    events.map((_, position) => BigInt(position + 1)),
  );
  let streamed = "";
  let completedText = "";
  for (const event of events) {
    if (event.kind.case === "agentMessageDelta") streamed += event.kind.value.delta;
    if (event.kind.case === "itemCompleted") completedText = event.kind.value.item?.text ?? "";
  }
  assert.match(streamed, /^You said: "hello from TypeScript"\./);
  assert.equal(streamed, completedText);
  const last = events.at(-1)!;
  assert.equal(last.kind.case === "turnCompleted" && last.kind.value.turn?.status, TurnStatus.COMPLETED);

  const closed = await agent.client.closeThread({ threadId: thread.id });
  assert.equal(closed.thread?.status, ThreadStatus.CLOSED);
  assert.ok(closed.thread?.bundlePath.startsWith(traces), closed.thread?.bundlePath);
});

test("interrupting a turn mid-stream", async () => {
  const { thread } = await agent.client.startThread({});
  const { turn } = await agent.client.startTurn({
    threadId: thread!.id,
    input: [text("a long answer, please")],
  });
  let interrupted: TurnStatus | undefined;
  const events = await eventsUntil(thread!.id, async (event) => {
    if (event.kind.case === "agentMessageDelta" && interrupted === undefined) {
      const reply = await agent.client.interrupt({ threadId: thread!.id, turnId: turn!.id });
      interrupted = reply.turn?.status;
    }
    return event.kind.case === "turnCompleted";
  });
  assert.equal(interrupted, TurnStatus.INTERRUPTED);
  const last = events.at(-1)!;
  assert.equal(last.kind.case === "turnCompleted" && last.kind.value.turn?.status, TurnStatus.INTERRUPTED);
  await agent.client.closeThread({ threadId: thread!.id });
});

test("a function tool answered with SubmitToolOutputs", async () => {
  const { thread } = await agent.client.startThread({
    tools: [
      {
        name: "weather",
        description: "Today's weather in a city.",
        parametersJson: JSON.stringify({ type: "object", properties: { city: { type: "string" } } }),
      },
    ],
  });
  const { turn } = await agent.client.startTurn({
    threadId: thread!.id,
    input: [text("What does weather say about Oslo?")],
  });
  let answer = "";
  await eventsUntil(thread!.id, async (event) => {
    if (event.kind.case === "toolCallRequested") {
      assert.deepEqual(JSON.parse(event.kind.value.arguments), {
        city: "What does weather say about Oslo?",
      });
      await agent.client.submitToolOutputs({
        threadId: thread!.id,
        turnId: turn!.id,
        outputs: [{ callId: event.kind.value.callId, output: "snow, -3 °C" }],
      });
    }
    if (event.kind.case === "itemCompleted") answer += event.kind.value.item?.text ?? "";
    return event.kind.case === "turnCompleted";
  });
  assert.match(answer, /The tool weather returned: "snow, -3 °C"\./);
  await agent.client.closeThread({ threadId: thread!.id });
});

test("errors carry their code and a google.rpc.ErrorInfo", async () => {
  const { thread } = await agent.client.startThread({});
  await assert.rejects(
    agent.client.startTurn({ threadId: thread!.id, input: [] }),
    (error: unknown) => {
      assert.ok(error instanceof ConnectError);
      assert.equal(error.code, Code.InvalidArgument);
      const info = errorInfo(error);
      assert.equal(info?.reason, "EMPTY_INPUT");
      assert.equal(info?.domain, "rollout-trace");
      return true;
    },
  );
  await assert.rejects(agent.client.getThread({ threadId: "thread_nope" }), (error: unknown) => {
    assert.equal(ConnectError.from(error).code, Code.NotFound);
    const info = errorInfo(error);
    assert.equal(info?.reason, "THREAD_NOT_FOUND");
    assert.deepEqual(info?.metadata, { thread_id: "thread_nope" });
    return true;
  });
  await agent.client.closeThread({ threadId: thread!.id });
});
