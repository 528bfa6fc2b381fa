"use strict";
// The rollout panel of the run page: rewards, the fork tree, per-call settings and stop
// reasons, the waterfall, token logprobs, and each request as a JSON tree with what is new
// since the previous call. Bundle text reaches the page only as text nodes.
(function () {
  const DATA = JSON.parse(document.getElementById("view-data").textContent);
  const R = DATA.rollout || { rewards: [], fork: null, calls: {}, tools: {}, links: {} };
  const RUNS = (R.links && R.links.runs) || {};
  const { el, shortId, payloads, fmtNumber } = RolloutPage;

  function runLink(threadId) {
    const run = RUNS[threadId];
    const label = shortId(threadId);
    return run && run.href ? el("a", { class: "run-link", href: run.href }, label) : label;
  }

  function fmt(value) {
    return fmtNumber(value, 4);
  }

  function section(id, title, ...body) {
    return el("div", { class: "rollout-part", id }, el("h2", {}, title), ...body);
  }

  function rewards() {
    if (!R.rewards.length) return section("rewards", "Rewards", el("p", { class: "note" }, "No reward was recorded."));
    const rows = R.rewards.map((r) => el("tr", { class: "reward" },
      el("td", { class: "reward-name" }, r.name), el("td", { class: "reward-value" }, fmt(r.value)),
      el("td", {}, r.weight ? fmt(r.weight) : ""),
      el("td", {}, r.item ? ["item ", shortId(r.item)] : r.turn ? ["turn ", shortId(r.turn)] : ["thread ", shortId(r.thread)],
        r.found ? "" : el("span", { class: "error" }, " (not in this trace)")),
      el("td", {}, r.source), el("td", {}, Object.entries(r.metadata).map(([k, v]) => `${k}=${v} `))));
    return section("rewards", "Rewards", el("table", { class: "rewards" },
      el("tr", {}, ["name", "value", "weight", "for", "source", "metadata"].map((h) => el("th", {}, h))), rows));
  }

  function forkTree() {
    const me = DATA.trace.root_thread_id;
    const fork = R.fork;
    const parts = [];
    if (fork) {
      const chain = [...fork.ancestors].reverse();
      const path = el("ol", { class: "fork-chain" });
      for (const link of chain) {
        path.appendChild(el("li", {}, runLink(link.thread_id), link.resumed ? " (resumed)" : ""));
      }
      path.appendChild(el("li", { class: "fork-self" }, shortId(me),
        fork.resumed ? ` resumes it after turn ` : ` forks it after turn `, shortId(fork.after_turn_id),
        fork.group_id ? [" \u00b7 group ", el("code", {}, fork.group_id), ` \u00b7 repetition ${fork.repetition_index}`] : "",
        fork.resolved ? "" : el("span", { class: "error" }, " (the parent bundle was not found: its shared history is missing)")));
      parts.push(el("div", {}, "parent ", runLink(fork.parent_thread_id)), path);
    }
    const children = Object.entries(RUNS).filter(([, run]) => run.parent_thread_id === me);
    if (children.length) {
      parts.push(el("div", {}, "continued by"), el("ul", { class: "fork-children" },
        children.map(([id, run]) => el("li", {}, runLink(id), ` ${run.status || ""}`, run.group_id ? ` \u00b7 group ${run.group_id} #${run.repetition_index}` : ""))));
    }
    if (fork && fork.group_id) {
      const siblings = Object.entries(RUNS).filter(([id, run]) => id !== me && run.group_id === fork.group_id);
      if (siblings.length) {
        parts.push(el("div", {}, `its group (${siblings.length + 1} rollouts)`), el("ul", { class: "fork-group" },
          siblings.map(([id, run]) => el("li", {}, runLink(id), ` #${run.repetition_index} ${run.status || ""} `,
            Object.entries(run.rewards || {}).map(([k, v]) => el("span", { class: "reward-chip" }, `${k}=${fmt(v)} `))))));
      }
    }
    if (!parts.length) parts.push(el("p", { class: "note" }, "Not a fork, and no run continues it."));
    return section("fork", "Fork tree", parts);
  }

  function callRows() {
    const ids = Object.keys(DATA.calls);
    const rows = ids.map((id) => {
      const call = DATA.calls[id];
      const extra = R.calls[id] || {};
      const settings = Object.entries(extra.sampling || {}).map(([k, v]) => `${k}=${fmt(v)}`).join(" ");
      return el("tr", { class: "call-row" },
        el("td", {}, shortId(id)), el("td", {}, call.model), el("td", {}, String(call.attempt)),
        el("td", {}, settings || "\u2014"), el("td", { class: "policy" }, extra.policy_version || "\u2014"),
        el("td", { class: "stop" }, extra.stop_reason || call.end_reason || "\u2014"),
        el("td", { class: "drift" }, extra.drift ? `${extra.drift.check}${extra.drift.check === "EXACT" ? "" : " at token " + extra.drift.position} of ${extra.drift.held} held` : "\u2014"));
    });
    return section("calls", "Inference calls", el("table", { class: "calls" },
      el("tr", {}, ["call", "model", "attempt", "sampling", "policy version", "stop reason", "drift"].map((h) => el("th", {}, h))), rows));
  }

  function waterfall() {
    const spans = [];
    for (const [id, call] of Object.entries(DATA.calls)) {
      if (call.start !== null) spans.push({ id, kind: "call", label: `call ${call.attempt > 1 ? "(retry " + call.attempt + ")" : ""}`, start: call.start, end: call.end, status: call.status });
    }
    for (const [id, tool] of Object.entries(DATA.tools)) {
      const times = R.tools[id] || {};
      if (times.start !== null && times.start !== undefined) spans.push({ id, kind: "tool", label: `tool ${tool.name}`, start: times.start, end: times.end, status: tool.status });
    }
    spans.sort((a, b) => a.start - b.start);
    const end = Math.max(1, DATA.trace.duration || 0, ...spans.map((s) => s.end || s.start));
    const rows = spans.map((s) => {
      const left = (100 * s.start) / end;
      const width = Math.max(0.3, (100 * ((s.end === null ? end : s.end) - s.start)) / end);
      return el("div", { class: `wf-row wf-${s.kind}`, "data-start": String(s.start) },
        el("span", { class: "wf-label" }, s.label, " ", shortId(s.id)),
        el("span", { class: "wf-track" }, el("span", { class: `wf-bar status-${String(s.status).toLowerCase()}`, style: `left:${left}%;width:${width}%`, title: `${fmt(s.start)} ms \u2192 ${s.end === null ? "running" : fmt(s.end) + " ms"}` })));
    });
    return section("waterfall", "Waterfall (by start time)", rows.length ? rows : el("p", { class: "note" }, "No call was recorded."));
  }

  function bucket(logprob) {
    const p = Math.exp(logprob);
    return p >= 0.9 ? "lp-high" : p >= 0.5 ? "lp-mid" : p >= 0.1 ? "lp-low" : "lp-unlikely";
  }

  function tokens() {
    const withTokens = Object.entries(R.calls).filter(([, c]) => c.tokens);
    if (!withTokens.length) return section("tokens", "Tokens", el("p", { class: "note" }, "No logprobs were recorded."));
    const holder = el("div", { class: "token-views" });
    let colored = false;
    const draw = () => {
      holder.replaceChildren(...withTokens.map(([id, c]) => {
        const t = c.tokens;
        const pieces = t.texts.length ? t.texts : t.ids.map((n) => `\u27e8${n}\u27e9`);
        const text = el("div", { class: "token-text" + (colored ? " colored" : "") },
          pieces.map((piece, i) => colored
            ? el("span", { class: `tok ${bucket(t.logprobs[i])}`, title: `logprob ${t.logprobs[i]} \u00b7 p ${Math.exp(t.logprobs[i]).toFixed(3)}` }, piece)
            : piece));
        return el("div", { class: "token-call" }, el("div", { class: "id" }, "call ", shortId(id), ` \u00b7 ${t.count} tokens`), text);
      }));
    };
    const toggle = el("button", { id: "logprob-toggle", "aria-pressed": "false" }, "show logprobs");
    toggle.addEventListener("click", () => {
      colored = !colored;
      toggle.setAttribute("aria-pressed", String(colored));
      toggle.textContent = colored ? "hide logprobs" : "show logprobs";
      draw();
    });
    draw();
    return section("tokens", "Tokens", toggle, el("span", { class: "note" }, " unlikely tokens (p < 0.1) are marked"), holder);
  }

  function resolveInputs(callId) {
    const chain = [];
    for (let id = callId; id !== null && id !== undefined && DATA.calls[id]; id = DATA.calls[id].body.base) chain.push(DATA.calls[id].body);
    let list = [];
    for (let i = chain.length - 1; i >= 0; i--) list = list.slice(0, chain[i].keep).concat(chain[i].add);
    return list;
  }

  function jsonTree(value, key, depth) {
    const label = key === null ? "" : [el("span", { class: "json-key" }, JSON.stringify(key)), ": "];
    if (value === null || typeof value !== "object") {
      return el("div", { class: "json-leaf" }, label, el("span", { class: `json-${value === null ? "null" : typeof value}` }, JSON.stringify(value)));
    }
    const entries = Array.isArray(value) ? value.map((v, i) => [i, v]) : Object.entries(value);
    const open = Array.isArray(value) ? "[" : "{";
    const node = el("details", { class: "json-node" }, el("summary", {}, label, `${open} ${entries.length} ${Array.isArray(value) ? "items" : "keys"}`));
    if (depth < 1) node.open = true;
    let built = false;
    const build = () => {
      if (built) return;
      built = true;
      for (const [k, v] of entries) node.appendChild(jsonTree(v, Array.isArray(value) ? null : k, depth + 1));
    };
    if (node.open) build();
    node.addEventListener("toggle", build);
    return node;
  }

  function requestView(callId) {
    const P = payloads();
    const call = DATA.calls[callId];
    const envelope = P.envelopes[call.body.envelope];
    const inputs = resolveInputs(callId).map((pid) => P.inputs[pid]);
    if (!envelope || inputs.some((t) => t === null || t === undefined)) {
      return el("p", { class: "note" }, "The request body cannot be rebuilt from this bundle.");
    }
    let body;
    try {
      body = JSON.parse(envelope[0] + "[" + inputs.join(",") + "]" + envelope[1]);
    } catch (e) {
      return el("p", { class: "note" }, "The request body is not JSON.");
    }
    const added = call.body.add.map((pid) => P.inputs[pid]).filter((t) => t !== null && t !== undefined);
    const diff = el("div", { class: "request-diff" },
      el("div", { class: "diff-head" }, call.body.base
        ? [`new since the previous call (`, shortId(call.body.base), `): ${added.length} input items; ${call.body.keep} kept`]
        : `the first call: all ${added.length} input items are new`),
      added.map((text) => el("div", { class: "diff-added" }, "+ ", jsonTree(JSON.parse(text), null, -3))));
    return el("div", { class: "request-view" }, diff, el("div", { class: "part-label" }, "request body"), jsonTree(body, null, 0));
  }

  function requests() {
    const list = Object.keys(DATA.calls).map((id) => {
      const details = el("details", { class: "request", "data-call": id }, el("summary", {}, "request of call ", shortId(id)));
      let built = false;
      details.addEventListener("toggle", () => {
        if (!built && details.open) {
          built = true;
          details.appendChild(requestView(id));
        }
      });
      return details;
    });
    return section("requests", "Requests", list.length ? list : el("p", { class: "note" }, "No request was recorded."));
  }

  const panel = document.getElementById("rollout");
  if (panel) {
    panel.replaceChildren(rewards(), forkTree(), callRows(), waterfall(), tokens(), requests());
  }

  // A served page of a bundle still being written reloads as the bundle grows.
  if (DATA.live && window.EventSource) {
    const source = new EventSource(DATA.live);
    source.addEventListener("message", (event) => {
      let update = null;
      try {
        update = JSON.parse(event.data);
      } catch (e) {
        return;
      }
      if (update.records > DATA.trace.integrity.records_read) {
        source.close();
        sessionStorage.setItem("scroll", String(window.scrollY));
        window.location.reload();
      }
      if (update.final) source.close();
    });
    const scroll = sessionStorage.getItem("scroll");
    if (scroll !== null) {
      sessionStorage.removeItem("scroll");
      window.scrollTo(0, Number(scroll));
    }
  }
  document.body.dataset.rolloutReady = "true";
})();
