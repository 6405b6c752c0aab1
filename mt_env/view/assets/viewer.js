// The trajectory viewer's page (built by mt_env/view/build.py): curves, the table of recorded episodes, and an
// episode token by token. The summary table is embedded (window.MTV_INDEX); each step's records are in
// data/<kind>_<step>.js, loaded with a <script> tag the first time one of its episodes is opened or searched.
"use strict";
(function () {
  const X = window.MTV_INDEX;
  const E = X.episodes;
  const N = E.step.length;
  const PAGE = 100;
  const ARRAYS = { "<i4": Int32Array, "u1": Uint8Array, "<f4": Float32Array };
  const $ = (id) => document.getElementById(id);
  const ENTITIES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" };
  const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ENTITIES[c]);
  const visible = (s) => s.replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u2192");  // as mt_env/render.py shows them
  const fmt = (x, d = 4) =>
    x === null || x === undefined ? "–" : Number.isInteger(x) ? String(x) : Number(x).toPrecision(d);

  // ------------------------------------------------------------------------------------------- step files
  const loaded = {}, waiting = {};
  window.MTV = {
    put(key, records) {
      loaded[key] = records;
      for (const w of waiting[key] || []) w.resolve(records);
      delete waiting[key];
    },
    loadedFiles: () => Object.keys(loaded),
  };
  function load(file) {
    const key = X.files[file];
    if (loaded[key]) return Promise.resolve(loaded[key]);
    const promise = new Promise((resolve, reject) => (waiting[key] = waiting[key] || []).push({ resolve, reject }));
    if (waiting[key].length === 1) {
      const s = document.createElement("script");
      s.src = "data/" + key + ".js";
      s.onerror = () => {
        for (const w of waiting[key] || []) w.reject(new Error("could not load " + s.src));
        delete waiting[key];
      };
      document.head.appendChild(s);
    }
    return promise;
  }
  function tokens(sample) {  // the per-token arrays, decoded once
    if (!sample._t) {
      sample._t = {};
      for (const [name, b64] of Object.entries(sample.tokens)) {
        const bin = atob(b64), bytes = new Uint8Array(bin.length);
        for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
        sample._t[name] = new ARRAYS[X.dtypes[name]](bytes.buffer);
      }
    }
    return sample._t;
  }

  // ------------------------------------------------------------------------------------------- curves
  function curve(name) {
    const [xs, ys] = X.metrics[name];
    const W = 300, H = 130, L = 38, B = 16;
    const vals = ys.filter((y) => y !== null);
    if (!vals.length) return;
    let lo = Math.min(...vals), hi = Math.max(...vals);
    if (lo === hi) { lo -= 0.5; hi += 0.5; }
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
    const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - 6);
    const py = (y) => 4 + (1 - (y - lo) / (hi - lo)) * (H - B - 8);
    const pts = xs.map((x, i) => (ys[i] === null ? null : [px(x).toFixed(1), py(ys[i]).toFixed(1)])).filter(Boolean);
    const marks = pts.length < 40 ? pts.map(([a, b]) => `<circle cx="${a}" cy="${b}" r="2"/>`).join("") : "";
    const div = document.createElement("div");
    div.className = "curve";
    div.dataset.metric = name;
    div.innerHTML = `<div class="name">${esc(name)}</div><svg width="${W}" height="${H}">` +
      `<text x="2" y="10">${fmt(hi)}</text><text x="2" y="${H - B}">${fmt(lo)}</text>` +
      `<text x="${L}" y="${H - 2}">step ${x0}</text><text x="${W - 60}" y="${H - 2}">step ${x1}</text>` +
      `<polyline points="${pts.map((p) => p.join(",")).join(" ")}"/>${marks}</svg>`;
    $("curves").appendChild(div);
  }
  function initCurves() {
    const names = Object.keys(X.metrics).sort();
    for (const name of X.curves) if (X.metrics[name]) curve(name);
    const add = $("add-curve");
    for (const name of names) add.add(new Option(name, name));
    add.onchange = () => { if (add.value) curve(add.value); add.value = ""; };
    if (!names.length) $("curves").textContent = "no metrics.jsonl in this run";
  }

  // ------------------------------------------------------------------------------------------- table
  const COLS = [  // [column, header, kind]
    ["kind", "kind"], ["step", "step", "num"], ["group", "group", "num"], ["index", "#", "num"], ["task", "task"],
    ["prompt", "prompt"], ["reward", "reward", "num"], ["success", "success"], ["turns", "turns", "num"],
    ["calls", "tool calls", "num"], ["errors", "tool errors", "num"], ["finish", "finish"], ["end", "end"],
    ["tokens", "tokens", "num"], ["trained", "trained", "num"], ["advantage", "advantage", "num"],
    ["mismatch", "max |mismatch|", "num"], ["answer", "last turn"],
  ];
  const value = (col, i) => {
    if (col === "kind") return X.kinds[E.file[i]];
    if (X.categories[col]) return X.categories[col][E[col][i]];
    return E[col][i];
  };
  const haystack = new Array(N);  // lower-cased summary text, made on first search
  const fullText = {};            // "file/pos" -> lower-cased tokens and tool results
  let rows = [], page = 0, sort = null, openRow = -1, searchRun = 0;

  function initTable() {
    $("table").tHead.innerHTML = "<tr>" + COLS.map(([c, h]) => `<th data-col="${c}">${esc(h)}</th>`).join("") + "</tr>";
    $("table").tHead.onclick = (ev) => {
      const col = ev.target.dataset.col;
      if (!col) return;
      sort = sort && sort.col === col ? { col, dir: -sort.dir } : { col, dir: 1 };
      applyFilters();
    };
    const form = $("filters");
    for (const k of [...new Set(X.kinds)]) form.kind.add(new Option(k, k));
    const reasons = new Set(X.categories.finish.flatMap((f) => f.split(",")).filter(Boolean));
    for (const r of reasons) form.finish.add(new Option(r, r));
    form.oninput = () => applyFilters();
    $("table").tBodies[0].onclick = (ev) => { const tr = ev.target.closest("tr"); if (tr) openEpisode(+tr.dataset.i); };
    $("prev").onclick = () => { page = Math.max(0, page - 1); renderTable(); };
    $("next").onclick = () => { page = Math.min(Math.floor((rows.length - 1) / PAGE), page + 1); renderTable(); };
  }
  function filtersOf(form) {
    const num = (name) => (form[name].value === "" ? null : Number(form[name].value));
    return {
      kind: form.kind.value, stepMin: num("stepMin"), stepMax: num("stepMax"), rewardMin: num("rewardMin"),
      rewardMax: num("rewardMax"), success: form.success.value, turnsMin: num("turnsMin"), turnsMax: num("turnsMax"),
      errors: form.errors.value, finish: form.finish.value, text: form.text.value.trim().toLowerCase(),
      full: form.full.checked,
    };
  }
  function passes(f, i) {
    const inRange = (v, lo, hi) => (lo === null || v >= lo) && (hi === null || v <= hi);
    if (f.kind && X.kinds[E.file[i]] !== f.kind) return false;
    if (!inRange(E.step[i], f.stepMin, f.stepMax) || !inRange(E.reward[i], f.rewardMin, f.rewardMax)) return false;
    if (!inRange(E.turns[i], f.turnsMin, f.turnsMax)) return false;
    if (f.success !== "" && E.success[i] !== +f.success) return false;
    if (f.errors === "0" && E.errors[i] > 0) return false;
    if (f.errors === "1" && E.errors[i] === 0) return false;
    if (f.finish && !X.categories.finish[E.finish[i]].split(",").includes(f.finish)) return false;
    return true;
  }
  function summaryText(i) {
    if (haystack[i] === undefined) {
      haystack[i] = [E.task[i], E.prompt[i], E.answer[i], value("end", i), value("state", i)].join("\n").toLowerCase();
    }
    return haystack[i];
  }
  function applyFilters() {
    const f = filtersOf($("filters"));
    let out = [];
    for (let i = 0; i < N; i++) if (passes(f, i)) out.push(i);
    const run = ++searchRun;
    if (f.text && f.full) return searchFullText(out, f.text, run);
    if (f.text) out = out.filter((i) => summaryText(i).includes(f.text));
    $("search-progress").textContent = "";
    show(out);
  }
  async function searchFullText(candidates, text, run) {  // loads the step files of the candidates, one at a time
    const files = [...new Set(candidates.map((i) => E.file[i]))];
    for (let k = 0; k < files.length; k++) {
      $("search-progress").textContent = `searching step files ${k + 1}/${files.length}…`;
      const records = await load(files[k]).catch(() => []);
      records.forEach((r, pos) => {
        const key = files[k] + "/" + pos;
        if (fullText[key] === undefined) fullText[key] = recordText(r).toLowerCase();
      });
      if (run !== searchRun) return;  // a newer search started
    }
    $("search-progress").textContent = `searched ${files.length} step files`;
    const found = (i) => summaryText(i).includes(text) || (fullText[E.file[i] + "/" + E.pos[i]] || "").includes(text);
    show(candidates.filter(found));
  }
  function recordText(r) {
    const parts = r.samples.map((s) => s.pieces.join(""));
    for (const t of r.turns) for (const o of t.observation) parts.push(o.content || "", o.error || "");
    return parts.join("\n");
  }
  function show(out) {
    if (sort) {
      const { col, dir } = sort;
      out.sort((a, b) => {
        const va = value(col, a), vb = value(col, b);
        return (va < vb ? -1 : va > vb ? 1 : 0) * dir || a - b;
      });
    }
    rows = out;
    page = 0;
    renderTable();
  }
  function renderTable() {
    const start = page * PAGE, shown = rows.slice(start, start + PAGE);
    $("count").textContent = `(${rows.length} of ${N})`;
    $("page").textContent = rows.length ? `${start + 1}–${start + shown.length} of ${rows.length}` : "no episodes";
    $("table").tBodies[0].innerHTML = shown.map((i) => `<tr data-i="${i}"${i === openRow ? ' class="open"' : ""}>` +
      COLS.map(([c, , kind]) => {
        const v = value(c, i);
        if (c === "success") return `<td class="${v ? "yes" : "no"}">${v ? "yes" : "no"}</td>`;
        return `<td${kind ? ' class="num"' : ""} title="${esc(v)}">${esc(kind ? fmt(v) : v)}</td>`;
      }).join("") + "</tr>").join("");
  }

  // ------------------------------------------------------------------------------------------- an episode
  let current = null;  // {i, record, records}
  function mode() { return document.querySelector("input[name=mode]:checked").value; }
  async function openEpisode(i) {
    openRow = i;
    renderTable();
    const records = await load(E.file[i]);
    current = { i, record: records[E.pos[i]], records };
    renderEpisode();
    $("episode-section").hidden = false;
    $("episode-section").scrollIntoView();
  }
  const FLOOR = { mismatch: 0.01, advantage: 1e-6 };  // below: noise, shown pale rather than at full colour
  function heatScale(records, m) {
    let scale = FLOOR[m];
    for (const r of records) for (const s of r.samples) {
      const t = tokens(s);
      for (let j = 0; j < t.ids.length; j++) {
        if (t.loss_mask[j]) scale = Math.max(scale, Math.abs(heatValue(t, j, m) || 0));
      }
    }
    return scale;
  }
  function heatValue(t, j, m) {
    if (m === "mismatch") return t.old_logprobs ? t.old_logprobs[j] - t.rollout_logprobs[j] : null;
    return t.advantages ? t.advantages[j] : null;
  }
  function tokenHtml(record, si, m, scale, compact) {
    const s = record.samples[si], t = tokens(s), out = [];
    for (const [kind, turn, start, end] of s.segments) {
      if (compact && turn < 0) continue;  // the group's shared prompt
      const cls = X.segments[kind];
      for (let j = start; j < end; j++) {
        let style = "", extra = (j - start) % 2 ? " o" : "";
        if (t.loss_mask[j]) extra += " tr";
        if (m !== "segments") {
          const v = t.loss_mask[j] ? heatValue(t, j, m) : null;
          if (v === null || Number.isNaN(v)) extra += " dim";
          else {
            const a = Math.min(1, Math.abs(v) / scale).toFixed(3);
            style = ` style="background:rgba(${v >= 0 === (m === "advantage") ? "44,160,44" : "214,39,40"},${a})"`;
          }
        }
        const text = esc(visible(s.pieces[j]));
        out.push(`<span class="t ${cls}${extra}" data-s="${si}" data-j="${j}"${style}>${text}</span>`);
      }
      if (kind === X.sampled) {
        const tr = record.turns.find((x) => x.index === turn && x.sample === si);
        if (tr && (tr.tool_calls.length || tr.observation.length)) out.push(toolHtml(tr));
      }
    }
    return out.join("");
  }
  function toolHtml(turn) {
    const calls = turn.tool_calls.map((c) => `<span class="call">→ ${esc(c.name)}(${esc(c.arguments)})</span>`);
    const answers = turn.observation.map((o) => {
      const ms = o.duration_s !== null && o.duration_s !== undefined ? (o.duration_s * 1000).toFixed(1) + " ms" : "";
      const meta = [o.name || o.role, ms, o.reward ? "reward " + fmt(o.reward) : ""].filter(Boolean).join(" · ");
      const err = o.error ? `<span class="err">${esc(o.error_kind || "error")}: ${esc(o.error)}</span>\n` : "";
      return `${err}← ${esc(o.content)} <span class="meta">(${esc(meta)})</span>`;
    });
    return `<span class="tool">${[...calls, ...answers].join("\n")}</span>`;
  }
  function renderEpisode() {
    const r = current.record, i = current.i, m = mode();
    const scale = m === "segments" ? 1 : heatScale([r], m);
    $("episode-title").textContent =
      `${X.kinds[E.file[i]]} step ${r.step} · group ${r.group} · sample ${r.index} · task ${r.task_id}`;
    const versions = [...new Set(r.turns.map((t) => t.policy_version))].join(", ");
    $("episode-facts").innerHTML = [
      `reward <b>${fmt(r.reward)}</b>`, `success <b>${r.success ? "yes" : "no"}</b>`, `state ${esc(r.state)}`,
      `end: ${esc(r.end_reason || r.error || "–")}`, `turns ${r.turns.length}`,
      `finish ${esc(r.finish_reasons.join(", ") || "–")}`, `policy version ${esc(versions || "–")}`,
      `trained tokens ${E.trained[i]} of ${E.tokens[i]}`,
    ].join(" · ");
    $("scale").textContent = m === "segments" ? ""
      : `colour scale: |value| ${fmt(scale, 3)} = full colour; grey: not trained or not recorded`;
    $("legend").innerHTML =
      Object.entries(X.legend).map(([c, name]) => `<span class="t ${c}">${esc(name)}</span>`).join("");
    $("episode").innerHTML = r.samples.map((s, si) =>
      (r.samples.length > 1 ? `<div class="samplehead">training sequence ${si + 1} of ${r.samples.length}</div>` : "") +
      `<div class="mtenv tokens" data-r="-1">${tokenHtml(r, si, m, scale, false)}</div>`).join("") ||
      `<p>no tokens: ${esc(r.error || "the episode never started")}</p>`;
  }
  function renderGroup() {
    const r = current.record, m = mode();
    const members = current.records.filter((x) => x.group === r.group).sort((a, b) => a.index - b.index);
    const scale = m === "segments" ? 1 : heatScale(members, m);
    $("episode").innerHTML = `<p>group ${r.group} of step ${r.step}: ${members.length} recorded samples of one task ` +
      `(the shared prompt left out)</p><div id="group">` + members.map((x) => {
        const k = current.records.indexOf(x);
        const adv = x.samples.length && tokens(x.samples[0]).advantages ? advantageOf(x) : null;
        return `<div class="member"><h3>#${x.index} · reward ${fmt(x.reward)} · advantage ${fmt(adv, 3)} · ` +
          `${x.success ? "success" : "no success"}</h3>` + x.samples.map((s, si) =>
          `<div class="mtenv tokens" data-r="${k}">${tokenHtml(x, si, m, scale, true)}</div>`).join("") + "</div>";
      }).join("") + "</div>";
  }
  function advantageOf(record) {
    let sum = 0, n = 0;
    for (const s of record.samples) {
      const t = tokens(s);
      for (let j = 0; j < t.ids.length; j++) if (t.loss_mask[j]) { sum += t.advantages[j]; n++; }
    }
    return n ? sum / n : null;
  }

  // ------------------------------------------------------------------------------------------- hover
  function tipText(record, si, j) {
    const s = record.samples[si], t = tokens(s);
    const seg = s.segments.find(([, , a, b]) => j >= a && j < b);
    const lines = [`token ${j} · id ${t.ids[j]} · ${X.legend[X.segments[seg[0]]]} · turn ${seg[1]}`,
      `text ${JSON.stringify(s.pieces[j])}`, `trained (loss mask) ${t.loss_mask[j] ? "yes" : "no"}`];
    if (seg[0] === X.sampled) {
      lines.push(`rollout logprob ${fmt(t.rollout_logprobs[j], 6)}`);
      if (t.old_logprobs) {
        const diff = t.old_logprobs[j] - t.rollout_logprobs[j];
        lines.push(`trainer logprob ${fmt(t.old_logprobs[j], 6)} · mismatch ${fmt(diff, 3)}`);
      }
      if (t.ref_logprobs) lines.push(`reference logprob ${fmt(t.ref_logprobs[j], 6)}`);
      if (t.advantages) lines.push(`advantage ${fmt(t.advantages[j], 5)}`);
      if (t.values) lines.push(`value ${fmt(t.values[j], 5)}`);
    }
    lines.push(`reward ${fmt(t.rewards[j], 4)}`);
    return lines.join("\n");
  }
  function initHover() {
    const tip = $("tip"), area = $("episode");
    area.onmouseover = (ev) => {
      const span = ev.target.closest("span.t");
      if (!span || !current) { tip.hidden = true; return; }
      const box = span.closest(".tokens"), k = +box.dataset.r;
      tip.textContent = tipText(k < 0 ? current.record : current.records[k], +span.dataset.s, +span.dataset.j);
      tip.hidden = false;
    };
    area.onmousemove = (ev) => {  // beside the pointer, on the side where it fits
      const box = tip.getBoundingClientRect();
      const x = ev.clientX + 14 + box.width > innerWidth ? ev.clientX - 14 - box.width : ev.clientX + 14;
      const y = ev.clientY + 14 + box.height > innerHeight ? ev.clientY - 14 - box.height : ev.clientY + 14;
      tip.style.left = Math.max(0, x) + "px";
      tip.style.top = Math.max(0, y) + "px";
    };
    area.onmouseleave = () => { tip.hidden = true; };
    for (const radio of document.querySelectorAll("input[name=mode]")) {
      radio.onchange = () => (document.getElementById("group") ? renderGroup() : renderEpisode());
    }
    $("group-button").onclick = renderGroup;
    $("close-button").onclick = () => { $("episode-section").hidden = true; openRow = -1; renderTable(); };
  }

  // ------------------------------------------------------------------------------------------- start
  $("run").textContent = `${X.run} · ${N} recorded episodes in ${X.files.length} step files`;
  initCurves();
  initTable();
  initHover();
  applyFilters();
  window.MTV.readyMs = performance.now();  // from navigation start to a usable page
  document.body.dataset.ready = "1";
})();
