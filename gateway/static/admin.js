/* The operator dashboard (GET /admin). The page loads without a key; the admin key typed into it is kept
 * in this tab's sessionStorage ("gw.adminKey") and sent as "Authorization: Bearer <key>" on every call.
 *
 * Data, polled every POLL_MS while the tab is visible (setTimeout chain: one poll at a time):
 *   GET /admin/v1/stats   running, waiting, kv_blocks_{used,cached,total}, prefix_cache_{queries,hits},
 *                         preemptions, aborts, requests_finished, {prompt,generation}_tokens,
 *                         spec_{drafts,draft_tokens,accepted_tokens} (speculative decoding; counters since
 *                         the backend started), per backend in backends[i].stats
 *   GET /metrics          the Prometheus histograms gateway:time_to_first_token_seconds and
 *                         gateway:inter_token_latency_seconds: p50/p90/p99 of the observations of the last
 *                         WINDOW_S seconds (bucket deltas, interpolated as Prometheus' histogram_quantile)
 * and every TENANT_MS: GET /admin/v1/tenants and GET /admin/v1/spend?group_by=tenant (since UTC midnight,
 * and since 60 s ago). Edits go through the admin API: POST /admin/v1/tenants, PUT .../limits,
 * PATCH /admin/v1/tenants/{id} (disabled), DELETE /admin/v1/tenants/{id}, POST .../keys (the secret shown
 * once), DELETE /admin/v1/keys/{id}. Errors are OpenAI error bodies {"error": {"message", "code", ...}}.
 */
"use strict";
(() => {
  const POLL_MS = 1000, TENANT_MS = 5000, WINDOW_S = 30, POINTS = 180;
  const KEY = "gw.adminKey";
  const $ = (id) => document.getElementById(id);
  const state = { key: sessionStorage.getItem(KEY) || "", timer: null, lastTenants: 0, prev: null,
    hist: [], series: null, charts: {}, tenants: [], tenantSig: "", editing: null, armed: null };

  // ---------------------------------------------------------------- HTTP

  class HTTPError extends Error {
    constructor(status, message, code) { super(message); this.status = status; this.code = code; }
  }

  async function call(method, path, body) {
    const init = { method, headers: { Authorization: "Bearer " + state.key }, cache: "no-store" };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let r;
    try {
      r = await fetch(path, init);
    } catch (e) {
      throw new HTTPError(0, "Cannot reach the gateway (" + e.message + ").", "network");
    }
    const text = await r.text();
    if (!r.ok) {
      let msg = text, code = null;
      try { const e = JSON.parse(text).error; msg = e.message; code = e.code; } catch (_) { /* not JSON */ }
      throw new HTTPError(r.status, msg, code);
    }
    return path === "/metrics" ? text : JSON.parse(text);
  }

  function describe(e) {
    if (e.status === 401) return "Authentication failed (401): " + e.message + " Check the admin key.";
    if (e.status === 403) return "Forbidden (403): " + e.message + " This key is not the admin key.";
    if (e.status === 0) return e.message;
    return "Error " + e.status + (e.code ? " (" + e.code + ")" : "") + ": " + e.message;
  }

  function banner(id, text) {
    const el = $(id);
    el.textContent = text || "";
    el.hidden = !text;
  }

  // ---------------------------------------------------------------- Prometheus text -> histograms

  /** Cumulative buckets of histogram `name` summed over its series: {bounds: [le...], cum: [...]}. */
  function histogram(text, name) {
    const byLe = new Map();
    const prefix = name + "_bucket{";
    for (const line of text.split("\n")) {
      if (!line.startsWith(prefix)) continue;
      const m = /le="([^"]+)"/.exec(line);
      const v = parseFloat(line.slice(line.lastIndexOf(" ") + 1));
      if (!m || !isFinite(v)) continue;
      const le = m[1] === "+Inf" ? Infinity : parseFloat(m[1]);
      byLe.set(le, (byLe.get(le) || 0) + v);
    }
    const bounds = [...byLe.keys()].sort((a, b) => a - b);
    return { bounds, cum: bounds.map((b) => byLe.get(b)) };
  }

  /** Observations of `now` minus those of `old` (same bounds), cumulative; `now` itself when `old` has
   * other buckets or more observations (the gateway restarted). */
  function delta(now, old) {
    const n = (h) => (h.cum.length ? h.cum[h.cum.length - 1] : 0);
    if (!old || old.bounds.length !== now.bounds.length || n(old) > n(now)) return now;
    return { bounds: now.bounds, cum: now.cum.map((c, i) => Math.max(0, c - old.cum[i])) };
  }

  /** The q-quantile of cumulative buckets, linear within a bucket (Prometheus histogram_quantile); null
   * without observations; the highest finite bound when it falls in the +Inf bucket. */
  function quantile(h, q) {
    const n = h.cum.length ? h.cum[h.cum.length - 1] : 0;
    if (!n) return null;
    const rank = q * n;
    for (let i = 0; i < h.cum.length; i++) {
      if (h.cum[i] < rank) continue;
      const upper = h.bounds[i], lower = i ? h.bounds[i - 1] : 0, below = i ? h.cum[i - 1] : 0;
      if (upper === Infinity) return lower;
      const inside = h.cum[i] - below;
      return inside > 0 ? lower + (upper - lower) * (rank - below) / inside : upper;
    }
    return null;
  }

  // ---------------------------------------------------------------- charts (uPlot)

  const COLORS = ["#2f6fed", "#e07b00", "#b42318"];
  const CHARTS = {
    requests: { el: "chart-requests", series: ["running", "waiting"] },
    tps: { el: "chart-tps", series: ["generated", "prompt"] },
    ttft: { el: "chart-ttft", series: ["p50", "p90", "p99"] },
    itl: { el: "chart-itl", series: ["p50", "p90", "p99"] },
  };

  function makeCharts() {
    state.series = { t: [] };
    for (const [name, spec] of Object.entries(CHARTS)) {
      spec.series.forEach((s) => { state.series[name + "." + s] = []; });
      const host = $(spec.el);
      const opts = {
        width: Math.max(200, host.clientWidth), height: 120, legend: { live: false },
        cursor: { show: false }, scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },
        axes: [{ size: 28, font: "11px system-ui" },
          { size: 40, font: "11px system-ui", values: (u, vals) => vals.map((v) => (v >= 1000 ? v / 1000 + "k" : v)) }],
        series: [{}, ...spec.series.map((s, i) => ({ label: s, stroke: COLORS[i], width: 1.5, spanGaps: false, points: { show: false } }))],
      };
      state.charts[name] = new uPlot(opts, [[], ...spec.series.map(() => [])], host);
    }
    window.addEventListener("resize", () => {
      for (const [name, spec] of Object.entries(CHARTS)) {
        state.charts[name].setSize({ width: Math.max(200, $(spec.el).clientWidth), height: 120 });
      }
    });
  }

  function pushPoint(t, values) {
    const s = state.series;
    s.t.push(t);
    for (const k of Object.keys(s)) if (k !== "t") s[k].push(values[k] ?? null);
    if (s.t.length > POINTS) for (const k of Object.keys(s)) s[k].shift();
    for (const [name, spec] of Object.entries(CHARTS)) {
      state.charts[name].setData([s.t, ...spec.series.map((x) => s[name + "." + x])]);
    }
  }

  // ---------------------------------------------------------------- KV grid (canvas)

  const KV_COLORS = { used: "#2f6fed", cached: "#f2b233", free: "#e4e7ec" };

  /** One canvas per backend: `used` cells, then `cached`, then `free` (one cell per block, or per
   * `per` blocks when the pool is larger than MAX_CELLS). Counts are also on the canvas' data-* attributes. */
  function drawGrid(canvas, st) {
    const MAX_CELLS = 2048;
    const total = st.kv_blocks_total, used = st.kv_blocks_used, cached = st.kv_blocks_cached;
    const free = Math.max(0, total - used - cached);
    const per = Math.max(1, Math.ceil(total / MAX_CELLS));
    const cells = Math.ceil(total / per);
    const width = canvas.parentElement.clientWidth || 400;
    const size = cells > 1024 ? 7 : cells > 400 ? 10 : 14, gap = 2, step = size + gap;
    const cols = Math.max(1, Math.floor((width + gap) / step)), rows = Math.ceil(cells / cols);
    const dpr = window.devicePixelRatio || 1;
    canvas.style.width = cols * step - gap + "px";
    canvas.style.height = rows * step - gap + "px";
    canvas.width = Math.round((cols * step - gap) * dpr);
    canvas.height = Math.round((rows * step - gap) * dpr);
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    const usedCells = Math.ceil(used / per), cachedCells = Math.ceil((used + cached) / per) - usedCells;
    for (let i = 0; i < cells; i++) {
      g.fillStyle = i < usedCells ? KV_COLORS.used : i < usedCells + cachedCells ? KV_COLORS.cached : KV_COLORS.free;
      g.fillRect((i % cols) * step, Math.floor(i / cols) * step, size, size);
    }
    Object.assign(canvas.dataset, { used, cached, free, total, per });
    canvas.setAttribute("aria-label", `KV cache: ${used} used, ${cached} cached, ${free} free of ${total} blocks`);
    return per;
  }

  function renderKV(stats) {
    const host = $("kv-grids");
    const backends = stats.backends.length ? stats.backends : [];
    while (host.children.length > backends.length) host.lastChild.remove();
    backends.forEach((b, i) => {
      let box = host.children[i];
      if (!box) {
        box = document.createElement("div");
        box.className = "kv-backend";
        box.innerHTML = '<p class="kv-title"></p><div class="kv-canvas"><canvas role="img"></canvas></div>';
        host.append(box);
      }
      const canvas = box.querySelector("canvas");
      canvas.dataset.backend = b.name;
      const title = box.querySelector(".kv-title");
      if (!b.stats) {
        title.textContent = `${b.name}: ${b.state}${b.error || b.last_error ? " (" + (b.error || b.last_error) + ")" : ""}`;
        canvas.hidden = true;
        return;
      }
      canvas.hidden = false;
      const per = drawGrid(canvas, b.stats);
      const s = b.stats;
      title.textContent = `${b.name} (${b.state}): ${s.kv_blocks_used} used · ${s.kv_blocks_cached} cached · ` +
        `${s.kv_blocks_total - s.kv_blocks_used - s.kv_blocks_cached} free of ${s.kv_blocks_total}` +
        (per > 1 ? ` (1 cell = ${per} blocks)` : "");
    });
  }

  // ---------------------------------------------------------------- engine poll

  const pct = (x) => (x === null || !isFinite(x) ? "-" : (100 * x).toFixed(1) + "%");
  const ms = (s) => (s === null ? null : s >= 0.1 ? Math.round(s * 1000) : Math.round(s * 10000) / 10);
  const fmt = (x) => (x === null || x === undefined ? "-" : Number(x).toLocaleString("en"));

  /** The snapshot of about WINDOW_S ago (the oldest kept if younger). */
  function windowStart(now) {
    while (state.hist.length > 1 && state.hist[1].t <= now - WINDOW_S) state.hist.shift();
    return state.hist[0];
  }

  function renderEngine(stats, metrics) {
    const now = Date.now() / 1000;
    const snap = { t: now, stats, ttft: histogram(metrics, "gateway:time_to_first_token_seconds"),
      itl: histogram(metrics, "gateway:inter_token_latency_seconds") };
    const prev = state.prev;
    state.hist.push(snap);
    state.prev = snap;
    const old = windowStart(now);
    const rate = (f) => (prev && now > prev.t ? Math.max(0, (stats[f] - prev.stats[f]) / (now - prev.t)) : null);
    const tps = rate("generation_tokens"), pps = rate("prompt_tokens");
    $("running").textContent = stats.running;
    $("waiting").textContent = stats.waiting;
    $("tps").textContent = tps === null ? "-" : tps.toFixed(1);
    $("tps-prompt").textContent = pps === null ? "" : pps.toFixed(0) + " prompt tok/s";
    $("hit-rate").textContent = pct(stats.prefix_cache_queries ? stats.prefix_cache_hits / stats.prefix_cache_queries : null);
    const dq = stats.prefix_cache_queries - old.stats.prefix_cache_queries;
    const dh = stats.prefix_cache_hits - old.stats.prefix_cache_hits;
    $("hit-rate-window").textContent = dq > 0 ? pct(dh / dq) + " last " + WINDOW_S + " s" : "all time";
    const drafted = stats.spec_draft_tokens || 0, accepted = stats.spec_accepted_tokens || 0;
    const dd = drafted - (old.stats.spec_draft_tokens || 0), da = accepted - (old.stats.spec_accepted_tokens || 0);
    $("spec-rate").textContent = pct(drafted ? accepted / drafted : null);
    $("spec-detail").textContent = `${fmt(accepted)} / ${fmt(drafted)} draft tokens` +
      (dd > 0 ? ", " + pct(da / dd) + " last " + WINDOW_S + " s" : "");
    $("preemptions").textContent = fmt(stats.preemptions);
    $("preemptions-window").textContent = "+" + (stats.preemptions - old.stats.preemptions) + " last " + WINDOW_S + " s";
    $("kv-perc").textContent = pct(stats.kv_blocks_total ? stats.kv_blocks_used / stats.kv_blocks_total : null);
    $("kv-detail").textContent = `${stats.kv_blocks_used} / ${stats.kv_blocks_total} blocks, ${stats.kv_blocks_cached} cached`;
    $("finished").textContent = fmt(stats.requests_finished) + " / " + fmt(stats.aborts);
    $("device").textContent = [stats.device, stats.attention_backend].filter(Boolean).join(" · ");
    const ttft = delta(snap.ttft, old.ttft), itl = delta(snap.itl, old.itl);
    const q = (h) => [0.5, 0.9, 0.99].map((x) => ms(quantile(h, x)));
    const [t50, t90, t99] = q(ttft), [i50, i90, i99] = q(itl);
    const now3 = (a, b, c) => (a === null ? "no requests" : `p50 ${a} · p90 ${b} · p99 ${c}`);
    $("requests-now").textContent = `${stats.running} running · ${stats.waiting} waiting`;
    $("tps-now").textContent = tps === null ? "" : `${tps.toFixed(1)} generated · ${pps.toFixed(0)} prompt`;
    $("ttft-now").textContent = now3(t50, t90, t99);
    $("itl-now").textContent = now3(i50, i90, i99);
    pushPoint(now, {
      "requests.running": stats.running, "requests.waiting": stats.waiting,
      "tps.generated": tps, "tps.prompt": pps,
      "ttft.p50": t50, "ttft.p90": t90, "ttft.p99": t99, "itl.p50": i50, "itl.p90": i90, "itl.p99": i99,
    });
    renderKV(stats);
    const down = stats.backends.filter((b) => b.state !== "ready");
    banner("warning", [stats.draining ? "The gateway is draining (shutting down)." : "",
      ...down.map((b) => `Backend ${b.name} is ${b.state}${b.last_error ? ": " + b.last_error : ""}.`)].filter(Boolean).join(" "));
  }

  async function poll() {
    state.timer = null;
    if (!state.key || document.visibilityState !== "visible") return;
    try {
      // /metrics is optional (no histograms: no percentiles); the stats are not
      const metrics = call("GET", "/metrics").catch(() => "");
      const [stats, text] = await Promise.all([call("GET", "/admin/v1/stats"), metrics]);
      renderEngine(stats, text);
      if (Date.now() - state.lastTenants >= TENANT_MS) await loadTenants();
      banner("error", "");
      $("status").textContent = "live · every " + POLL_MS / 1000 + " s · " + new Date().toLocaleTimeString();
      document.body.dataset.connected = "1";
    } catch (e) {
      banner("error", describe(e));
      $("status").textContent = e.status === 401 || e.status === 403 ? "not connected" : "retrying";
      document.body.dataset.connected = "";
      if (e.status === 401 || e.status === 403) return; // a wrong key: wait for another one
    }
    schedule();
  }

  function schedule(delay = POLL_MS) {
    if (state.timer === null && state.key) state.timer = setTimeout(poll, delay);
  }

  // ---------------------------------------------------------------- tenants

  const utcMidnight = () => { const d = new Date(); d.setUTCHours(0, 0, 0, 0); return d.getTime() / 1000; };
  const lim = (x) => (x === null || x === undefined ? "∞" : fmt(x));
  const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 16) + "Z" : "never");

  function cell(tr, text, cls) {
    const td = document.createElement("td");
    if (text instanceof Node) td.append(text); else td.textContent = text;
    if (cls) td.className = cls;
    tr.append(td);
    return td;
  }

  /** A bar of `used` against `limit` (null: unlimited, no bar). */
  function meter(used, limit, unit) {
    const wrap = document.createElement("div");
    wrap.className = "meter-wrap";
    const txt = document.createElement("span");
    txt.textContent = fmt(used) + " / " + lim(limit) + (unit ? " " + unit : "");
    if (limit !== null && limit !== undefined) {
      const m = document.createElement("meter");
      Object.assign(m, { min: 0, max: Math.max(1, limit), value: Math.min(used, limit), high: 0.8 * limit, optimum: 0 });
      m.setAttribute("aria-label", txt.textContent);
      wrap.append(m);
    }
    wrap.append(txt);
    return wrap;
  }

  async function loadTenants() {
    state.lastTenants = Date.now();
    const nowS = Date.now() / 1000;
    const [list, today, minute] = await Promise.all([
      call("GET", "/admin/v1/tenants"),
      call("GET", "/admin/v1/spend?group_by=tenant&since=" + utcMidnight()),
      call("GET", "/admin/v1/spend?group_by=tenant&since=" + (nowS - 60).toFixed(3)),
    ]);
    const by = (sp) => new Map(sp.data.map((g) => [g.group, g]));
    const day = by(today), last = by(minute);
    if (state.editing) {
      const t = list.data.find((x) => x.id === state.editing);
      if (t) fillHeader(t); else closeEditor();
    }
    state.tenants = list.data;
    const sig = JSON.stringify([list.data, today.data, minute.data]);
    if (sig === state.tenantSig) return; // unchanged: keep the rows (and the keyboard focus in them)
    state.tenantSig = sig;
    const rows = $("tenant-rows");
    rows.replaceChildren();
    if (!list.data.length) cell(rows.insertRow(), "No tenants yet.", "muted").colSpan = 8;
    for (const t of list.data) {
      const d = day.get(t.id), m = last.get(t.id), L = t.limits;
      const tr = rows.insertRow();
      tr.dataset.tenantId = t.id;
      const name = document.createElement("span");
      name.innerHTML = "<b></b><br><code></code>";
      name.querySelector("b").textContent = t.name;
      name.querySelector("code").textContent = t.id;
      cell(tr, name);
      cell(tr, meter(d ? d.total_tokens : 0, L.daily_tokens), "usage-day");
      cell(tr, `${fmt(m ? m.requests : 0)} req · ${fmt(m ? m.total_tokens : 0)} tok`, "usage-minute");
      cell(tr, lim(L.rpm), "lim-rpm");
      cell(tr, lim(L.tpm), "lim-tpm");
      cell(tr, lim(L.max_concurrent), "lim-max_concurrent");
      cell(tr, t.disabled ? "disabled" : "active", t.disabled ? "off" : "on");
      const b = document.createElement("button");
      b.type = "button";
      b.className = "manage";
      b.textContent = "Manage";
      b.setAttribute("aria-label", "Manage tenant " + t.name);
      b.addEventListener("click", () => openEditor(t.id));
      cell(tr, b);
    }
  }

  function fillHeader(t) {
    $("ed-name").textContent = t.name;
    $("ed-id").textContent = t.id;
    $("toggle-disabled").textContent = t.disabled ? "Enable tenant" : "Disable tenant";
  }

  async function openEditor(id) {
    const t = state.tenants.find((x) => x.id === id);
    if (!t) return;
    state.editing = id;
    disarm();
    fillHeader(t);
    for (const f of ["rpm", "tpm", "max_concurrent", "daily_tokens", "window_s"]) {
      $("lim-" + f).value = t.limits[f] === null ? "" : t.limits[f];
    }
    $("limits-msg").textContent = "";
    $("new-key-secret").hidden = true;
    $("editor").hidden = false;
    $("lim-rpm").focus();
    await loadKeys();
  }

  function closeEditor() {
    state.editing = null;
    $("editor").hidden = true;
    $("new-key-value").textContent = "";
  }

  /** A destructive button asks once more: the first click arms it, the second acts. */
  function confirmed(btn, label) {
    if (state.armed === btn) { disarm(); return true; }
    disarm();
    state.armed = btn;
    btn.dataset.label = btn.textContent;
    btn.textContent = label;
    btn.classList.add("armed");
    return false;
  }

  function disarm() {
    const b = state.armed;
    if (b) { b.textContent = b.dataset.label; b.classList.remove("armed"); }
    state.armed = null;
  }

  async function loadKeys() {
    const id = state.editing;
    const keys = await call("GET", `/admin/v1/tenants/${id}/keys`);
    const rows = $("key-rows");
    rows.replaceChildren();
    if (!keys.data.length) cell(rows.insertRow(), "No keys.", "muted").colSpan = 6;
    for (const k of keys.data) {
      const tr = rows.insertRow();
      tr.dataset.keyId = k.id;
      cell(tr, k.name || "-");
      cell(tr, k.prefix + "…");
      cell(tr, when(k.created_at));
      cell(tr, k.expires_at ? when(k.expires_at) : "never");
      cell(tr, k.revoked_at ? "revoked " + when(k.revoked_at) : "active", k.revoked_at ? "off" : "on");
      const td = cell(tr, "");
      if (!k.revoked_at) {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "danger revoke";
        b.textContent = "Revoke";
        b.setAttribute("aria-label", "Revoke key " + (k.name || k.prefix));
        b.addEventListener("click", () => act(async () => {
          if (!confirmed(b, "Confirm revoke")) return;
          await call("DELETE", `/admin/v1/keys/${k.id}`);
          await loadKeys();
        }));
        td.append(b);
      }
    }
  }

  /** Run an edit; its error goes to the editor's message line (or the banner), then the tables reload. */
  async function act(fn, msgEl = $("limits-msg")) {
    try {
      await fn();
    } catch (e) {
      if (msgEl && !$("editor").hidden) { msgEl.textContent = describe(e); msgEl.className = "msg error"; }
      else banner("error", describe(e));
      return;
    }
    try { await loadTenants(); } catch (e) { banner("error", describe(e)); }
  }

  function limitsBody() {
    const body = {};
    for (const f of ["rpm", "tpm", "max_concurrent", "daily_tokens"]) {
      const v = $("lim-" + f).value.trim();
      body[f] = v === "" ? null : Number(v);
    }
    const w = $("lim-window_s").value.trim();
    if (w !== "") body.window_s = Number(w);
    return body;
  }

  // ---------------------------------------------------------------- wiring

  function connect(key) {
    state.key = key;
    if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
    state.lastTenants = 0;
    state.tenantSig = "";
    if (state.timer !== null) { clearTimeout(state.timer); state.timer = null; }
    banner("error", "");
    if (key) { $("status").textContent = "connecting…"; schedule(0); } else $("status").textContent = "not connected";
  }

  $("key-form").addEventListener("submit", (ev) => { ev.preventDefault(); connect($("admin-key").value.trim()); });
  $("forget").addEventListener("click", () => { $("admin-key").value = ""; connect(""); });
  $("new-tenant").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const name = $("new-tenant-name").value.trim();
    act(async () => {
      const t = await call("POST", "/admin/v1/tenants", { name });
      $("new-tenant-name").value = "";
      await loadTenants();
      await openEditor(t.id);
    }, null);
  });
  $("limits-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = state.editing;
    act(async () => {
      const L = await call("PUT", `/admin/v1/tenants/${id}/limits`, limitsBody());
      const msg = $("limits-msg");
      msg.textContent = `Saved: rpm ${lim(L.rpm)}, tpm ${lim(L.tpm)}, at once ${lim(L.max_concurrent)}, ` +
        `daily ${lim(L.daily_tokens)}, window ${L.window_s} s.`;
      msg.className = "msg ok";
    });
  });
  $("toggle-disabled").addEventListener("click", () => {
    const t = state.tenants.find((x) => x.id === state.editing);
    if (t) act(() => call("PATCH", `/admin/v1/tenants/${t.id}`, { disabled: !t.disabled }));
  });
  $("delete-tenant").addEventListener("click", (ev) => act(async () => {
    if (!confirmed(ev.currentTarget, "Confirm delete")) return;
    await call("DELETE", `/admin/v1/tenants/${state.editing}`);
    closeEditor();
  }));
  $("close-editor").addEventListener("click", closeEditor);
  $("new-key").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const name = $("new-key-name").value.trim();
    act(async () => {
      const k = await call("POST", `/admin/v1/tenants/${state.editing}/keys`, name ? { name } : {});
      $("new-key-name").value = "";
      $("new-key-value").textContent = k.key;
      $("new-key-secret").hidden = false;
      await loadKeys();
    });
  });
  $("copy-key").addEventListener("click", () => {
    const v = $("new-key-value").textContent;
    if (navigator.clipboard) navigator.clipboard.writeText(v).catch(() => {});
    getSelection().selectAllChildren($("new-key-value"));
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") { if (state.armed) disarm(); else if (!$("editor").hidden) closeEditor(); }
  });
  document.addEventListener("visibilitychange", () => { if (document.visibilityState === "visible") schedule(0); });

  // the histogram arithmetic, for the page's tests
  window.Dashboard = Object.freeze({ histogram, delta, quantile });
  makeCharts();
  $("admin-key").value = state.key;
  connect(state.key);
})();
