// The wire side of a chat answer: HTTP errors in words, the SSE parser, and the assembly of a stream.
//
// window.ChatStream:
//   errorOf(response) -> the `error` object of an OpenAI-style error body ({} when the body is not one).
//   describeHttpError(response, err?) -> one line for a person: 401 (check the key), 429 with the retry time
//     (retry-after-ms, else retry-after in seconds or as an HTTP-date), 400 naming the parameter, a prompt
//     blocked by the content filter (hook and category), 503 with its code, else status, code and message.
//   retrySeconds(response) -> seconds to wait, or null.
//   filterText(content_filter_result) -> "category x (hook y), ..." for the filtered categories.
//   sseEvents(ReadableStream) -> async iterator over the data of each server-sent event.
//   headersObject(Headers) -> {lower-case name: value}.
//   fold(resp, chunk): folds one chat.completion.chunk into `resp`, the stream assembled as a chat.completion
//     (per choice: content, tool_calls by index, logprobs.content, finish_reason; usage; the last timings).
// Sources: WHATWG HTML "event stream interpretation"
// (https://html.spec.whatwg.org/multipage/server-sent-events.html); OpenAI "The chat completion chunk object";
// RFC 9110 section 10.2.3 (Retry-After).
"use strict";

(() => {
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
  async function errorOf(r) {
    try { return (await r.json()).error || {}; } catch (_) { return {}; } // not JSON
  }
  async function describeHttpError(r, err) {
    if (err === undefined) err = await errorOf(r);
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
    if (r.status === 400) return "Bad request (400)" + (err.param ? ", parameter " + err.param : "") + ": " + msg;
    if (r.status === 503) {
      const s = retrySeconds(r);
      return "Service unavailable (503" + (err.code ? " " + err.code : "") + "): " + msg + (s !== null ? " Retry after " + s + " s." : "");
    }
    return "Error " + r.status + (err.code ? " " + err.code : "") + ": " + msg;
  }

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

  function headersObject(h) {
    const o = {};
    h.forEach((v, k) => { o[k.toLowerCase()] = v; });
    return o;
  }
  // Folds one chunk into the assembled response `resp` (per choice: text, tool calls, logprobs, finish).
  function fold(resp, ev) {
    for (const k of ["id", "created", "model", "system_fingerprint"]) if (ev[k] !== undefined) resp[k] = ev[k];
    if (ev.usage) resp.usage = ev.usage;
    if (ev.timings) resp.timings = ev.timings;
    for (const ch of ev.choices || []) {
      const c = resp.choices[ch.index] || (resp.choices[ch.index] = { index: ch.index, message: { role: "assistant", content: "" }, logprobs: null, finish_reason: null });
      const d = ch.delta || {};
      if (d.content) c.message.content += d.content;
      for (const tc of d.tool_calls || []) {
        const calls = c.message.tool_calls || (c.message.tool_calls = []);
        const t = calls[tc.index] || (calls[tc.index] = { id: tc.id, type: "function", function: { name: "", arguments: "" } });
        if (tc.id) t.id = tc.id;
        if (tc.function && tc.function.name) t.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) t.function.arguments += tc.function.arguments;
      }
      if (ch.logprobs && ch.logprobs.content) {
        c.logprobs = c.logprobs || { content: [] };
        c.logprobs.content.push(...ch.logprobs.content);
      }
      if (ch.finish_reason) c.finish_reason = ch.finish_reason;
      if (ch.content_filter_results) c.content_filter_results = ch.content_filter_results;
    }
  }

  window.ChatStream = { errorOf, describeHttpError, retrySeconds, filterText, sseEvents, headersObject, fold };
})();
