// The cluster page: the fleet as this gateway's /admin API tells it,
// refreshed every few seconds. Every value is written as text (never as
// HTML): engine details and log lines are not ours to trust.
"use strict";

const TOKEN = "llmgw-admin-token";
const EVERY_MS = 3000;
const $ = (id) => document.getElementById(id);
let timer = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function badge(text) {
  const td = el("td");
  td.appendChild(el("span", text, "badge " + text));
  return td;
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", c));
  return tr;
}

function fill(id, rows) {
  const body = $(id).tBodies[0];
  body.replaceChildren(...rows);
}

function gib(mib) {
  return (mib / 1024).toFixed(mib >= 10240 ? 0 : 1) + " GiB";
}

function age(unix) {
  const s = Math.max(0, Date.now() / 1000 - unix);
  if (s < 120) return Math.round(s) + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  if (s < 172800) return Math.round(s / 3600) + " h";
  return Math.round(s / 86400) + " d";
}

function gpus(node) {
  const td = el("td");
  if (!node.gpus || node.gpus.length === 0) {
    td.textContent = node.cpus ? node.cpus + " CPUs, no GPU" : "no GPU";
    return td;
  }
  for (const g of node.gpus) {
    const line = el("span", null, "gpu");
    let text = g.index + ": " + (g.name || "GPU");
    if (g.memory_mib) {
      const free = g.memory_free_mib;
      text += free === null || free === undefined
        ? " " + gib(g.memory_mib)
        : " " + gib(free) + " free of " + gib(g.memory_mib);
    }
    if (g.utilization !== null && g.utilization !== undefined) text += ", " + g.utilization + "% busy";
    line.appendChild(document.createTextNode(text));
    if (g.memory_mib && g.memory_free_mib !== null && g.memory_free_mib !== undefined) {
      const bar = el("span", null, "bar");
      const used = el("span");
      used.style.width = Math.round(100 * (1 - g.memory_free_mib / g.memory_mib)) + "%";
      bar.appendChild(used);
      bar.title = "memory in use";
      line.appendChild(bar);
    }
    td.appendChild(line);
  }
  return td;
}

function nodeState(conf) {
  const words = [];
  if (conf.pool && conf.pool !== "default") words.push("pool " + conf.pool);
  for (const [k, v] of Object.entries(conf.labels || {}).sort()) words.push(k + "=" + v);
  const td = badge(conf.draining ? "draining" : conf.cordoned ? "cordoned" : "schedulable");
  if (words.length) td.appendChild(document.createTextNode(" " + words.join(", ")));
  return td;
}

function num(v) {
  return el("td", v, "num");
}

function render(data) {
  const models = [...data.models].sort((a, b) => a.name.localeCompare(b.name));
  fill("models", models.map((m) => {
    const st = m.status || {};
    const health = (st.health && st.health.state) || "";
    const why = [st.health && st.health.detail, st.unplaced,
      ...(st.failed || []).map((f) => f.id + " failed on " + f.node + ": " + f.detail)]
      .filter(Boolean).join("; ");
    // A spec shows only the fields given: a flat spec without `engine` (or
    // a profile without one) runs vLLM, the default.
    const engine = m.external ? "external"
      : m.profiles ? m.profiles.map((p) => p.engine || "vllm").join(", ") : (m.engine || "vllm");
    return row([m.name, engine, num(st.ready), num(st.replicas), num(st.wanted), badge(health),
      el("td", why, "detail")]);
  }));
  const replicas = [...data.replicas].sort((a, b) => a.model.localeCompare(b.model) || a.id.localeCompare(b.id));
  fill("replicas", replicas.map((r) => row([r.id, r.model, r.node, (r.gpus || []).join(", "),
    badge(r.phase), num(r.inflight), r.url, el("td", r.detail, "detail")])));
  const nodes = [...data.nodes].sort((a, b) => a.name.localeCompare(b.name));
  fill("nodes", nodes.map((n) => row([n.name, n.address, gpus(n), (n.engines || []).join(", "),
    n.version, nodeState(n.conf || {}), (n.replicas || []).join(", ")])));
  const leader = data.leader.leader;
  const gateways = [...data.gateways].sort((a, b) => a.id.localeCompare(b.id));
  fill("gateways", gateways.map((g) => row([g.id, g.url, g.version, age(g.started),
    g.id === leader ? badge("leader") : el("td", "")])));
  $("where").textContent = "gateway " + data.leader.gateway + (leader ? ", leader " + leader : ", no leader");
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

class Refused extends Error {}

async function get(path, token) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
  if (r.status === 401 || r.status === 403) throw new Refused("the gateway refused this token");
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const said = body && (body.detail || body.title) ? body.title + ": " + body.detail : r.statusText;
    throw new Error(path + " answered " + r.status + " (" + said + ")");
  }
  return body;
}

function problem(text) {
  $("problem").textContent = text || "";
  $("problem").hidden = !text;
}

function signedOut(why) {
  clearTimeout(timer);
  sessionStorage.removeItem(TOKEN);
  $("fleet").hidden = true;
  $("signout").hidden = true;
  $("signin").hidden = false;
  problem(why);
  $("token").focus();
}

async function refresh() {
  const token = sessionStorage.getItem(TOKEN);
  if (!token) return signedOut("");
  try {
    const [leader, gateways, nodes, models, replicas] = await Promise.all(
      ["/admin/leader", "/admin/gateways", "/admin/nodes", "/admin/models", "/admin/replicas"]
        .map((p) => get(p, token)));
    render({ leader, gateways, nodes, models, replicas });
    $("signin").hidden = true;
    $("fleet").hidden = false;
    $("signout").hidden = false;
    problem("");
  } catch (e) {
    if (e instanceof Refused) return signedOut(e.message);
    // Keep the last view; say why it is not fresh.
    problem(e.message === "Failed to fetch" ? "this gateway cannot be reached" : e.message);
  }
  clearTimeout(timer);
  timer = setTimeout(refresh, EVERY_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN, $("token").value.trim());
    $("token").value = "";
    refresh();
  });
  $("signout").addEventListener("click", () => signedOut(""));
  refresh();
});
