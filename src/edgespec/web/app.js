// The edgespec page: a chat over the OpenAI endpoints, and a live view of the ring
// (/v1/ring/events: the ring's layout, the current token tree, per-generation statistics).
// No build step and no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const SVGNS = "http://www.w3.org/2000/svg";
const state = {
  messages: [],        // the conversation sent with every request
  controller: null,    // AbortController of the answer being streamed
  history: [],         // per-generation statistics of this server's session
  tree: { lap: null, nodes: new Map(), bonus: null },
  snapshot: null,
};

function svg(tag, attrs, text) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// ------------------------------------------------------------------------------- chat

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "body";
  div.appendChild(body);
  const meta = document.createElement("div");
  meta.className = "meta";
  div.appendChild(meta);
  setText(div, role, text);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setText(div, role, text) {
  const body = div.querySelector(".body");
  if (role === "assistant") body.innerHTML = Markdown.render(text);
  else body.textContent = text;
}

async function* sseEvents(response) {
  // Server-sent events from a fetch() body: yields each "data:" payload.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  $("stop").disabled = false;
  $("send").disabled = true;
  let answer = "";
  let usage = null;
  let finish = null;
  const t0 = performance.now();
  let first = null;
  let pending = false;
  const paint = () => { pending = false; setText(div, "assistant", answer); $("messages").scrollTop = $("messages").scrollHeight; };
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", signal: controller.signal, credentials: "same-origin",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        messages: state.messages, stream: true, stream_options: { include_usage: true },
        temperature: Number($("temperature").value), spec: $("spec").value, max_tokens: 1024,
      }),
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({ error: { message: resp.statusText } }));
      throw new Error(err.error ? err.error.message : resp.statusText);
    }
    for await (const data of sseEvents(resp)) {
      if (data === "[DONE]") break;
      const ev = JSON.parse(data);
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) usage = ev.usage;
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        if (first === null) first = performance.now();
        answer += choice.delta.content;
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    paint();
    const secs = (performance.now() - t0) / 1000;
    const n = usage ? usage.completion_tokens : null;
    div.querySelector(".meta").textContent =
      (n !== null ? `${n} tokens · ${(n / secs).toFixed(1)} tok/s (incl. prompt) · ` : "") +
      (first !== null ? `first token ${Math.round(first - t0)} ms · ` : "") + `finish: ${finish}`;
  } catch (e) {
    paint();
    if (e.name === "AbortError") {
      div.querySelector(".meta").textContent = "stopped";
    } else {
      div.classList.add("error");
      div.querySelector(".meta").textContent = "error: " + e.message;
    }
  } finally {
    div.classList.remove("streaming");
    div.classList.add("done");
    state.messages.push({ role: "assistant", content: answer });
    state.controller = null;
    $("stop").disabled = true;
    $("send").disabled = false;
  }
}

function setupChat() {
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    $("messages").innerHTML = "";
  });
  $("temperature").addEventListener("input", () => { $("temperature-value").textContent = $("temperature").value; });
}

// --------------------------------------------------------------------------- ring view

const fmtBytes = (b) => (b == null ? "?" : b >= 1 << 30 ? (b / (1 << 30)).toFixed(1) + " GiB" : Math.round(b / (1 << 20)) + " MiB");
const fmtMs = (x) => (x == null ? "–" : x < 10 ? x.toFixed(1) + " ms" : Math.round(x) + " ms");

function drawRing(snap) {
  const box = $("ring");
  box.innerHTML = "";
  const stages = snap.stages || [];
  const w = 168, h = 78, gap = 30;
  const items = [{ head: true }, ...stages];
  const width = items.length * (w + gap) + 10;
  const root = svg("svg", { viewBox: `0 0 ${width} ${h + 60}`, role: "img", "aria-label": "ring" });
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
  marker.appendChild(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#6b6b70" }));
  defs.appendChild(marker);
  root.appendChild(defs);
  // Per-link transfer time of the last answer (lap timing: node to node, encode to decode).
  const links = (snap.lap_timing && snap.lap_timing.links) || [];
  const linkMs = (from, to) => {
    const l = links.find((x) => String(x.from) === String(from) && String(x.to) === String(to));
    return l ? l.transfer_ms : null;
  };
  items.forEach((it, i) => {
    const x = 5 + i * (w + gap), y = 5;
    const g = svg("g", { class: "node" + (it.head ? " head" : "") + (it.alive === false ? " lost" : ""), transform: `translate(${x},${y})` });
    g.appendChild(svg("rect", { width: w, height: h, rx: 6 }));
    const lines = it.head
      ? [["title", "head"], ["", `drafter: ${snap.drafter || "none"}`.slice(0, 26)], ["", `spec: ${snap.spec}`],
         ["", `model: ${(snap.model || "").slice(0, 19)}`]]
      : [["title", `stage ${it.stage} · layers ${it.layers[0]}–${it.layers[1] - 1}`],
         ["", `${it.node}`.slice(0, 24)],
         ["", `${(it.backend || "?").toUpperCase()} · ${fmtBytes(it.free_ram)} free`],
         ["", `compute ${fmtMs(it.ms_per_batch)}/batch`]];
    lines.forEach(([cls, t], j) => g.appendChild(svg("text", { x: 8, y: 17 + j * 16, class: cls }, t)));
    if (!it.head) g.setAttribute("data-stage", it.stage);
    root.appendChild(g);
    if (i + 1 < items.length) {
      root.appendChild(svg("path", { class: "link", d: `M ${x + w} ${y + h / 2} L ${x + w + gap - 2} ${y + h / 2}` }));
      const t = linkMs(it.head ? "head" : it.stage, items[i + 1].stage);
      if (t != null) {
        root.appendChild(svg("text", { class: "link-label link-ms", x: x + w + 1, y: y + h / 2 - 5 }, fmtMs(t)));
      }
    }
    if (!it.head && it.rtt_ms != null) {
      root.appendChild(svg("text", { class: "link-label", x: x + 4, y: y + h + 14 }, `head ⇄ node ${fmtMs(it.rtt_ms)}`));
    }
  });
  // The lap closes at the head: the last stage's targets return to it.
  const xEnd = 5 + (items.length - 1) * (w + gap) + w / 2;
  root.appendChild(svg("path", { class: "link", d: `M ${xEnd} ${h + 5} L ${xEnd} ${h + 45} L ${5 + w / 2} ${h + 45} L ${5 + w / 2} ${h + 7}` }));
  const back = stages.length ? linkMs(stages[stages.length - 1].stage, "head") : null;
  root.appendChild(svg("text", { class: "link-label", x: w, y: h + 40 },
    "target tokens back to the head" + (back != null ? ` (${fmtMs(back)})` : "")));
  box.appendChild(root);
  const rec = snap.recoveries || [];
  $("ring-note").textContent = `${stages.length} stage(s)` +
    (rec.length ? ` · recovered ${rec.length}× (last: ${rec[rec.length - 1].error})` : "") +
    (snap.serving ? " · answering" : "") + (snap.queued ? ` · ${snap.queued} queued` : "");
}

// The speculation menu lists the modes this ring runs (``modes`` of its snapshot, from the
// server's one registry of modes); the choice made is kept while it is still offered.
function fillModes(modes) {
  const select = $("spec");
  if (!Array.isArray(modes) || !modes.length) return;
  const have = Array.from(select.options, (o) => o.value);
  if (have.join() === modes.join()) return;
  const chosen = select.value;
  select.replaceChildren(...modes.map((m) => {
    const o = document.createElement("option");
    o.value = m; o.textContent = m;
    return o;
  }));
  select.value = modes.includes(chosen) ? chosen : modes[0];
}

function applySnapshot(snap) {
  state.snapshot = snap;
  $("model").textContent = snap.model ? `${snap.model} · ${(snap.stages || []).length} stage(s)` : "";
  const up = snap.status === "up";
  $("ring-state").textContent = up ? "ring up" : "ring down";
  $("ring-state").className = "badge " + (up ? "up" : "down");
  const banner = $("down");
  if (up) { banner.hidden = true; } else {
    banner.hidden = false;
    banner.innerHTML = "<strong>The ring is down.</strong> " + Markdown.escape(snap.message || "") +
      (snap.hint ? "<br>To bring it up: <code>" + Markdown.escape(snap.hint) + "</code>" : "");
  }
  fillModes(snap.modes);
  drawRing(snap);
  if (snap.history) { state.history = snap.history.slice(); drawCharts(); }
}

function serverGone() {
  $("ring-state").textContent = "server unreachable";
  $("ring-state").className = "badge down";
  const banner = $("down");
  banner.hidden = false;
  banner.innerHTML = "<strong>The server is not answering.</strong> Start it with " +
    "<code>edgespec serve</code> (it attaches to the ring brought up by <code>edgespec ring up</code>, " +
    "or starts a local one with <code>--local 2</code>); this page reconnects by itself.";
}

// --------------------------------------------------------------------------- tree view

function applyTreeEvents(events) {
  const t = state.tree;
  for (const ev of events) {
    if (ev.lap !== t.lap && (ev.e === "rows" || ev.e === "plain")) {
      t.lap = ev.lap; t.nodes = new Map(); t.bonus = null; t.decided = false;
    }
    if (ev.lap !== t.lap) continue;
    if (ev.e === "rows") {
      for (const [node, parent, , text] of ev.rows) {
        if (!t.nodes.has(node)) t.nodes.set(node, { parent, text, status: node === 0 ? "root" : "inflight" });
      }
    } else if (ev.e === "plain") {
      t.nodes.set(0, { parent: -1, text: ev.root_text, status: "root" });
      t.bonus = { parent: 0, text: ev.text };
      t.decided = true;
    } else if (ev.e === "verify" || ev.e === "decide") {
      for (const n of ev.accepted) { const x = t.nodes.get(n); if (x && n !== 0) x.status = "accepted"; }
      for (const n of ev.rejected || []) { const x = t.nodes.get(n); if (x) x.status = "rejected"; }
      if (ev.e === "decide") {
        const on = new Set(ev.accepted);
        for (const [n, x] of t.nodes) if (n !== 0 && !on.has(n)) x.status = "rejected";
        t.bonus = { parent: ev.accepted[ev.accepted.length - 1], text: ev.bonus_text };
        t.decided = true;
      }
    }
  }
}

function drawTree() {
  const t = state.tree;
  const box = $("tree");
  if (!t.nodes.size) return;
  const all = new Map(t.nodes);
  if (t.bonus) all.set("bonus", { parent: t.bonus.parent, text: t.bonus.text, status: "bonus" });
  const depth = new Map();
  const depthOf = (n) => {
    if (depth.has(n)) return depth.get(n);
    const x = all.get(n);
    const d = x && all.has(x.parent) ? depthOf(x.parent) + 1 : 0;
    depth.set(n, d);
    return d;
  };
  // Long accepted paths (flow steps can accept a hundred tokens) are elided but for their
  // last few rows, so the frontier (in flight, just decided) stays in view.
  let deepest = 0;
  for (const [n, x] of all) if (x.status === "accepted") deepest = Math.max(deepest, depthOf(n));
  const KEEP = 4;
  const cut = Math.max(0, deepest - KEEP);
  const shown = new Map([...all].filter(([n]) => depthOf(n) >= cut).map(([n, x]) => [n, { ...x }]));
  if (cut > 0) {
    for (const [, x] of shown) if (!shown.has(x.parent)) x.parent = "elided";
    shown.set("elided", { parent: null, text: `… ${cut} accepted`, status: "accepted" });
  }
  const kids = new Map();
  for (const [n, x] of shown) {
    if (!kids.has(x.parent)) kids.set(x.parent, []);
    kids.get(x.parent).push(n);
  }
  const pos = new Map();
  let row = 0, maxDepth = 0;
  const place = (n, d) => {
    const c = kids.get(n) || [];
    maxDepth = Math.max(maxDepth, d);
    if (!c.length) { pos.set(n, [d, row++]); return; }
    const first = row;
    c.forEach((k) => place(k, d + 1));
    pos.set(n, [d, (first + row - 1) / 2]);
  };
  [...shown].filter(([, x]) => !shown.has(x.parent)).forEach(([n]) => place(n, 0));
  const bw = 62, bh = 18, dx = 76, dy = 22;
  const root = svg("svg", { width: (maxDepth + 1) * dx + 10, height: row * dy + 10 });
  for (const [n, x] of shown) {
    const p = pos.get(n), q = pos.get(x.parent);
    if (!p || !q) continue;
    root.appendChild(svg("path", { class: "t-edge", d: `M ${5 + q[0] * dx + bw} ${5 + q[1] * dy + bh / 2} L ${5 + p[0] * dx} ${5 + p[1] * dy + bh / 2}` }));
  }
  for (const [n, [d, r]] of pos) {
    const x = shown.get(n);
    const g = svg("g", { class: "t-" + x.status, transform: `translate(${5 + d * dx},${5 + r * dy})` });
    g.appendChild(svg("rect", { width: n === "elided" ? bw + dx - 8 : bw, height: bh, rx: 3 }));
    // Whitespace made visible: code answers are full of indentation tokens.
    const label = n === "elided" ? x.text : JSON.stringify(x.text || "").slice(1, -1).replace(/ /g, "·");
    g.appendChild(svg("text", { x: 4, y: 13 }, label.length > 9 && n !== "elided" ? label.slice(0, 8) + "…" : label));
    g.appendChild(svg("title", {}, `${x.status}: ${label}`));
    root.appendChild(g);
  }
  if (cut > 0) {  // the elided box is wider: shift everything else right by one column
    for (const g of root.querySelectorAll("g")) {
      const m = g.getAttribute("transform").match(/translate\(([\d.]+),([\d.]+)\)/);
      if (Number(m[1]) > 5) g.setAttribute("transform", `translate(${Number(m[1]) + dx - 8},${m[2]})`);
    }
    for (const e of root.querySelectorAll("path")) {
      e.setAttribute("d", e.getAttribute("d").replace(/M ([\d.]+) ([\d.]+) L ([\d.]+)/, (_, a, b, c) => `M ${Number(a) + dx - 8} ${b} L ${Number(c) + dx - 8}`));
    }
    root.setAttribute("width", (maxDepth + 2) * dx + 10);
  }
  box.innerHTML = "";
  box.appendChild(root);
  box.scrollLeft = box.scrollWidth;  // the frontier is on the right
  const counts = { accepted: 0, rejected: 0, inflight: 0 };
  for (const [, x] of t.nodes) if (x.status in counts) counts[x.status]++;
  $("tree-info").textContent = `lap ${t.lap} · ${counts.accepted} accepted, ${counts.rejected} rejected, ${counts.inflight} in flight`;
  box.dataset.lap = t.lap;
  box.dataset.updates = String(Number(box.dataset.updates || 0) + 1);
}

// ------------------------------------------------------------------------------ charts

function barChart(id, values, labels, fmt) {
  const el = $(id);
  el.innerHTML = "";
  const W = 300, H = 90, pad = 14;
  el.setAttribute("viewBox", `0 0 ${W} ${H}`);
  if (!values.length) { el.appendChild(svg("text", { x: 8, y: 40, class: "chart-label" }, "no answers yet")); return; }
  const max = Math.max(...values, 1e-9);
  const bw = (W - pad) / values.length;
  el.appendChild(svg("line", { class: "axis", x1: pad, x2: W, y1: H - pad, y2: H - pad }));
  values.forEach((v, i) => {
    const hgt = (H - 2 * pad) * (v / max);
    const r = svg("rect", { class: "bar", x: pad + i * bw + 1, y: H - pad - hgt, width: Math.max(1, bw - 2), height: hgt });
    r.appendChild(svg("title", {}, `${labels[i]}: ${fmt(v)}`));
    el.appendChild(r);
  });
  el.appendChild(svg("text", { class: "chart-label", x: pad, y: 10 }, `max ${fmt(max)} · last ${fmt(values[values.length - 1])}`));
  if (values.length <= 12) values.forEach((_, i) => el.appendChild(svg("text", { class: "chart-label", x: pad + i * bw + 2, y: H - 2 }, labels[i])));
}

function drawCharts() {
  const h = state.history.slice(-40);
  const idx = h.map((_, i) => String(i + 1));
  barChart("chart-tps", h.map((g) => g.tokens_per_s), idx, (v) => v.toFixed(1));
  barChart("chart-tpl", h.map((g) => g.tokens_per_lap), idx, (v) => v.toFixed(2));
  barChart("chart-ttft", h.map((g) => g.ttft_ms || 0), idx, (v) => Math.round(v) + "");
  // Acceptance by depth over the session: the share of steps that kept a drafted token at
  // depth d (a step gaining k tokens accepted depths 1..k-1; the k-th is the bonus).
  const hist = {};
  for (const g of state.history) for (const [k, c] of Object.entries(g.accepted_hist || {})) hist[k] = (hist[k] || 0) + c;
  const steps = Object.values(hist).reduce((a, b) => a + b, 0);
  const depth = [];
  const maxK = Math.max(0, ...Object.keys(hist).map(Number));
  for (let d = 1; d < Math.min(maxK, 13); d++) {
    let n = 0;
    for (const [k, c] of Object.entries(hist)) if (Number(k) > d) n += c;
    depth.push(steps ? n / steps : 0);
  }
  barChart("chart-depth", depth, depth.map((_, i) => String(i + 1)), (v) => (100 * v).toFixed(0) + "%");
}

// -------------------------------------------------------------------------- live feed

function connectLive() {
  const es = new EventSource("v1/ring/events", { withCredentials: true });
  let treeDirty = false;
  es.addEventListener("ring", (ev) => applySnapshot(JSON.parse(ev.data)));
  es.addEventListener("tree", (ev) => {
    applyTreeEvents(JSON.parse(ev.data));
    if (!treeDirty) { treeDirty = true; requestAnimationFrame(() => { treeDirty = false; drawTree(); }); }
  });
  es.addEventListener("gen", (ev) => { state.history.push(JSON.parse(ev.data)); drawCharts(); });
  es.onerror = () => { if (es.readyState !== EventSource.OPEN) serverGone(); };
}

setupChat();
drawCharts();
connectLive();
