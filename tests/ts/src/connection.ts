// An IOP connection in TypeScript: mTLS, the codec preface, length-prefixed frames, envelopes.
//
// Written from README.md's protocol section and proto/iop/runtime.proto alone; every message
// class comes from gen/ts (protobuf-es), none is written by hand.

import { readFileSync } from "node:fs";
import * as tls from "node:tls";

import { create, fromBinary, fromJsonString, toBinary, toJsonString } from "@bufbuild/protobuf";
import { DurationSchema, timestampNow } from "@bufbuild/protobuf/wkt";

import { type Envelope, EnvelopeSchema, HeartbeatSchema } from "./gen/iop/runtime_pb.js";

export type Codec = "proto" | "json";

export interface ConnectOptions {
  host: string;
  port: number;
  cert: string;
  key: string;
  ca: string;
  codec: Codec;
  serverName?: string;
  heartbeatMs?: number;
}

const PREFACE_PREFIX = "IOP/1 ";

/** Prefix `body` with its 4-byte big-endian length. */
export function frame(body: Uint8Array): Buffer {
  const header = Buffer.alloc(4);
  header.writeUInt32BE(body.length, 0);
  return Buffer.concat([header, body]);
}

export class IopConnection {
  private buffer = Buffer.alloc(0);
  private frames: Buffer[] = [];
  private waiters: Array<(body: Buffer | null) => void> = [];
  private ended = false;
  private nextId = 0;
  private heartbeat?: NodeJS.Timeout;
  heartbeatsReceived = 0;
  heartbeatsSent = 0;

  private constructor(
    private readonly socket: tls.TLSSocket,
    readonly codec: Codec,
  ) {
    socket.on("data", (chunk: Buffer) => this.onData(chunk));
    socket.on("close", () => this.onEnd());
    socket.on("error", () => this.onEnd());
  }

  /** Connect with a client certificate, agree on the codec, start heartbeats (unless heartbeatMs is 0). */
  static async open(options: ConnectOptions): Promise<IopConnection> {
    const socket = tls.connect({
      host: options.host,
      port: options.port,
      cert: readFileSync(options.cert),
      key: readFileSync(options.key),
      ca: readFileSync(options.ca),
      servername: options.serverName ?? "localhost",
      minVersion: "TLSv1.2",
    });
    await new Promise<void>((resolve, reject) => {
      socket.once("secureConnect", resolve);
      socket.once("error", reject);
    });
    const connection = new IopConnection(socket, options.codec);
    const preface = Buffer.from(PREFACE_PREFIX + options.codec, "ascii");
    connection.writeFrame(preface);
    const answer = await connection.nextFrame();
    if (answer === null) throw new Error("the listener closed the connection during the preface");
    if (!answer.equals(preface)) {
      const refusal = connection.decode(answer);
      throw new Error(`refused: ${JSON.stringify(toJsonString(EnvelopeSchema, refusal))}`);
    }
    connection.startHeartbeats(options.heartbeatMs ?? 30_000);
    return connection;
  }

  /** Send one envelope, filling in its id and send time. */
  send(envelope: Envelope): void {
    if (!envelope.id) envelope.id = `ts-${this.nextId++}`;
    envelope.sentAt = timestampNow();
    this.writeFrame(this.encode(envelope));
  }

  /** Write raw bytes, for sending malformed input on purpose. */
  writeRaw(bytes: Uint8Array): void {
    this.socket.write(bytes);
  }

  /** The next envelope that is not a heartbeat; null once the connection closed. */
  async next(): Promise<Envelope | null> {
    for (;;) {
      const body = await this.nextFrame();
      if (body === null) return null;
      const envelope = this.decode(body);
      if (envelope.body.case === "heartbeat") {
        this.heartbeatsReceived++;
        continue;
      }
      return envelope;
    }
  }

  close(): void {
    clearInterval(this.heartbeat);
    this.socket.end();
  }

  encode(envelope: Envelope): Uint8Array {
    if (this.codec === "proto") return toBinary(EnvelopeSchema, envelope);
    return Buffer.from(toJsonString(EnvelopeSchema, envelope), "utf8");
  }

  decode(body: Uint8Array): Envelope {
    if (this.codec === "proto") return fromBinary(EnvelopeSchema, body);
    return fromJsonString(EnvelopeSchema, Buffer.from(body).toString("utf8"), { ignoreUnknownFields: true });
  }

  private startHeartbeats(intervalMs: number): void {
    if (intervalMs <= 0) return; // tests only: a client that never beats, which the node must cut off
    let sequence = 0n;
    const interval = create(DurationSchema, {
      seconds: BigInt(Math.floor(intervalMs / 1000)),
      nanos: (intervalMs % 1000) * 1_000_000,
    });
    const beat = () => {
      this.send(
        create(EnvelopeSchema, {
          body: { case: "heartbeat", value: create(HeartbeatSchema, { sequence: sequence++, interval }) },
        }),
      );
      this.heartbeatsSent++;
    };
    beat();
    this.heartbeat = setInterval(beat, intervalMs);
    this.heartbeat.unref();
  }

  private writeFrame(body: Uint8Array): void {
    this.socket.write(frame(body));
  }

  private nextFrame(): Promise<Buffer | null> {
    const ready = this.frames.shift();
    if (ready !== undefined) return Promise.resolve(ready);
    if (this.ended) return Promise.resolve(null);
    return new Promise((resolve) => this.waiters.push(resolve));
  }

  private onData(chunk: Buffer): void {
    this.buffer = Buffer.concat([this.buffer, chunk]);
    while (this.buffer.length >= 4) {
      const size = this.buffer.readUInt32BE(0);
      if (this.buffer.length < 4 + size) break;
      const body = this.buffer.subarray(4, 4 + size);
      this.buffer = this.buffer.subarray(4 + size);
      const waiter = this.waiters.shift();
      if (waiter) waiter(Buffer.from(body));
      else this.frames.push(Buffer.from(body));
    }
  }

  private onEnd(): void {
    this.ended = true;
    clearInterval(this.heartbeat);
    for (const waiter of this.waiters.splice(0)) waiter(null);
  }
}
