// Talking to this server: /v1/models, and /v1/chat/completions streamed as server-sent events.
"use strict";

import { store } from "./store.js";

export class Unauthorized extends Error {}

function headers() {
  const key = store.get("key", "");
  return { "Content-Type": "application/json", ...(key ? { Authorization: "Bearer " + key } : {}) };
}

async function checked(response) {
  if (response.status === 401) throw new Unauthorized("this server wants an API key");
  if (response.ok) return response;
  let message;
  try { message = (await response.json()).error.message; } catch { message = `${response.status} ${response.statusText}`; }
  throw new Error(message);
}

export async function modelIds() {
  const response = await checked(await fetch("/v1/models", { headers: headers() }));
  return (await response.json()).data.map((model) => model.id);
}

// Streams a chat completion: onDelta(delta) for each choice delta ({content} or {reasoning_content});
// resolves to the usage the server sends last (stream_options.include_usage), or null when stopped.
export async function streamChat(body, signal, onDelta) {
  const request = { ...body, stream: true, stream_options: { include_usage: true } };
  const response = await checked(await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(request), signal,
  }));
  let usage = null;
  await readEvents(response, (data) => {
    if (data.error) throw new Error(data.error.message);
    if (data.usage) usage = data.usage;
    const delta = data.choices?.[0]?.delta;
    if (delta) onDelta(delta);
  });
  return usage;
}

async function readEvents(response, onData) {
  // "data: {...}" lines, a blank line between events, "data: [DONE]" at the end
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    const events = buffered.split("\n\n");
    buffered = events.pop();
    for (const event of events) {
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
      if (data === "[DONE]") return;
      if (data) onData(JSON.parse(data));
    }
  }
}
