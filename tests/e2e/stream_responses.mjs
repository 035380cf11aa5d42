// One streamed response with the npm `openai` package (tests/ts/node_modules): each event of
// client.responses.create({stream: true}) as a JSON line on stdout, then {"done": true}; an error
// as {"error": {status, name, message}} and exit 1.
// Usage: node stream_responses.mjs BASE_URL API_KEY MODEL
import { createRequire } from "node:module";
import { fileURLToPath, pathToFileURL } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const fromTs = createRequire(path.join(here, "..", "ts", "package.json"));
const entry = path.join(path.dirname(fromTs.resolve("openai")), "index.mjs"); // the ESM build
const { default: OpenAI } = await import(pathToFileURL(entry).href);

const [baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
try {
  const stream = await client.responses.create({ model, input: "hello from node", stream: true });
  for await (const event of stream) {
    console.log(JSON.stringify(event));
  }
  console.log(JSON.stringify({ done: true }));
} catch (error) {
  console.log(JSON.stringify({ error: { status: error.status ?? null, name: error.name, message: error.message } }));
  process.exit(1);
}
