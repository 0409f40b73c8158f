// hearth's chat page: talks to this server's /v1/chat/completions, streaming. The conversation,
// the settings and the API key stay in this browser (localStorage); nothing else keeps them.
"use strict";

const $ = (id) => document.getElementById(id);
const store = {
  get: (key, fallback) => { try { return JSON.parse(localStorage.getItem("hearth." + key)) ?? fallback; } catch { return fallback; } },
  set: (key, value) => localStorage.setItem("hearth." + key, JSON.stringify(value)),
};
const SETTINGS = ["system", "temperature", "top_p", "max_tokens"];
let messages = store.get("messages", []);  // [{role, content}], the system prompt not among them
let controller = null;  // aborts the reply being streamed
let pendingRetry = null;  // what to do once an API key is given

// ---- markdown: a small renderer; every piece of the text is HTML-escaped before markup is added

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function inline(text) {
  return text.split(/(`[^`\n]+`)/).map((part) => {
    if (part.length > 1 && part.startsWith("`") && part.endsWith("`")) return "<code>" + escapeHtml(part.slice(1, -1)) + "</code>";
    return escapeHtml(part)
      .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
  }).join("");
}

function renderMarkdown(source) {
  const lines = source.split("\n");
  const html = [];
  let i = 0;
  const listOf = (pattern, tag) => {
    const items = [];
    while (i < lines.length && pattern.test(lines[i])) items.push("<li>" + inline(lines[i++].replace(pattern, "")) + "</li>");
    html.push(`<${tag}>${items.join("")}</${tag}>`);
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    if (fence) {
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      i++;  // the closing fence (a reply still streaming may not have written it yet)
      const language = fence[1] ? ` class="language-${escapeHtml(fence[1])}"` : "";
      html.push(`<pre><code${language}>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if (/^#{1,6}\s/.test(line)) {
      const level = line.match(/^#+/)[0].length;
      html.push(`<h${level}>${inline(line.slice(level).trim())}</h${level}>`);
      i++;
    } else if (/^\s*[-*+]\s+/.test(line)) {
      listOf(/^\s*[-*+]\s+/, "ul");
    } else if (/^\s*\d+[.)]\s+/.test(line)) {
      listOf(/^\s*\d+[.)]\s+/, "ol");
    } else if (!line.trim()) {
      i++;
    } else {
      const paragraph = [];
      while (i < lines.length && lines[i].trim() && !/^\s*(```|#{1,6}\s|[-*+]\s|\d+[.)]\s)/.test(lines[i])) paragraph.push(inline(lines[i++]));
      html.push("<p>" + paragraph.join("<br>") + "</p>");
    }
  }
  return html.join("");
}

// ---- the conversation on the page

function showMessage(message) {
  const box = document.createElement("div");
  box.className = "message " + message.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const body = document.createElement("div");
  body.className = "body";
  box.append(role, body);
  $("messages").append(box);
  fill(body, message);
  return body;
}

function fill(body, message) {
  if (message.role === "assistant") body.innerHTML = renderMarkdown(message.content);
  else body.textContent = message.content;
  $("messages").scrollTop = $("messages").scrollHeight;
}

function showAll() {
  $("messages").replaceChildren();
  messages.forEach(showMessage);
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

// ---- talking to the server

function headers() {
  const key = store.get("key", "");
  return { "Content-Type": "application/json", ...(key ? { Authorization: "Bearer " + key } : {}) };
}

function askForKey(retry) {
  pendingRetry = retry;
  $("key-form").hidden = false;
  $("key").focus();
}

async function errorText(response) {
  try { return (await response.json()).error.message; } catch { return `${response.status} ${response.statusText}`; }
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) return askForKey(loadModels);
  if (!response.ok) return showError(await errorText(response));
  const chosen = store.get("model", null);
  $("model").replaceChildren(...(await response.json()).data.map((m) => new Option(m.id, m.id, false, m.id === chosen)));
}

function requestBody() {
  const system = $("system").value.trim();
  const body = {
    model: $("model").value || undefined,
    messages: [...(system ? [{ role: "system", content: system }] : []), ...messages],
    stream: true,
  };
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  return body;
}

async function reply() {
  const answer = { role: "assistant", content: "" };
  const body = showMessage(answer);
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (response.status === 401) { body.parentElement.remove(); return askForKey(reply); }
    if (!response.ok) { body.parentElement.remove(); return showError(await errorText(response)); }
    await readEvents(response, (data) => {
      if (data.error) throw new Error(data.error.message);
      const delta = data.choices?.[0]?.delta;
      if (delta?.content) { answer.content += delta.content; fill(body, answer); }
    });
  } catch (e) {
    if (e.name !== "AbortError") showError(String(e.message || e));
  } finally {
    controller = null;
    setBusy(false);
    if (answer.content) { messages.push(answer); store.set("messages", messages); }
    else if (body.isConnected) body.parentElement.remove();
  }
}

async function readEvents(response, onData) {
  // server-sent events: "data: {...}" lines, a blank line between events, "[DONE]" at the end
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

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

// ---- the controls

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  showError("");
  const message = { role: "user", content: text };
  messages.push(message);
  store.set("messages", messages);
  showMessage(message);
  $("prompt").value = "";
  reply();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => {
  controller?.abort();
  messages = [];
  store.set("messages", messages);
  showAll();
  showError("");
});
$("toggle-settings").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
$("model").addEventListener("change", () => store.set("model", $("model").value));
$("forget-key").addEventListener("click", () => { localStorage.removeItem("hearth.key"); askForKey(null); });
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  store.set("key", $("key").value.trim());
  $("key").value = "";
  $("key-form").hidden = true;
  const retry = pendingRetry;
  pendingRetry = null;
  retry?.();
  if (retry !== loadModels) loadModels();
});
for (const name of SETTINGS) {
  $(name).value = store.get("setting." + name, $(name).value);
  $(name).addEventListener("change", () => store.set("setting." + name, $(name).value));
}

showAll();
loadModels();
