// edge-queue's queue page. Talks to the MQTT broker over WebSocket (MQTT 3.1.1, so it works
// with mosquitto and amqtt alike): reads <base>/status, info, queue and events, sends the same
// requests as every client (docs/topics.md), with reply_to on a topic of its own.
// This file: helpers, the broker login, the connection and the requests. jobs.js draws the
// list, detail.js a job's detail, picker.js the file picker; start() runs once all are read.
"use strict";

const $ = (id) => document.getElementById(id);
const STATES = ["queued", "running", "retrying", "cancelling", "succeeded", "failed", "cancelled"];
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const ACTIVE = new Set(["queued", "running", "retrying", "cancelling"]);
const PAGE_SIZE = 100; // jobs asked for at a time, newest first; "Show more" asks for the next
const CRED_KEY = "edge-queue.login";
// A read is asked again when it has no answer after this long; an action shows as waiting.
const READ_TIMEOUT_MS = 10000;
const ACTION_SLOW_MS = 5000;

const page = {
  cfg: null, client: null, base: "", reply: "", user: "", online: null, connected: false,
  // why the page is not connected to the broker, shown under the header; null while connected
  // or still trying for the first time
  away: null,
  info: null, queue: null, kinds: {}, jobs: new Map(), rows: new Map(), pending: new Map(),
  login: null, txn: 0, detailId: null, picker: { path: null, after: null, selected: new Set() },
  // the list as shown: job ids newest first, the filter, the total and where the next page starts
  view: { ids: [], filter: { state: "", kind: "", q: "" }, total: null, next: null, gen: 0, loaded: false, askedAt: 0 },
  // actions sent and not yet answered, by job id (or "queue"): {label, seq, slow, settle}
  busy: new Map(),
  // the event log of the jobs whose detail was opened, by job id (detail.js)
  history: new Map(),
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
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

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

// At most n characters, cut at a word boundary, with an ellipsis when cut.
function clip(text, n) {
  if (!text || text.length <= n) return text || "";
  const cut = text.slice(0, n + 1).replace(/\s+\S*$/, "");
  return (cut.length > n / 2 ? cut : text.slice(0, n)).replace(/[\s,.;:]+$/, "") + "…";
}

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

// -- readiness --------------------------------------------------------------------------
// Reads need the broker; actions need edge-queue online too. Whatever waits for either is
// woken by changed(), called on every connect, disconnect and change of <base>/status.

const canRead = () => page.connected && page.online !== false;
const canAct = () => page.connected && page.online === true;
let wakers = [];
const nextChange = () => new Promise((r) => wakers.push(r));

function changed() {
  const w = wakers;
  wakers = [];
  for (const r of w) r();
  renderReady();
}

async function readable() {
  while (!canRead()) await nextChange();
}

// -- MQTT -------------------------------------------------------------------------------

function wsUrl() {
  if (page.cfg.websocket_path) {
    // relayed by the page's own server: the same origin and path prefix (Home Assistant's
    // ingress, a reverse proxy)
    const url = new URL(page.cfg.websocket_path, location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    return url.href;
  }
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
  // a first try that takes this long is said on the page, not only in the pill's tooltip
  setTimeout(() => { if (page.client === client && !page.connected && !page.away) brokerAway(`no answer from ${wsUrl()} yet`); }, 4000);
  client.on("connect", () => {
    notice(null);
    const topics = ["status", "info", "queue", "events"].map((t) => `${page.base}/${t}`);
    client.subscribe([...topics, page.reply], { qos: 1 }, (err, granted) => {
      if (err || granted.some((g) => g.qos === 128)) {
        notice("The broker refused a subscription: this user may not read edge-queue's topics (check the ACL).");
        brokerAway("it refused a subscription to edge-queue's topics (check the ACL)");
        return;
      }
      // what changed while the page was away (events it missed) is read again
      page.connected = true;
      page.away = null;
      changed();
      refresh();
    });
  });
  client.on("message", onMessage);
  client.on("error", (err) => {
    const code = err && err.code;
    if (code === 4 || code === 5 || code === 134 || code === 135) {
      client.end(true);
      setStatus("offline", "the broker refused the login");
      brokerAway(login?.username ? `it refused the login of "${login.username}"` : "it asks for a user name and password");
      askLogin(login?.username ? `The broker refused the login of "${login.username}".` :
        "The MQTT broker asks for a user name and password.");
    }
  });
  client.on("close", () => {
    const was = page.connected;
    page.connected = false;
    // the broker's retained status is read again at the next connect
    page.online = null;
    if (was) { setStatus("connecting", "lost the broker; reconnecting"); page.away = "the connection was lost; reconnecting"; }
    // a read is asked again once connected; an action stays: it may have reached the broker,
    // and its answer, or its effect on the job, settles it
    for (const [t, p] of page.pending) if (!p.keep) { page.pending.delete(t); p.reject(transportError("the connection to the broker was lost")); }
    changed();
  });
  client.on("offline", () => {
    if (!page.connected) {
      setStatus("connecting", `cannot reach the broker at ${wsUrl()}`);
      brokerAway(`cannot reach its WebSocket listener at ${wsUrl()}; trying again every 3 s`);
    }
  });
}

function transportError(message) {
  const e = new Error(message);
  e.transport = true;
  return e;
}

// One request and its answer (the whole response). Rejects with e.transport when not
// connected, when the connection is lost, or after timeoutMs without an answer; with keep,
// it waits for its answer for good instead (onSlow is called after timeoutMs).
function request(command, body = {}, { timeoutMs = READ_TIMEOUT_MS, keep = false, onSlow = null } = {}) {
  return new Promise((resolve, reject) => {
    if (!page.client || !page.connected) { reject(transportError("not connected to the broker")); return; }
    const transaction = `${page.reply}#${++page.txn}`;
    const done = () => { clearTimeout(timer); page.pending.delete(transaction); };
    const timer = setTimeout(() => {
      if (keep) { onSlow?.(); return; }
      done();
      reject(transportError(page.online === false ? "edge-queue is offline" : "no answer from edge-queue"));
    }, timeoutMs);
    page.pending.set(transaction, {
      keep, resolve: (r) => { done(); resolve(r); }, reject: (e) => { done(); reject(e); },
    });
    const payload = JSON.stringify({ ...body, transaction, reply_to: page.reply });
    const topic = page.user ? `${page.base}/request/${command}/${page.user}` : `${page.base}/request/${command}`;
    page.client.publish(topic, payload, { qos: 1 });
  });
}

function unwrap(r) {
  if (r.status !== "ok") {
    const e = new Error(r.error?.message || "error");
    e.code = r.error?.code;
    e.response = r;
    throw e;
  }
  return r.data;
}

// A read (list, kinds, get, browse): asked until edge-queue answers it, again after every
// reconnect and when edge-queue comes back, so nothing stays unread after an outage. Throws
// only edge-queue's refusals, or e.stale once alive() says the answer is no longer wanted.
async function ask(command, body = {}, alive = () => true) {
  for (let pause = 1000; ; pause = Math.min(pause * 2, 16000)) {
    await readable();
    if (!alive()) throw Object.assign(new Error("no longer wanted"), { stale: true });
    try { return unwrap(await request(command, body)); } catch (e) { if (!e.transport) throw e; }
    await Promise.race([sleep(pause), nextChange()]);
  }
}

// An action (cancel, retry, pause, resume, submit), sent only while edge-queue is online (the
// buttons are disabled otherwise). Without an answer after ACTION_SLOW_MS (edge-queue stopped,
// or the broker restarts) the request waits in edge-queue's broker session and takes effect
// when edge-queue is back: onSlow shows it waiting, and the action fails only when edge-queue
// refuses it. settle(data) ends the wait early (the page saw the effect).
function act(command, body, { onSlow, settleWith } = {}) {
  return new Promise((resolve, reject) => {
    if (settleWith) settleWith(resolve);
    request(command, body, { keep: true, timeoutMs: ACTION_SLOW_MS, onSlow })
      .then((r) => { try { resolve(unwrap(r)); } catch (e) { reject(e); } }, reject);
  });
}

function onMessage(topic, payload) {
  const text = new TextDecoder().decode(payload);
  const t = topic.slice(page.base.length + 1);
  if (topic === page.reply) {
    let r;
    try { r = JSON.parse(text); } catch { return; }
    const p = page.pending.get(r.transaction);
    if (p) p.resolve(r);
    return;
  }
  if (t === "status") {
    const was = page.online;
    page.online = text === "online";
    setStatus(page.online ? "online" : "offline");
    changed();
    // back after being offline: what it did while starting up is read again; and a first
    // read that found no one to answer it (a new broker keeps no request for edge-queue) is
    // asked again at once
    if (page.online && (was === false || (!page.view.loaded && Date.now() - page.view.askedAt > 2000))) refresh();
    return;
  }
  if (!text) return;
  let body;
  try { body = JSON.parse(text); } catch { return; }
  if (t === "info") { page.info = body; renderInfo(); }
  else if (t === "queue") { page.queue = body; renderQueue(); }
  else if (t === "events" && body.job) onJobEvent(body);
}

function setStatus(state, title) {
  const s = $("status");
  s.dataset.state = state;
  s.textContent = state;
  s.title = title || "";
  s.className = "pill " + (state === "online" ? "pill-ok" : state === "offline" ? "pill-bad" : "pill-wait");
}

// The broker is away: why, in words on the page (a phone shows no tooltips).
function brokerAway(why) {
  page.away = why;
  renderReady();
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
  renderReady();
  connect();
}

document.addEventListener("DOMContentLoaded", start);
