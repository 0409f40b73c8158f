// hearth's chat page: the conversations in a sidebar, the current one in the middle, streaming
// replies from this server's /v1/chat/completions. Everything it keeps stays in this browser (store.js).
"use strict";

import { modelIds, streamChat, Unauthorized } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { Conversations, store } from "./store.js";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "max_tokens"];
const conversations = new Conversations();
let controller = null;  // aborts the reply being streamed
let pendingRetry = null;  // what to do once an API key is given
let attached = [];  // the images (data URLs) that go with the next message
const narrow = matchMedia("(max-width: 700px)");  // a phone: the sidebar covers the chat, shown when asked

function element(tag, className = "", text = "") {
  const node = document.createElement(tag);
  node.className = className;
  node.textContent = text;
  return node;
}

function button(text, title, onClick) {
  const node = element("button", "", text);
  node.type = "button";
  node.title = title;
  node.addEventListener("click", onClick);
  return node;
}

// ---- the sidebar: every conversation, the current one marked; select, rename, delete

function showConversations() {
  $("conversations").replaceChildren(...conversations.all.map((conversation) => {
    const item = element("li", conversation.id === conversations.currentId ? "current" : "");
    item.dataset.id = conversation.id;
    const title = button(Conversations.title(conversation), "Open", () => switchTo(conversation.id));
    title.className = "title";
    const rename = button("✎", "Rename", () => startRename(item, conversation));
    rename.className = "rename";
    const remove = button("✕", "Delete", () => {
      if (!confirm(`Delete "${Conversations.title(conversation)}"?`)) return;
      if (conversation.id === conversations.currentId) switchTo(null);
      conversations.remove(conversation.id);
      showConversations();
    });
    remove.className = "delete";
    item.append(title, rename, remove);
    return item;
  }));
}

function startRename(item, conversation) {
  const input = element("input", "rename-input");
  input.value = Conversations.title(conversation);
  item.querySelector(".title").replaceWith(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) conversations.rename(conversation.id, input.value);
    showConversations();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    else if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
}

function switchTo(id) {  // null: a new chat, kept once its first message is sent
  controller?.abort();
  if (narrow.matches) $("sidebar").hidden = true;
  conversations.select(id);
  showError("");
  showAll();
}

// ---- the messages of the current conversation

function showAll() {
  const messages = conversations.messages;
  $("messages").replaceChildren(...messages.map((message, index) => {
    const box = messageBox(message);
    box.dataset.index = index;
    const actions = box.querySelector(".actions");
    actions.append(button("Copy", "Copy the text", (event) => copy(message.content, event.target)));
    if (message.role === "user") actions.append(button("Edit", "Edit and send again from here", () => edit(index)));
    if (index === messages.length - 1) {  // the last reply is replaced; a message left unanswered is answered
      const from = message.role === "assistant" ? index : messages.length;
      actions.append(button("Regenerate", "Answer again from here", () => regenerate(from)));
    }
    return box;
  }));
  showConversations();
  scrollDown(true);
}

function messageBox(message) {
  const box = element("div", "message " + message.role);
  const reasoning = element("details", "reasoning");
  reasoning.append(element("summary", "", "Reasoning"), element("div", "reasoning-body"));
  const meta = element("div", "meta");
  meta.append(element("span", "stats"), element("span", "actions"));
  box.append(element("div", "role", message.role), reasoning, element("div", "body"), meta);
  fill(box, message);
  return box;
}

function fill(box, message) {
  const reasoning = box.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  if (message.reasoning) reasoning.querySelector(".reasoning-body").innerHTML = renderMarkdown(message.reasoning);
  const body = box.querySelector(".body");
  if (message.role === "assistant") {
    body.innerHTML = renderMarkdown(message.content);
    for (const pre of body.querySelectorAll("pre")) {
      const code = pre.firstChild;
      pre.prepend(button("Copy", "Copy the code", (event) => copy(code.textContent, event.target)));
    }
  } else {
    body.textContent = message.content;
    if (message.images?.length) {
      const row = element("div", "images");
      row.append(...message.images.map(thumbnail));
      body.prepend(row);
    }
  }
  box.querySelector(".stats").textContent = message.stats ? statsText(message.stats) : "";
}

function statsText({ tokens, exact, ttft_ms, tokens_per_s, stopped }) {
  const rate = tokens_per_s == null ? "" : ` · ${tokens_per_s.toFixed(1)} tokens/s`;
  return `${exact ? "" : "~"}${tokens} tokens${rate} · TTFT ${ttft_ms} ms${stopped ? " · stopped" : ""}`;
}

function scrollDown(always = false) {
  const view = $("messages");
  if (always || view.scrollHeight - view.scrollTop - view.clientHeight < 80) view.scrollTop = view.scrollHeight;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function thumbnail(url) {
  const image = element("img", "thumb");
  image.src = url;
  image.alt = "an attached image";
  return image;
}

// ---- images attached to the next message: thumbnails, each with a button that removes it

function showAttachments() {
  $("attachments").hidden = !attached.length;
  $("attachments").replaceChildren(...attached.map((url, index) => {
    const item = element("span", "attachment");
    item.append(thumbnail(url), button("✕", "Remove the image", () => {
      attached.splice(index, 1);
      showAttachments();
    }));
    return item;
  }));
}

function dataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach() {
  const files = [...$("attach-input").files];
  $("attach-input").value = "";  // the same file may be chosen again
  for (const file of files) {
    if (file.type.startsWith("image/")) attached.push(await dataURL(file));
    else showError(`${file.name} is not an image`);
  }
  showAttachments();
}

// ---- what the buttons on a message do

async function copy(text, target) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {  // no clipboard API off https (other than localhost): the older way
    const area = element("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  target.textContent = "Copied";
  setTimeout(() => { target.textContent = "Copy"; }, 1500);
}

function edit(index) {
  if (controller) return;
  const box = $("messages").children[index];
  const area = element("textarea", "editor");
  const { content, images } = conversations.messages[index];  // the images stay with the edited text
  area.value = content;
  area.rows = Math.min(12, area.value.split("\n").length + 1);
  const send = button("Send", "Send the edited message; the replies after it are dropped", () => {
    const text = area.value.trim();
    if (text || images?.length) resendFrom(index, { role: "user", content: text, ...(images ? { images } : {}) });
  });
  send.className = "primary";
  box.querySelector(".body").replaceWith(area);
  box.querySelector(".actions").replaceChildren(send, button("Cancel", "Keep the message as it was", showAll));
  area.focus();
}

function regenerate(index) {
  if (!controller) resendFrom(index, null);
}

// the conversation up to `index` (and `message`, if given) is kept, and answered anew
function resendFrom(index, message) {
  const conversation = conversations.current;
  conversation.messages = conversation.messages.slice(0, index).concat(message ? [message] : []);
  conversations.touch(conversation);
  showError("");
  showAll();
  reply();
}

// ---- talking to the server

function askForKey(retry) {
  pendingRetry = retry;
  $("key-form").hidden = false;
  $("key").focus();
}

async function loadModels() {
  try {
    const chosen = store.get("model", null);
    $("model").replaceChildren(...(await modelIds()).map((id) => new Option(id, id, false, id === chosen)));
  } catch (e) {
    if (e instanceof Unauthorized) askForKey(loadModels);
    else showError(e.message);
  }
}

// a message with images: its text and its images as parts (image_url parts of data URLs)
function apiMessage({ role, content, images }) {
  if (!images?.length) return { role, content };
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return { role, content: content ? [{ type: "text", text: content }, ...parts] : parts };
}

function requestBody(messages) {
  const system = $("system").value.trim();
  const body = {
    model: $("model").value || undefined,
    messages: [...(system ? [{ role: "system", content: system }] : []), ...messages.map(apiMessage)],
  };
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  return body;
}

// TTFT: from sending to the first token, as this browser saw it; tokens/s: the tokens after the first
// over the time between the first and the last. Tokens are the server's count (its usage); a stopped
// reply has none, and counts its deltas instead ("~").
function replyStats(clock, usage, stopped) {
  const tokens = usage?.completion_tokens ?? clock.deltas;
  const seconds = (clock.last - clock.first) / 1000;
  return {
    tokens, exact: usage !== null, stopped, ttft_ms: Math.round(clock.first - clock.start),
    tokens_per_s: tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null,
  };
}

async function reply() {
  const conversation = conversations.open();
  const answer = { role: "assistant", content: "" };
  const box = messageBox(answer);
  box.classList.add("streaming");
  $("messages").append(box);
  scrollDown(true);
  controller = new AbortController();
  setBusy(true);
  const clock = { start: performance.now(), first: null, last: null, deltas: 0 };
  let usage = null;
  let error = null;
  try {
    usage = await streamChat(requestBody(conversation.messages), controller.signal, (delta) => {
      if (!delta.content && !delta.reasoning_content) return;
      clock.last = performance.now();
      clock.first ??= clock.last;
      clock.deltas++;
      answer.content += delta.content ?? "";
      if (delta.reasoning_content) answer.reasoning = (answer.reasoning ?? "") + delta.reasoning_content;
      fill(box, answer);
      scrollDown();
    });
  } catch (e) {
    if (e.name !== "AbortError") error = e;
  }
  controller = null;
  setBusy(false);
  if (clock.first !== null && conversations.all.includes(conversation)) {  // not deleted meanwhile
    answer.stats = replyStats(clock, usage, usage === null && error === null);
    conversation.messages.push(answer);
    conversations.touch(conversation);
  }
  showAll();
  if (error instanceof Unauthorized) askForKey(reply);
  else if (error) showError(error.message);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("attach").disabled = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

// ---- the controls

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if ((!text && !attached.length) || controller) return;
  showError("");
  const conversation = conversations.open();
  conversation.messages.push({ role: "user", content: text, ...(attached.length ? { images: attached } : {}) });
  conversations.touch(conversation);
  $("prompt").value = "";
  attached = [];
  showAttachments();
  showAll();
  reply();
}

function toggleTheme() {
  const classes = document.documentElement.classList;
  const dark = classes.contains("dark") || (!classes.contains("light") && matchMedia("(prefers-color-scheme: dark)").matches);
  classes.remove("dark", "light");
  classes.add(dark ? "light" : "dark");
  store.set("theme", dark ? "light" : "dark");
}

function useKey(event) {
  event.preventDefault();
  store.set("key", $("key").value.trim());
  $("key").value = "";
  $("key-form").hidden = true;
  const retry = pendingRetry;
  pendingRetry = null;
  retry?.();
  if (retry !== loadModels) loadModels();
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller?.abort());
$("attach").addEventListener("click", () => $("attach-input").click());
$("attach-input").addEventListener("change", attach);
$("new-chat").addEventListener("click", () => switchTo(null));
$("toggle-sidebar").addEventListener("click", () => { $("sidebar").hidden = !$("sidebar").hidden; });
$("toggle-settings").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
$("toggle-theme").addEventListener("click", toggleTheme);
$("model").addEventListener("change", () => store.set("model", $("model").value));
$("forget-key").addEventListener("click", () => { store.remove("key"); askForKey(null); });
$("key-form").addEventListener("submit", useKey);
for (const name of SETTINGS) {
  $(name).value = store.get("setting." + name, $(name).value);
  $(name).addEventListener("change", () => store.set("setting." + name, $(name).value));
}

store.onError = (e) => showError(`This browser did not keep the conversation (${e.message}): delete some.`);
$("sidebar").hidden = narrow.matches;
showAll();
loadModels();
