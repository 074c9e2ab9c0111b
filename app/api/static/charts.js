// The cluster page's charts: each model's requests, tokens per second and
// time to first token over the last minutes, as the fleet's gateways
// counted them (GET /admin/stats, docs/design/cluster-page.md).
// Small SVGs built with DOM calls: no library, no inline style, and every
// value (model names included) written as text.
"use strict";

(() => {
  const TOKEN = "llmgw-admin-token"; // the key cluster.js keeps the token under
  const EVERY_MS = 5000;
  const SVG = "http://www.w3.org/2000/svg";
  const W = 240, H = 64, PAD = 2;
  let timer = null;

  function svg(tag, attrs, cls) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (cls) e.setAttribute("class", cls);
    return e;
  }

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function short(v) {
    if (v === null || !isFinite(v)) return "–";
    if (v >= 1000) return (v / 1000).toFixed(v >= 10000 ? 0 : 1) + "k";
    if (v >= 10 || Number.isInteger(v)) return String(Math.round(v));
    return v.toPrecision(2);
  }

  // One chart: `series` is [{values, cls, label}], drawn as bars stacked
  // (`stacked`) or as lines; null values are gaps.
  function chart(title, unit, series, stacked, n) {
    const fig = el("figure", null, "chart");
    const top = [];
    for (let i = 0; i < n; i++) {
      let sum = 0, most = 0;
      for (const s of series) {
        const v = s.values[i];
        if (v === null) continue;
        sum += v;
        most = Math.max(most, v);
      }
      top.push(stacked ? sum : most);
    }
    const max = Math.max(...top, 0);
    // The latest interval with traffic (the one in progress may have none yet).
    let at = n - 1;
    while (at > 0 && !(top[at] > 0)) at--;
    const latest = series.map((s) => short(s.values[at]) + (series.length > 1 ? " " + s.label : ""));
    const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img",
      "aria-label": title });
    g.appendChild(svg("line", { x1: 0, y1: H - 0.5, x2: W, y2: H - 0.5 }, "axis"));
    const step = W / n;
    const y = (v) => H - PAD - (max > 0 ? (v / max) * (H - 2 * PAD) : 0);
    if (stacked) {
      for (let i = 0; i < n; i++) {
        let base = 0;
        for (const s of series) {
          const v = s.values[i] || 0;
          if (v <= 0) continue;
          const r = svg("rect", { x: (i * step + 0.5).toFixed(1), width: Math.max(step - 1, 1).toFixed(1),
            y: y(base + v).toFixed(1), height: (y(base) - y(base + v)).toFixed(1) }, s.cls);
          r.appendChild(svg("title")).textContent = s.label + ": " + v;
          g.appendChild(r);
          base += v;
        }
      }
    } else {
      for (const s of series) {
        let d = "", pen = "M";
        for (let i = 0; i < n; i++) {
          const v = s.values[i];
          if (v === null) { pen = "M"; continue; }
          d += pen + ((i + 0.5) * step).toFixed(1) + " " + y(v).toFixed(1) + " ";
          pen = "L";
        }
        if (d) g.appendChild(svg("path", { d: d.trim() }, "line " + s.cls));
        // A dot per sample: one busy interval alone is no line.
        for (let i = 0; i < n; i++) {
          const v = s.values[i];
          if (v === null || v <= 0) continue;
          const dot = svg("circle", { cx: ((i + 0.5) * step).toFixed(1), cy: y(v).toFixed(1), r: 1.6 },
            "dot " + s.cls);
          dot.appendChild(svg("title")).textContent = s.label + ": " + short(v);
          g.appendChild(dot);
        }
      }
    }
    fig.appendChild(g);
    const cap = el("figcaption");
    cap.appendChild(el("span", title, "what"));
    cap.appendChild(el("span", max > 0 ? "latest " + latest.join(", ") + unit + "; top " + short(max)
      : "none",
      "figures"));
    fig.appendChild(cap);
    // What the test (and a curious operator's devtools) can read back.
    fig.dataset.total = String(top.reduce((a, b) => a + b, 0));
    return fig;
  }

  function model(name, cols, data) {
    const n = data.samples;
    // The interval in progress has lasted only so long: rates over that.
    const lastSpan = Math.min(data.interval,
      Math.max(1, data.now - (data.start + (n - 1) * data.interval)));
    const span = (i) => (i === n - 1 ? lastSpan : data.interval);
    const perSecond = (f) => cols[f].map((v, i) => v / span(i));
    const ttft = cols.ttft_sum.map((v, i) => (cols.ttft_count[i] > 0 ? v / cols.ttft_count[i] : null));
    const card = el("div", null, "model-charts");
    card.dataset.model = name;
    card.appendChild(el("h3", name));
    card.appendChild(chart("requests / " + data.interval + " s", "", [
      { values: cols.requests_2xx, cls: "ok", label: "2xx" },
      { values: cols.requests_4xx, cls: "client", label: "4xx" },
      { values: cols.requests_5xx, cls: "server", label: "5xx" }], true, n)).classList.add("requests");
    card.appendChild(chart("tokens / s", "", [
      { values: perSecond("completion_tokens"), cls: "completion", label: "completion" },
      { values: perSecond("prompt_tokens"), cls: "prompt", label: "prompt" }], false, n)
    ).classList.add("tokens");
    card.appendChild(chart("time to first token, mean (s)", " s", [
      { values: ttft, cls: "ttft", label: "mean" }], false, n)).classList.add("ttft");
    return card;
  }

  function render(data) {
    const list = document.getElementById("chart-list");
    const names = Object.keys(data.models).sort((a, b) => a.localeCompare(b));
    list.replaceChildren(...names.map((m) => model(m, data.models[m], data)));
    const minutes = Math.round((data.samples * data.interval) / 60);
    const missing = Object.entries(data.missing || {}).map(([g, why]) => g + " (" + why + ")");
    document.getElementById("charts-note").textContent =
      (names.length ? "" : "No requests in the last " + minutes + " min. ") +
      "Last " + minutes + " min, one sample per " + data.interval + " s, summed over " +
      data.gateways.length + " gateway" + (data.gateways.length === 1 ? "" : "s") +
      (missing.length ? "; not counted: " + missing.join(", ") : "") + ".";
  }

  async function poll() {
    clearTimeout(timer);
    timer = setTimeout(poll, EVERY_MS);
    const token = sessionStorage.getItem(TOKEN);
    if (!token) return; // cluster.js asks for it; the next poll uses it
    try {
      const r = await fetch("/admin/stats", { headers: { Authorization: "Bearer " + token },
        cache: "no-store" });
      if (!r.ok) {
        // A refused token is cluster.js's to show; anything else is said here.
        if (r.status !== 401) document.getElementById("charts-note").textContent =
          "/admin/stats answered " + r.status + "; the charts show the last answer.";
        return;
      }
      render(await r.json());
    } catch (e) {
      document.getElementById("charts-note").textContent =
        "the charts cannot be refreshed: " + e.message;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    poll();
    // Right after signing in, rather than at the next tick.
    document.getElementById("signin").addEventListener("submit", () => setTimeout(poll, 100));
  });
})();
