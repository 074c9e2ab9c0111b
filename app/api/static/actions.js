// Actions from the cluster page (docs/design/cluster-page.md):
// each asks for confirmation in a <dialog>, sends one /admin request with
// the operator's token, shows the API's refusal (its problem JSON's title
// and detail) as written, and refreshes the view so its effect shows
// without a reload. Uses cluster.js's $, el, view, refresh and signedOut.
"use strict";

const path = encodeURIComponent; // a name holding "/" must not reach another route

class ApiRefusal extends Error {}

// The problem JSON as the API wrote it: "412 Precondition Failed: ...", and
// each schema error's field and message on lines of their own.
function said(r, p) {
  if (!p || typeof p !== "object") return r.status + " " + r.statusText;
  let text = r.status + " " + (p.title || r.statusText) + (p.detail ? ": " + p.detail : "");
  if (Array.isArray(p.errors)) {
    for (const e of p.errors) text += "\n" + (e.loc || []).join(".") + ": " + e.msg;
  }
  return text;
}

async function send(method, url, body, headers) {
  const h = Object.assign({ Authorization: "Bearer " + sessionStorage.getItem(TOKEN) }, headers);
  if (body !== undefined) h["Content-Type"] = "application/json";
  let r;
  try {
    r = await fetch(url, { method, headers: h, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    throw new ApiRefusal("this gateway cannot be reached; nothing was sent");
  }
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; } // 204: no body
  if (r.status === 401) {
    $("act").close();
    signedOut("the gateway refused this token");
    throw new ApiRefusal("the gateway refused this token");
  }
  if (!r.ok) throw new ApiRefusal(said(r, data));
  return data;
}

const FIELDSETS = ["f-build", "f-range", "f-key"];
let pending = null; // what the open dialog's Confirm runs

// Opens the confirmation dialog; `fieldset` (or null) holds the action's inputs.
function ask(title, text, fieldset, run, ok) {
  $("act-title").textContent = title;
  $("act-text").textContent = text;
  for (const id of FIELDSETS) {
    const f = $(id);
    f.hidden = id !== fieldset;
    f.disabled = f.hidden; // a hidden input must not block the form's validation
  }
  $("act-error").hidden = true;
  $("act-error").textContent = "";
  $("act-ok").textContent = ok || "Confirm";
  $("act-ok").disabled = false;
  pending = run;
  $("act").showModal();
}

async function confirmed(ev) {
  ev.preventDefault();
  if (!pending) return;
  $("act-ok").disabled = true;
  try {
    const after = await pending();
    pending = null;
    $("act").close();
    if (typeof after === "function") after(); // e.g. the new key shown
  } catch (e) {
    if (!(e instanceof ApiRefusal)) throw e;
    $("act-error").textContent = e.message;
    $("act-error").hidden = false;
    $("act-ok").disabled = false;
    return;
  } finally {
    refresh(); // the effect, or the state that refused it
  }
}

const node = (name, rest) => "/admin/nodes/" + path(name) + rest;

const NODE_ACTS = {
  cordon: ["Cordon", "No new replicas are placed on %; those on it stay."],
  uncordon: ["Uncordon", "Replicas may be placed on % again; a drain ends."],
  drain: ["Drain", "Cordons % and moves its replicas to other nodes (uncordon ends it)."],
};

function nodeAct(act, name) {
  const [verb, text] = NODE_ACTS[act];
  ask(verb + " node " + name + "?", text.replace("%", name), null,
    () => send("POST", node(name, "/" + act)), verb);
}

// A GPU its agent found sick (docs/design/gpu-health.md).
function gpuClearAct(name, gpu) {
  const n = view.nodes.find((x) => x.name === name) || {};
  const g = (n.gpus || []).find((x) => String(x.index) === gpu) || {};
  ask("Clear GPU " + gpu + " of node " + name + "?", "Its fault: " + (g.health_reason || "?") +
    ". Replicas are placed on it again until it reports another fault; clearing does not " +
    "reset the GPU.", null, () => send("POST", node(name, "/gpus/" + gpu + "/clear")), "Clear");
}

function buildAct(name) {
  const n = view.nodes.find((x) => x.name === name) || {};
  const conf = n.conf || {};
  $("f-build-choice").value = conf.engine_build || "auto";
  $("f-build-version").value = conf.vllm_version || "";
  ask("Engine build of node " + name, "The vLLM build its agent installs and runs (none: no " +
    "vLLM replicas there); it is told within its long poll. A node running its operator's " +
    "own vLLM keeps it.", "f-build",
  () => send("PUT", node(name, "/engine-build"), {
    build: $("f-build-choice").value, vllm_version: $("f-build-version").value.trim() }), "Choose");
}

function rangeAct(name) {
  const m = view.models.find((x) => x.name === name);
  if (!m) return;
  // The spec as read, with the ETag read with it: a change made since (by
  // another admin, another tab) fails with 412 instead of being overwritten.
  const { name: _n, created: _c, status: _s, etag, ...spec } = m;
  const r = m.replicas || { min: 1, max: 1 };
  $("f-range-min").value = r.min;
  $("f-range-max").value = r.max;
  ask("Replicas of " + name, "The fewest replicas kept running and the most under load. " +
    "Saved only if the model is unchanged since this page read it.", "f-range", () => {
    spec.replicas = { min: Number($("f-range-min").value), max: Number($("f-range-max").value) };
    return send("PUT", "/admin/models/" + path(name), spec, etag ? { "If-Match": etag } : {});
  }, "Save");
}

function keyAct() {
  for (const id of ["f-key-name", "f-key-models", "f-key-rpm", "f-key-tpm", "f-key-conc", "f-key-days"]) {
    $(id).value = "";
  }
  ask("New client key", "A key for /v1. It is shown once, after it is made.", "f-key", async () => {
    const body = { name: $("f-key-name").value.trim(),
      models: $("f-key-models").value.split(",").map((s) => s.trim()).filter(Boolean), limits: {} };
    for (const [id, field] of [["f-key-rpm", "requests_per_minute"], ["f-key-tpm", "tokens_per_minute"],
      ["f-key-conc", "concurrent_requests"]]) {
      if ($(id).value !== "") body.limits[field] = Number($(id).value);
    }
    if ($("f-key-days").value !== "") body.expires_in = Number($("f-key-days").value) * 86400;
    const made = await send("POST", "/admin/keys", body);
    return () => showKey(made);
  }, "Create");
}

function showKey(made) {
  $("shown-key-name").textContent = made.name + " (" + made.id + ")";
  $("shown-key-value").textContent = made.key;
  $("shown-key").showModal();
}

function revokeAct(id, name) {
  ask("Revoke key " + name + " (" + id + ")?", "Every gateway refuses it within a second; " +
    "its usage records stay.", null, () => send("DELETE", "/admin/keys/" + path(id)), "Revoke");
}

document.addEventListener("DOMContentLoaded", () => {
  $("act-form").addEventListener("submit", confirmed);
  $("act-cancel").addEventListener("click", () => { pending = null; $("act").close(); });
  $("new-key").addEventListener("click", keyAct);
  // Dismissed however (the button, Escape): the key leaves the page in the
  // same turn. The dialog's "close" event is queued for a later task, so it
  // only backs up the other two.
  const forgetKey = () => { $("shown-key-value").textContent = ""; };
  $("shown-key-done").addEventListener("click", () => { forgetKey(); $("shown-key").close(); });
  $("shown-key").addEventListener("cancel", forgetKey);
  $("shown-key").addEventListener("close", forgetKey);
  document.addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-act]");
    if (!b || !view) return;
    const d = b.dataset;
    if (d.act in NODE_ACTS) nodeAct(d.act, d.node);
    else if (d.act === "build") buildAct(d.node);
    else if (d.act === "gpuclear") gpuClearAct(d.node, d.gpu);
    else if (d.act === "range") rangeAct(d.model);
    else if (d.act === "revoke") revokeAct(d.key, d.name);
  });
});
