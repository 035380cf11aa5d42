// One stream with the npm `openai` package (tests/ts/node_modules): a chat completion (`chat`) or a
// response (`responses`), each chunk or event as a JSON line on stdout, then {"done": true}; an
// error as {"error": {status, name, message}} and exit 1.
// Usage: node npm_stream.mjs chat|responses BASE_URL API_KEY MODEL
import { createRequire } from "node:module";
import { fileURLToPath, pathToFileURL } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const fromTs = createRequire(path.join(here, "..", "ts", "package.json"));
const entry = path.join(path.dirname(fromTs.resolve("openai")), "index.mjs"); // the ESM build
const { default: OpenAI } = await import(pathToFileURL(entry).href);

const [api, baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const open = {
  chat: () =>
    client.chat.completions.create({
      model,
      messages: [{ role: "user", content: "hello from node" }],
      stream: true,
      stream_options: { include_usage: true },
    }),
  responses: () => client.responses.create({ model, input: "hello from node", stream: true }),
}[api];
try {
  for await (const item of await open()) {
    console.log(JSON.stringify(item));
  }
  console.log(JSON.stringify({ done: true }));
} catch (error) {
  console.log(JSON.stringify({ error: { status: error.status ?? null, name: error.name, message: error.message } }));
  process.exit(1);
}
