// The cluster page: the fleet as this gateway's /admin API tells it,
// refreshed every few seconds. Every value is written as text (never as
// HTML): engine details and log lines are not ours to trust. Widths and
// colours are set through element.style (CSSOM), which the page's CSP
// allows; it refuses inline style attributes. Actions: actions.js.
"use strict";

const TOKEN = "llmgw-admin-token";
const EVERY_MS = 3000;
const $ = (id) => document.getElementById(id);
let timer = null;
let view = null; // the last data shown: actions read a model's spec and ETag from it
let asked = 0; // refreshes started: only the latest one's answer is drawn

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
  $(id).tBodies[0].replaceChildren(...rows);
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

const known = (v) => v !== null && v !== undefined;

// A bar filled to `fraction` (0..1), with its words beside it.
function bar(fraction, words, cls) {
  const wrap = el("span", null, "meter " + (cls || ""));
  const b = el("span", null, "bar");
  const fillEl = el("span");
  fillEl.style.width = Math.round(100 * Math.min(1, Math.max(0, fraction))) + "%";
  b.appendChild(fillEl);
  wrap.append(b, el("span", words, "words"));
  return wrap;
}

// A stable colour per model (its hue from the name's hash), a shade per
// replica of it, so one replica's GPUs read as one block in the grid.
function hash(s) {
  let h = 2166136261;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 16777619);
  return h >>> 0;
}
function colour(model, replica) {
  const light = [40, 50, 60][hash(replica || "") % 3];
  return "hsl(" + (hash(model) % 360) + ", 60%, " + light + "%)";
}

function gpuGrid(node, byId) {
  const grid = el("span", null, "grid");
  for (const g of node.gpus) {
    const rep = g.replica ? byId[g.replica] : null;
    const cell = el("span", g.index, "cell" + (g.replica ? " held" : " free") + (g.unhealthy ? " sick" : ""));
    cell.title = "GPU " + g.index + ": " + (g.replica ? g.replica + (rep ? " (" + rep.model + ")" : "") : "free") +
      (g.unhealthy ? "; unhealthy: " + g.health_reason : "");
    if (g.replica) cell.style.backgroundColor = colour(rep ? rep.model : g.replica, g.replica);
    grid.appendChild(cell);
  }
  return grid;
}

function gpus(node, byId) {
  const td = el("td", null, "gpus");
  if (!node.gpus || node.gpus.length === 0) {
    td.textContent = node.cpus ? node.cpus + " CPUs, no GPU" : "no GPU";
    return td;
  }
  td.appendChild(gpuGrid(node, byId));
  td.appendChild(el("span", (node.gpus_free ?? "?") + " free, " + (node.gpus_used ?? "?") + " used" +
    (node.gpus_unhealthy ? ", " + node.gpus_unhealthy + " unhealthy" : ""), "count"));
  for (const g of node.gpus) {
    // A GPU its agent reports sick, not cleared by an admin: out of
    // placement until `llmgw ctl node gpu-clear` (docs/design/gpu-health.md, "Clearing").
    const line = el("div", null, "gpu" + (g.unhealthy ? " sick" : ""));
    if (g.unhealthy) line.title = "unhealthy: " + g.health_reason;
    line.appendChild(el("span", g.index + ": " + (g.name || "GPU"), "gname"));
    const holder = g.replica ? g.replica : (g.unhealthy ? "unhealthy" : "free");
    line.appendChild(el("span", holder, g.replica ? "holder" : g.unhealthy ? "holder sick" : "holder free"));
    if (g.memory_mib && known(g.memory_free_mib)) {
      const used = g.memory_mib - g.memory_free_mib;
      line.appendChild(bar(used / g.memory_mib, gib(used) + " used, " + gib(g.memory_free_mib) + " free", "mem"));
    } else if (g.memory_mib) {
      line.appendChild(el("span", gib(g.memory_mib), "words"));
    }
    if (known(g.utilization)) line.appendChild(bar(g.utilization / 100, g.utilization + "% busy", "util"));
    td.appendChild(line);
  }
  return td;
}

function button(label, act, data) {
  const b = el("button", label);
  b.type = "button";
  b.dataset.act = act;
  Object.assign(b.dataset, data);
  return b;
}

function nodeState(conf) {
  const words = [];
  if (conf.pool && conf.pool !== "default") words.push("pool " + conf.pool);
  for (const [k, v] of Object.entries(conf.labels || {}).sort()) words.push(k + "=" + v);
  const td = badge(conf.draining ? "draining" : conf.cordoned ? "cordoned" : "schedulable");
  if (words.length) td.appendChild(document.createTextNode(" " + words.join(", ")));
  return td;
}

function build(n) {
  const conf = n.conf || {};
  const td = el("td");
  td.appendChild(el("div", "chosen: " + (conf.engine_build || "auto") + ", vLLM " + (conf.vllm_version || "default"), "chosen"));
  if (n.vllm_build || n.vllm_version) {
    td.appendChild(el("div", "running: " + (n.vllm_build || "?") + (n.vllm_version ? ", vLLM " + n.vllm_version : "")));
  }
  if (n.vllm_build_check) td.appendChild(el("div", n.vllm_build_check, "detail"));
  return td;
}

function nodeActions(n) {
  const conf = n.conf || {};
  const td = el("td", null, "actions");
  const node = { node: n.name };
  if (conf.cordoned || conf.draining) td.appendChild(button("Uncordon", "uncordon", node));
  else td.appendChild(button("Cordon", "cordon", node));
  if (!conf.draining) td.appendChild(button("Drain", "drain", node));
  td.appendChild(button("Engine build…", "build", node));
  for (const g of n.gpus || []) {
    if (g.unhealthy) td.appendChild(button("Clear GPU " + g.index, "gpuclear", { node: n.name, gpu: g.index }));
  }
  return td;
}

function num(v) {
  return el("td", v, "num");
}

function range(m) {
  if (m.external) return el("td", "—");
  const r = m.replicas || { min: 1, max: 1 };
  return el("td", r.min === r.max ? String(r.min) : r.min + "–" + r.max, "num range");
}

function limits(l) {
  const words = [];
  if (l && l.requests_per_minute) words.push(l.requests_per_minute + " req/min");
  if (l && l.tokens_per_minute) words.push(l.tokens_per_minute + " tokens/min");
  if (l && l.concurrent_requests) words.push(l.concurrent_requests + " at once");
  return words.join(", ") || "none";
}

function render(data) {
  view = data;
  const byId = Object.fromEntries(data.replicas.map((r) => [r.id, r]));
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
    const act = el("td", null, "actions");
    if (!m.external) act.appendChild(button("Replicas…", "range", { model: m.name }));
    return row([m.name, engine, num(st.ready), num(st.replicas), num(st.wanted), range(m), badge(health),
      el("td", why, "detail"), act]);
  }));
  const replicas = [...data.replicas].sort((a, b) => a.model.localeCompare(b.model) || a.id.localeCompare(b.id));
  fill("replicas", replicas.map((r) => {
    const kv = el("td");
    if (known(r.kv_cache)) kv.appendChild(bar(r.kv_cache, Math.round(100 * r.kv_cache) + "%", "kv"));
    const name = el("td");
    const swatch = el("span", null, "swatch");
    swatch.style.backgroundColor = colour(r.model, r.id);
    name.append(swatch, document.createTextNode(r.id));
    if (!known(r.kv_cache)) kv.textContent = "—";
    return row([name, r.model, r.node, (r.gpus || []).join(", "), badge(r.phase), num(r.inflight),
      num(known(r.running) ? r.running : "—"), num(known(r.waiting) ? r.waiting : "—"), kv, r.url,
      el("td", r.detail, "detail")]);
  }));
  const nodes = [...data.nodes].sort((a, b) => a.name.localeCompare(b.name));
  fill("nodes", nodes.map((n) => row([n.name, n.address, gpus(n, byId), (n.engines || []).join(", "),
    build(n), n.version, nodeState(n.conf || {}), (n.replicas || []).join(", "), nodeActions(n)])));
  legend(data.replicas);
  const keys = [...data.keys].sort((a, b) => a.name.localeCompare(b.name) || a.id.localeCompare(b.id));
  fill("keys", keys.map((k) => {
    const act = el("td", null, "actions");
    act.appendChild(button("Revoke", "revoke", { key: k.id, name: k.name }));
    const expires = !known(k.expires) ? "never"
      : (k.expired ? "expired " : "") + new Date(k.expires * 1000).toLocaleString();
    return row([k.name, k.id, k.prefix ? k.prefix + "…" : "", (k.models || []).join(", ") || "all",
      limits(k.limits), expires, act]);
  }));
  const leader = data.leader.leader;
  const gateways = [...data.gateways].sort((a, b) => a.id.localeCompare(b.id));
  fill("gateways", gateways.map((g) => row([g.id, g.url, g.version, age(g.started),
    g.id === leader ? badge("leader") : el("td", "")])));
  $("where").textContent = "gateway " + data.leader.gateway + (leader ? ", leader " + leader : ", no leader");
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

function legend(replicas) {
  const items = [el("span", "GPU grid:", "words")];
  const free = el("span", null, "item");
  free.append(el("span", null, "swatch free"), document.createTextNode("free"));
  items.push(free);
  const sick = el("span", null, "item");
  sick.append(el("span", null, "swatch free sick"), document.createTextNode("unhealthy"));
  items.push(sick);
  for (const model of [...new Set(replicas.map((r) => r.model))].sort()) {
    const item = el("span", null, "item");
    const sw = el("span", null, "swatch");
    sw.style.backgroundColor = colour(model, "");
    item.append(sw, document.createTextNode(model));
    items.push(item);
  }
  $("legend").replaceChildren(...items);
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
  clearTimeout(timer);
  const mine = ++asked;
  try {
    const [leader, gateways, nodes, models, replicas, keys] = await Promise.all(
      ["/admin/leader", "/admin/gateways", "/admin/nodes", "/admin/models", "/admin/replicas",
        "/admin/keys"].map((p) => get(p, token)));
    // An older refresh answering after a newer one (an action's) would
    // draw the state from before the action.
    if (mine !== asked) return;
    render({ leader, gateways, nodes, models, replicas, keys });
    $("signin").hidden = true;
    $("fleet").hidden = false;
    $("signout").hidden = false;
    problem("");
  } catch (e) {
    if (e instanceof Refused) return signedOut(e.message);
    if (mine !== asked) return;
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
