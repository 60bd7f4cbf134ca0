// Saved chats in localStorage.
//
// "gw.chats": JSON array of chats, "gw.chat": the id of the open one. A chat:
//   {id: string, title: string, name?: string (a title the user gave), created: ms, updated: ms,
//    messages: Message[]}
// A message:
//   {role: "user"|"assistant", content: string, state?: "done"|"stopped"|"error"|"filtered"|"cut",
//    stats?: [[name, text]], notices?: [[kind, text]], alts?: string[] (choices 1..n-1),
//    tool_calls?: object[], entry?: {request, response, headers, request_id} (see app.js)}
// The title is the user's `name`, else the first line of the first user message (48 characters at most).
// Writing past the storage quota (DOMException QuotaExceededError) drops the inspector entries (the
// largest part: logprobs) of every chat, then the oldest chats, until the write fits (save() answers false
// when the one chat alone does not fit).
"use strict";

(() => {
  const KEY = "gw.chats";
  const CURRENT = "gw.chat";

  function all() {
    try {
      const v = JSON.parse(localStorage.getItem(KEY) || "[]");
      return Array.isArray(v) ? v.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
    } catch (_) {
      return [];
    }
  }

  function write(chats) {
    for (;;) {
      try {
        localStorage.setItem(KEY, JSON.stringify(chats));
        return true;
      } catch (e) {
        const withEntry = chats.some((c) => c.messages.some((m) => m.entry));
        if (withEntry) chats.forEach((c) => c.messages.forEach((m) => delete m.entry));
        else if (chats.length > 1) chats.sort((a, b) => b.updated - a.updated).pop();
        else return false;
      }
    }
  }

  function titleOf(chat) {
    if (chat.name) return chat.name;
    const first = chat.messages.find((m) => m.role === "user" && m.content.trim());
    if (!first) return "New chat";
    const line = first.content.trim().split("\n")[0];
    return line.length > 48 ? line.slice(0, 47) + "\u2026" : line;
  }

  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  const ChatStore = {
    /** Chats, the most recently updated first. */
    list() { return all().sort((a, b) => b.updated - a.updated); },
    get(id) { return all().find((c) => c.id === id) || null; },
    create() {
      const now = Date.now();
      return { id: newId(), title: "New chat", created: now, updated: now, messages: [] };
    },
    /** Stores `chat` (a chat without messages is not kept); false when even the chat alone does not fit. */
    save(chat) {
      chat.title = titleOf(chat);
      chat.updated = Date.now();
      const chats = all().filter((c) => c.id !== chat.id);
      if (chat.messages.length) chats.push(chat);
      return write(chats);
    },
    remove(id) { return write(all().filter((c) => c.id !== id)); },
    currentId() { return localStorage.getItem(CURRENT); },
    setCurrent(id) { localStorage.setItem(CURRENT, id); },
  };

  window.ChatStore = ChatStore;
})();
