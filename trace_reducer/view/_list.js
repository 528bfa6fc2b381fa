"use strict";
// The run list. A static site's page holds every run (#list-data) and searches, filters and
// sorts them itself. A served page holds one answer of its server's /api/runs (the runs a
// question chooses, in its order, a page of them, how many it chose of how many, and what the
// menus offer) and asks again, with `list`'s filter names, for each change and every few
// seconds, so live runs move on their own: a root of 100,000 runs is never all in the page.
// Bundle text reaches the page only as text nodes.
(function () {
  const DATA = JSON.parse(document.getElementById("list-data").textContent);
  const served = DATA.served === true;
  let runs = DATA.runs;
  // Served: the answer drawn, and what the menus offer.
  let answer = DATA;
  const state = { text: "", status: "", integrity: "", model: "", reward: "", sort: "started", descending: true };
  const POLL_MS = 2000;
  // A served page asks once typing pauses this long, not at every keystroke.
  const TYPING_MS = 150;
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
      // The fields `list --text` searches (_searched_fields in batch/_listing.py), in its order.
      const fork = run.fork || {};
      const fields = [run.thread_id, run.trace_id, fork.group_id, fork.parent_thread_id, run.model, run.bundle, run.text,
        ...Object.values(run.metadata || {}), ...(run.tools || [])];
      hay = fields.map((v) => String(v || "").toLowerCase()).join("\u0000");
      haystacks.set(run, hay);
    }
    return hay;
  }

  // Unknown is no 0: "?" when no call reported usage, "N+?" when some did not.
  function fmtTokens(tokens) {
    if (tokens.total === null) return el("span", { title: "no call reported usage" }, "?");
    if (!tokens.unknown_calls) return tokens.total.toLocaleString();
    return el("span", { title: `${tokens.unknown_calls} call(s) reported no usage` }, `${tokens.total.toLocaleString()}+?`);
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

  // What each menu offers: the served answer's facets, or what the page's runs have.
  function offered(id) {
    if (served) return answer.facets[id];
    return [...new Set(runs.map((r) => r[id]).filter(Boolean))].sort();
  }

  function fillOptions(select, label, values) {
    select.replaceChildren(el("option", { value: "" }, `any ${label}`), ...values.map((v) => el("option", { value: v }, v)));
    // A value no run has any more stays chosen, shown as such.
    if (state[select.id] && !values.includes(state[select.id])) select.append(el("option", { value: state[select.id] }, state[select.id]));
    select.value = state[select.id] || "";
  }

  const MENUS = [["status", "status"], ["integrity", "integrity"], ["model", "model"]];
  let menusFilled = "";

  // The menus again when what they offer changed; the inputs stay, so typing is not cut off.
  function menus() {
    const key = JSON.stringify(MENUS.map(([id]) => offered(id)));
    if (key === menusFilled) return;
    menusFilled = key;
    for (const [id, label] of MENUS) fillOptions(document.getElementById(id), label, offered(id));
  }

  function filters() {
    const search = el("input", { id: "search", type: "search", placeholder: "search ids, models, metadata, messages", size: "40" });
    search.addEventListener("input", () => { state.text = search.value; changed(true); });
    const reward = el("input", { id: "reward", type: "text", placeholder: "reward, e.g. score<0.5", size: "18" });
    reward.addEventListener("input", () => { state.reward = reward.value; changed(true); });
    const selects = MENUS.map(([id, label]) => {
      const select = el("select", { id, "aria-label": label });
      select.addEventListener("change", () => { state[id] = select.value; changed(false); });
      return select;
    });
    document.getElementById("filters").replaceChildren(search, " ", selects[0], " ", selects[1], " ", selects[2], " ", reward,
      el("span", { id: "count", class: "note" }), el("span", { id: "query-error", class: "error", role: "status" }));
    menus();
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
      case "tokens": return el("td", { class: "num" }, fmtTokens(run.tokens));
      case "reward": return el("td", { class: "rewards" }, Object.entries(run.rewards).map(([k, v]) => el("span", { class: "reward-chip" }, `${k}=${fmtNumber(v, 3)}`)));
      case "status": return el("td", {}, el("span", { class: `status st-${run.status}` }, run.status), run.error ? el("div", { class: "error" }, run.error) : "");
      case "duration": return el("td", { class: "num" }, run.duration === null ? "\u2014" : `${run.duration.toFixed(1)}s`);
      case "started": return el("td", {}, run.started ? run.started.slice(0, 19).replace("T", " ") : "\u2014");
      default: return el("td", {}, String(run[key] === undefined || run[key] === "" ? "\u2014" : run[key]));
    }
  }

  // Rows drawn at once; "show more" adds as many again. Thousands of rows would be drawn again
  // at every keystroke of a search.
  const PAGE_ROWS = DATA.page_rows;
  let drawnRows = PAGE_ROWS;

  // The rows to draw, how many runs match and of how many.
  function chosen() {
    if (served) return [answer.runs, answer.matching, answer.total];
    const matching = sorted(runs.filter(matches));
    return [matching.slice(0, drawnRows), matching.length, runs.length];
  }

  function draw() {
    const [shown, matchingCount, totalCount] = chosen();
    const head = el("tr", {}, COLUMNS.map(([key, label]) => {
      const th = el("th", { "data-sort": key, "aria-sort": state.sort === key ? (state.descending ? "descending" : "ascending") : null },
        label, state.sort === key ? (state.descending ? " \u25bc" : " \u25b2") : "");
      th.addEventListener("click", () => {
        if (state.sort === key) state.descending = !state.descending;
        else { state.sort = key; state.descending = key === "started"; }
        changed(false);
      });
      return th;
    }));
    const body = shown.map((run) => el("tr", { class: `run st-${run.status}`, "data-thread": run.thread_id, "data-bundle": run.bundle },
      COLUMNS.map(([key]) => cell(run, key))));
    const table = el("table", { id: "runs" }, el("thead", {}, head), el("tbody", {}, body));
    const rest = matchingCount - shown.length;
    const more = rest > 0
      ? el("button", { id: "more", type: "button" }, `show ${Math.min(rest, PAGE_ROWS).toLocaleString()} more of ${rest.toLocaleString()}`)
      : "";
    if (more) more.addEventListener("click", () => { drawnRows += PAGE_ROWS; changed(false); });
    document.getElementById("main").replaceChildren(table, more);
    const count = document.getElementById("count");
    if (count) {
      const drawn = rest > 0 ? `${shown.length} shown, ` : "";
      count.textContent = ` ${drawn}${matchingCount} of ${totalCount} runs`;
    }
  }

  // The served list's question, in `list`'s words: its filters, its sort (the rewards column
  // by the first reward name the runs have), and as many rows as are drawn.
  function question() {
    const params = new URLSearchParams();
    if (state.text) params.set("text", state.text);
    for (const [id] of MENUS) if (state[id]) params.set(id, state[id]);
    if (state.reward.trim()) params.set("reward", state.reward.trim());
    let key = state.sort;
    if (key === "reward") key = answer.facets.reward.length ? `reward:${answer.facets.reward[0]}` : "started";
    params.set("sort", (state.descending ? "-" : "") + key);
    params.set("limit", String(drawnRows));
    return params.toString();
  }

  // The answer drawn, and its tag: an unchanged one is answered 304, without its body.
  let tag = DATA.tag || null;
  // Each question is numbered; an answer to one that a newer question replaced is not drawn.
  let asked = 0;
  let typing = null;

  // A filter, the sort or "show more" changed: a static page draws at once; a served one asks
  // its server (after a pause in typing), the page's body busy until the answer is drawn.
  function changed(typed) {
    if (!served) { draw(); return; }
    document.body.dataset.busy = "true";
    clearTimeout(typing);
    typing = setTimeout(() => ask(false), typed ? TYPING_MS : 0);
  }

  // Asks the question the page shows; true when a new answer was drawn. A poll's unchanged
  // answer draws nothing (the rows stay as the reader left them); a change's draws the
  // headings again, its sort shown.
  async function ask(polling) {
    const number = ++asked;
    const error = document.getElementById("query-error");
    try {
      const headers = tag === null ? {} : { "If-None-Match": tag };
      const response = await fetch(`api/runs?${question()}`, { credentials: "same-origin", cache: "no-store", headers });
      if (number !== asked) return false;
      if (response.status === 304) {
        error.textContent = "";
        if (!polling) draw();
        return false;
      }
      if (!response.ok) {
        // A filter the server cannot read (a reward that is not KEY<X): it says why; the
        // rows stay as they were.
        error.textContent = ` ${(await response.text()).trim()}`;
        return false;
      }
      const got = await response.json();
      if (number !== asked) return false;
      tag = response.headers.get("ETag");
      answer = got;
      error.textContent = "";
      menus();
      draw();
      return true;
    } catch (e) {
      // The server went away; the list stays as it was.
      return false;
    } finally {
      if (number === asked) document.body.dataset.busy = "false";
    }
  }

  async function poll() {
    const started = performance.now();
    if (await ask(true)) document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
    const wait = Math.max(POLL_MS, Math.round(POLL_BACKOFF * (performance.now() - started)));
    document.body.dataset.pollMs = String(wait);
    setTimeout(poll, wait);
  }

  filters();
  draw();
  document.body.dataset.busy = "false";
  document.body.dataset.ready = "true";
  if (served) setTimeout(poll, POLL_MS);
})();
