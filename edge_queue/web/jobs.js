// The queue page's job list: counts, filter, pages, rows, the actions of a row, toasts.
"use strict";

// -- reading the list -------------------------------------------------------------------

function listBody(before) {
  const f = page.view.filter;
  return {
    limit: PAGE_SIZE, count: true, ...(f.state ? { state: f.state } : {}), ...(f.kind ? { kind: f.kind } : {}),
    ...(f.q ? { input_contains: f.q } : {}), ...(before ? { before } : {}),
  };
}

// The first page of the list (with the filter) and the kinds, read again after every
// reconnect, when edge-queue comes back and when the filter changes; a newer refresh
// replaces an older one still waiting.
async function refresh() {
  const mine = ++page.view.gen;
  page.view.askedAt = Date.now();
  const alive = () => page.view.gen === mine;
  try {
    const [list, kinds] = await Promise.all([ask("list", listBody(), alive), ask("kinds", {}, alive)]);
    if (!alive()) return;
    page.kinds = kinds.kinds;
    renderKinds();
    for (const job of list.jobs) upsert(job);
    Object.assign(page.view, { ids: list.jobs.map((j) => j.job_id), total: list.total, next: list.next_before, loaded: true });
    // an action whose answer was lost with the connection is settled by what the list says
    for (const job of list.jobs) settleBusy(job);
    if (page.queue) settleBusy(null);
    notice(null);
    renderJobs();
    renderReady();
  } catch (e) {
    if (!e.stale) notice(`Could not read the jobs: ${e.code || "error"}: ${e.message}`);
  }
}

async function showMore() {
  const v = page.view, mine = v.gen;
  $("more-jobs").disabled = true;
  try {
    const list = await ask("list", listBody(v.next), () => page.view.gen === mine);
    for (const job of list.jobs) upsert(job);
    const seen = new Set(v.ids);
    v.ids.push(...list.jobs.map((j) => j.job_id).filter((id) => !seen.has(id)));
    v.next = list.next_before;
    v.total = list.total;
    renderJobs();
  } catch (e) {
    if (!e.stale) notice(`Could not read more jobs: ${e.code || "error"}: ${e.message}`);
  } finally {
    $("more-jobs").disabled = false;
  }
}
$("more-jobs").addEventListener("click", showMore);

function matches(job) {
  const f = page.view.filter;
  return (!f.state || job.state === f.state) && (!f.kind || job.kind === f.kind) &&
    (!f.q || String(job.input || "").toLowerCase().includes(f.q.toLowerCase()));
}

let typing = null; // a file name being typed, read 250 ms after the last key

function setFilter(change) {
  // what was typed counts at once when another part of the filter changes
  if (typing) { clearTimeout(typing); typing = null; change = { q: $("f-q").value.trim(), ...change }; }
  Object.assign(page.view.filter, change);
  const f = page.view.filter;
  $("f-state").value = f.state;
  $("f-kind").value = f.kind;
  if ($("f-q").value !== f.q) $("f-q").value = f.q;
  for (const c of document.querySelectorAll(".count")) c.setAttribute("aria-pressed", String(c.dataset.state === f.state));
  page.view.loaded = false;
  renderJobs();
  refresh();
}

$("f-state").addEventListener("change", () => setFilter({ state: $("f-state").value }));
$("f-kind").addEventListener("change", () => setFilter({ kind: $("f-kind").value }));
$("f-q").addEventListener("input", () => {
  clearTimeout(typing);
  typing = setTimeout(() => { typing = null; setFilter({ q: $("f-q").value.trim() }); }, 250);
});
for (const c of document.querySelectorAll(".count")) {
  c.addEventListener("click", () => setFilter({ state: page.view.filter.state === c.dataset.state ? "" : c.dataset.state }));
}

// -- live changes -----------------------------------------------------------------------

function upsert(job) {
  const had = page.jobs.get(job.job_id);
  if (had && had.seq > job.seq) return false;
  if (had && had.seq === job.seq && had.state === job.state && had.progress === job.progress) return false;
  page.jobs.set(job.job_id, job);
  if (page.detailId === job.job_id && (!had || had.state !== job.state)) showDetail(job.job_id, false);
  return true;
}

function onJobEvent(ev) {
  const id = ev.job.job_id, before = page.jobs.get(id);
  // whether it was counted in the total: unknown for an older job not read yet
  const counted = before ? matches(before) : ev.type === "new" ? false : null;
  if (upsert(ev.job) && ev.type === "end") toastEnd(ev.job);
  const job = page.jobs.get(id);
  settleBusy(job);
  const v = page.view, at = v.ids.indexOf(id), fits = matches(job);
  if (!v.loaded) return;
  if (fits && at < 0) {
    // a new job, or one that now fits the filter: in its place when it falls among the
    // jobs shown, else on a later page
    if (v.next == null || id > v.next) { v.ids.push(id); v.ids.sort().reverse(); }
    if (counted === false && v.total != null) v.total++;
    renderJobs();
  } else if (!fits && (at >= 0 || counted)) {
    if (at >= 0) v.ids.splice(at, 1);
    if (v.total != null) v.total--;
    renderJobs();
  } else if (at >= 0) renderJob(id);
}

// -- drawing ----------------------------------------------------------------------------

function renderQueue() {
  const q = page.queue;
  for (const c of document.querySelectorAll(".count")) {
    const n = q.counts?.[c.dataset.state];
    c.querySelector("b").textContent = n == null ? "–" : String(n);
  }
  $("paused").hidden = !q.paused;
  settleBusy(null);
  renderNodes(q.nodes || []);
  renderReady();
}

// Worker nodes (docs/nodes.md): one chip each, online or offline, with the jobs it runs.
function renderNodes(nodes) {
  const box = $("nodes");
  box.replaceChildren(...nodes.map((n) =>
    el("span", { class: `node ${n.online && !n.incompatible ? "on" : "off"}`, "data-node": n.node_id,
                 title: n.incompatible || `${n.host || ""} · ${(n.kinds || []).join(", ")}${n.device ? " · " + n.device : ""}` },
      `${n.node_id} · ${n.incompatible ? "incompatible" : n.online ? `${n.running}/${n.slots} running` : "offline"}`)));
  box.hidden = nodes.length === 0;
}

// What can be done now: the actions are off while edge-queue is offline or the broker away.
function renderReady() {
  const up = canAct();
  $("add").disabled = !up || !Object.keys(page.kinds).length;
  $("pause").disabled = !up || page.busy.has("queue");
  // a pause or resume sent and not answered yet shows as such, as Retry and Cancel do
  const queueBusy = page.busy.get("queue");
  $("pause").textContent = queueBusy ? (queueBusy.paused ? "Resuming…" : "Pausing…")
    : page.queue?.paused ? "Resume" : "Pause";
  const why = !up ? (page.connected ? "edge-queue is offline" : "not connected to the broker") : "";
  for (const b of [$("add"), $("pause")]) b.title = b.disabled ? why : "";
  for (const id of page.rows.keys()) renderJob(id);
  if (typeof renderDetailActions === "function") renderDetailActions();
  if (typeof updatePicked === "function") updatePicked();
  const off = page.connected && page.online === false;
  $("offline").hidden = !off;
  $("offline").textContent = off
    ? "edge-queue is offline. Add files, Cancel, Retry and Pause come back when it is online again; " +
      "what was sent before it went away takes effect then."
    : "";
  $("loading").hidden = page.view.loaded || !page.connected;
  const away = !page.connected && !!page.away;
  $("broker").hidden = !away;
  $("broker").textContent = away ? `Not connected to the broker: ${page.away}. Add files, Cancel, Retry and Pause ` +
    "are off until it is back." : "";
}

function progressText(job) {
  if (job.state === "running" || job.state === "cancelling") {
    const parts = [`${(job.progress || 0).toFixed(0)} %`];
    if (job.stage) parts.push(job.stage.replace(/_/g, " "));
    if (job.eta_s != null) parts.push(`${duration(job.eta_s)} left`);
    return parts.join(" · ");
  }
  if (job.state === "retrying") return job.retry_at ? `again at ${new Date(job.retry_at).toLocaleTimeString()}` : "waiting";
  if (job.state === "queued") return waitingText(job);
  if (job.state === "failed") return job.error?.code || "failed";
  if (job.state === "succeeded") {
    const r = job.result || {};
    return r.duration_s != null ? `${duration(r.duration_s)} of media` : "done";
  }
  return job.state;
}

// Why a queued job waits, as far as the page can tell (docs/topics.md, "queued -> running").
function waitingText(job) {
  if (page.online === false) return "waiting: edge-queue is offline";
  if (page.queue?.paused) return "waiting: the queue is paused";
  if (job.run_at && new Date(job.run_at) > new Date()) return `waiting until ${new Date(job.run_at).toLocaleTimeString()}`;
  const limit = page.kinds[job.kind]?.max_concurrency;
  const running = (page.queue?.running || []).filter((r) => r.kind === job.kind).length;
  if (limit && running >= limit) return `waiting: ${limit} ${job.kind} at a time`;
  return "waiting for a worker";
}

function metaText(job) {
  const bits = [job.kind];
  if (job.node && job.node !== "hub") bits.push(`on ${job.node}`);
  if (job.attempt > 1) bits.push(`attempt ${job.attempt}/${job.max_attempts}`);
  bits.push(when(job.finished_at || job.started_at || job.created_at));
  return bits.join(" · ");
}

// A row: its name is a button (keyboard and screen readers open the detail with it); a
// click anywhere else on the row does the same.
function makeRow(id) {
  const row = el("li", { class: "job", "data-id": id },
    el("span", { class: "state" }, el("span", { class: "badge" })),
    el("button", { type: "button", class: "name" }),
    el("span", { class: "meta" }),
    el("div", { class: "progress" },
      el("div", { class: "track", role: "progressbar", "aria-valuemin": "0", "aria-valuemax": "100" },
        el("div", { class: "fill" })),
      el("span", { class: "ptext" })),
    el("span", { class: "act" }, el("button", { type: "button", class: "btn btn-small" })));
  row.addEventListener("click", (ev) => { if (!ev.target.closest(".act")) showDetail(id, true); });
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
  const track = row.querySelector(".track");
  track.setAttribute("aria-valuenow", String(Math.round(pct)));
  track.setAttribute("aria-label", `${baseName(job.input)}: ${job.state}`);
  row.querySelector(".ptext").textContent = progressText(job);
  row.querySelector(".ptext").title = progressText(job);
  const btn = row.querySelector(".act button");
  const canCancel = job.state === "queued" || job.state === "running" || job.state === "retrying";
  const canRetry = job.state === "failed" || job.state === "cancelled";
  const busy = page.busy.get(id);
  btn.hidden = !(canCancel || canRetry || busy);
  btn.textContent = busy ? (busy.label === "cancel" ? "Cancelling…" : "Retrying…") : canCancel ? "Cancel" : "Retry";
  btn.className = "btn btn-small" + (canCancel ? " btn-danger" : "") + (busy?.slow ? " waiting" : "");
  btn.disabled = !canAct() || !!busy;
  btn.title = busy?.slow ? "sent; it takes effect when edge-queue answers" : !canAct() ? "edge-queue is offline" : "";
  btn.setAttribute("aria-label", `${btn.textContent} ${baseName(job.input)}`);
}

function renderJobs() {
  const v = page.view;
  const list = $("jobs");
  v.ids.forEach((id, i) => {
    const row = page.rows.get(id) || makeRow(id);
    if (list.children[i] !== row) list.insertBefore(row, list.children[i] || null);
    renderJob(id);
  });
  while (list.children.length > v.ids.length) {
    const last = list.lastElementChild;
    page.rows.delete(last.dataset.id);
    last.remove();
  }
  const filtered = Object.values(v.filter).some(Boolean);
  $("empty").hidden = !v.loaded || v.ids.length > 0;
  $("empty").replaceChildren(...(filtered ? ["No jobs match the filter."]
    : ["No jobs yet. ", el("b", { text: "Add files" }), " to give edge-queue work."]));
  $("shown").textContent = v.loaded && v.total != null ? `${v.ids.length} of ${v.total} job${v.total === 1 ? "" : "s"}` : "";
  // more only when some exist: all that match may be shown with a page that was full
  $("more-jobs").hidden = !v.loaded || v.next == null || (v.total != null && v.ids.length >= v.total);
}

// -- actions ----------------------------------------------------------------------------

// An action's wait ends with its answer, or with its effect seen on the job (or the queue)
// when the answer was lost with the broker connection.
function settleBusy(job) {
  const key = job ? job.job_id : "queue";
  const b = page.busy.get(key);
  if (!b || !b.settle) return;
  const seen = job ? job.seq > b.seq : !!page.queue && page.queue.paused !== b.paused;
  if (seen) b.settle(null);
}

async function jobAction(id) {
  const job = page.jobs.get(id);
  if (!job || page.busy.has(id) || !canAct()) return;
  const label = ACTIVE.has(job.state) ? "cancel" : "retry";
  const name = baseName(job.input);
  const busy = { label, seq: job.seq, slow: false, settle: null };
  page.busy.set(id, busy);
  renderJob(id);
  renderDetailActions();
  try {
    const data = await act(label, { job_id: id }, {
      settleWith: (s) => { busy.settle = s; },
      onSlow: () => {
        busy.slow = true;
        renderJob(id);
        toast("info", `${label === "cancel" ? "Cancel" : "Retry"} of ${name} is waiting for edge-queue`,
          "It takes effect when edge-queue answers.", id);
      },
    });
    if (data && label === "retry") upsert(data);
  } catch (e) {
    toast("failed", `Could not ${label} ${name}`, `${e.code || "error"}: ${e.message}`);
  } finally {
    page.busy.delete(id);
    renderJob(id);
    renderDetailActions();
  }
}

$("pause").addEventListener("click", async () => {
  if (page.busy.has("queue") || !canAct()) return;
  const paused = !!page.queue?.paused, what = paused ? "resume" : "pause";
  const busy = { label: what, paused, slow: false, settle: null };
  page.busy.set("queue", busy);
  renderReady();
  try {
    await act(what, {}, {
      settleWith: (s) => { busy.settle = s; },
      onSlow: () => toast("info", `${paused ? "Resume" : "Pause"} is waiting for edge-queue`, "It takes effect when edge-queue answers."),
    });
  } catch (e) {
    toast("failed", `Could not ${what}`, `${e.code || "error"}: ${e.message}`);
  } finally {
    page.busy.delete("queue");
    renderReady();
  }
});

// -- toasts -----------------------------------------------------------------------------

const toasted = new Set();

function toastEnd(job) {
  const key = `${job.job_id}:${job.finished_at}`;
  if (toasted.has(key)) return;
  toasted.add(key);
  const name = baseName(job.input);
  if (job.state === "succeeded") {
    toast("succeeded", `${job.kind} done: ${name}`, clip(job.result?.text, 140), job.job_id);
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
