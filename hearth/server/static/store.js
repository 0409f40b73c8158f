// What the page keeps, all in this browser's localStorage under "hearth.*" keys (the server keeps none):
// the settings, the API key, the theme, and the conversations.
"use strict";

export const store = {
  get: (key, fallback) => {
    try { return JSON.parse(localStorage.getItem("hearth." + key)) ?? fallback; } catch { return fallback; }
  },
  set: (key, value) => {
    try { localStorage.setItem("hearth." + key, JSON.stringify(value)); } catch (e) { store.onError(e); }
  },
  onError: (e) => { throw e; },  // the page shows it (the storage may be full)
  remove: (key) => localStorage.removeItem("hearth." + key),
};

const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);  // randomUUID needs https

// The conversations, the most recently used first: [{id, title, messages, updated}]. A message is
// {role, content} and, for a user's, maybe {images} (data URLs), for a reply maybe {reasoning, stats};
// role, content and images are sent back.
// `current` is null for a new chat until its first message is sent (no empty conversations pile up).
export class Conversations {
  constructor() {
    this.all = store.get("conversations", []);
    this.currentId = store.get("current", null);
    const single = store.get("messages", null);  // the page before this one kept one conversation there
    if (single?.length) {
      this.all.unshift({ id: newId(), title: "", messages: single, updated: Date.now() });
      this.currentId = this.all[0].id;
      store.remove("messages");
      this.save();
    }
  }

  get current() {
    return this.all.find((c) => c.id === this.currentId) ?? null;
  }

  get messages() {
    return this.current?.messages ?? [];
  }

  select(id) {
    this.currentId = id;
    this.save();
  }

  // the current conversation, started if there is none
  open() {
    if (!this.current) {
      this.all.unshift({ id: newId(), title: "", messages: [], updated: Date.now() });
      this.currentId = this.all[0].id;
    }
    return this.current;
  }

  // a conversation changed: it goes to the top of the list
  touch(conversation) {
    conversation.updated = Date.now();
    this.all = [conversation, ...this.all.filter((c) => c !== conversation)];
    this.save();
  }

  rename(id, title) {
    const conversation = this.all.find((c) => c.id === id);
    if (conversation) conversation.title = title.trim();
    this.save();
  }

  remove(id) {
    this.all = this.all.filter((c) => c.id !== id);
    if (this.currentId === id) this.currentId = null;
    this.save();
  }

  save() {
    store.set("conversations", this.all);
    store.set("current", this.currentId);
  }

  static title(conversation) {
    const first = conversation.messages.find((m) => m.role === "user");
    return conversation.title || first?.content.trim().split("\n")[0].slice(0, 60) ||
      (first?.images?.length ? "Image" : "New chat");
  }
}
