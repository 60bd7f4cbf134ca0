// The "Parameters" panel and "View code".
//
// window.ChatParams.fields(): the request fields the panel sets, in the API's names and types
//   (top_p, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, seed, stop: string[], n,
//   logprobs + top_logprobs, response_format {type: json_object | json_schema}, structured_outputs
//   {regex | choice}, tools, tool_choice, the gateway's `inspect` extension). Empty fields are left out
//   (the server's default holds).
//   Throws ParamError(field, message) for JSON that does not parse or has the wrong shape.
// window.ChatParams.load() / save(): the panel's values in localStorage ("gw.params").
// window.ChatParams.curl(url, body) / python(baseUrl, body): the request as a curl command and as OpenAI
//   Python SDK code; the key is always $OPENAI_API_KEY (the SDK reads that variable itself).
// Sources: OpenAI API reference "Create chat completion"; vLLM extra parameters (top_k, min_p,
//   repetition_penalty, structured_outputs), sent by the SDK through `extra_body`.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const NUMBERS = [["top_p", false], ["top_k", true], ["min_p", false], ["presence_penalty", false],
    ["frequency_penalty", false], ["repetition_penalty", false], ["seed", true], ["n", true], ["top_logprobs", true]];
  const TEXTS = ["stop", "format", "format-spec", "tools", "tool_choice"];
  const STORE = "gw.params";
  // Fields of client.chat.completions.create(); the others go through extra_body.
  const SDK_ARGS = new Set(["model", "messages", "stream", "stream_options", "temperature", "max_tokens",
    "max_completion_tokens", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "n", "logprobs",
    "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls", "logit_bias", "user",
    "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"]);

  class ParamError extends Error {
    constructor(field, message) { super(field + ": " + message); this.field = field; }
  }

  function json(field, text) {
    try { return JSON.parse(text); } catch (e) { throw new ParamError(field, "not valid JSON (" + e.message + ")"); }
  }

  function fields() {
    const out = {};
    for (const [name, int] of NUMBERS) {
      const v = $("p-" + name).value.trim();
      if (v === "") continue;
      const x = Number(v);
      if (!Number.isFinite(x)) throw new ParamError(name, "not a number");
      out[name] = int ? Math.trunc(x) : x;
    }
    const stop = $("p-stop").value.split("\n").filter((s) => s !== "");
    if (stop.length) out.stop = stop;
    if ($("p-logprobs").checked) out.logprobs = true;
    else if ("top_logprobs" in out) out.logprobs = true; // top_logprobs needs logprobs
    const fmt = $("p-format").value;
    const spec = $("p-format-spec").value.trim();
    if (fmt === "json_object") out.response_format = { type: "json_object" };
    else if (fmt === "json_schema") {
      const schema = json("response_format.json_schema.schema", spec || "{}");
      out.response_format = { type: "json_schema", json_schema: { name: "output", schema, strict: true } };
    } else if (fmt === "regex") {
      if (!spec) throw new ParamError("structured_outputs.regex", "give a regular expression");
      out.structured_outputs = { regex: spec };
    } else if (fmt === "choice") {
      const choice = spec.split("\n").filter((s) => s !== "");
      if (!choice.length) throw new ParamError("structured_outputs.choice", "give one choice per line");
      out.structured_outputs = { choice };
    }
    const tools = $("p-tools").value.trim();
    if (tools) {
      const t = json("tools", tools);
      if (!Array.isArray(t)) throw new ParamError("tools", "must be a JSON array of tools");
      out.tools = t;
    }
    if ($("p-inspect").checked) out.inspect = true; // gateway extension: GET /v1/inspect/{id} (docs/inspector.md)
    const tc = $("p-tool_choice").value.trim();
    if (tc) out.tool_choice = ["auto", "none", "required"].includes(tc) ? tc : { type: "function", function: { name: tc } };
    return out;
  }

  function ids() {
    return NUMBERS.map(([n]) => "p-" + n).concat(TEXTS.map((n) => "p-" + n), ["p-logprobs", "p-inspect"]);
  }

  function load() {
    let v = {};
    try { v = JSON.parse(localStorage.getItem(STORE) || "{}") || {}; } catch (_) { /* reset */ }
    for (const id of ids()) {
      if (!(id in v)) continue;
      if ($(id).type === "checkbox") $(id).checked = !!v[id];
      else $(id).value = v[id];
    }
  }

  function save() {
    const v = {};
    for (const id of ids()) v[id] = $(id).type === "checkbox" ? $(id).checked : $(id).value;
    localStorage.setItem(STORE, JSON.stringify(v));
  }

  // ------------------------------------------------------------------ code
  function shellQuote(s) { return "'" + s.replace(/'/g, "'\\''") + "'"; }

  function curl(url, body) {
    return ["curl" + (body.stream ? " -N" : "") + " " + shellQuote(url),
      "  -H 'Content-Type: application/json'",
      '  -H "Authorization: Bearer $OPENAI_API_KEY"',
      "  -d " + shellQuote(JSON.stringify(body, null, 2))].join(" \\\n");
  }

  // A JSON value as a Python literal (JSON strings are valid Python string literals).
  function py(v, indent) {
    const pad = " ".repeat(indent + 4);
    const end = " ".repeat(indent);
    if (v === null || v === undefined) return "None";
    if (v === true) return "True";
    if (v === false) return "False";
    if (typeof v === "number" || typeof v === "string") return JSON.stringify(v);
    if (Array.isArray(v)) {
      if (!v.length) return "[]";
      return "[\n" + v.map((x) => pad + py(x, indent + 4) + ",\n").join("") + end + "]";
    }
    const keys = Object.keys(v);
    if (!keys.length) return "{}";
    return "{\n" + keys.map((k) => pad + JSON.stringify(k) + ": " + py(v[k], indent + 4) + ",\n").join("") + end + "}";
  }

  function python(baseUrl, body) {
    const args = [];
    const extra = {};
    for (const [k, v] of Object.entries(body)) {
      if (SDK_ARGS.has(k)) args.push("    " + k + "=" + py(v, 4) + ",");
      else extra[k] = v;
    }
    if (Object.keys(extra).length) args.push("    extra_body=" + py(extra, 4) + ",");
    const lines = ["from openai import OpenAI", "",
      "# The key is read from $OPENAI_API_KEY.",
      "client = OpenAI(base_url=" + JSON.stringify(baseUrl) + ")", "",
      (body.stream ? "stream" : "completion") + " = client.chat.completions.create(", ...args, ")"];
    if (body.stream) {
      lines.push("for chunk in stream:",
        "    for choice in chunk.choices:",
        "        if choice.delta.content:",
        '            print(choice.delta.content, end="", flush=True)',
        "print()");
    } else {
      lines.push("print(completion.choices[0].message.content)");
    }
    return lines.join("\n") + "\n";
  }

  window.ChatParams = { fields, load, save, ids, curl, python, ParamError };
})();
