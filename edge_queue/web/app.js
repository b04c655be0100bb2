// edge-queue's queue page. Talks to the MQTT broker over WebSocket (MQTT 3.1.1, so it works
// with mosquitto and amqtt alike): reads <base>/status, info, queue and events, sends the same
// requests as every client (docs/topics.md), with reply_to on a topic of its own.
"use strict";

const $ = (id) => document.getElementById(id);
const STATES = ["queued", "running", "retrying", "cancelling", "succeeded", "failed", "cancelled"];
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const ACTIVE = new Set(["queued", "running", "retrying", "cancelling"]);
const SHOWN = 100; // jobs on the page at most, newest first
const CRED_KEY = "edge-queue.login";

const page = {
  cfg: null, client: null, base: "", reply: "", user: "", online: null, connected: false,
  info: null, queue: null, kinds: {}, jobs: new Map(), rows: new Map(), pending: new Map(),
  login: null, txn: 0, detailId: null, picker: { path: null, after: null, selected: new Set() },
};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

const baseName = (p) => (p ? String(p).split("/").filter(Boolean).pop() || p : "(no input)");

function duration(s) {
  if (s == null || !isFinite(s)) return "";
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
  return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
}

function stamp(s) {
  const t = Math.max(0, s || 0);
  const h = Math.floor(t / 3600), m = Math.floor((t % 3600) / 60), sec = t % 60;
  const mm = String(m).padStart(2, "0"), ss = sec.toFixed(1).padStart(4, "0");
  return h ? `${h}:${mm}:${ss}` : `${mm}:${ss}`;
}

function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}

const when = (iso) => (iso ? new Date(iso).toLocaleString() : "");

// -- login ------------------------------------------------------------------------------

function savedLogin() {
  try { return JSON.parse(localStorage.getItem(CRED_KEY) || "null"); } catch { return null; }
}

function askLogin(why) {
  const d = $("login");
  $("login-why").textContent = why;
  const saved = page.login || savedLogin();
  $("user").value = saved?.username || "";
  $("password").value = "";
  $("remember").checked = !!savedLogin();
  if (!d.open) d.showModal();
}

$("login-form").addEventListener("submit", () => {
  page.login = { username: $("user").value, password: $("password").value };
  if ($("remember").checked) localStorage.setItem(CRED_KEY, JSON.stringify(page.login));
  else localStorage.removeItem(CRED_KEY);
  connect();
});
$("forget").addEventListener("click", () => {
  localStorage.removeItem(CRED_KEY);
  page.login = null;
  $("remember").checked = false;
  $("user").value = $("password").value = "";
});

// -- MQTT -------------------------------------------------------------------------------

function wsUrl() {
  if (page.cfg.websocket_url) return page.cfg.websocket_url;
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const host = location.hostname.includes(":") ? `[${location.hostname}]` : location.hostname;
  return `${scheme}://${host}:${page.cfg.websocket_port}/`;
}

function connect() {
  if (page.client) page.client.end(true);
  const id = "page-" + Math.random().toString(36).slice(2, 12);
  const login = page.login || savedLogin();
  // With a broker user, requests go on that user's own request topics and answers come under
  // its own reply topics (docs/topics.md, "Who sent a request"); a user name that cannot be one
  // topic level uses the shared topics.
  const user = login?.username && !/[/+#\u0000]/.test(login.username) ? login.username : "";
  page.user = user;
  page.reply = user ? `${page.base}/reply/${user}/${id}` : `${page.base}/reply/${id}`;
  const opts = {
    protocolVersion: 4, clientId: id, clean: true, keepalive: 30,
    reconnectPeriod: 3000, connectTimeout: 10000, resubscribe: false,
  };
  if (login?.username) { opts.username = login.username; opts.password = login.password || ""; }
  setStatus("connecting", `connecting to ${wsUrl()}`);
  const client = mqtt.connect(wsUrl(), opts);
  page.client = client;
  client.on("connect", () => {
    page.connected = true;
    notice(null);
    const topics = ["status", "info", "queue", "events"].map((t) => `${page.base}/${t}`);
    client.subscribe([...topics, page.reply], { qos: 1 }, (err, granted) => {
      if (err || granted.some((g) => g.qos === 128)) {
        notice("The broker refused a subscription: this user may not read edge-queue's topics (check the ACL).");
        return;
      }
      refresh();
    });
  });
  client.on("message", onMessage);
  client.on("error", (err) => {
    const code = err && err.code;
    if (code === 4 || code === 5 || code === 134 || code === 135) {
      client.end(true);
      setStatus("offline", "the broker refused the login");
      askLogin(login?.username ? `The broker refused the login of "${login.username}".` :
        "The MQTT broker asks for a user name and password.");
    }
  });
  client.on("close", () => {
    if (page.connected) setStatus("connecting", "lost the broker; reconnecting");
    page.connected = false;
    for (const [, p] of page.pending) p.reject(new Error("the connection to the broker was lost"));
    page.pending.clear();
  });
  client.on("offline", () => {
    if (!page.connected) {
      setStatus("connecting", `cannot reach the broker at ${wsUrl()}`);
      notice(`Cannot reach the MQTT broker at ${wsUrl()} (its WebSocket listener). Retrying…`);
    }
  });
}

function request(command, body = {}, timeoutMs = 20000) {
  return new Promise((resolve, reject) => {
    if (!page.client || !page.connected) { reject(new Error("not connected to the broker")); return; }
    const transaction = `${page.reply}#${++page.txn}`;
    const timer = setTimeout(() => {
      page.pending.delete(transaction);
      reject(new Error(page.online === false ? "edge-queue is offline" : "no answer from edge-queue"));
    }, timeoutMs);
    page.pending.set(transaction, {
      resolve: (r) => { clearTimeout(timer); resolve(r); },
      reject: (e) => { clearTimeout(timer); reject(e); },
    });
    const payload = JSON.stringify({ ...body, transaction, reply_to: page.reply });
    const topic = page.user ? `${page.base}/request/${command}/${page.user}` : `${page.base}/request/${command}`;
    page.client.publish(topic, payload, { qos: 1 });
  });
}

async function call(command, body) {
  const r = await request(command, body);
  if (r.status !== "ok") {
    const e = new Error(r.error?.message || "error");
    e.code = r.error?.code;
    e.response = r;
    throw e;
  }
  return r.data;
}

function onMessage(topic, payload) {
  const text = new TextDecoder().decode(payload);
  const t = topic.slice(page.base.length + 1);
  if (topic === page.reply) {
    let r;
    try { r = JSON.parse(text); } catch { return; }
    const p = page.pending.get(r.transaction);
    if (p) { page.pending.delete(r.transaction); p.resolve(r); }
    return;
  }
  if (t === "status") {
    const was = page.online;
    page.online = text === "online";
    setStatus(page.online ? "online" : "offline");
    if (page.online && was === false) refresh();
    return;
  }
  if (!text) return;
  let body;
  try { body = JSON.parse(text); } catch { return; }
  if (t === "info") { page.info = body; renderInfo(); }
  else if (t === "queue") { page.queue = body; renderQueue(); }
  else if (t === "events" && body.job) {
    const isNew = !page.jobs.has(body.job.job_id);
    if (upsert(body.job) && body.type === "end") toastEnd(body.job);
    if (isNew) renderJobs(); else renderJob(body.job.job_id);
  }
}

async function refresh() {
  try {
    const [list, kinds] = await Promise.all([call("list", { limit: SHOWN }), call("kinds")]);
    for (const job of list.jobs) upsert(job);
    page.kinds = kinds.kinds;
    renderJobs();
    renderKinds();
    $("add").disabled = false;
  } catch (e) {
    if (page.online !== false) notice(`Could not read the jobs: ${e.message}`);
  }
}

// -- state ------------------------------------------------------------------------------

function upsert(job) {
  const had = page.jobs.get(job.job_id);
  if (had && had.seq > job.seq) return false;
  if (had && had.seq === job.seq && had.state === job.state && had.progress === job.progress) return false;
  page.jobs.set(job.job_id, job);
  if (page.detailId === job.job_id && (!had || had.state !== job.state)) showDetail(job.job_id, false);
  return true;
}

function setStatus(state, title) {
  const s = $("status");
  s.dataset.state = state;
  s.textContent = state;
  s.title = title || "";
  s.className = "pill " + (state === "online" ? "pill-ok" : state === "offline" ? "pill-bad" : "pill-wait");
  $("pause").disabled = state !== "online";
}

function notice(text) {
  $("notice").hidden = !text;
  $("notice").textContent = text || "";
}

function renderInfo() {
  const i = page.info;
  $("version").textContent = i.version ? `v${i.version}` : "";
  $("host").textContent = i.host || "";
  document.title = i.host ? `edge-queue · ${i.host}` : "edge-queue";
  if (i.conflict?.length) {
    notice(`Another edge-queue installation announces itself on this base topic: ${i.conflict
      .map((c) => `${c.host} (${c.instance_id}, ${c.version})`).join(", ")}. Give each box its own base topic.`);
  }
  renderKinds();
}

function renderQueue() {
  const q = page.queue;
  for (const c of document.querySelectorAll(".count")) {
    const n = q.counts?.[c.dataset.state];
    c.querySelector("b").textContent = n == null ? "–" : String(n);
  }
  $("paused").hidden = !q.paused;
  $("pause").textContent = q.paused ? "Resume" : "Pause";
  renderNodes(q.nodes || []);
}

// Worker nodes (docs/nodes.md): one chip each, online or offline, with the jobs it runs.
function renderNodes(nodes) {
  const box = $("nodes");
  box.replaceChildren(...nodes.map((n) =>
    el("span", { class: `node ${n.online ? "on" : "off"}`, "data-node": n.node_id,
                 title: `${n.host || ""} · ${(n.kinds || []).join(", ")}${n.device ? " · " + n.device : ""}` },
      `${n.node_id} · ${n.online ? `${n.running}/${n.slots} running` : "offline"}`)));
  box.hidden = nodes.length === 0;
}

function progressText(job) {
  if (job.state === "running" || job.state === "cancelling") {
    const parts = [`${(job.progress || 0).toFixed(0)} %`];
    if (job.stage) parts.push(job.stage.replace(/_/g, " "));
    if (job.eta_s != null) parts.push(`${duration(job.eta_s)} left`);
    return parts.join(" · ");
  }
  if (job.state === "retrying") return job.retry_at ? `again at ${new Date(job.retry_at).toLocaleTimeString()}` : "waiting";
  if (job.state === "queued") return "waiting for a worker";
  if (job.state === "failed") return job.error?.code || "failed";
  if (job.state === "succeeded") {
    const r = job.result || {};
    return r.duration_s != null ? `${duration(r.duration_s)} of media` : "done";
  }
  return job.state;
}

function metaText(job) {
  const bits = [job.kind];
  if (job.node && job.node !== "hub") bits.push(`on ${job.node}`);
  if (job.attempt > 1) bits.push(`attempt ${job.attempt}/${job.max_attempts}`);
  bits.push(when(job.finished_at || job.started_at || job.created_at));
  return bits.join(" · ");
}

function makeRow(id) {
  const row = el("li", { class: "job", "data-id": id, tabindex: "0" },
    el("span", { class: "state" }, el("span", { class: "badge" })),
    el("span", { class: "name" }),
    el("span", { class: "meta" }),
    el("div", { class: "progress" },
      el("div", { class: "track" }, el("div", { class: "fill" })),
      el("span", { class: "ptext" })),
    el("span", { class: "act" }, el("button", { type: "button", class: "btn btn-small" })));
  row.addEventListener("click", (ev) => { if (!ev.target.closest("button")) showDetail(id, true); });
  row.addEventListener("keydown", (ev) => { if (ev.key === "Enter") showDetail(id, true); });
  row.querySelector(".act button").addEventListener("click", () => jobAction(id));
  page.rows.set(id, row);
  return row;
}

function renderJob(id) {
  const job = page.jobs.get(id), row = page.rows.get(id);
  if (!job || !row) return;
  row.dataset.state = job.state;
  const badge = row.querySelector(".badge");
  badge.dataset.state = job.state;
  badge.textContent = job.state;
  const name = row.querySelector(".name");
  name.textContent = baseName(job.input);
  name.title = job.input || "";
  row.querySelector(".meta").textContent = metaText(job);
  const pct = job.state === "succeeded" ? 100 : Math.max(0, Math.min(100, job.progress || 0));
  row.querySelector(".fill").style.transform = `scaleX(${pct / 100})`;
  row.querySelector(".progress").setAttribute("aria-valuenow", String(pct));
  row.querySelector(".ptext").textContent = progressText(job);
  const btn = row.querySelector(".act button");
  const canCancel = job.state === "queued" || job.state === "running" || job.state === "retrying";
  const canRetry = job.state === "failed" || job.state === "cancelled";
  btn.hidden = !(canCancel || canRetry);
  btn.textContent = canCancel ? "Cancel" : "Retry";
  btn.className = "btn btn-small" + (canCancel ? " btn-danger" : "");
}

function renderJobs() {
  const ids = [...page.jobs.keys()].sort().reverse().slice(0, SHOWN);
  const list = $("jobs");
  ids.forEach((id, i) => {
    const row = page.rows.get(id) || makeRow(id);
    if (list.children[i] !== row) list.insertBefore(row, list.children[i] || null);
    renderJob(id);
  });
  while (list.children.length > ids.length) {
    const last = list.lastElementChild;
    page.rows.delete(last.dataset.id);
    last.remove();
  }
  $("empty").hidden = ids.length > 0;
}

async function jobAction(id) {
  const job = page.jobs.get(id);
  if (!job) return;
  try {
    if (ACTIVE.has(job.state)) await call("cancel", { job_id: id });
    else upsert(await call("retry", { job_id: id }));
    renderJob(id);
  } catch (e) {
    toast("failed", "Could not " + (ACTIVE.has(job.state) ? "cancel" : "retry"), e.message);
  }
}

$("pause").addEventListener("click", async () => {
  const paused = !!page.queue?.paused;
  try { await call(paused ? "resume" : "pause"); } catch (e) { toast("failed", "Could not pause", e.message); }
});

// -- toasts -----------------------------------------------------------------------------

const toasted = new Set();

function toastEnd(job) {
  const key = `${job.job_id}:${job.finished_at}`;
  if (toasted.has(key)) return;
  toasted.add(key);
  const name = baseName(job.input);
  if (job.state === "succeeded") {
    const text = job.result?.text;
    toast("succeeded", `${job.kind} done: ${name}`, text ? text.slice(0, 140) : "", job.job_id);
  } else if (job.state === "failed") {
    toast("failed", `${job.kind} failed: ${name}`, `${job.error?.code}: ${job.error?.message || ""}`, job.job_id);
  } else {
    toast("cancelled", `${job.kind} cancelled: ${name}`, "", job.job_id);
  }
}

function toast(state, title, text, jobId) {
  const t = el("div", { class: "toast", "data-state": state, role: "status" }, el("b", { text: title }),
    text ? el("span", { text }) : null);
  if (jobId) t.dataset.job = jobId;
  t.addEventListener("click", () => { t.remove(); if (jobId) showDetail(jobId, true); });
  $("toasts").append(t);
  while ($("toasts").children.length > 4) $("toasts").firstElementChild.remove();
  setTimeout(() => t.remove(), state === "failed" ? 15000 : 8000);
}

// -- job detail -------------------------------------------------------------------------

async function showDetail(id, open) {
  const d = $("detail");
  page.detailId = id;
  let job = page.jobs.get(id);
  if (open && !d.open) d.showModal();
  if (!d.open) return;
  renderDetail(job, null);
  if (job && TERMINAL.has(job.state)) {
    try {
      job = await call("get", { job_id: id, segments: true });
      if (page.detailId === id) renderDetail(job, job.result?.segment_list || null);
    } catch (e) { /* the summary stays */ }
  }
}

$("detail").addEventListener("close", () => { page.detailId = null; });

function renderDetail(job, segments) {
  const body = $("d-body");
  body.replaceChildren();
  if (!job) { body.append(el("p", { text: "This job is not known (purged?)." })); return; }
  $("d-title").textContent = `${job.kind}: ${baseName(job.input)}`;
  const kv = el("dl", { class: "kv" });
  const add = (k, v) => { if (v != null && v !== "") kv.append(el("dt", { text: k }), el("dd", { text: String(v) })); };
  add("State", job.state + (job.stage ? ` (${job.stage})` : ""));
  add("Job", job.job_id);
  add("Input", job.input);
  if (ACTIVE.has(job.state)) add("Progress", progressText(job));
  add("Attempts", `${job.attempt} of ${job.max_attempts}`);
  add("Created", when(job.created_at));
  add("Started", when(job.started_at));
  add("Finished", when(job.finished_at));
  if (job.batch_id) add("Batch", job.batch_id);
  if (Object.keys(job.options || {}).length) add("Options", JSON.stringify(job.options));
  body.append(kv);
  if (job.error) {
    body.append(el("h3", { text: "Error" }), el("p", { class: "error", text: `${job.error.code}: ${job.error.message}` }));
  }
  const r = job.result;
  if (r) {
    const outputs = r.outputs || (r.output ? { output: r.output } : null);
    if (outputs) {
      body.append(el("h3", { text: "Outputs" }));
      const o = el("dl", { class: "kv" });
      for (const [k, v] of Object.entries(outputs)) o.append(el("dt", { text: k }), el("dd", { text: v }));
      body.append(o);
    }
    if (segments && segments.length) {
      body.append(el("h3", { text: `Transcript (${r.language || "?"}, ${duration(r.duration_s)})` }));
      const s = el("div", { class: "segments" });
      for (const seg of segments) s.append(el("time", { text: stamp(seg.start) }), el("span", { text: seg.text }));
      body.append(s);
      if (r.segment_list_truncated) body.append(el("p", { class: "muted", text: "… more in the output files." }));
    } else if (r.text != null) {
      body.append(el("h3", { text: "Transcript" }), el("p", { class: "transcript", text: r.text }));
    }
    if (Array.isArray(r.streams)) {
      body.append(el("h3", { text: `Streams (${r.container || ""}, ${duration(r.duration_s)})` }));
      const table = el("table", { class: "streams" }, el("tr", {},
        ...["#", "type", "codec", "details", "language"].map((h) => el("th", { text: h }))));
      for (const st of r.streams) {
        const details = st.type === "audio" ? `${st.sample_rate || "?"} Hz, ${st.channels || "?"} ch`
          : st.type === "video" ? `${st.width}×${st.height} ${st.fps ? st.fps + " fps" : ""}` : "";
        table.append(el("tr", {}, ...[st.index, st.type, st.codec, details, st.language || ""]
          .map((v) => el("td", { text: String(v ?? "") }))));
      }
      body.append(table);
    }
    const rest = { ...r };
    for (const k of ["text", "outputs", "output", "streams", "segment_list", "segment_list_truncated"]) delete rest[k];
    body.append(el("h3", { text: "Result" }), el("pre", { text: JSON.stringify(rest, null, 1) }));
  }
  $("d-cancel").hidden = !(job.state === "queued" || job.state === "running" || job.state === "retrying");
  $("d-retry").hidden = !(job.state === "failed" || job.state === "cancelled");
  $("d-cancel").parentElement.hidden = $("d-cancel").hidden && $("d-retry").hidden;
}

$("d-cancel").addEventListener("click", () => page.detailId && jobAction(page.detailId));
$("d-retry").addEventListener("click", () => page.detailId && jobAction(page.detailId));

// -- file picker ------------------------------------------------------------------------

$("add").addEventListener("click", () => {
  page.picker.selected.clear();
  updatePicked();
  $("submit-msg").textContent = "";
  $("picker").showModal();
  browse(page.picker.path);
});

async function browse(path, after) {
  const p = page.picker;
  $("pick-error").hidden = true;
  let data;
  try {
    data = await call("browse", { ...(path ? { path } : {}), ...(after ? { after } : {}), limit: 200 });
  } catch (e) {
    $("pick-error").textContent = `${e.code || "error"}: ${e.message}`;
    $("pick-error").hidden = false;
    if (path && !after) return browse(null);
    return;
  }
  p.path = data.path;
  p.after = data.next_after;
  if (!after) $("entries").replaceChildren();
  renderCrumbs();
  for (const e of data.entries) $("entries").append(entryRow(e));
  $("more").hidden = !data.next_after;
  if (!data.entries.length && !after) $("entries").append(el("li", { class: "muted" }, el("span"), el("span", { text: "(empty)" })));
}

$("more").addEventListener("click", () => browse(page.picker.path, page.picker.after));

function join(folder, name) {
  return folder ? `${folder.replace(/\/$/, "")}/${name}` : name;
}

function entryRow(e) {
  const full = join(page.picker.path, e.name);
  if (e.type === "dir") {
    const li = el("li", { class: "dir", "data-path": full },
      el("span", { class: "icon", text: "📁" }), el("span", { class: "ename", text: e.name }),
      el("span", { class: "esize", text: "" }));
    li.addEventListener("click", () => browse(full));
    return li;
  }
  const box = el("input", { type: "checkbox", "data-path": full, "aria-label": e.name });
  box.checked = page.picker.selected.has(full);
  box.addEventListener("change", () => {
    if (box.checked) page.picker.selected.add(full); else page.picker.selected.delete(full);
    updatePicked();
  });
  const li = el("li", { class: "file" }, box, el("span", { class: "ename", text: e.name }),
    el("span", { class: "esize", text: bytes(e.size) }));
  li.querySelector(".ename").addEventListener("click", () => box.click());
  return li;
}

function renderCrumbs() {
  const c = $("crumbs");
  c.replaceChildren(el("button", { type: "button", text: "Media roots", onclick: () => browse(null) }));
  const path = page.picker.path;
  if (!path) return;
  const roots = (page.info?.media_roots || []).filter((r) => path === r || path.startsWith(r.replace(/\/$/, "") + "/"));
  const root = roots.sort((a, b) => b.length - a.length)[0] || "/";
  c.append(el("span", { text: "/" }), el("button", { type: "button", text: root, onclick: () => browse(root) }));
  let sofar = root.replace(/\/$/, "");
  for (const part of path.slice(sofar.length).split("/").filter(Boolean)) {
    sofar = `${sofar}/${part}`;
    const target = sofar;
    c.append(el("span", { text: "/" }), el("button", { type: "button", text: part, onclick: () => browse(target) }));
  }
}

$("pick-all").addEventListener("click", () => {
  for (const box of $("entries").querySelectorAll("input[type=checkbox]")) {
    box.checked = true;
    page.picker.selected.add(box.dataset.path);
  }
  updatePicked();
});

function updatePicked() {
  const n = page.picker.selected.size;
  $("pick-count").textContent = `${n} selected`;
  const kind = page.kinds[$("kind").value];
  $("submit").disabled = !(n || (kind && !kind.needs_input));
}

function renderKinds() {
  const sel = $("kind");
  const names = Object.keys(page.kinds);
  if (!names.length || sel.options.length === names.length) return;
  const current = sel.value || page.info?.default_kind || names[0];
  sel.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
  sel.value = names.includes(current) ? current : names[0];
  renderOptions();
}

$("kind").addEventListener("change", () => { renderOptions(); updatePicked(); });

function schemaOf(prop) {
  if (prop.anyOf) return { ...prop, ...(prop.anyOf.find((a) => a.type !== "null") || {}) };
  return prop;
}

function renderOptions() {
  const kind = page.kinds[$("kind").value];
  $("kind-desc").textContent = kind?.description || "";
  const box = $("options");
  box.replaceChildren();
  const props = kind?.options?.properties || {};
  for (const [name, raw] of Object.entries(props)) {
    const p = schemaOf(raw);
    const label = name.replace(/_/g, " ");
    const hint = [p.description, p.default != null ? `default ${JSON.stringify(p.default)}` : ""].filter(Boolean).join("; ");
    let input;
    if (p.type === "array" && p.items?.enum) {
      input = el("span", { class: "choices", "data-option": name, "data-type": "choices" },
        ...p.items.enum.map((v) => el("label", { class: "check" },
          el("input", { type: "checkbox", value: v }), v)));
    } else if (p.enum) {
      input = el("select", { "data-option": name },
        el("option", { value: "", text: `default${p.default != null ? ` (${p.default})` : ""}` }),
        ...p.enum.map((v) => el("option", { value: v, text: v })));
    } else if (p.type === "boolean") {
      input = el("select", { "data-option": name, "data-type": "boolean" },
        el("option", { value: "", text: `default${p.default != null ? ` (${p.default ? "yes" : "no"})` : ""}` }),
        el("option", { value: "true", text: "yes" }), el("option", { value: "false", text: "no" }));
    } else if (p.type === "integer" || p.type === "number") {
      input = el("input", { type: "number", "data-option": name, "data-type": p.type, step: p.type === "integer" ? "1" : "any",
        ...(p.minimum != null ? { min: String(p.minimum) } : {}), ...(p.maximum != null ? { max: String(p.maximum) } : {}),
        placeholder: p.default != null ? String(p.default) : "default" });
    } else {
      input = el("input", { type: "text", "data-option": name, placeholder: p.default != null ? String(p.default) : "default" });
    }
    box.append(el("label", { title: hint }, label, input));
  }
}

function optionValues() {
  const out = {};
  for (const node of $("options").querySelectorAll("[data-option]")) {
    const name = node.dataset.option, type = node.dataset.type;
    if (type === "choices") {
      const picked = [...node.querySelectorAll("input:checked")].map((i) => i.value);
      if (picked.length) out[name] = picked;
    } else if (node.value !== "") {
      if (type === "boolean") out[name] = node.value === "true";
      else if (type === "integer") out[name] = parseInt(node.value, 10);
      else if (type === "number") out[name] = parseFloat(node.value);
      else out[name] = node.value;
    }
  }
  return out;
}

$("submit").addEventListener("click", async () => {
  const inputs = [...page.picker.selected];
  const body = { kind: $("kind").value, options: optionValues() };
  if (inputs.length === 1) body.input = inputs[0];
  else if (inputs.length > 1) body.inputs = inputs;
  $("submit").disabled = true;
  $("submit-msg").textContent = "submitting…";
  try {
    const data = await call("submit", body);
    for (const j of data.jobs) if (!page.jobs.has(j.job_id)) await call("get", { job_id: j.job_id }).then(upsert).catch(() => {});
    renderJobs();
    const rej = data.rejected.length ? `; ${data.rejected.length} refused: ${data.rejected[0].code}` : "";
    toast("info", `Submitted ${data.jobs.length} job${data.jobs.length === 1 ? "" : "s"}${rej}`, "");
    $("picker").close();
  } catch (e) {
    const rej = e.response?.error?.rejected;
    $("submit-msg").textContent = rej ? `refused: ${rej.map((r) => `${baseName(r.input)}: ${r.code}`).join(", ")}` : `${e.code || "error"}: ${e.message}`;
  } finally {
    updatePicked();
  }
});

// -- start ------------------------------------------------------------------------------

async function start() {
  try {
    const r = await fetch("config.json", { cache: "no-cache" });
    page.cfg = await r.json();
  } catch (e) {
    notice(`Cannot read config.json from this server: ${e.message}`);
    return;
  }
  page.base = page.cfg.base_topic;
  if (page.cfg.version) $("version").textContent = `v${page.cfg.version}`;
  page.login = savedLogin();
  connect();
}

start();
