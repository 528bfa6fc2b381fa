"use strict";
// What every page's script shares, inlined into each page ahead of its own script (the pages
// stay self-contained): elements built from text, never from markup; ids shortened in the face
// of the page, whole on hover and when copied; the request payloads, parsed once when first
// needed; numbers as the pages print them.
const RolloutPage = (function () {
  function add(node, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) {
      for (const c of child) add(node, c);
    } else if (typeof child === "string" || typeof child === "number") {
      node.appendChild(document.createTextNode(String(child)));
    } else {
      node.appendChild(child);
    }
  }

  // Every string from the bundle reaches the page as a text node or an attribute's value.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "onclick") node.addEventListener("click", value);
      else if (key === "data") Object.assign(node.dataset, value);
      else node.setAttribute(key, String(value));
    }
    add(node, children);
    return node;
  }

  function shortId(id) {
    const text = String(id || "");
    const match = /^([a-z]+_)?([0-9a-f]{12,})$/i.exec(text);
    const shown = match ? (match[1] || "") + match[2].slice(0, 8) + "\u2026" : text;
    return el("span", { class: "short-id mono", title: text, "data-full": text }, shown);
  }

  document.addEventListener("copy", (event) => {
    const selection = document.getSelection();
    if (!selection || selection.rangeCount === 0) return;
    const holder = selection.anchorNode && selection.anchorNode.parentElement;
    const id = holder && holder.closest(".short-id");
    if (id && selection.toString() && id.contains(selection.focusNode)) {
      event.clipboardData.setData("text/plain", id.dataset.full);
      event.preventDefault();
    }
  });

  let payloadCache = null;

  // Parsed only when a request body is first asked for: most readers never need them.
  function payloads() {
    if (payloadCache === null) {
      payloadCache = JSON.parse(document.getElementById("view-payloads").textContent);
    }
    return payloadCache;
  }

  function fmtNumber(value, digits) {
    if (typeof value !== "number") return String(value);
    return Number.isInteger(value) ? String(value) : value.toPrecision(digits);
  }

  return Object.freeze({ add, el, shortId, payloads, fmtNumber });
})();
