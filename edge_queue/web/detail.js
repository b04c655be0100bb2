// The queue page's job detail: the job, its transcript with downloads, streams, result.
"use strict";

async function showDetail(id, open) {
  const d = $("detail");
  page.detailId = id;
  let job = page.jobs.get(id);
  if (open && !d.open) d.showModal();
  if (!d.open) return;
  renderDetail(job, null, page.history.get(id));
  const alive = () => page.detailId === id && d.open;
  try {
    const [full, log] = await Promise.all([
      job && TERMINAL.has(job.state) ? ask("get", { job_id: id, segments: true }, alive) : null,
      ask("events", { job_id: id }, alive),
    ]);
    page.history.set(id, log.events);
    if (full) job = full;
    if (page.detailId === id) renderDetail(job, job?.result?.segment_list || null, log.events);
  } catch (e) { /* the summary stays */ }
}

// The job's history from the event log: its runs, and the retries asked by hand (a retry
// starts the attempts again from 0, so "Attempts 1 of 3" alone would hide the earlier runs).
function history(events) {
  const table = el("table", { class: "streams history" }, el("tr", {},
    ...["when", "state", "attempt", "detail"].map((h) => el("th", { text: h }))));
  for (const e of events) {
    table.append(el("tr", {}, ...[when(e.at), e.from_state ? `${e.from_state} → ${e.state}` : e.state,
      e.attempt || "", detailText(e.detail)].map((v) => el("td", { text: String(v) }))));
  }
  return table;
}

// An event's detail: a text, or an object (an error, a retry by hand: who asked)
function detailText(d) {
  if (d == null) return "";
  if (typeof d !== "object") return String(d);
  if (d.code || d.message) return [d.code, d.message].filter(Boolean).join(": ");
  return Object.entries(d).map(([k, v]) => `${k.replace(/_/g, " ")}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ");
}

const byHand = (events) => (events || []).filter((e) => e.state === "queued" && (e.from_state === "failed" || e.from_state === "cancelled")).length;

$("detail").addEventListener("close", () => { page.detailId = null; });

// Subtitle and text files from get's segment_list (read from the job's json output, else
// its srt or vtt), srt and vtt from its cue_list (the job's own srt or vtt cues, laid out as
// subtitles) when there is one, and txt from the segments' text: the json's segments, else
// line_list (the job's own txt, read by get); never from srt or vtt cues, whose lines are laid
// out. Built in the browser: the same bytes as the transcription's own txt, srt and vtt
// outputs (kinds/transcribe.py, render).
function srtTime(seconds, sep) {
  let ms = Math.round(seconds * 1000);
  const h = Math.floor(ms / 3600000); ms -= h * 3600000;
  const m = Math.floor(ms / 60000); ms -= m * 60000;
  const s = Math.floor(ms / 1000); ms -= s * 1000;
  const p = (n, w) => String(n).padStart(w, "0");
  return `${p(h, 2)}:${p(m, 2)}:${p(s, 2)}${sep}${p(ms, 3)}`;
}

function transcriptFile(fmt, segments) {
  if (fmt === "txt") return segments.map((s) => s.text.trim() + "\n").join("");
  const cue = (s, sep) => `${srtTime(s.start, sep)} --> ${srtTime(s.end, sep)}\n${s.text.trim()}\n`;
  if (fmt === "srt") return segments.map((s, i) => `${i + 1}\n${cue(s, ",")}`).join("\n");
  return "WEBVTT\n\n" + segments.map((s) => cue(s, ".")).join("\n");
}

const MIME = { txt: "text/plain", srt: "application/x-subrip", vtt: "text/vtt" };

function downloads(job, segments, truncated) {
  const stem = baseName(job.input).replace(/\.[^.]*$/, "") || job.job_id;
  const box = el("p", { class: "downloads" }, el("span", { class: "muted", text: "Download" }));
  // every format from a json output; from an srt or vtt, the formats the job wrote
  const wrote = Object.keys(job.result?.outputs || {});
  const lines = Array.isArray(job.result?.line_list) ? job.result.line_list : null;
  const json = !wrote.length || wrote.includes("json");
  const formats = ["txt", "srt", "vtt"].filter((f) => f === "txt" ? json || lines : json || wrote.includes(f));
  for (const fmt of formats) {
    const a = el("a", { class: "btn btn-small", href: "#", download: `${stem}.${fmt}`, "data-format": fmt,
      "aria-label": `Download the transcript as ${fmt}` }, fmt);
    // the file is made on click, so a long transcript costs nothing until it is wanted
    a.addEventListener("click", () => {
      const cues = fmt !== "txt" && Array.isArray(job.result?.cue_list) ? job.result.cue_list : segments;
      const file = fmt === "txt" && lines ? lines.map((l) => l + "\n").join("") : transcriptFile(fmt, cues);
      const blob = new Blob([file], { type: `${MIME[fmt]};charset=utf-8` });
      if (a.href.startsWith("blob:")) URL.revokeObjectURL(a.href);
      a.href = URL.createObjectURL(blob);
    });
    box.append(a);
  }
  if (truncated || (lines && job.result.line_list_truncated)) box.append(el("span", { class: "muted", text: "(the first part: the whole transcript is in the output files)" }));
  return box;
}

function renderDetail(job, segments, events) {
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
  const retried = byHand(events);
  add("Attempts", `${job.attempt} of ${job.max_attempts}` +
    (retried ? ` since it was retried by hand (${retried} time${retried === 1 ? "" : "s"}; the earlier runs are in the history)` : ""));
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
    if (segments && segments.length) {
      body.append(el("h3", { text: `Transcript (${r.language || "?"}, ${duration(r.duration_s)})` }));
      body.append(downloads(job, segments, r.segment_list_truncated));
      const s = el("div", { class: "segments" });
      for (const seg of segments) s.append(el("time", { text: stamp(seg.start) }), el("span", { text: seg.text }));
      body.append(s);
      if (r.segment_list_truncated) body.append(el("p", { class: "muted", text: "… more in the output files." }));
    } else if (r.text != null) {
      body.append(el("h3", { text: "Transcript" }), el("p", { class: "transcript", text: r.text }));
    }
    const outputs = r.outputs || (r.output ? { output: r.output } : null);
    if (outputs) {
      body.append(el("h3", { text: "Output files on the box" }));
      const o = el("dl", { class: "kv" });
      for (const [k, v] of Object.entries(outputs)) o.append(el("dt", { text: k }), el("dd", { text: v }));
      body.append(o);
    }
    if (Array.isArray(r.streams)) {
      body.append(el("h3", { text: `Streams (${r.container || ""}, ${duration(r.duration_s)})` }));
      const table = el("table", { class: "streams" }, el("tr", {},
        ...["#", "what", "codec", "details", "language"].map((h) => el("th", { text: h }))));
      // what each stream is (probe's role: a cover is not a video), marked when a kind uses it
      const used = new Set(Object.values(r.uses || {}).flat());
      for (const st of r.streams) {
        const details = st.type === "audio" ? `${st.sample_rate || "?"} Hz, ${st.channels || "?"} ch`
          : st.type === "video" ? `${st.width}×${st.height} ${st.fps ? st.fps + " fps" : ""}` : "";
        const what = (st.role || st.type) + (st.default ? ", default" : "") + (used.has(st.index) ? ", used" : "");
        table.append(el("tr", {}, ...[st.index, what, st.codec, details, st.language || ""]
          .map((v) => el("td", { text: String(v ?? "") }))));
      }
      body.append(table);
    }
    const rest = { ...r };
    for (const k of ["text", "outputs", "output", "streams", "segment_list", "segment_list_truncated"]) delete rest[k];
    if (Array.isArray(r.streams)) for (const k of ["uses", "audio_stream", "video_stream"]) delete rest[k];
    body.append(el("h3", { text: "Result" }), el("pre", { text: JSON.stringify(rest, null, 1) }));
  }
  if (events?.length) body.append(el("h3", { text: "History" }), history(events));
  renderDetailActions();
}

function renderDetailActions() {
  const job = page.detailId && page.jobs.get(page.detailId);
  const busy = job && page.busy.get(job.job_id);
  $("d-cancel").hidden = !job || !(job.state === "queued" || job.state === "running" || job.state === "retrying");
  $("d-retry").hidden = !job || !(job.state === "failed" || job.state === "cancelled");
  $("d-cancel").parentElement.hidden = $("d-cancel").hidden && $("d-retry").hidden;
  for (const b of [$("d-cancel"), $("d-retry")]) {
    b.disabled = !canAct() || !!busy;
    b.title = busy?.slow ? "sent; it takes effect when edge-queue answers" : !canAct() ? "edge-queue is offline" : "";
  }
}

$("d-cancel").addEventListener("click", () => page.detailId && jobAction(page.detailId));
$("d-retry").addEventListener("click", () => page.detailId && jobAction(page.detailId));
