"use strict";
// The run list: search, filters and sorting over the runs embedded in #list-data; a served
// list asks its server for the runs again every few seconds, so live runs move on their own.
// Bundle text reaches the page only as text nodes.
(function () {
  const DATA = JSON.parse(document.getElementById("list-data").textContent);
  let runs = DATA.runs;
  const state = { text: "", status: "", integrity: "", model: "", reward: "", sort: "started", descending: true };
  const POLL_MS = 2000;
  // The next poll waits this many times as long as the last one took, when that is longer: a
  // server takes seconds to list a root of tens of thousands of runs, and one open page must
  // not keep it listing all the time.
  const POLL_BACKOFF = 4;
  const { el, shortId, fmtNumber } = RolloutPage;

  function rewardFilter(text) {
    const m = /^\s*([^<>=!\s]+)\s*(>=|<=|!=|==|=|>|<)\s*(-?[0-9.eE+-]+)\s*$/.exec(text);
    if (!m) return null;
    const value = Number(m[3]);
    if (Number.isNaN(value)) return null;
    const compare = { ">=": (a, b) => a >= b, "<=": (a, b) => a <= b, ">": (a, b) => a > b, "<": (a, b) => a < b,
      "=": (a, b) => a === b, "==": (a, b) => a === b, "!=": (a, b) => a !== b }[m[2]];
    return (run) => run.rewards[m[1]] !== undefined && compare(run.rewards[m[1]], value);
  }

  function matches(run) {
    if (state.status && run.status !== state.status) return false;
    if (state.integrity && run.integrity !== state.integrity) return false;
    if (state.model && run.model !== state.model) return false;
    if (state.reward) {
      const test = rewardFilter(state.reward);
      if (test && !test(run)) return false;
    }
    if (state.text && !haystack(run).includes(state.text.toLowerCase())) return false;
    return true;
  }

  // Each run's searchable text, lower-cased once while the list stays as fetched: a keystroke
  // searches thousands of runs, and each run's text is up to a thousand characters. The
  // fields are joined by a character no search can span. Keyed weakly by the run object, so a
  // polled list (new objects) starts afresh and the old entries go with the old runs.
  const haystacks = new WeakMap();
  function haystack(run) {
    let hay = haystacks.get(run);
    if (hay === undefined) {
      const fields = [run.thread_id, run.model, run.bundle, run.text, ...Object.values(run.metadata || {}), ...(run.tools || [])];
      hay = fields.map((v) => String(v || "").toLowerCase()).join("\u0000");
      haystacks.set(run, hay);
    }
    return hay;
  }

  function sortValue(run, key) {
    if (key.startsWith("reward:")) return run.rewards[key.slice(7)];
    if (key === "tokens") return run.tokens.total;
    if (key === "reward") {
      const values = Object.values(run.rewards);
      return values.length ? values[0] : undefined;
    }
    return run[key];
  }

  // Runs with a value for the key, in its order, then the runs without one as they came: one
  // pass to split them, each run's value taken once.
  function sorted(list) {
    const key = state.sort;
    const present = [], missing = [];
    for (const run of list) {
      const value = sortValue(run, key);
      if (value === undefined || value === null || value === "") missing.push(run);
      else present.push([value, run]);
    }
    const sign = state.descending ? -1 : 1;
    present.sort((a, b) => sign * (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
    return present.map((pair) => pair[1]).concat(missing);
  }

  function options(id, label, values) {
    const select = el("select", { id, "aria-label": label }, el("option", { value: "" }, `any ${label}`),
      [...values].sort().map((v) => el("option", { value: v }, v)));
    select.value = state[id] || "";
    select.addEventListener("change", () => { state[id] = select.value; draw(); });
    return select;
  }

  function filters() {
    const search = el("input", { id: "search", type: "search", placeholder: "search ids, models, metadata, messages", size: "40" });
    search.value = state.text;
    search.addEventListener("input", () => { state.text = search.value; draw(); });
    const reward = el("input", { id: "reward", type: "text", placeholder: "reward, e.g. score<0.5", size: "18" });
    reward.value = state.reward;
    reward.addEventListener("input", () => { state.reward = reward.value; draw(); });
    document.getElementById("filters").replaceChildren(search, " ",
      options("status", "status", new Set(runs.map((r) => r.status))), " ",
      options("integrity", "integrity", new Set(runs.map((r) => r.integrity).filter(Boolean))), " ",
      options("model", "model", new Set(runs.map((r) => r.model).filter(Boolean))), " ", reward,
      el("span", { id: "count", class: "note" }));
  }

  const COLUMNS = [
    ["thread_id", "thread"], ["model", "model"], ["status", "status"], ["turns", "turns"], ["calls", "calls"],
    ["tool_calls", "tool calls"], ["tokens", "tokens"], ["reward", "rewards"], ["integrity", "integrity"],
    ["started", "started"], ["duration", "duration"],
  ];

  function cell(run, key) {
    switch (key) {
      case "thread_id": {
        const label = run.thread_id ? shortId(run.thread_id) : el("span", { class: "mono" }, run.bundle);
        return el("td", {}, el("a", { class: "run-link", href: run.href }, label),
          run.fork ? el("span", { class: "note" }, run.fork.resumed ? " resumed" : ` fork #${run.fork.repetition_index}`) : "");
      }
      case "tokens": return el("td", { class: "num" }, run.tokens.total.toLocaleString());
      case "reward": return el("td", { class: "rewards" }, Object.entries(run.rewards).map(([k, v]) => el("span", { class: "reward-chip" }, `${k}=${fmtNumber(v, 3)}`)));
      case "status": return el("td", {}, el("span", { class: `status st-${run.status}` }, run.status), run.error ? el("div", { class: "error" }, run.error) : "");
      case "duration": return el("td", { class: "num" }, run.duration === null ? "\u2014" : `${run.duration.toFixed(1)}s`);
      case "started": return el("td", {}, run.started ? run.started.slice(0, 19).replace("T", " ") : "\u2014");
      default: return el("td", {}, String(run[key] === undefined || run[key] === "" ? "\u2014" : run[key]));
    }
  }

  // Rows drawn at once; "show more" adds as many again. Thousands of rows would be drawn again
  // at every keystroke of a search.
  const PAGE_ROWS = 500;
  let drawnRows = PAGE_ROWS;

  function draw() {
    const matching = sorted(runs.filter(matches));
    const shown = matching.slice(0, drawnRows);
    const head = el("tr", {}, COLUMNS.map(([key, label]) => {
      const th = el("th", { "data-sort": key, "aria-sort": state.sort === key ? (state.descending ? "descending" : "ascending") : null },
        label, state.sort === key ? (state.descending ? " \u25bc" : " \u25b2") : "");
      th.addEventListener("click", () => {
        if (state.sort === key) state.descending = !state.descending;
        else { state.sort = key; state.descending = key === "started"; }
        draw();
      });
      return th;
    }));
    const body = shown.map((run) => el("tr", { class: `run st-${run.status}`, "data-thread": run.thread_id, "data-bundle": run.bundle },
      COLUMNS.map(([key]) => cell(run, key))));
    const table = el("table", { id: "runs" }, el("thead", {}, head), el("tbody", {}, body));
    const rest = matching.length - shown.length;
    const more = rest > 0
      ? el("button", { id: "more", type: "button" }, `show ${Math.min(rest, PAGE_ROWS).toLocaleString()} more of ${rest.toLocaleString()}`)
      : "";
    if (more) more.addEventListener("click", () => { drawnRows += PAGE_ROWS; draw(); });
    document.getElementById("main").replaceChildren(table, more);
    const count = document.getElementById("count");
    if (count) {
      const drawn = rest > 0 ? `${shown.length} shown, ` : "";
      count.textContent = ` ${drawn}${matching.length} of ${runs.length} runs`;
    }
  }

  // The list as last fetched (first, the one the page came with): an unchanged one is
  // answered 304, without its body.
  let tag = DATA.tag || null;

  async function poll() {
    const started = performance.now();
    try {
      const headers = tag === null ? {} : { "If-None-Match": tag };
      const response = await fetch("api/runs", { credentials: "same-origin", cache: "no-store", headers });
      // The tag is a digest of the list's bytes: an answer with a body is a changed list.
      if (response.ok) {
        tag = response.headers.get("ETag");
        runs = (await response.json()).runs;
        filters();
        draw();
        document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
      }
    } catch (e) {
      // The server went away; the list stays as it was.
    }
    const wait = Math.max(POLL_MS, Math.round(POLL_BACKOFF * (performance.now() - started)));
    document.body.dataset.pollMs = String(wait);
    setTimeout(poll, wait);
  }

  filters();
  draw();
  document.body.dataset.ready = "true";
  if (DATA.served) setTimeout(poll, POLL_MS);
})();
