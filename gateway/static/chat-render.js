// Markdown rendering of model text: marked (CommonMark + GFM) -> DOMPurify -> the page.
//
// window.ChatRender.markdown(el, text): renders `text` into `el`, replacing only the top-level blocks that
// changed since the last call (a stream re-renders the growing answer: finished paragraphs and code blocks
// keep their nodes, so nothing flickers and a selection in them survives).
// window.ChatRender.plain(el, text): the text as is (user messages).
//
// Safety (model output is untrusted): raw HTML in the markdown is shown as text, not parsed (the `html`
// renderer escapes it); the HTML marked produces is then sanitized by DOMPurify with images, media, forms,
// SVG/MathML and style attributes forbidden (no request leaves the page from rendered text, no handler
// attribute survives); links open in a new tab with rel="noopener noreferrer nofollow". The page's CSP
// (script-src 'self') blocks inline handlers as a further layer.
// Code blocks: highlight.js for a named language it knows (the common-languages build), else plain.
"use strict";

(() => {
  const FORBID_TAGS = ["img", "picture", "source", "video", "audio", "track", "svg", "math", "style", "link", "meta",
    "base", "form", "input", "button", "select", "textarea", "iframe", "frame", "object", "embed"];
  const FORBID_ATTR = ["style", "srcset", "background", "poster", "formaction"];

  function escapeHtml(s) {
    return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  function codeBlock(token) {
    const lang = (token.lang || "").trim().split(/\s+/)[0].replace(/[^\w+#-]/g, "");
    let body = escapeHtml(token.text);
    if (lang && window.hljs && hljs.getLanguage(lang)) {
      try { body = hljs.highlight(token.text, { language: lang, ignoreIllegals: true }).value; } catch (_) { /* plain */ }
    }
    return '<pre><code class="hljs' + (lang ? " language-" + lang : "") + '">' + body + "</code></pre>\n";
  }

  const md = new marked.Marked({ gfm: true, breaks: false });
  md.use({
    renderer: {
      code: codeBlock,
      html: (token) => escapeHtml(token.text), // raw HTML from the model is text
    },
  });

  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  });

  function toFragment(text) {
    const html = md.parse(text || "", { async: false });
    return DOMPurify.sanitize(html, { FORBID_TAGS, FORBID_ATTR, RETURN_DOM_FRAGMENT: true });
  }

  function morph(el, frag) {
    const next = Array.from(frag.childNodes);
    for (let i = 0; i < next.length; i++) {
      const old = el.childNodes[i];
      if (!old) el.append(next[i]);
      else if (!old.isEqualNode(next[i])) old.replaceWith(next[i]);
    }
    while (el.childNodes.length > next.length) el.lastChild.remove();
  }

  function markdown(el, text) {
    el.classList.add("md");
    morph(el, toFragment(text));
  }

  function plain(el, text) {
    el.classList.remove("md");
    el.textContent = text || "";
  }

  window.ChatRender = { markdown, plain, escapeHtml };
})();
