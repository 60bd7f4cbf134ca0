// Gateway playground: one static page, no build step, no external requests.
// Streaming: fetch() + ReadableStream + an SSE parser following the WHATWG HTML
// "event stream interpretation" (https://html.spec.whatwg.org/multipage/server-sent-events.html).
// Stop: AbortController (the gateway sees the connection close and aborts the backend request).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const els = {
    key: $("api-key"), toggleKey: $("toggle-key"), base: $("api-base"), model: $("model"), models: $("models"),
    system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"), clear: $("clear"),
    messages: $("messages"), form: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"), status: $("status"),
  };
  const LS = { key: "gw.apiKey", base: "gw.apiBase", model: "gw.model", system: "gw.system", temperature: "gw.temperature", maxTokens: "gw.maxTokens" };

  let history = []; // [{role, content}] of finished turns (system prompt is added per request)
  let controller = null; // AbortController of the answer in flight

  // ------------------------------------------------------------------ settings
  function load() {
    const q = new URLSearchParams(location.search);
    els.key.value = localStorage.getItem(LS.key) || "";
    els.base.value = q.get("base") || localStorage.getItem(LS.base) || "";
    els.model.value = localStorage.getItem(LS.model) || "";
    els.system.value = localStorage.getItem(LS.system) || "";
    els.temperature.value = localStorage.getItem(LS.temperature) || els.temperature.value;
    els.maxTokens.value = localStorage.getItem(LS.maxTokens) || els.maxTokens.value;
  }
  function save() {
    localStorage.setItem(LS.key, els.key.value.trim());
    localStorage.setItem(LS.base, els.base.value.trim());
    localStorage.setItem(LS.model, els.model.value.trim());
    localStorage.setItem(LS.system, els.system.value);
    localStorage.setItem(LS.temperature, els.temperature.value);
    localStorage.setItem(LS.maxTokens, els.maxTokens.value);
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

  async function loadModels() {
    if (!els.key.value.trim()) { setStatus("Paste an API key to start."); return; }
    try {
      const r = await fetch(url("/v1/models"), { headers: authHeaders() });
      if (!r.ok) { setStatus("Could not list models: " + (await describeHttpError(r))); return; }
      const data = (await r.json()).data || [];
      els.models.replaceChildren(...data.map((m) => { const o = document.createElement("option"); o.value = m.id; return o; }));
      if (!els.model.value && data.length) els.model.value = data[0].id;
      els.model.placeholder = data.length ? data[0].id : "model id";
      setStatus("Ready.");
    } catch (e) {
      setStatus("Could not reach the gateway (" + e.message + ").");
    }
  }

  // ------------------------------------------------------------------ DOM
  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    const r = document.createElement("div");
    r.className = "role";
    r.textContent = role;
    const c = document.createElement("div");
    c.className = "content";
    c.textContent = text || "";
    div.append(r, c);
    els.messages.append(div);
    els.messages.scrollTop = els.messages.scrollHeight;
    return div;
  }
  function addNotice(msgDiv, kind, text) {
    const n = document.createElement("div");
    n.className = "notice " + kind;
    n.textContent = text;
    msgDiv.append(n);
    els.messages.scrollTop = els.messages.scrollHeight;
    return n;
  }
  function addStats(msgDiv, items) {
    const s = document.createElement("div");
    s.className = "stats";
    for (const [name, value] of items) {
      const span = document.createElement("span");
      span.dataset.stat = name;
      span.textContent = value;
      s.append(span);
    }
    msgDiv.append(s);
  }
  function busy(on) {
    els.send.disabled = on;
    els.stop.disabled = !on;
  }

  // ------------------------------------------------------------------ errors
  function retrySeconds(r) {
    const ms = r.headers.get("retry-after-ms");
    if (ms !== null && ms !== "" && !isNaN(Number(ms))) return Number(ms) / 1000;
    const s = r.headers.get("retry-after");
    if (s === null || s === "") return null;
    if (!isNaN(Number(s))) return Number(s);
    const d = Date.parse(s); // HTTP-date form
    return isNaN(d) ? null : Math.max(0, (d - Date.now()) / 1000);
  }
  function filterText(result) {
    // Azure-style content_filter_result(s): {category: {filtered, hook, ...}}
    if (!result || typeof result !== "object") return "";
    const parts = [];
    for (const [cat, v] of Object.entries(result)) {
      if (v && typeof v === "object" && v.filtered) parts.push("category " + cat + (v.hook ? " (hook " + v.hook + ")" : ""));
    }
    return parts.join(", ");
  }
  async function describeHttpError(r) {
    let err = {};
    try { err = (await r.json()).error || {}; } catch (_) { /* not JSON */ }
    const msg = err.message || r.statusText || "error";
    if (r.status === 401) return "Authentication failed (401): " + msg + " Check the API key.";
    if (r.status === 429) {
      const s = retrySeconds(r);
      return "Rate limited (429): " + msg + (s !== null ? " Retry after " + (Math.round(s * 10) / 10) + " s." : "");
    }
    if (r.status === 400 && err.code === "content_filter") {
      const detail = filterText(err.innererror && err.innererror.content_filter_result);
      return "Prompt blocked by the content filter (400)" + (detail ? ": " + detail : "") + ".";
    }
    return "Error " + r.status + (err.code ? " " + err.code : "") + ": " + msg;
  }

  // ------------------------------------------------------------------ SSE
  // Yields the data of each event (WHATWG: lines end in CRLF, LF or CR; "data:" lines are joined
  // with "\n"; one leading space is dropped; ":" lines are comments (heartbeats); blank line ends an event).
  async function* sseEvents(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let m;
      while ((m = /\r\n|\n|\r/.exec(buf)) !== null) {
        if (m[0] === "\r" && m.index === buf.length - 1) break; // maybe the first half of CRLF
        const line = buf.slice(0, m.index);
        buf = buf.slice(m.index + m[0].length);
        if (line === "") {
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith(":")) {
          continue;
        } else {
          const i = line.indexOf(":");
          const field = i < 0 ? line : line.slice(0, i);
          let v = i < 0 ? "" : line.slice(i + 1);
          if (v.startsWith(" ")) v = v.slice(1);
          if (field === "data") data.push(v);
        }
      }
    }
    if (data.length) yield data.join("\n");
  }

  // ------------------------------------------------------------------ chat
  async function send(text) {
    save();
    const userMsg = { role: "user", content: text };
    addMessage("user", text);
    const div = addMessage("assistant", "");
    div.dataset.state = "streaming";
    const content = div.querySelector(".content");
    const messages = [];
    if (els.system.value.trim()) messages.push({ role: "system", content: els.system.value });
    messages.push(...history, userMsg);
    const body = { model: els.model.value.trim() || undefined, messages, stream: true, stream_options: { include_usage: true } };
    const t = parseFloat(els.temperature.value);
    if (!isNaN(t)) body.temperature = t;
    const mt = parseInt(els.maxTokens.value, 10);
    if (!isNaN(mt)) body.max_tokens = mt;

    controller = new AbortController();
    busy(true);
    setStatus("Generating...");
    const t0 = performance.now();
    let tFirst = null, tLast = null, usage = null, finish = null, filterResult = null, answer = "", state = "done";
    try {
      const r = await fetch(url("/v1/chat/completions"), { method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal: controller.signal });
      if (!r.ok) {
        const text = await describeHttpError(r);
        state = r.status === 400 && text.startsWith("Prompt blocked") ? "filtered" : "error";
        addNotice(div, state === "filtered" ? "warn" : "error", text);
        return;
      }
      for await (const data of sseEvents(r.body)) {
        if (data === "[DONE]") break;
        let ev;
        try { ev = JSON.parse(data); } catch (_) { continue; }
        if (ev.error) {
          state = "error";
          addNotice(div, "error", "Error during generation: " + (ev.error.message || JSON.stringify(ev.error)));
          continue;
        }
        if (ev.usage) usage = ev.usage;
        for (const ch of ev.choices || []) {
          const d = ch.delta || {};
          if (d.content) {
            if (tFirst === null) tFirst = performance.now();
            tLast = performance.now();
            answer += d.content;
            content.append(document.createTextNode(d.content)); // one DOM update per delta
            els.messages.scrollTop = els.messages.scrollHeight;
          }
          if (ch.finish_reason) finish = ch.finish_reason;
          if (ch.content_filter_results) filterResult = ch.content_filter_results;
        }
      }
      const tEnd = performance.now();
      if (finish === "content_filter") {
        state = "cut";
        const detail = filterText(filterResult);
        addNotice(div, "warn", "Answer cut by the content filter (finish_reason content_filter)" + (detail ? ": " + detail : "") + ".");
      } else if (finish === "length") {
        addNotice(div, "info", "Stopped at max_tokens (finish_reason length).");
      }
      const stats = [];
      if (tFirst !== null) stats.push(["ttft", "TTFT " + Math.round(tFirst - t0) + " ms"]);
      if (usage) {
        const n = usage.completion_tokens;
        const secs = ((tLast !== null ? tLast : tEnd) - (tFirst !== null ? tFirst : t0)) / 1000;
        if (n > 1 && secs > 0) stats.push(["tps", ((n - 1) / secs).toFixed(1) + " tok/s"]);
        stats.push(["prompt", usage.prompt_tokens + " prompt"]);
        stats.push(["completion", n + " completion"]);
        const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
        stats.push(["cached", cached + " cached"]);
      }
      if (stats.length) addStats(div, stats);
    } catch (e) {
      if (e.name === "AbortError") {
        state = "stopped";
        addNotice(div, "info", "Stopped.");
      } else {
        state = "error";
        addNotice(div, "error", "Network error: " + e.message + " (gateway unreachable, or blocked by CORS).");
      }
    } finally {
      controller = null;
      busy(false);
      div.dataset.state = state;
      setStatus({ done: "Ready.", stopped: "Stopped.", error: "Error: see the message.", filtered: "Prompt blocked.",
                  cut: "Answer cut by the content filter." }[state] || state);
      if (state !== "error" && state !== "filtered") {
        history.push(userMsg);
        if (answer) history.push({ role: "assistant", content: answer });
      }
    }
  }

  // ------------------------------------------------------------------ wiring
  els.form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = els.prompt.value.trim();
    if (!text || controller) return;
    els.prompt.value = "";
    send(text);
  });
  els.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); els.form.requestSubmit(); }
  });
  els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  els.clear.addEventListener("click", () => { if (controller) controller.abort(); history = []; els.messages.replaceChildren(); });
  els.toggleKey.addEventListener("click", () => {
    const show = els.key.type === "password";
    els.key.type = show ? "text" : "password";
    els.toggleKey.textContent = show ? "hide" : "show";
  });
  for (const el of [els.key, els.base]) el.addEventListener("change", () => { save(); loadModels(); });
  for (const el of [els.model, els.system, els.temperature, els.maxTokens]) el.addEventListener("change", save);

  load();
  loadModels();
})();
