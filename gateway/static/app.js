// Gateway playground: one static page, no build step, no external requests.
//
// Modules (plain scripts, loaded in order with `defer`): vendor/ (marked, DOMPurify, highlight.js),
// chat-render.js (window.ChatRender: safe markdown), chat-store.js (window.ChatStore: saved chats),
// chat-params.js (window.ChatParams: the Parameters panel, View code), chat-stream.js (window.ChatStream:
// errors in words, the SSE parser, a stream assembled), inspector.js (window.Inspector, optional), then this
// file (the page).
//
// Inspector contract. Each finished assistant answer keeps an `entry`; its "Inspect" button (shown when
// window.Inspector exists) calls window.Inspector.open(entry) with
//   entry = {
//     request:    the JSON body sent to POST /v1/chat/completions (an object, exactly as sent),
//     response:   the stream assembled as a non-stream chat.completion:
//                 {id, object: "chat.completion", created, model, system_fingerprint,
//                  choices: [{index, message: {role, content, tool_calls?}, logprobs: {content: [...]} | null,
//                             finish_reason}],
//                  usage: {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details} | null,
//                  timings: the last `timings` object of the stream (ns) | null},
//     headers:    the response headers as an object of lower-case names (x-request-id, x-ratelimit-*,
//                 ...; across origins only those in Access-Control-Expose-Headers),
//     request_id: headers["x-request-id"], else response.id,
//   }
// Entries are saved with the chat (dropped first when localStorage is full).
//
// Streaming: fetch() + ReadableStream + the SSE parser of chat-stream.js.
// Stop (button or Esc): AbortController (the gateway sees the connection close and aborts the backend
// request). An answer re-renders at most every RENDER_MS while it streams (chat-render.js morphs the DOM).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const { errorOf, describeHttpError, filterText, sseEvents, headersObject, fold } = ChatStream;
  const els = {
    key: $("api-key"), toggleKey: $("toggle-key"), base: $("api-base"), model: $("model"),
    system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"), newChat: $("new-chat"),
    chatList: $("chat-list"), messages: $("messages"), form: $("composer"), prompt: $("prompt"), send: $("send"),
    stop: $("stop"), status: $("status"), params: $("params"), viewCode: $("view-code"), dialog: $("code-dialog"),
    codeCurl: $("code-curl"), codePython: $("code-python"), tabCurl: $("tab-curl"), tabPython: $("tab-python"),
    copyCode: $("copy-code"), closeCode: $("close-code"), toggleChats: $("toggle-chats"),
    toggleSettings: $("toggle-settings"),
  };
  const LS = { key: "gw.apiKey", base: "gw.apiBase", model: "gw.model", system: "gw.system", temperature: "gw.temperature", maxTokens: "gw.maxTokens" };
  const RENDER_MS = 50;
  const FAILED = new Set(["error", "filtered"]); // turns (question and answer) left out of the conversation

  let chat = null; // the open chat (ChatStore shape)
  let controller = null; // AbortController of the answer in flight

  // ------------------------------------------------------------------ settings
  function load() {
    const q = new URLSearchParams(location.search);
    els.key.value = localStorage.getItem(LS.key) || "";
    els.base.value = q.get("base") || localStorage.getItem(LS.base) || "";
    setModelOptions([], localStorage.getItem(LS.model) || "");
    els.system.value = localStorage.getItem(LS.system) || "";
    els.temperature.value = localStorage.getItem(LS.temperature) || els.temperature.value;
    els.maxTokens.value = localStorage.getItem(LS.maxTokens) || els.maxTokens.value;
    ChatParams.load();
  }
  function save() {
    localStorage.setItem(LS.key, els.key.value.trim());
    localStorage.setItem(LS.base, els.base.value.trim());
    if (els.model.value) localStorage.setItem(LS.model, els.model.value);
    localStorage.setItem(LS.system, els.system.value);
    localStorage.setItem(LS.temperature, els.temperature.value);
    localStorage.setItem(LS.maxTokens, els.maxTokens.value);
    ChatParams.save();
  }
  function apiBase() { return els.base.value.trim().replace(/\/+$/, ""); }
  function url(path) { return apiBase() + path; }
  function authHeaders() {
    const h = { "Content-Type": "application/json" };
    const k = els.key.value.trim();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }
  function setStatus(text) { els.status.textContent = text; }
  // The clipboard API exists only in secure contexts (https, localhost).
  function copyText(text) {
    if (!navigator.clipboard) { setStatus("Copying needs https or localhost: select the text instead."); return; }
    navigator.clipboard.writeText(text).then(() => setStatus("Copied."), () => setStatus("Copy failed."));
  }

  // The model picker: the ids of GET /v1/models, `keep` selected when listed (or kept as the only one).
  function setModelOptions(ids, keep) {
    const list = ids.length ? ids : keep ? [keep] : [];
    els.model.replaceChildren(...list.map((id) => new Option(id, id)));
    els.model.value = list.includes(keep) ? keep : list[0] || "";
  }
  async function loadModels() {
    if (!els.key.value.trim()) { setStatus("Paste an API key to start."); return; }
    try {
      const r = await fetch(url("/v1/models"), { headers: authHeaders() });
      if (!r.ok) { setStatus("Could not list models: " + (await describeHttpError(r))); return; }
      const data = (await r.json()).data || [];
      setModelOptions(data.map((m) => m.id), els.model.value || localStorage.getItem(LS.model) || "");
      setStatus("Ready.");
    } catch (e) {
      setStatus("Could not reach the gateway (" + e.message + ").");
    }
  }

  // ------------------------------------------------------------------ chats
  function openChat(c) {
    if (controller) controller.abort();
    chat = c;
    ChatStore.setCurrent(c.id);
    renderMessages();
    renderChatList();
    closeDrawers();
  }
  function closeDrawers() { // the phone-width panels
    document.body.classList.remove("show-chats", "show-settings");
    els.toggleChats.setAttribute("aria-expanded", "false");
    els.toggleSettings.setAttribute("aria-expanded", "false");
  }
  function persist() {
    store(chat);
    renderChatList();
  }
  function store(c) {
    if (!ChatStore.save(c)) setStatus("This chat is too large for the browser's storage: it is not saved.");
  }
  function renderChatList() {
    const chats = ChatStore.list();
    if (chat && !chats.some((c) => c.id === chat.id)) chats.unshift(chat);
    els.chatList.replaceChildren(...chats.map((c) => {
      const li = document.createElement("li");
      li.dataset.id = c.id;
      if (chat && c.id === chat.id) li.setAttribute("aria-current", "true");
      const open = button(c.title, "chat-open", () => openChat(ChatStore.get(c.id) || c));
      open.title = c.title;
      const rename = button("\u270e", "chat-rename", () => renameChat(li, c), "Rename chat " + c.title);
      const del = button("\u00d7", "chat-delete", () => {
        ChatStore.remove(c.id);
        if (chat && chat.id === c.id) openChat(ChatStore.list()[0] || ChatStore.create());
        else renderChatList();
      }, "Delete chat " + c.title);
      li.append(open, rename, del);
      return li;
    }));
  }
  // An input in place of the title: Enter keeps it (an empty one goes back to the first message), Esc cancels.
  function renameChat(li, c) {
    const input = document.createElement("input");
    input.className = "chat-title";
    input.value = c.title;
    input.setAttribute("aria-label", "Chat title");
    input.addEventListener("keydown", (e) => {
      if (e.key === "Escape") { e.stopPropagation(); renderChatList(); }
      if (e.key !== "Enter") return;
      const target = chat && chat.id === c.id ? chat : ChatStore.get(c.id) || c;
      target.name = input.value.trim() || undefined;
      if (target.messages.length) ChatStore.save(target);
      else target.title = target.name || "New chat";
      renderChatList();
    });
    input.addEventListener("blur", () => { if (input.isConnected) renderChatList(); });
    li.replaceChildren(input);
    input.focus();
    input.select();
  }

  // ------------------------------------------------------------------ DOM
  function button(text, cls, onClick, label) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.textContent = text;
    if (label) b.setAttribute("aria-label", label);
    b.addEventListener("click", onClick);
    return b;
  }
  function scrollDown() { els.messages.scrollTop = els.messages.scrollHeight; }
  function addNotice(div, kind, text) {
    const n = document.createElement("div");
    n.className = "notice " + kind;
    n.textContent = text;
    div.querySelector(".extra").append(n);
    scrollDown();
  }
  function addStats(div, items) {
    const s = document.createElement("div");
    s.className = "stats";
    for (const [name, value] of items) {
      const span = document.createElement("span");
      span.dataset.stat = name;
      span.textContent = value;
      s.append(span);
    }
    div.querySelector(".extra").append(s);
  }
  function addExtras(div, msg) {
    if (msg.tool_calls && msg.tool_calls.length) {
      const pre = document.createElement("pre");
      pre.className = "tool-calls";
      pre.textContent = msg.tool_calls.map((t) => t.function.name + "(" + t.function.arguments + ")").join("\n");
      div.querySelector(".extra").append(pre);
    }
    (msg.alts || []).forEach((text, i) => {
      const d = document.createElement("details");
      d.className = "alt";
      const s = document.createElement("summary");
      s.textContent = "choice " + (i + 1);
      const c = document.createElement("div");
      c.className = "content";
      ChatRender.markdown(c, text);
      d.append(s, c);
      div.querySelector(".extra").append(d);
    });
    for (const [kind, text] of msg.notices || []) addNotice(div, kind, text);
    if (msg.stats && msg.stats.length) addStats(div, msg.stats);
  }
  // The markdown an answer is drawn from: JSON output (response_format) as a fenced json block.
  function markdownOf(msg) {
    return msg.format === "json" && msg.content ? "```json\n" + msg.content + "\n```" : msg.content;
  }
  // The view of chat.messages[i].
  function messageView(i) {
    const msg = chat.messages[i];
    const div = document.createElement("div");
    div.className = "msg " + msg.role;
    if (msg.state) div.dataset.state = msg.state;
    const r = document.createElement("div");
    r.className = "role";
    r.textContent = msg.role;
    const c = document.createElement("div");
    c.className = "content";
    if (msg.role === "assistant") ChatRender.markdown(c, markdownOf(msg));
    else ChatRender.plain(c, msg.content);
    const extra = document.createElement("div");
    extra.className = "extra";
    const actions = document.createElement("div");
    actions.className = "actions";
    div.append(r, c, extra, actions);
    addExtras(div, msg);
    if (msg.role === "user") {
      actions.append(button("Edit", "edit", () => editMessage(div, i), "Edit this message and resend"));
    } else if (msg.state && msg.state !== "streaming") {
      actions.append(button("Regenerate", "regenerate", () => regenerate(i), "Regenerate this answer"));
      actions.append(button("Copy", "copy", () => copyText(msg.content), "Copy this answer"));
      if (msg.entry && window.Inspector && typeof window.Inspector.open === "function") {
        actions.append(button("Inspect", "inspect", () => window.Inspector.open(msg.entry), "Inspect this answer"));
      }
    }
    return div;
  }
  function renderMessages() {
    els.messages.replaceChildren(...chat.messages.map((_, i) => messageView(i)));
    scrollDown();
  }
  function editMessage(div, i) {
    if (controller) return;
    const c = div.querySelector(".content");
    const ta = document.createElement("textarea");
    ta.className = "edit-box";
    ta.setAttribute("aria-label", "Edit the message");
    ta.value = chat.messages[i].content;
    ta.rows = Math.min(12, ta.value.split("\n").length + 1);
    const ok = button("Save & send", "save-edit", () => {
      const text = ta.value.trim();
      if (!text) return;
      chat.messages = chat.messages.slice(0, i + 1);
      chat.messages[i].content = text;
      persist();
      renderMessages();
      generate();
    });
    const cancel = button("Cancel", "cancel-edit", () => renderMessages());
    ta.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); ok.click(); }
      if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); cancel.click(); }
    });
    c.replaceChildren(ta);
    div.querySelector(".actions").replaceChildren(ok, cancel);
    ta.focus();
  }
  function regenerate(i) {
    if (controller) return;
    chat.messages = chat.messages.slice(0, i);
    persist();
    renderMessages();
    generate();
  }
  function busy(on) {
    els.send.disabled = on;
    els.stop.disabled = !on;
  }

  // ------------------------------------------------------------------ requests
  // The body POST /v1/chat/completions gets for the conversation `msgs` (ChatStore messages).
  function requestBody(msgs) {
    const messages = [];
    if (els.system.value.trim()) messages.push({ role: "system", content: els.system.value });
    msgs.forEach((m, i) => {
      const next = msgs[i + 1];
      if (m.role === "assistant" && (FAILED.has(m.state) || !m.content)) return;
      if (m.role === "user" && next && next.role === "assistant" && FAILED.has(next.state)) return; // refused turn
      messages.push({ role: m.role, content: m.content });
    });
    const body = { model: els.model.value || undefined, messages, stream: true, stream_options: { include_usage: true } };
    const t = parseFloat(els.temperature.value);
    if (!isNaN(t)) body.temperature = t;
    const mt = parseInt(els.maxTokens.value, 10);
    if (!isNaN(mt)) body.max_tokens = mt;
    return Object.assign(body, ChatParams.fields());
  }
  // Whether the Parameters panel reads; if not, says why and opens it.
  function paramsOk() {
    try {
      ChatParams.fields();
      return true;
    } catch (e) {
      setStatus("Parameters: " + e.message);
      els.params.open = true;
      return false;
    }
  }
  // Streams an answer to the conversation as it stands (its last message is the user's).
  async function generate() {
    save();
    if (!paramsOk()) return;
    const body = requestBody(chat.messages);
    const owner = chat; // the user may open another chat meanwhile
    const msg = { role: "assistant", content: "", state: "streaming", notices: [], stats: [] };
    if (body.response_format && body.response_format.type !== "text") msg.format = "json"; // shown as a JSON block
    chat.messages.push(msg);
    const div = messageView(chat.messages.length - 1);
    div.setAttribute("aria-busy", "true"); // screen readers read the answer once it is complete
    els.messages.append(div);
    scrollDown();
    const content = div.querySelector(".content");
    let lastRender = 0, timer = null;
    const render = () => {
      timer = null;
      lastRender = performance.now();
      ChatRender.markdown(content, markdownOf(msg));
      scrollDown();
    };
    const schedule = () => {
      if (timer !== null) return;
      const wait = RENDER_MS - (performance.now() - lastRender);
      if (wait <= 0) render();
      else timer = setTimeout(render, wait);
    };

    controller = new AbortController();
    busy(true);
    setStatus("Generating...");
    const t0 = performance.now();
    const resp = { id: null, object: "chat.completion", created: null, model: body.model, system_fingerprint: null, choices: [], usage: null, timings: null };
    let tFirst = null, tLast = null, headers = {};
    let state = "done";
    let retry = false;
    try {
      const r = await fetch(url("/v1/chat/completions"), { method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal: controller.signal });
      headers = headersObject(r.headers);
      if (!r.ok) {
        const err = await errorOf(r);
        if (r.status === 400 && err.param === "inspect" && body.inspect) {
          // a gateway without inspection records: ask again without the extension
          $("p-inspect").checked = false;
          retry = true;
          return;
        }
        const text = await describeHttpError(r, err);
        state = r.status === 400 && text.startsWith("Prompt blocked") ? "filtered" : "error";
        msg.notices.push([state === "filtered" ? "warn" : "error", text]);
        return;
      }
      for await (const data of sseEvents(r.body)) {
        if (data === "[DONE]") break;
        let ev;
        try { ev = JSON.parse(data); } catch (_) { continue; }
        if (ev.error) {
          state = "error";
          msg.notices.push(["error", "Error during generation: " + (ev.error.message || JSON.stringify(ev.error))]);
          continue;
        }
        fold(resp, ev);
        if ((ev.choices || []).some((ch) => ch.delta && (ch.delta.content || ch.delta.tool_calls))) {
          if (tFirst === null) tFirst = performance.now();
          tLast = performance.now();
        }
        const first = resp.choices[0];
        if (first && first.message.content !== msg.content) {
          msg.content = first.message.content;
          schedule();
        }
      }
      const tEnd = performance.now();
      const first = resp.choices[0] || { finish_reason: null };
      if (first.finish_reason === "content_filter") {
        state = "cut";
        const detail = filterText(first.content_filter_results);
        msg.notices.push(["warn", "Answer cut by the content filter (finish_reason content_filter)" + (detail ? ": " + detail : "") + "."]);
      } else if (first.finish_reason === "length") {
        msg.notices.push(["info", "Stopped at max_tokens (finish_reason length)."]);
      }
      const usage = resp.usage;
      if (tFirst !== null) msg.stats.push(["ttft", "TTFT " + Math.round(tFirst - t0) + " ms"]);
      if (usage) {
        const n = usage.completion_tokens;
        const secs = ((tLast !== null ? tLast : tEnd) - (tFirst !== null ? tFirst : t0)) / 1000;
        if (n > 1 && secs > 0) msg.stats.push(["tps", ((n - 1) / secs).toFixed(1) + " tok/s"]);
        msg.stats.push(["prompt", usage.prompt_tokens + " prompt"]);
        msg.stats.push(["completion", n + " completion"]);
        const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
        msg.stats.push(["cached", cached + " cached"]);
      }
    } catch (e) {
      if (e.name === "AbortError") {
        state = "stopped";
        msg.notices.push(["info", "Stopped."]);
      } else {
        state = "error";
        msg.notices.push(["error", "Network error: " + e.message + " (gateway unreachable, or blocked by CORS)."]);
      }
    } finally {
      if (timer !== null) clearTimeout(timer);
      controller = null;
      busy(false);
      if (retry) {
        owner.messages.splice(owner.messages.indexOf(msg), 1);
        div.remove();
        if (owner === chat) generate();
        return;
      }
      const first = resp.choices[0];
      if (first) {
        msg.content = first.message.content;
        if (first.message.tool_calls) msg.tool_calls = first.message.tool_calls;
      }
      const alts = resp.choices.slice(1).filter(Boolean).map((c) => c.message.content);
      if (alts.length) msg.alts = alts;
      msg.state = state;
      if (resp.id || resp.choices.length) {
        msg.entry = { request: body, response: resp, headers, request_id: headers["x-request-id"] || resp.id };
      }
      setStatus({ done: "Ready.", stopped: "Stopped.", error: "Error: see the message.", filtered: "Prompt blocked.",
                  cut: "Answer cut by the content filter." }[state] || state);
      const i = owner.messages.indexOf(msg);
      if (i >= 0) {
        store(owner);
        if (owner === chat && div.isConnected) {
          // in place: the answer's blocks are morphed (no flicker), stats, notices and actions swapped in
          const fresh = messageView(i);
          render();
          div.dataset.state = state;
          div.removeAttribute("aria-busy");
          for (const part of [".extra", ".actions"]) div.querySelector(part).replaceWith(fresh.querySelector(part));
        }
        renderChatList();
      }
      scrollDown();
    }
  }

  function submit(text) {
    chat.messages.push({ role: "user", content: text });
    persist();
    els.messages.append(messageView(chat.messages.length - 1));
    generate();
  }

  // ------------------------------------------------------------------ view code
  function showCode() {
    save();
    const pending = els.prompt.value.trim();
    const msgs = chat.messages.concat(pending ? [{ role: "user", content: pending }] : []);
    if (!paramsOk()) return;
    const body = requestBody(msgs);
    const base = apiBase() || location.origin;
    els.codeCurl.textContent = ChatParams.curl(base + "/v1/chat/completions", body);
    els.codePython.textContent = ChatParams.python(base + "/v1", body);
    els.dialog.showModal();
  }
  function selectTab(python) {
    els.tabCurl.setAttribute("aria-selected", String(!python));
    els.tabPython.setAttribute("aria-selected", String(python));
    els.codeCurl.hidden = python;
    els.codePython.hidden = !python;
  }

  // ------------------------------------------------------------------ wiring
  els.form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = els.prompt.value.trim();
    if (!text || controller || !paramsOk()) return;
    els.prompt.value = "";
    submit(text);
  });
  els.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); els.form.requestSubmit(); }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape" || document.querySelector("dialog[open]")) return; // a dialog closes itself on Esc
    if (controller) { e.preventDefault(); controller.abort(); } else closeDrawers();
  });
  els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  els.newChat.addEventListener("click", () => { openChat(ChatStore.create()); els.prompt.focus(); });
  els.toggleKey.addEventListener("click", () => {
    const show = els.key.type === "password";
    els.key.type = show ? "text" : "password";
    els.toggleKey.textContent = show ? "hide" : "show";
  });
  els.viewCode.addEventListener("click", showCode);
  els.tabCurl.addEventListener("click", () => selectTab(false));
  els.tabPython.addEventListener("click", () => selectTab(true));
  els.closeCode.addEventListener("click", () => els.dialog.close());
  els.copyCode.addEventListener("click", () => {
    copyText((els.codeCurl.hidden ? els.codePython : els.codeCurl).textContent);
  });
  for (const [btn, cls] of [[els.toggleChats, "show-chats"], [els.toggleSettings, "show-settings"]]) {
    btn.addEventListener("click", () => {
      const on = document.body.classList.toggle(cls);
      btn.setAttribute("aria-expanded", String(on));
    });
  }
  for (const el of [els.key, els.base]) el.addEventListener("change", () => { save(); loadModels(); });
  for (const el of [els.model, els.system, els.temperature, els.maxTokens]) el.addEventListener("change", save);
  for (const id of ChatParams.ids()) $(id).addEventListener("change", save);

  load();
  chat = ChatStore.get(ChatStore.currentId()) || ChatStore.list()[0] || ChatStore.create();
  ChatStore.setCurrent(chat.id);
  renderMessages();
  renderChatList();
  loadModels();
})();
