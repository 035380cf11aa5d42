// The TypeScript IOP client used by tests/integration/test_typescript.py.
//
//   node build/client.js COMMAND --host H --port P --cert C --key K --ca CA [--codec proto|json]
//
// Commands: run, cancel, capabilities, hold, golden (reads examples on stdin), oversized, garbage.
// Each prints JSON lines on stdout for the Python side to check.

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { create, fromBinary, fromJson, type JsonValue, toBinary, toJson } from "@bufbuild/protobuf";

import { type Codec, frame, IopConnection } from "./connection.js";
import {
  CancelRequestSchema,
  CapabilityRequestSchema,
  CapabilityResponseSchema,
  ChatMessageSchema,
  ContentPartSchema,
  EnvelopeSchema,
  file_iop_runtime,
  Role,
  RunEventSchema,
  RunRequestSchema,
  SamplingSchema,
} from "./gen/iop/runtime_pb.js";

const { positionals, values } = parseArgs({
  allowPositionals: true,
  options: {
    host: { type: "string", default: "127.0.0.1" },
    port: { type: "string" },
    cert: { type: "string" },
    key: { type: "string" },
    ca: { type: "string" },
    codec: { type: "string", default: "proto" },
    model: { type: "string", default: "mock-small" },
    text: { type: "string", default: "hello from typescript" },
    "max-tokens": { type: "string", default: "12" },
    "heartbeat-ms": { type: "string", default: "30000" },
    "hold-ms": { type: "string", default: "2000" },
  },
});

function print(value: unknown): void {
  process.stdout.write(JSON.stringify(value, (_, v) => (typeof v === "bigint" ? v.toString() : v)) + "\n");
}

function connect(): Promise<IopConnection> {
  return IopConnection.open({
    host: values.host!,
    port: Number(values.port),
    cert: values.cert!,
    key: values.key!,
    ca: values.ca!,
    codec: values.codec as Codec,
    heartbeatMs: Number(values["heartbeat-ms"]),
  });
}

function runRequest(runId: string) {
  return create(EnvelopeSchema, {
    runId,
    body: {
      case: "runRequest",
      value: create(RunRequestSchema, {
        runId,
        model: values.model!,
        stream: true,
        messages: [
          create(ChatMessageSchema, {
            role: Role.USER,
            content: [create(ContentPartSchema, { part: { case: "text", value: values.text! } })],
          }),
        ],
        sampling: create(SamplingSchema, { maxTokens: Number(values["max-tokens"]) }),
      }),
    },
  });
}

/** Stream one run; print each event and the final text. */
async function run(): Promise<void> {
  const connection = await connect();
  connection.send(runRequest("ts-run"));
  let text = "";
  for (;;) {
    const envelope = await connection.next();
    if (envelope === null) throw new Error("connection closed mid-run");
    if (envelope.body.case !== "runEvent") continue;
    const event = envelope.body.value;
    print({ event: event.event.case, sequence: event.sequence, json: toJson(RunEventSchema, event) });
    if (event.event.case === "delta") text += event.event.value.text;
    if (event.event.case === "complete" || event.event.case === "error") break;
  }
  print({ text, heartbeatsReceived: connection.heartbeatsReceived });
  connection.close();
}

/** Start a run, cancel it after its first delta, print the final event. */
async function cancel(): Promise<void> {
  const connection = await connect();
  connection.send(runRequest("ts-cancel"));
  let cancelSent = false;
  for (;;) {
    const envelope = await connection.next();
    if (envelope === null) throw new Error("connection closed mid-run");
    if (envelope.body.case !== "runEvent") continue;
    const event = envelope.body.value.event;
    if (event.case === "delta" && !cancelSent) {
      cancelSent = true;
      connection.send(
        create(EnvelopeSchema, {
          runId: "ts-cancel",
          body: { case: "cancelRequest", value: create(CancelRequestSchema, { runId: "ts-cancel", reason: "ts says stop" }) },
        }),
      );
    }
    if (event.case === "error" || event.case === "complete") {
      print({ final: event.case, json: toJson(RunEventSchema, envelope.body.value) });
      break;
    }
  }
  connection.close();
}

async function capabilities(): Promise<void> {
  const connection = await connect();
  const request = create(EnvelopeSchema, { id: "caps-1", body: { case: "capabilityRequest", value: create(CapabilityRequestSchema) } });
  connection.send(request);
  for (;;) {
    const envelope = await connection.next();
    if (envelope === null) throw new Error("connection closed before the capability response");
    if (envelope.inReplyTo === "caps-1" && envelope.body.case === "capabilityResponse") {
      print({ capabilities: toJson(CapabilityResponseSchema, envelope.body.value) });
      break;
    }
  }
  connection.close();
}

/** Stay connected with no application traffic for --hold-ms, reading all along, then ask for capabilities.
 *  Prints the heartbeats each side sent, any error envelope the node sent, and whether it still answered. */
async function hold(): Promise<void> {
  const connection = await connect();
  let error: JsonValue | null = null;
  let answered = false;
  const reading = (async () => {
    for (;;) {
      const envelope = await connection.next(); // counts the node's heartbeats as it skips them
      if (envelope === null) return;
      if (envelope.body.case === "error") error = toJson(EnvelopeSchema, envelope);
      if (envelope.inReplyTo === "caps-1" && envelope.body.case === "capabilityResponse") {
        answered = true;
        return;
      }
    }
  })();
  await new Promise((resolve) => setTimeout(resolve, Number(values["hold-ms"])));
  const heartbeatsReceived = connection.heartbeatsReceived; // during the hold only
  connection.send(create(EnvelopeSchema, { id: "caps-1", body: { case: "capabilityRequest", value: create(CapabilityRequestSchema) } }));
  await Promise.race([reading, new Promise((resolve) => setTimeout(resolve, 5000))]);
  print({ heartbeatsReceived, heartbeatsSent: connection.heartbeatsSent, error, answered });
  connection.close();
}

interface GoldenInput {
  file: string;
  message: string;
  json: JsonValue;
  binary: string;
}

/** Decode each example from its JSON and from Python's bytes; re-encode both ways. */
function golden(): void {
  const inputs = JSON.parse(readFileSync(0, "utf8")) as GoldenInput[];
  for (const input of inputs) {
    const schema = file_iop_runtime.messages.find((m) => m.name === input.message);
    if (schema === undefined) throw new Error(`no message ${input.message} in the generated code`);
    const fromJsonMessage = fromJson(schema, input.json);
    const fromBinaryMessage = fromBinary(schema, Buffer.from(input.binary, "base64"));
    print({
      file: input.file,
      fromJson: { binary: Buffer.from(toBinary(schema, fromJsonMessage)).toString("base64"), json: toJson(schema, fromJsonMessage) },
      fromBinary: { binary: Buffer.from(toBinary(schema, fromBinaryMessage)).toString("base64"), json: toJson(schema, fromBinaryMessage) },
    });
  }
}

/** Send a bad frame on purpose and print the error envelope that comes back. */
async function bad(kind: "oversized" | "garbage"): Promise<void> {
  const connection = await connect();
  if (kind === "oversized") {
    const header = Buffer.alloc(4);
    header.writeUInt32BE(0xfffffff0, 0);
    connection.writeRaw(Buffer.concat([header, Buffer.alloc(64)]));
  } else {
    connection.writeRaw(frame(Buffer.from([0xff, 0xff, 0xff, 0xff, 0x13, 0x37, 0x00, 0x42])));
  }
  const envelope = await connection.next();
  print({ reply: envelope === null ? null : toJson(EnvelopeSchema, envelope) });
  connection.close();
}

const commands: Record<string, () => Promise<void> | void> = {
  run,
  cancel,
  capabilities,
  hold,
  golden,
  oversized: () => bad("oversized"),
  garbage: () => bad("garbage"),
};

const command = commands[positionals[0] ?? ""];
if (command === undefined) {
  process.stderr.write(`usage: client.js ${Object.keys(commands).join("|")} --port P --cert C --key K --ca CA\n`);
  process.exit(2);
}
await command();
