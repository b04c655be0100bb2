// The queue page's file picker (the browse request over the media roots), the kind and its
// options, and the submit of the chosen files.
"use strict";

$("add").addEventListener("click", () => {
  page.picker.selected.clear();
  updatePicked();
  $("submit-msg").textContent = "";
  $("picker").showModal();
  browse(page.picker.path);
});

function browseBody(path, after) {
  return { ...(path ? { path } : {}), ...(after ? { after } : {}), limit: 200 };
}

async function browse(path, after) {
  const p = page.picker;
  $("pick-error").hidden = true;
  let data;
  try {
    data = await ask("browse", browseBody(path, after), () => $("picker").open);
  } catch (e) {
    if (e.stale) return;
    $("pick-error").textContent = `${e.code || "error"}: ${e.message}`;
    $("pick-error").hidden = false;
    if (path && !after) return browse(null);
    return;
  }
  if (data.reading !== undefined) {
    // a large folder is read a piece per request (docs/topics.md, "browse"): ask again
    return browse(path, after);
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

// A folder is a button (it takes focus and opens with Enter); a file is a labelled checkbox.
function entryRow(e) {
  const full = join(page.picker.path, e.name);
  if (e.type === "dir") {
    const open = el("button", { type: "button", class: "ename", text: e.name, "aria-label": `Open folder ${e.name}` });
    const li = el("li", { class: "dir", "data-path": full },
      el("span", { class: "icon icon-dir", "aria-hidden": "true" }), open, el("span", { class: "esize", text: "" }));
    li.addEventListener("click", () => browse(full));
    return li;
  }
  const box = el("input", { type: "checkbox", "data-path": full, id: `f-${Math.random().toString(36).slice(2, 10)}` });
  box.checked = page.picker.selected.has(full);
  box.addEventListener("change", () => {
    if (box.checked) page.picker.selected.add(full); else page.picker.selected.delete(full);
    updatePicked();
  });
  return el("li", { class: "file" }, box, el("label", { class: "ename", for: box.id, text: e.name }),
    el("span", { class: "esize", text: bytes(e.size) }));
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

// Every file of the folder, also those of pages not shown yet: the rest are read first.
$("pick-all").addEventListener("click", async () => {
  const p = page.picker, folder = p.path;
  $("pick-all").disabled = true;
  try {
    let after = p.after;
    while (after && $("picker").open && p.path === folder) {
      const data = await ask("browse", browseBody(folder, after), () => $("picker").open && p.path === folder);
      for (const e of data.entries) if (e.type !== "dir") p.selected.add(join(folder, e.name));
      after = data.next_after;
    }
    for (const box of $("entries").querySelectorAll("input[type=checkbox]")) {
      box.checked = true;
      p.selected.add(box.dataset.path);
    }
  } catch (e) {
    if (!e.stale) { $("pick-error").textContent = `${e.code || "error"}: ${e.message}`; $("pick-error").hidden = false; }
  } finally {
    $("pick-all").disabled = false;
    updatePicked();
  }
});

function updatePicked() {
  const n = page.picker.selected.size;
  $("pick-count").textContent = `${n} selected`;
  const kind = page.kinds[$("kind").value];
  $("submit").disabled = !canAct() || !(n || (kind && !kind.needs_input));
  $("submit").title = canAct() ? "" : "edge-queue is offline";
}

function renderKinds() {
  const names = Object.keys(page.kinds);
  const filter = $("f-kind");
  if (filter.options.length !== names.length + 1) {
    filter.replaceChildren(el("option", { value: "", text: "All kinds" }), ...names.map((n) => el("option", { value: n, text: n })));
    filter.value = page.view.filter.kind;
  }
  const sel = $("kind");
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
      // none ticked is the default (for formats: every one), and says so
      input = el("span", { class: "choices", "data-option": name, "data-type": "choices", role: "group", "aria-label": label },
        ...p.items.enum.map((v) => el("label", { class: "check" }, el("input", { type: "checkbox", value: v }), v)),
        el("span", { class: "muted hint", text: `none ticked: ${!Array.isArray(p.default) ? "the default"
          : p.default.length === p.items.enum.length ? "all of them" : p.default.join(", ")}` }));
      box.append(el("div", { class: "option", title: hint }, el("span", { text: label }), input));
      continue;
    }
    if (p.enum) {
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
  if (!canAct()) return;
  const inputs = [...page.picker.selected];
  const body = { kind: $("kind").value, options: optionValues() };
  if (inputs.length === 1) body.input = inputs[0];
  else if (inputs.length > 1) body.inputs = inputs;
  $("submit").disabled = true;
  $("submit-msg").textContent = "submitting…";
  try {
    const data = await act("submit", body, {
      onSlow: () => { $("submit-msg").textContent = "sent; waiting for edge-queue (it takes effect when edge-queue answers)"; },
    });
    for (const j of data.jobs) if (!page.jobs.has(j.job_id)) await ask("get", { job_id: j.job_id }).then(upsert).catch(() => {});
    for (const j of data.jobs) { const job = page.jobs.get(j.job_id); if (job) onJobEvent({ type: "new", job }); }
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
