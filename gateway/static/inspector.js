// The inspector: one answer's pipeline, read from its inspection record (GET /v1/inspect/{id}, a gateway
// extension: the request was sent with "inspect": true) and from the answer itself.
//
//   window.Inspector.open(entry)   entry = {request, response, headers, request_id[, api: {base, key}]}
//                                  (the playground's contract, app.js); returns a Promise that settles
//                                  once the panel is drawn.
//   window.Inspector.close()
//
// The panel (a modal <dialog>, Esc closes it) shows:
//   * the exact prompt the model read: one span per token (boundaries shaded in turn), its id and position
//     on hover (title), special tokens highlighted, the first `cached_tokens` tokens marked as served from
//     the prefix cache;
//   * the timeline (an SVG drawn here, ms since the request reached the gateway): gateway preparation,
//     queue wait, each prompt chunk with its token count, the first token (TTFT, the response's
//     `timings.ttft_duration`), each decode step, preemptions, the finish with its reason;
//   * each output token coloured by the probability of the token chosen, its top alternatives on hover
//     (the response's logprobs; none when the request did not ask for logprobs);
//   * the usage and the tenant's remaining limits (the x-ratelimit-* response headers).
// Nothing but the record is fetched, from the same API base and key the playground uses.
"use strict";

(() => {
  const NS_PER_MS = 1e6;
  let dialog = null;

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const k of kids) if (k !== null && k !== undefined) e.append(k);
    return e;
  }
  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function ms(ns) { return (ns / NS_PER_MS).toFixed(1) + " ms"; }
  function ttftLabel(ns) { return "TTFT " + ms(ns); }

  // ------------------------------------------------------------------ where the record lives
  function api(entry) {
    if (entry.api) return { base: (entry.api.base || "").replace(/\/+$/, ""), key: entry.api.key || "" };
    const val = (id, ls) => {
      const input = document.getElementById(id);
      return ((input && input.value) || localStorage.getItem(ls) || "").trim();
    };
    return { base: val("api-base", "gw.apiBase").replace(/\/+$/, ""), key: val("api-key", "gw.apiKey") };
  }

  async function fetchRecord(entry) {
    const id = entry.request_id || (entry.response && entry.response.id);
    if (!id) return { error: "This answer has no request id." };
    const { base, key } = api(entry);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    try {
      const r = await fetch(base + "/v1/inspect/" + encodeURIComponent(id), { headers });
      if (r.ok) return { record: await r.json() };
      let msg = "HTTP " + r.status;
      try { msg = (await r.json()).error.message || msg; } catch (_) { /* not JSON */ }
      if (r.status === 404) {
        msg = 'No inspection record for this answer (ask with "inspect": true; records are kept 10 min). ' + msg;
      }
      return { error: msg };
    } catch (e) {
      return { error: "Could not reach the gateway (" + e.message + ")." };
    }
  }

  // ------------------------------------------------------------------ sections
  function section(title, ...kids) {
    return el("section", { class: "insp-section", "aria-label": title }, el("h3", { text: title }), ...kids);
  }

  function promptSection(rec) {
    const p = rec.prompt;
    const special = new Set(p.special);
    const box = el("div", { class: "insp-prompt", role: "list", "aria-label": "Prompt tokens" });
    p.tokens.forEach((text, i) => {
      const cls = ["tok", i % 2 ? "odd" : "even"];
      if (special.has(i)) cls.push("special");
      if (i < p.cached_tokens) cls.push("cached");
      const shown = text === "" ? "\u00b7" : text; // a byte of a split character: a dot holds its place
      box.append(el("span", {
        class: cls.join(" "), role: "listitem", "data-id": p.token_ids[i],
        title: "#" + i + "  id " + p.token_ids[i] + (special.has(i) ? "  special" : "") +
          (i < p.cached_tokens ? "  cached" : "") + "  " + JSON.stringify(text),
      }, shown));
    });
    const legend = el("p", { class: "insp-legend" },
      el("span", { class: "insp-count", "data-count": "prompt", text: p.token_ids.length + " tokens" }), " \u00b7 ",
      el("span", { class: "tok cached", "data-count": "cached", text: p.cached_tokens + " cached" }), " \u00b7 ",
      el("span", { class: "tok special", text: special.size + " special" }),
      " \u00b7 hover a token for its id");
    return section("Prompt as the model read it", legend, box);
  }

  // The timeline of one choice (a picker when there are several) as rows of an SVG chart.
  function timelineSection(rec) {
    const wrap = section("Timeline");
    const body = el("div", { class: "insp-tl" });
    const choices = rec.choices || [];
    if (choices.length > 1) {
      const pick = el("select", { class: "insp-choice", "aria-label": "Choice" },
        ...choices.map((c, i) => el("option", { value: String(i), text: "choice " + c.index })));
      pick.addEventListener("change", () => body.replaceChildren(...drawTimeline(rec, choices[Number(pick.value)])));
      wrap.append(el("label", { class: "insp-pick" }, "Choice ", pick));
    }
    body.replaceChildren(...drawTimeline(rec, choices[0]));
    wrap.append(body);
    return wrap;
  }

  function drawTimeline(rec, choice) {
    const timings = rec.timings || {};
    const t = choice && choice.timeline;
    const ttft = timings.ttft_duration;
    if (!t) return [el("p", { class: "insp-note", text: "The backend sent no timeline for this answer." })];
    const end = Math.max(t.finish, timings.total_duration || 0, ttft || 0, 1);
    // drawn at the panel's width (no scaling: 11 px labels stay 11 px), at least 640 px (scrolls on a phone)
    const room = dialog ? dialog.querySelector(".insp-body").clientWidth - 36 : 900;
    const W = Math.max(640, Math.round(room)), left = 90, right = 20, rowH = 22, rows = ["gateway", "queue", "prefill", "decode", "events"];
    const H = rows.length * rowH + 34;
    const x = (ns) => left + (ns / end) * (W - left - right);
    const chart = svg("svg", { class: "insp-timeline", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
      "aria-label": "Timeline: queue, prompt chunks, first token, decode steps, preemptions, finish" });
    const rowY = (name) => 6 + rows.indexOf(name) * rowH;
    rows.forEach((name) => {
      chart.append(svg("text", { class: "label", x: 4, y: rowY(name) + 14 }, name));
      chart.append(svg("line", { class: "grid", x1: left, x2: W - right, y1: rowY(name) + rowH - 2, y2: rowY(name) + rowH - 2 }));
    });
    const bar = (name, a, b, cls, tip) => {
      const r = svg("rect", { class: cls, x: x(a), y: rowY(name) + 3, width: Math.max(1, x(b) - x(a)), height: rowH - 8 });
      r.append(svg("title", {}, tip));
      chart.append(r);
      return r;
    };
    bar("gateway", 0, t.backend_start, "bar gw", "gateway: parse, template, tokenize, admission " + ms(t.backend_start));
    bar("queue", t.backend_start, t.backend_start + t.queue, "bar queue", "queue wait " + ms(t.queue));
    t.chunks.forEach(([a, b, n], i) => bar("prefill", a, b, "bar chunk " + (i % 2 ? "odd" : "even"),
      `prompt chunk ${i + 1}: ${n} tokens, ${ms(a)} \u2192 ${ms(b)} (${ms(b - a)})`));
    const tick = (name, at, cls, tip) => {
      const l = svg("line", { class: cls, x1: x(at), x2: x(at), y1: rowY(name) + 2, y2: rowY(name) + rowH - 4 });
      l.append(svg("title", {}, tip));
      chart.append(l);
    };
    t.decode.forEach((at, i) => tick("decode", at, "tick decode", `decode step ${i + 1} at ${ms(at)}`));
    t.preemptions.forEach((at) => tick("events", at, "tick preempt", "preempted at " + ms(at)));
    if (t.first_token !== null) tick("events", t.first_token, "tick first", "backend sampled the first token at " + ms(t.first_token));
    tick("events", t.finish, "tick finish", "finished (" + choice.finish_reason + ") at " + ms(t.finish));
    if (ttft !== undefined) {
      chart.append(svg("line", { class: "ttft", x1: x(ttft), x2: x(ttft), y1: 2, y2: H - 28 }));
      const anchor = x(ttft) > W - 140 ? "end" : "start";
      chart.append(svg("text", { class: "ttft-label", x: x(ttft) + (anchor === "end" ? -4 : 4), y: H - 16, "text-anchor": anchor }, ttftLabel(ttft)));
    }
    chart.append(svg("text", { class: "axis", x: left, y: H - 2 }, "0"));
    chart.append(svg("text", { class: "axis", x: W - right, y: H - 2, "text-anchor": "end" }, ms(end)));
    const steps = t.decode.length;
    const itl = steps > 0 && t.first_token !== null ? (t.decode[steps - 1] - t.first_token) / steps : null;
    const prefillTokens = t.chunks.reduce((s, c) => s + c[2], 0);
    const facts = el("ul", { class: "insp-facts" },
      el("li", {}, el("span", { class: "insp-ttft", "data-ns": ttft === undefined ? "" : ttft, text: ttft === undefined ? "TTFT \u2014" : ttftLabel(ttft) })),
      el("li", { text: "queue " + ms(t.queue) }),
      el("li", { text: `${t.chunks.length} prompt chunk${t.chunks.length === 1 ? "" : "s"}, ${prefillTokens} tokens computed` +
        (rec.prompt && rec.prompt.cached_tokens ? `, ${rec.prompt.cached_tokens} from the prefix cache` : "") }),
      el("li", { text: `${steps} decode step${steps === 1 ? "" : "s"}` + (itl !== null ? `, ${ms(itl)} per token` : "") }),
      el("li", { text: `${t.preemptions.length} preemption${t.preemptions.length === 1 ? "" : "s"}` }),
      el("li", { class: "insp-finish", text: "stop reason: " + choice.finish_reason }));
    if (t.dropped) facts.append(el("li", { text: t.dropped + " events not recorded (list limit)" }));
    return [el("div", { class: "insp-chart" }, chart), facts];
  }

  function probClass(p) { return "p" + Math.min(4, Math.floor(p * 5)); }

  function outputSection(response) {
    const wrap = section("Output tokens");
    const c = response && response.choices && response.choices[0];
    const lps = c && c.logprobs && c.logprobs.content;
    if (!lps || !lps.length) {
      wrap.append(el("p", { class: "insp-note", text: "No logprobs in this answer: ask with logprobs (and top_logprobs) to see each token's probability." }));
      return wrap;
    }
    const box = el("div", { class: "insp-out", role: "list", "aria-label": "Output tokens by probability" });
    for (const lp of lps) {
      const p = Math.exp(lp.logprob);
      const alts = (lp.top_logprobs || []).map((a) => `${JSON.stringify(a.token)} ${(Math.exp(a.logprob) * 100).toFixed(1)}%`);
      box.append(el("span", {
        class: "otok " + probClass(p), role: "listitem", "data-p": p.toFixed(4),
        title: `${JSON.stringify(lp.token)} ${(p * 100).toFixed(1)}%` + (alts.length ? "\nalternatives: " + alts.join(", ") : ""),
      }, lp.token === "" ? "\u00b7" : lp.token));
    }
    const scale = el("p", { class: "insp-legend" }, "probability of the chosen token: ",
      ...[0, 1, 2, 3, 4].map((i) => el("span", { class: "otok p" + i, text: `${i * 20}\u2013${i * 20 + 20}%` })));
    wrap.append(scale, box);
    return wrap;
  }

  function usageSection(rec, entry) {
    const u = (rec && rec.usage) || (entry.response && entry.response.usage) || null;
    const h = entry.headers || {};
    const dl = el("dl", { class: "insp-usage" });
    const add = (k, v, key) => dl.append(el("dt", { text: k }), el("dd", { "data-key": key, text: String(v) }));
    if (u) {
      add("prompt tokens", u.prompt_tokens, "prompt_tokens");
      add("cached", (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0, "cached_tokens");
      add("completion tokens", u.completion_tokens, "completion_tokens");
      add("total", u.total_tokens, "total_tokens");
    }
    const limit = (what) => {
      const rem = h["x-ratelimit-remaining-" + what], lim = h["x-ratelimit-limit-" + what], reset = h["x-ratelimit-reset-" + what];
      if (rem === undefined && lim === undefined) return;
      add(what + " left", (rem ?? "?") + " of " + (lim ?? "?") + (reset ? ", resets in " + reset : ""), "limit-" + what);
    };
    limit("requests");
    limit("tokens");
    if (!dl.children.length) dl.append(el("dd", { text: "No usage or rate-limit headers on this answer." }));
    return section("Usage and limits", dl);
  }

  // ------------------------------------------------------------------ the dialog
  function ensureDialog() {
    if (dialog) return dialog;
    dialog = el("dialog", { id: "inspector", class: "inspector", "aria-labelledby": "insp-title" });
    const close = el("button", { type: "button", class: "insp-close", "aria-label": "Close the inspector", text: "Close" });
    close.addEventListener("click", () => dialog.close());
    dialog.append(el("div", { class: "dialog-head" }, el("h2", { id: "insp-title", text: "Inspector" }), close),
      el("div", { class: "insp-body" }));
    document.body.append(dialog);
    return dialog;
  }

  async function open(entry) {
    const d = ensureDialog();
    const body = d.querySelector(".insp-body");
    const id = entry.request_id || (entry.response && entry.response.id) || "";
    d.querySelector("#insp-title").textContent = "Inspector \u2014 " + id;
    body.replaceChildren(el("p", { class: "insp-note", text: "Loading the inspection record\u2026" }));
    d.dataset.state = "loading";
    if (!d.open) d.showModal();
    const { record, error } = entry.record ? { record: entry.record } : await fetchRecord(entry);
    const parts = [];
    if (error) parts.push(el("p", { class: "insp-error", role: "alert", text: error }));
    parts.push(usageSection(record, entry));
    if (record) parts.push(timelineSection(record), promptSection(record));
    parts.push(outputSection(entry.response));
    body.replaceChildren(...parts);
    d.dataset.state = record ? "ready" : "error";
    d.querySelector(".insp-close").focus();
  }

  window.Inspector = { open, close: () => dialog && dialog.close() };
})();
