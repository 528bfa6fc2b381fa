"use strict";
// Renders the rollout embedded in #view-data. Every string from the bundle reaches the page as
// a text node (textContent), never as markup: model and user text is untrusted.
(function () {
  const DATA = JSON.parse(document.getElementById("view-data").textContent);
  const { add, el, payloads } = RolloutPage;
  const LONG_TEXT = 4000;
  const BODY_SHOWN = 1000000;
  const SEEN_SHOWN = 5000;

  const turnOrder = [];
  for (const thread of DATA.threads) for (const id of thread.turns) turnOrder.push(id);
  const turnIndex = new Map(turnOrder.map((id, i) => [id, i]));
  const toolByItem = new Map();
  for (const tool of Object.values(DATA.tools)) {
    if (tool.call_item) toolByItem.set(tool.call_item, tool);
  }
  const state = { tab: "transcript", page: 0 };
  const pageCount = Math.max(1, Math.ceil(turnOrder.length / DATA.page_turns));

  function token(value) {
    return String(value || "unspecified").toLowerCase().replace(/[^a-z0-9_]/g, "_");
  }

  const SYMBOLS = { COMPLETED: "\u2713", FAILED: "\u2717", CANCELLED: "\u25a0", RUNNING: "\u25cf",
    ABORTED: "!", CLEAN: "\u2713", CORRUPT: "\u2717", TRUNCATED: "\u2702", UNCLOSED: "\u25cb" };

  function badge(status, prefix) {
    const name = status || "UNSPECIFIED";
    const sym = SYMBOLS[name] ? SYMBOLS[name] + " " : "";
    return el("span", { class: `status ${prefix || "st"}-${token(name)}`, title: name,
      data: { status: name } }, sym + name);
  }

  function fmtDuration(ms) {
    if (ms === null || ms === undefined) return "\u2014";
    if (ms < 1000) return `${Math.round(ms)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(2)} s`;
    const minutes = Math.floor(ms / 60000);
    return `${minutes} min ${Math.round((ms % 60000) / 1000)} s`;
  }

  function fmtAt(ms) {
    return ms === null || ms === undefined ? "\u2014" : `+${(ms / 1000).toFixed(3)} s`;
  }

  function durationOf(x) {
    return x.start !== null && x.end !== null ? x.end - x.start : null;
  }

  // A completed call without usage: its provider reported none (a Chat stream without
  // stream_options.include_usage), and its count is unknown, not 0.
  function fmtUsage(usage) {
    if (!usage) return "tokens unknown";
    let text = `${usage.input} in / ${usage.output} out tokens`;
    if (usage.cached) text += `, ${usage.cached} cached`;
    if (usage.reasoning) text += `, ${usage.reasoning} reasoning`;
    return text;
  }

  function fmtError(error) {
    if (!error) return null;
    const http = error.http ? ` (HTTP ${error.http})` : "";
    return el("div", { class: "error" }, `error ${error.code || "?"}${http}: ${error.message}`);
  }

  function textBlock(text, cls) {
    const node = el("div", { class: "text " + (cls || "") });
    if (text.length <= LONG_TEXT) {
      node.textContent = text;
      return node;
    }
    // Long texts are collapsed: a page of long replies stays quick to lay out.
    node.textContent = text.slice(0, LONG_TEXT) + "\u2026";
    const more = el("button", { class: "more" }, `show all ${text.length.toLocaleString()} characters`);
    more.addEventListener("click", () => {
      node.textContent = text;
      more.remove();
    });
    return el("div", {}, node, more);
  }

  // Markdown for the model's replies, built as DOM nodes from text: no bundle text is ever
  // parsed as HTML, a link is followed only when clicked (http, https, mailto), and an image is
  // never loaded (it shows as its alt text and address).
  function mdInline(text) {
    const out = [];
    const pattern = /(`[^`]+`)|(!?)\[([^\]]*)\]\(([^)\s]*)[^)]*\)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|(?<![A-Za-z0-9])_([^_]+)_(?![A-Za-z0-9])/g;
    let last = 0;
    for (const m of text.matchAll(pattern)) {
      if (m.index > last) out.push(text.slice(last, m.index));
      if (m[1]) out.push(el("code", {}, m[1].slice(1, -1)));
      else if (m[2] === "!") out.push(el("span", { class: "md-image", title: m[4] }, `[image: ${m[3] || "no description"}] ${m[4]}`));
      else if (m[3] !== undefined && m[4] !== undefined) {
        out.push(/^(https?:|mailto:)/i.test(m[4])
          ? el("a", { class: "md-link", href: m[4], rel: "noopener noreferrer nofollow", target: "_blank", referrerpolicy: "no-referrer" }, m[3])
          : el("span", { class: "md-link", title: m[4] }, m[3]));
      } else if (m[5]) out.push(el("strong", {}, m[5]));
      else if (m[6]) out.push(el("em", {}, m[6]));
      else if (m[7]) out.push(el("em", {}, m[7]));
      last = m.index + m[0].length;
    }
    if (last < text.length) out.push(text.slice(last));
    return out;
  }

  function markdown(text) {
    if (text.length > LONG_TEXT) return textBlock(text);
    const root = el("div", { class: "text md" });
    const lines = text.split("\n");
    let i = 0;
    const special = (line) => /^(```|#{1,6}\s|\s*[-*+]\s+|\s*\d+[.)]\s+|>\s?)/.test(line);
    while (i < lines.length) {
      const line = lines[i];
      if (/^```/.test(line)) {
        const code = [];
        for (i++; i < lines.length && !/^```/.test(lines[i]); i++) code.push(lines[i]);
        i++;
        root.appendChild(el("pre", { class: "md-code" }, code.join("\n")));
      } else if (/^#{1,6}\s/.test(line)) {
        const level = Math.min(6, line.indexOf(" ") + 2);
        root.appendChild(el("h" + level, { class: "md-heading" }, mdInline(line.replace(/^#+\s+/, ""))));
        i++;
      } else if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
        const ordered = /^\s*\d/.test(line);
        const list = el(ordered ? "ol" : "ul", {});
        for (; i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i]); i++) {
          list.appendChild(el("li", {}, mdInline(lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, ""))));
        }
        root.appendChild(list);
      } else if (/^>\s?/.test(line)) {
        const quote = [];
        for (; i < lines.length && /^>\s?/.test(lines[i]); i++) quote.push(lines[i].replace(/^>\s?/, ""));
        root.appendChild(el("blockquote", {}, mdInline(quote.join(" "))));
      } else if (!line.trim()) {
        i++;
      } else {
        const para = el("p", {});
        for (let first = true; i < lines.length && lines[i].trim() && !special(lines[i]); i++, first = false) {
          if (!first) para.appendChild(el("br", {}));
          add(para, mdInline(lines[i]));
        }
        root.appendChild(para);
      }
    }
    return root;
  }

  function jump(label, tab, turnId, targetId) {
    return el("a", { class: "jump", onclick: () => show(tab, turnId, targetId) }, label);
  }

  function callLabel(callId) {
    const call = DATA.calls[callId];
    return call ? `call ${callId} (attempt ${call.attempt})` : `call ${callId}`;
  }

  function provenance(item) {
    if (!item.by.length) return el("span", { class: "prov" }, "seen in a request; produced outside this trace");
    const parts = [];
    for (const [kind, ref] of item.by) {
      if (parts.length) parts.push("; ");
      if (kind === "user_input") {
        parts.push("user input of turn ", jump(ref, "transcript", ref, "turn-" + ref));
      } else if (kind === "inference") {
        const call = DATA.calls[ref];
        parts.push("output of inference ", jump(callLabel(ref), "timeline", call ? call.turn : null, "call-" + ref));
      } else if (kind === "tool") {
        const tool = DATA.tools[ref];
        parts.push(`output of tool call ${tool ? tool.name + " " : ""}${ref}`);
      }
    }
    return el("span", { class: "prov" }, "from ", parts);
  }

  function itemText(item) {
    if (item.kind === "function_call") return `${item.name || "?"}(${item.arguments || ""})`;
    if (item.kind === "function_call_output") return item.output || item.parts.map((p) => p[1]).join("");
    return item.parts.map((p) => p[1]).join("");
  }

  function itemLabel(item) {
    if (item.kind === "function_call") return "tool call";
    if (item.kind === "function_call_output") return "tool output";
    if (item.kind === "reasoning") return "reasoning";
    return item.role === "unspecified" ? item.kind : item.role;
  }

  function prettyJson(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch (e) {
      return text;
    }
  }

  function itemBody(item) {
    if (item.kind === "function_call") {
      const tool = toolByItem.get(item.id);
      return [
        el("div", { class: "tool-name" }, el("code", {}, item.name || "?"), item.call_id ? el("span", { class: "id" }, ` call_id ${item.call_id}`) : null,
          tool ? [" ", badge(tool.status), ` ${fmtDuration(durationOf(tool))}`,
            tool.is_error ? el("span", { class: "error" }, " (error output)") : null,
            tool.submitted_by ? el("span", { class: "prov" }, ` output submitted by ${tool.submitted_by}`) : null] : null),
        el("div", { class: "part-label" }, "arguments"),
        el("pre", { class: "arguments" }, prettyJson(item.arguments || "")),
      ];
    }
    if (item.kind === "function_call_output") {
      return [
        item.call_id ? el("div", { class: "id" }, `for call_id ${item.call_id}`) : null,
        el("pre", { class: "output" }, item.output || item.parts.map((p) => p[1]).join("")),
      ];
    }
    if (!item.parts.length) return el("div", { class: "note" }, "(no text content)");
    return item.parts.map(([type, text]) => {
      const node = el("div", { class: `part part-${token(type)}` });
      if (type === "refusal") node.appendChild(el("div", { class: "part-label" }, "refusal"));
      else if (type && type !== "output_text" && type !== "input_text" && type !== "summary_text") {
        node.appendChild(el("div", { class: "id" }, type));
      }
      node.appendChild(item.role === "assistant" && type === "output_text" ? markdown(text) : textBlock(text));
      return node;
    });
  }

  function itemView(item) {
    const node = el("div", { class: `item role-${token(item.role)} kind-${token(item.kind)}`, data: { itemId: item.id } },
      el("div", { class: "item-head" },
        el("span", { class: "who" }, itemLabel(item)),
        provenance(item),
        el("span", { class: "id" }, `${item.id}${item.rid ? " \u00b7 " + item.rid : ""} \u00b7 seq ${item.seq} \u00b7 ${fmtAt(item.at)}`)),
      itemBody(item));
    node.id = "item-" + item.id;
    return node;
  }

  function discardedView(call, index) {
    const out = call.discarded[index];
    const node = el("div", { class: "discarded", data: { callId: call.id } },
      el("div", { class: "item-head" },
        el("span", { class: "discarded-label" }, "DISCARDED OUTPUT"),
        el("span", { class: "prov" }, "never completed \u2014 not part of the conversation; from ",
          jump(callLabel(call.id), "timeline", call.turn, "call-" + call.id)),
        el("span", { class: "id" }, [out.type || "item", out.id ? " " + out.id : ""].join(""))),
      textBlock(out.text || "(no text streamed)"));
    return node;
  }

  function callMarker(call) {
    return el("div", { class: "call-marker", data: { callId: call.id } },
      "\u25b8 ", jump(`inference call ${call.id}`, "timeline", call.turn, "call-" + call.id),
      el("span", {}, `attempt ${call.attempt}`), badge(call.status),
      el("span", {}, fmtDuration(durationOf(call))),
      call.usage || call.status === "COMPLETED" ? el("span", {}, fmtUsage(call.usage)) : null,
      call.error ? el("span", { class: "error" }, `${call.error.code || "error"}: ${call.error.message}`) : null);
  }

  function interruptView(turn) {
    const it = turn.interrupt;
    return el("div", { class: "interrupt" },
      `\u2016 interrupt requested by ${it.by || "(unknown)"} at ${fmtAt(it.at)} (seq ${it.seq})`);
  }

  function turnHead(turn, extra) {
    const number = turnIndex.get(turn.id) + 1;
    return el("div", { class: "turn-head" },
      el("h2", {}, `Turn ${number}`, badge(turn.status), el("span", { class: "id" }, turn.id),
        el("span", { class: "prov" }, `${fmtAt(turn.start)} \u00b7 ${fmtDuration(durationOf(turn))}`),
        DATA.threads.length > 1 ? el("span", { class: "id" }, `thread ${turn.thread}`) : null,
        extra || null),
      fmtError(turn.error));
  }

  function transcriptTurn(turn) {
    const body = el("div", { class: "turn-body" });
    for (const entry of turn.flow) {
      if (entry[0] === "i") body.appendChild(itemView(DATA.items[entry[1]]));
      else if (entry[0] === "c") body.appendChild(callMarker(DATA.calls[entry[1]]));
      else if (entry[0] === "d") body.appendChild(discardedView(DATA.calls[entry[1]], entry[2]));
      else if (entry[0] === "x") body.appendChild(interruptView(turn));
    }
    if (!turn.flow.length) body.appendChild(el("div", { class: "note" }, "(nothing recorded in this turn)"));
    const node = el("section", { class: "turn", data: { turnId: turn.id } }, turnHead(turn), body);
    node.id = "turn-" + turn.id;
    return node;
  }

  // A call's lists are stored as "the previous call's first `keep` entries, then `add`".
  function resolveList(callId, field) {
    const chain = [];
    for (let id = callId; id !== null && id !== undefined; id = DATA.calls[id][field].base) {
      chain.push(DATA.calls[id][field]);
    }
    let list = [];
    for (let i = chain.length - 1; i >= 0; i--) list = list.slice(0, chain[i].keep).concat(chain[i].add);
    return list;
  }

  function requestBody(callId) {
    const P = payloads();
    const call = DATA.calls[callId];
    const envelope = P.envelopes[call.body.envelope];
    if (!envelope) return { error: "the request envelope is not in the bundle" };
    const inputs = [];
    for (const pid of resolveList(callId, "body")) {
      const text = P.inputs[pid];
      if (text === null || text === undefined) return { error: `input payload ${pid} is not in the bundle` };
      inputs.push(text);
    }
    return { text: envelope[0] + "[" + inputs.join(",") + "]" + envelope[1] };
  }

  function seenList(call) {
    const list = el("ol", { class: "seen" });
    const ids = resolveList(call.id, "seen");
    for (const id of ids.slice(0, SEEN_SHOWN)) {
      const item = DATA.items[id];
      if (!item) {
        list.appendChild(el("li", {}, el("span", { class: "id" }, id)));
        continue;
      }
      const preview = itemText(item);
      list.appendChild(el("li", { data: { itemId: id } },
        el("span", { class: "who" }, itemLabel(item)), " ",
        jump(id, "transcript", item.turn, "item-" + id), " ",
        el("span", { class: "preview" }, preview.length > 160 ? preview.slice(0, 160) + "\u2026" : preview)));
    }
    if (ids.length > SEEN_SHOWN) list.appendChild(el("li", { class: "note" }, `\u2026 and ${ids.length - SEEN_SHOWN} more`));
    return list;
  }

  function bodyView(call) {
    const holder = el("div", { class: "request-body" });
    const result = requestBody(call.id);
    if (result.error) {
      holder.appendChild(el("div", { class: "error" }, `cannot rebuild the request body: ${result.error}`));
      return holder;
    }
    const text = result.text;
    const pre = el("pre", { class: "body", data: { callId: call.id } });
    pre.textContent = text.length > BODY_SHOWN ? text.slice(0, BODY_SHOWN) + "\u2026" : text;
    const link = el("a", { download: `request-${token(call.id)}.json` }, `download (${text.length.toLocaleString()} bytes)`);
    link.href = URL.createObjectURL(new Blob([text], { type: "application/json" }));
    const pretty = el("button", { class: "more" }, "indent");
    pretty.addEventListener("click", () => {
      pre.textContent = prettyJson(text);
      pretty.remove();
    });
    holder.append(el("div", { class: "note" }, "The exact JSON body sent to the provider, rebuilt from the bundle. ", link, " "), pretty, pre);
    return holder;
  }

  function lazyDetails(summary, cls, build) {
    const details = el("details", { class: cls }, el("summary", {}, summary));
    details.addEventListener("toggle", () => {
      if (details.open && details.childElementCount === 1) details.appendChild(build());
    }, { once: false });
    return details;
  }

  function bar(ms, max, status) {
    const node = el("span", { class: `bar st-${token(status)}` });
    node.style.width = `${Math.max(2, Math.round(((ms || 0) / (max || 1)) * 120))}px`;
    return node;
  }

  function timelineTurn(turn, max, table) {
    const row = el("tr", { class: "turn-row", data: { turnId: turn.id } },
      el("td", {}, `Turn ${turnIndex.get(turn.id) + 1}`),
      el("td", { class: "id" }, turn.id),
      el("td", {}, badge(turn.status)),
      el("td", {}, fmtAt(turn.start)),
      el("td", {}, bar(durationOf(turn), max, turn.status), fmtDuration(durationOf(turn))),
      el("td", {}, `${turn.calls.length} inference call${turn.calls.length === 1 ? "" : "s"}`,
        turn.tools.length ? `, ${turn.tools.length} tool call${turn.tools.length === 1 ? "" : "s"}` : "",
        turn.interrupt ? el("div", { class: "interrupt" }, `interrupt requested by ${turn.interrupt.by || "(unknown)"} at ${fmtAt(turn.interrupt.at)}`) : null,
        fmtError(turn.error)));
    row.id = "tl-turn-" + turn.id;
    table.appendChild(row);
    for (const callId of turn.calls) {
      const call = DATA.calls[callId];
      const callRow = el("tr", { class: "call-row", data: { callId: call.id, status: call.status } },
        el("td", {}, `attempt ${call.attempt}`),
        el("td", { class: "id" }, call.id),
        el("td", {}, badge(call.status)),
        el("td", {}, fmtAt(call.start)),
        el("td", {}, bar(durationOf(call), max, call.status), fmtDuration(durationOf(call))),
        el("td", {},
          el("div", {}, `model ${call.model}`, call.response_id ? el("span", { class: "id" }, ` \u00b7 ${call.response_id}`) : null),
          call.usage || call.status === "COMPLETED" ? el("div", { class: "usage" }, fmtUsage(call.usage)) : null,
          call.end_reason ? el("div", { class: "prov" }, `ended: ${call.end_reason}`) : null,
          fmtError(call.error),
          el("div", { class: "prov" }, `${call.accepted.length} accepted, ${call.discarded.length} discarded`)));
      callRow.id = "call-" + call.id;
      table.appendChild(callRow);
      const detail = el("td", { colspan: 6 },
        lazyDetails(`What the model saw (${call.seen_count} items)`, "seen-details", () => seenList(call)),
        lazyDetails("Request body", "body-details", () => bodyView(call)));
      for (let i = 0; i < call.discarded.length; i++) detail.appendChild(discardedView(call, i));
      table.appendChild(el("tr", { class: "detail-row", data: { callId: call.id } }, detail));
    }
    for (const toolId of turn.tools) {
      const tool = DATA.tools[toolId];
      if (!tool) continue;
      table.appendChild(el("tr", { class: "tool-row", data: { toolCallId: tool.id } },
        el("td", {}, "tool call"),
        el("td", { class: "id" }, tool.id),
        el("td", {}, badge(tool.status)),
        el("td", {}, fmtAt(tool.start)),
        el("td", {}, bar(durationOf(tool), max, tool.status), fmtDuration(durationOf(tool))),
        el("td", {}, el("code", {}, tool.name), tool.is_error ? el("span", { class: "error" }, " error output") : null,
          tool.submitted_by ? el("span", { class: "prov" }, ` \u00b7 output submitted by ${tool.submitted_by}`) : null)));
    }
  }

  function timeline(turnIds) {
    let max = 0;
    for (const id of turnIds) {
      const turn = DATA.turns[id];
      max = Math.max(max, durationOf(turn) || 0);
      for (const c of turn.calls) max = Math.max(max, durationOf(DATA.calls[c]) || 0);
    }
    const table = el("table", { class: "timeline" },
      el("thead", {}, el("tr", {}, ["", "id", "status", "started", "duration", "details"].map((h) => el("th", {}, h)))));
    const body = el("tbody", {});
    for (const id of turnIds) timelineTurn(DATA.turns[id], max, body);
    table.appendChild(body);
    return table;
  }

  function pager() {
    const first = state.page * DATA.page_turns;
    const last = Math.min(turnOrder.length, first + DATA.page_turns);
    const jumpTo = el("input", { type: "number", min: 1, max: pageCount, value: state.page + 1, "aria-label": "page" });
    jumpTo.addEventListener("change", () => go(Number(jumpTo.value) - 1));
    return el("div", { class: "pager" },
      el("button", { onclick: () => go(0), disabled: state.page === 0 ? "disabled" : null }, "\u00ab first"),
      el("button", { class: "prev", onclick: () => go(state.page - 1), disabled: state.page === 0 ? "disabled" : null }, "\u2039 previous"),
      el("span", { class: "page-info" }, `page ${state.page + 1} of ${pageCount} \u00b7 turns ${turnOrder.length ? first + 1 : 0}\u2013${last} of ${turnOrder.length}`),
      el("button", { class: "next", onclick: () => go(state.page + 1), disabled: state.page >= pageCount - 1 ? "disabled" : null }, "next \u203a"),
      el("button", { onclick: () => go(pageCount - 1), disabled: state.page >= pageCount - 1 ? "disabled" : null }, "last \u00bb"),
      jumpTo);
  }

  function go(page) {
    state.page = Math.min(pageCount - 1, Math.max(0, page || 0));
    render();
    window.scrollTo(0, 0);
  }

  function show(tab, turnId, targetId) {
    state.tab = tab;
    if (turnId !== null && turnId !== undefined && turnIndex.has(turnId)) {
      state.page = Math.floor(turnIndex.get(turnId) / DATA.page_turns);
    }
    render();
    const target = targetId ? document.getElementById(targetId) : null;
    if (target) {
      target.scrollIntoView({ block: "center" });
      target.classList.add("highlight");
      setTimeout(() => target.classList.remove("highlight"), 1500);
    }
  }

  function render() {
    for (const button of document.querySelectorAll("nav#tabs button")) {
      button.setAttribute("aria-selected", String(button.dataset.tab === state.tab));
    }
    const ids = turnOrder.slice(state.page * DATA.page_turns, (state.page + 1) * DATA.page_turns);
    const main = document.getElementById("main");
    const content = el("div", { id: state.tab });
    if (!ids.length) content.appendChild(el("p", { class: "note" }, "No turn was recorded."));
    else if (state.tab === "transcript") for (const id of ids) content.appendChild(transcriptTurn(DATA.turns[id]));
    else content.appendChild(timeline(ids));
    main.replaceChildren(pager(), content, pageCount > 1 ? pager() : "");
  }

  function header() {
    const t = DATA.trace;
    const integrity = t.integrity;
    const facts = el("dl", { class: "facts" });
    const fact = (name, ...value) => facts.append(el("dt", {}, name), el("dd", {}, ...value));
    for (const thread of DATA.threads) {
      fact("thread", el("span", { class: "mono", id: thread.id === t.root_thread_id ? "thread-id" : null }, thread.id), " ", badge(thread.status),
        ` \u00b7 ${thread.turns.length} turns \u00b7 ${thread.item_count} conversation items`);
      fact("model", el("span", { class: "model" }, thread.model));
      if (thread.instructions) {
        const details = el("details", {}, el("summary", {}, `instructions (${thread.instructions.length} characters)`), textBlock(thread.instructions));
        fact("", details);
      }
      const meta = Object.entries(thread.metadata);
      if (meta.length) fact("metadata", meta.map(([k, v]) => el("code", {}, `${k}=${v} `)));
    }
    fact("producer", el("span", { class: "producer" }, t.producer || "\u2014"));
    fact("trace id", el("span", { class: "mono" }, t.trace_id || "\u2014"));
    fact("recorded", `${t.started_at || "\u2014"} \u00b7 ${fmtDuration(t.duration)}`);
    fact("integrity", el("span", { id: "integrity" }, badge(integrity.status, "in")),
      ` ${integrity.records_read.toLocaleString()} records, ${integrity.bytes_read.toLocaleString()} bytes`,
      integrity.detail ? el("div", { id: "integrity-detail", class: "mono" }, integrity.detail) : null);
    fact("recording complete", el("span", { id: "recording-complete", class: `status ${t.recording_complete ? "yes" : "no"}` },
      t.recording_complete ? "\u2713 yes" : "\u2717 no: the recording did not finish cleanly"));
    const calls = Object.keys(DATA.calls).length;
    const discarded = Object.values(DATA.calls).reduce((n, c) => n + c.discarded.length, 0);
    fact("contents", `${turnOrder.length} turns \u00b7 ${calls} inference calls \u00b7 ${Object.keys(DATA.items).length} items \u00b7 ${Object.keys(DATA.tools).length} tool calls \u00b7 ${discarded} discarded outputs`);
    const head = document.getElementById("header");
    head.replaceChildren(el("h1", {}, `Rollout ${t.root_thread_id || t.trace_id}`), facts);
  }

  function tabs() {
    const nav = document.getElementById("tabs");
    nav.replaceChildren(
      el("button", { data: { tab: "transcript" }, onclick: () => { state.tab = "transcript"; render(); } }, "Transcript"),
      el("button", { data: { tab: "timeline" }, onclick: () => { state.tab = "timeline"; render(); } }, "Timeline"),
      el("span", { class: "note", style: null }, `  ${DATA.page_turns} turns a page`));
  }

  header();
  tabs();
  render();
  document.body.dataset.ready = "true";
})();
