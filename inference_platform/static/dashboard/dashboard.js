// The live dashboard: charts (uPlot) and figures from dashboard.json, repainted on each poll.
(function () {
  "use strict";
  const config = JSON.parse(document.getElementById("dashboard-config").textContent);
  const CACHES = Object.keys(config.cacheTitles);
  const PALETTE = ["#2f7ed8", "#e8710a", "#1a9850", "#c2185b", "#7b1fa2", "#795548", "#00838f"];
  const plots = {};

  const percent = (r) => (r === null || r === undefined ? "—" : (r * 100).toFixed(1) + "%");
  // As admin_dashboard.milliseconds: whole ms, one decimal under 10 ms.
  const ms = (s) => (s === null || s === undefined ? "—" : s < 0.01 ? (s * 1000).toFixed(1) + " ms" : Math.round(s * 1000) + " ms");
  const countAndShare = (n, share) => (!n || share === null || share === undefined ? String(n) : n + " (" + percent(share) + ")");
  const perSecond = (v) => (v === 0 ? "0" : v < 0.01 ? v.toPrecision(2) : v < 10 ? v.toFixed(2) : v.toFixed(0));
  const pct = (r) => (r === null || r === undefined ? null : r * 100);
  const msOrNull = (s) => (s === null || s === undefined ? null : s * 1000);

  function themeColours() {
    const style = getComputedStyle(document.body);
    return {
      fg: style.getPropertyValue("--body-fg").trim() || style.color,
      grid: style.getPropertyValue("--hairline-color").trim() || "#ddd",
    };
  }

  function numberValues(snapshot) {
    const w = snapshot.window, t = w.totals;
    const values = {
      requests: String(t.requests),
      server_errors: countAndShare(t.server_errors, t.server_error_share),
      client_errors: countAndShare(t.client_errors, t.client_error_share),
      rate_limited: countAndShare(t.rate_limited, t.rate_limited_share),
      requests_per_s: perSecond(t.requests_per_s),
      tokens_per_s: perSecond(t.tokens_per_s),
      ttft_p50: ms(t.ttft.p50),
      ttft_p99: ms(t.ttft.p99),
      latency_p50: ms(t.latency.p50),
      inter_token_p50: ms(t.inter_token.p50),
      queue_wait_p90: ms(t.queue_wait.p90),
      shed: String(t.shed),
      overlap_given_up: t.overlap_given_up_blocks === null ? "—"
        : t.overlap_given_up_blocks + " blocks" + (t.overlap_given_up_share === null ? "" : " (" + percent(t.overlap_given_up_share) + ")"),
    };
    for (const cache of CACHES) values["hit_" + cache] = percent(w.caches[cache].hit_rate);
    return values;
  }

  // Each chart: its series (label, values per minute) built from the snapshot.
  function chartSeries(key, snapshot) {
    const w = snapshot.window, minutes = w.per_minute;
    switch (key) {
      case "cache_hit_rates":
        return CACHES.map((c) => [config.cacheTitles[c], snapshot.series[c].map(pct)]);
      case "per_worker:kv":
      case "per_worker:embedding":
      case "per_worker:local_image":
      case "per_worker:shared_image": {
        const cache = key.split(":")[1];
        return snapshot.workers.map((wk) => [wk.name, wk.series[cache].map(pct)]);
      }
      case "ttft":
      case "latency":
      case "inter_token":
        return ["p50", "p90", "p99"].map((q) => [q, minutes.map((m) => msOrNull(m[key][q]))]);
      case "throughput":
        return [
          ["tokens/s", minutes.map((m) => m.tokens_per_s)],
          ["requests/s", minutes.map((m) => m.requests_per_s)],
          ["requests", minutes.map((m) => m.requests)],
        ];
      case "admission":
        return [
          ["waiting", minutes.map((m) => m.queued)],
          ["shed", minutes.map((m) => m.shed)],
        ];
      case "admission_wait":
        return ["p50", "p90", "p99"].map((q) => [q, minutes.map((m) => msOrNull(m.queue_wait[q]))]);
      case "queue":
        return w.workers.map((name) => [name, w.per_worker[name].engine_waiting]);
      case "kv_usage":
        return w.workers.map((name) => [name, w.per_worker[name].kv_usage.map(pct)]);
      case "errors": {
        // By whose doing (the chart), and each status (the data table).
        const statuses = w.statuses.filter((s) => s !== "200");
        return [
          ["5xx server", minutes.map((m) => m.server_errors)],
          ["4xx client", minutes.map((m) => m.client_errors)],
          ["429 rate limited", minutes.map((m) => m.rate_limited)],
          ...statuses.map((s) => ["HTTP " + s, minutes.map((m) => m.by_status[s] || 0)]),
        ];
      }
      case "overlap":
        return [
          ["given up", minutes.map((m) => m.overlap_given_up_blocks)],
          ["best eligible", minutes.map((m) => m.best_overlap_blocks)],
        ];
    }
    return [];
  }

  // Series shown in the data table only (counts behind a rate chart, each status behind its class).
  const TABLE_ONLY = {throughput: ["requests"], errors: (label) => label.startsWith("HTTP ")};
  // Series drawn against an axis of their own on the right (requests/s beside thousands of tokens/s).
  const RIGHT_AXIS = {throughput: ["requests/s"]};
  const ERROR_COLOURS = {"5xx server": "#d62728", "4xx client": "#7f7f7f", "429 rate limited": "#e8a10a"};
  const hiddenIn = (key, label) => {
    const hidden = TABLE_ONLY[key];
    return typeof hidden === "function" ? hidden(label) : (hidden || []).includes(label);
  };

  function timeLabel(unix, withDate) {
    const d = new Date(unix * 1000);
    const hm = d.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"});
    return withDate ? d.toLocaleDateString([], {month: "short", day: "numeric"}) + " " + hm : hm;
  }

  function fillTable(table, key, xs, series) {
    const head = document.createElement("tr");
    for (const title of ["Minute", ...series.map((s) => s[0])]) {
      const th = document.createElement("th");
      th.textContent = title;
      head.appendChild(th);
    }
    const thead = document.createElement("thead");
    thead.appendChild(head);
    const tbody = document.createElement("tbody");
    const longWindow = config.minutes > 24 * 60 - 1;
    // Newest first: the minute being filled is the one an operator looks for.
    for (let i = xs.length - 1; i >= 0; i--) {
      const tr = document.createElement("tr");
      const th = document.createElement("td");
      th.textContent = timeLabel(xs[i], longWindow);
      tr.appendChild(th);
      for (const [label, values] of series) {
        const td = document.createElement("td");
        td.className = "num";
        td.dataset.series = label;
        const v = values[i];
        td.textContent = v === null || v === undefined ? "—" : Number.isInteger(v) ? String(v) : v.toFixed(2);
        tr.appendChild(td);
      }
      tbody.appendChild(tr);
    }
    table.replaceChildren(thead, tbody);
  }

  function drawChart(figure, snapshot) {
    const key = figure.dataset.chart;
    const xs = snapshot.window.minute_starts;
    const all = chartSeries(key, snapshot);
    fillTable(figure.querySelector(".chart-data table"), key, xs, all);
    const shown = all.filter((s) => !hiddenIn(key, s[0]));
    const right = RIGHT_AXIS[key] || [];
    const hasRight = shown.some((s) => right.includes(s[0]));
    const holder = figure.querySelector(".plot");
    const width = Math.max(200, holder.clientWidth);
    const colours = themeColours();
    const signature = key + "|" + shown.map((s) => s[0]).join(",") + "|" + colours.fg + "|" + xs.length;
    const data = [xs, ...shown.map((s) => s[1])];
    const existing = plots[key];
    if (existing && existing.signature === signature) {
      existing.plot.setData(data);
      if (existing.width !== width) { existing.plot.setSize({width, height: 200}); existing.width = width; }
      return;
    }
    if (existing) existing.plot.destroy();
    const unit = figure.querySelector(".unit").textContent.replace(/[()]/g, "");
    const axis = {stroke: colours.fg, grid: {stroke: colours.grid, width: 1}, ticks: {stroke: colours.grid, width: 1}};
    const tickValues = (u, ticks) => ticks.map((v) => (Math.abs(v) >= 1000 ? (v / 1000).toFixed(1) + "k" : String(+v.toFixed(2))));
    const fromZero = {range: (u, lo, hi) => [0, Math.max(unit === "%" ? 0 : 1, hi * 1.1)]};
    const options = {
      width,
      height: 200,
      cursor: {drag: {x: false, y: false}},
      scales: {x: {time: true}, y: unit === "%" ? {range: [0, 100]} : fromZero, ...(hasRight ? {right: {range: (u, lo, hi) => [0, Math.max(0.1, hi * 1.1)]}} : {})},
      axes: [
        {...axis, space: 80},
        {...axis, size: 56, label: hasRight ? shown.filter((s) => !right.includes(s[0])).map((s) => s[0]).join(", ") : unit, labelSize: 18, values: tickValues},
        ...(hasRight ? [{...axis, scale: "right", side: 1, size: 56, grid: {show: false}, label: right.join(", "), labelSize: 18, values: tickValues}] : []),
      ],
      series: [
        {value: (u, v) => (v === null ? "—" : timeLabel(v, config.minutes >= 24 * 60))},
        ...shown.map((s, i) => ({
          label: s[0],
          scale: right.includes(s[0]) ? "right" : "y",
          stroke: ERROR_COLOURS[s[0]] || PALETTE[i % PALETTE.length],
          width: 2,
          spanGaps: false,
          points: {show: xs.length <= 90},
          value: (u, v) => (v === null || v === undefined ? "—" : (+v.toFixed(2)).toString() + (unit === "%" ? "%" : "")),
        })),
      ],
    };
    plots[key] = {plot: new uPlot(options, data, holder), signature, width};
  }

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function activeCell(w) {
    // Requests routed there; below, what its engine reports: batch (running/cap +waiting), KV used/free.
    const td = cell(String(w.active_requests), "num");
    if (!w.engine_max_running) return td; // no batching engine reported (an encode worker, say)
    const engine = document.createElement("div");
    engine.className = "quiet engine";
    engine.textContent = "batch " + w.engine_running + "/" + w.engine_max_running +
      (w.engine_waiting ? " +" + w.engine_waiting : "");
    td.appendChild(engine);
    return td;
  }

  function kvUseCell(w) {
    // KV cache usage as vLLM reports it (pool held by running requests), not the prefix hit rate.
    const td = cell(percent(w.kv_usage), "num kv-use");
    if (w.kv_usage === null || w.kv_usage === undefined) return td;
    const blocks = document.createElement("div");
    blocks.className = "quiet";
    blocks.textContent = w.kv_blocks_used + "/" + (w.kv_blocks_used + w.kv_blocks_free);
    td.append(" ", blocks);
    return td;
  }

  function renderWorkers(snapshot) {
    const rows = snapshot.workers.map((w) => {
      const tr = document.createElement("tr");
      tr.dataset.worker = w.name;
      const name = document.createElement("td");
      const strong = document.createElement("span");
      strong.className = "worker-name";
      strong.textContent = w.name;
      name.append(strong, " ");
      const where = document.createElement("div");
      where.className = "quiet";
      where.textContent = w.model + " on " + w.device;
      name.appendChild(where);
      tr.append(
        name,
        cell(w.state, "state state-" + w.state),
        activeCell(w),
        kvUseCell(w),
        cell(w.cached_blocks + (w.capacity_blocks ? " / " + w.capacity_blocks : ""), "num"),
      );
      for (const cache of CACHES) tr.append(cell(percent(w.window_caches[cache].hit_rate), "num"));
      tr.append(
        cell(w.session_scoped === null ? "—" : w.session_scoped ? "scoped" : "not scoped"),
        cell(w.shared_image_cache || "—", "url"),
      );
      return tr;
    });
    if (!rows.length) {
      const td = cell("No worker has registered, beaten or reported yet.");
      td.colSpan = 11;
      const tr = document.createElement("tr");
      tr.appendChild(td);
      rows.push(tr);
    }
    document.querySelector("#workers tbody").replaceChildren(...rows);
  }

  // E/PD: an encode worker's transfer figures are its puts into the side store, an LLM worker's its reads.
  function renderEncoders(section) {
    const fixed = (v, digits) => (v === null || v === undefined ? "—" : v.toFixed(digits));
    const rows = (section ? section.workers : []).map((e) => {
      const tr = document.createElement("tr");
      tr.dataset.worker = e.name;
      const encodes = e.role === "encode";
      tr.append(cell(e.name), cell(e.role), cell(String(e.pending), "num"), cell(String(e.busy), "num"),
        cell(e.cached_entries === null || e.cached_entries === undefined ? "—" : String(e.cached_entries), "num"), cell(percent(e.embedding_cache_hit_rate), "num"),
        cell(fixed(e.encode_ms_per_image, 1), "num"),
        cell(fixed(encodes ? e.put_bytes_per_image : e.received_bytes_per_image, 0), "num"),
        cell(fixed(encodes ? e.put_ms_per_image : e.get_ms_per_image, 2), "num"),
        cell(String(e.fallbacks), "num"), cell(String(e.counters.tower_forwards), "num"));
      return tr;
    });
    if (!rows.length) {
      const td = cell("No encode or LLM worker (E/PD) has reported.");
      td.colSpan = 11;
      const tr = document.createElement("tr");
      tr.appendChild(td);
      rows.push(tr);
    }
    document.querySelector("#encoders tbody").replaceChildren(...rows);
  }

  function renderProblems(snapshot) {
    const notes = snapshot.configuration.problems.map((text) => {
      const p = document.createElement("p");
      p.className = "errornote config-problem";
      p.textContent = text;
      return p;
    });
    document.getElementById("config-problems").replaceChildren(...notes);
  }

  function render(snapshot) {
    const values = numberValues(snapshot);
    for (const box of document.querySelectorAll("#numbers .number")) {
      box.querySelector(".value").textContent = values[box.dataset.figure];
      if (box.dataset.figure === "server_errors") box.classList.toggle("bad", snapshot.window.totals.server_errors > 0);
      if (box.dataset.figure === "rate_limited") box.classList.toggle("warn", snapshot.window.totals.rate_limited > 0);
    }
    for (const figure of document.querySelectorAll("#charts .chart")) drawChart(figure, snapshot);
    renderWorkers(snapshot);
    renderProblems(snapshot);
    renderEncoders(snapshot.encoders);
    document.getElementById("dashboard-updated").textContent =
      "Updated " + new Date(snapshot.generated_at * 1000).toLocaleTimeString() + ".";
  }

  function showError(message) {
    const note = document.getElementById("dashboard-error");
    note.textContent = message;
    note.hidden = !message;
    document.getElementById("dashboard-status").classList.toggle("stale", !!message);
  }

  let latest = JSON.parse(document.getElementById("dashboard-snapshot").textContent);

  async function poll() {
    try {
      const response = await fetch(config.dataUrl, {credentials: "same-origin", headers: {Accept: "application/json"}});
      // admin_view answers an expired session with a redirect to the login page.
      if (response.redirected) { showError("Session expired: reload the page to log in again."); return; }
      const body = await response.json();
      if (!response.ok) { showError(body.error || "HTTP " + response.status); }
      else { showError(""); latest = body; render(body); }
    } catch (exc) {
      showError("Dashboard unreachable: " + exc.message);
    }
    setTimeout(poll, config.pollMs);
  }

  if (latest) render(latest);
  // Charts follow the page's width and the admin's light/dark theme switch.
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => latest && render(latest), 150);
  });
  new MutationObserver(() => latest && render(latest)).observe(document.documentElement, {attributes: true, attributeFilter: ["data-theme"]});
  window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => latest && render(latest));
  setTimeout(poll, config.pollMs);
})();
