/* kv-harness report page: renders the JSON in <script id="data"> (harness/report/html.py) as HTML and inline SVG.
   No library, no network. Block kinds: chart, table, heatmaps, intervals (harness/page_blocks.py). */
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const RUNS = D.overview.runs;
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
                   "#393b79", "#e6550d", "#31a354", "#756bb1", "#843c39", "#de9ed6", "#636363", "#8ca252", "#3182bd", "#ad494a"];
  const SVGNS = "http://www.w3.org/2000/svg";
  const colours = {};
  function colour(line) {
    if (line === "full") return "#000";
    if (!(line in colours)) colours[line] = PALETTE[Object.keys(colours).length % PALETTE.length];
    return colours[line];
  }
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "on") for (const [ev, f] of Object.entries(v)) e.addEventListener(ev, f);
      else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const k of kids.flat()) if (k !== null && k !== undefined) e.append(k);
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) e.setAttribute(k, v);
    return e;
  }
  function fmt(v, d) {
    if (v === null || v === undefined || v === "") return "–";
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(d === undefined ? 3 : d);
    return String(v);
  }
  const protoLabel = p => ({query_aware: "query-aware", query_agnostic: "query-agnostic"}[p] || p);
  const dashOf = p => (p === "query_agnostic" || p === "query-agnostic") ? "6 4" : null;

  // ---------------------------------------------------------------- item drawer
  let runItems = null;  // run id -> [[key, score]]
  function itemsOfRun(id) {
    if (!runItems) {
      runItems = {};
      for (const [key, item] of Object.entries(D.items))
        for (const s of item.settings) (runItems[s.run] = runItems[s.run] || []).push([key, s.score]);
    }
    return runItems[id] || [];
  }
  const drawer = el("aside", {id: "drawer", class: "drawer hidden", "aria-live": "polite"});
  function openDrawer(...content) {
    drawer.replaceChildren(el("button", {class: "close", title: "close", on: {click: () => drawer.classList.add("hidden")}}, "×"), ...content);
    drawer.classList.remove("hidden");
    drawer.scrollTop = 0;
  }
  function runName(id) {
    const r = RUNS[id];
    return r ? `${r.setting} · ${protoLabel(r.protocol)}` : "?";
  }
  function showList(title, entries, highlightRun) {
    const list = el("ul", {class: "itemlist"});
    for (const [key, score] of entries) {
      const item = D.items[key];
      if (!item) continue;
      list.append(el("li", {}, el("a", {href: "#", "data-item": key, on: {click: e => { e.preventDefault(); showItem(key, highlightRun); }}},
        item.title), score === undefined ? "" : ` — score ${fmt(score)}`));
    }
    openDrawer(el("h2", {text: title}), entries.length ? list : el("p", {text: "No item of this run is recorded."}));
  }
  function showRun(id) { showList(`Items of ${runName(id)} (${RUNS[id] ? RUNS[id].rel : ""})`, itemsOfRun(id), id); }
  function keptBars(kept) {
    const box = el("div", {class: "kept"});
    for (const [span, layers] of Object.entries(kept || {})) {
      if (!layers.length) { box.append(el("div", {class: "span"}, el("span", {class: "spanname", text: `${span}: all kept (nothing compressed)`}))); continue; }
      const w = 4, h = 22, s = svg("svg", {width: layers.length * w + 2, height: h + 2, class: "bars"});
      layers.forEach((v, i) => {
        if (v === null) { s.append(svg("rect", {x: i * w + 1, y: h - 2, width: w - 1, height: 2, fill: "#ccc"})); return; }
        const bh = Math.max(1, v / 100 * h);
        const r = svg("rect", {x: i * w + 1, y: h - bh + 1, width: w - 1, height: bh, fill: v >= 99 ? "#2ca02c" : v > 0 ? "#e6a100" : "#d62728"});
        r.append(svg("title", {})); r.lastChild.textContent = `layer ${i}: ${v}% of the ${span} kept`;
        s.append(r);
      });
      const mean = layers.filter(v => v !== null);
      box.append(el("div", {class: "span"}, el("span", {class: "spanname", text: `${span} ${mean.length ? Math.round(mean.reduce((a, b) => a + b, 0) / mean.length) + "%" : ""}`}), s));
    }
    return box;
  }
  function showItem(key, highlightRun) {
    const item = D.items[key];
    if (!item) return;
    const ctx = el("div", {class: "context"});
    if (!item.context.length) ctx.append(el("p", {class: "muted", text: "The prompt was not logged (run with task.log_prompts=true to see it here)."}));
    for (const w of item.context) {
      const pre = el("pre", {class: "window"});
      let at = 0;
      for (const [a, b] of w.marks) { pre.append(w.text.slice(at, a), el("mark", {text: w.text.slice(a, b)})); at = b; }
      pre.append(w.text.slice(at));
      ctx.append(el("div", {class: "winhead", text: `characters ${w.start}-${w.end} of ${w.of}`}), pre);
    }
    const filter = el("input", {type: "search", placeholder: "filter settings", class: "filter"});
    const body = el("tbody");
    const settings = item.settings.slice().sort((a, b) => {
      const ra = RUNS[a.run] || {}, rb = RUNS[b.run] || {};
      return (ra.protocol || "").localeCompare(rb.protocol || "") || ((ra.method !== "full") - (rb.method !== "full")) ||
        (ra.setting || "").localeCompare(rb.setting || "", undefined, {numeric: true});
    });
    for (const s of settings) {
      const r = RUNS[s.run] || {};
      body.append(el("tr", {class: s.run === highlightRun ? "hl" : null, "data-run": s.run},
        el("td", {text: r.setting || "?"}), el("td", {text: protoLabel(r.protocol)}), el("td", {class: "num", text: fmt(s.score)}),
        el("td", {class: "resp"}, el("pre", {text: s.response || "(empty)"})), el("td", {}, keptBars(s.kept))));
    }
    filter.addEventListener("input", () => {
      const q = filter.value.toLowerCase();
      for (const tr of body.children) tr.style.display = tr.textContent.toLowerCase().includes(q) ? "" : "none";
    });
    openDrawer(el("h2", {text: item.title}),
      el("p", {}, el("b", {text: "Reference: "}), el("span", {class: "ref", text: item.reference || "–"})),
      el("h3", {text: "Prompt around the needle or answer"}), ctx,
      el("h3", {text: `Every setting of this item (${settings.length})`}), filter,
      el("table", {class: "items"}, el("thead", {}, el("tr", {}, ...["Setting", "Protocol", "Score", "Response", "Kept per layer"].map(h => el("th", {text: h})))), body));
  }

  // ---------------------------------------------------------------- chart
  function chart(block) {
    const W = 640, H = 360, M = {l: 56, r: 16, t: 16, b: 44};
    const hidden = new Set();
    const wrap = el("div", {class: "chart"});
    const plot = el("div", {class: "plot"});
    const legend = el("div", {class: "legend"});
    let current = {series: block.series, hlines: block.hlines};
    const names = () => [...new Set([...current.hlines.map(h => h.line), ...current.series.map(s => s.line)])];
    function draw() {
      const ser = current.series, hl = current.hlines;
      const xs = ser.flatMap(s => s.points.map(p => p.x)), ys = ser.flatMap(s => s.points.flatMap(p => [p.y, p.lo, p.hi]))
        .concat(hl.flatMap(h => [h.y, h.lo, h.hi])).concat(block.gpu ? [block.gpu] : []).filter(v => v !== null && v !== undefined);
      let x0 = xs.length ? Math.min(...xs) : 0, x1 = xs.length ? Math.max(...xs) : 1;
      if (block.xmin !== null && block.xmin !== undefined) x0 = Math.min(x0, block.xmin);
      const logx = block.logx && x0 > 0;
      const tx = v => logx ? Math.log2(v) : v;
      let a = tx(x0), b = tx(x1); if (a === b) { a -= 1; b += 1; }
      let y0 = Math.min(0, ...ys), y1 = ys.length ? Math.max(...ys) : 1; if (y1 <= y0) y1 = y0 + 1;
      y1 = y1 + (y1 - y0) * 0.05;
      const X = v => M.l + (tx(v) - a) / (b - a) * (W - M.l - M.r), Y = v => H - M.b - (v - y0) / (y1 - y0) * (H - M.t - M.b);
      const s = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "chartsvg", role: "img"});
      const ticks = 5;
      for (let i = 0; i <= ticks; i++) {
        const v = y0 + (y1 - y0) * i / ticks, y = Y(v);
        s.append(svg("line", {x1: M.l, x2: W - M.r, y1: y, y2: y, class: "grid"}));
        const t = svg("text", {x: M.l - 6, y: y + 4, "text-anchor": "end", class: "tick"}); t.textContent = fmt(v, y1 > 10 ? 0 : 2); s.append(t);
      }
      const xt = [...new Set(xs)].sort((p, q) => p - q);
      const xticks = xt.length <= 12 ? xt : Array.from({length: 6}, (_, i) => logx ? 2 ** (a + (b - a) * i / 5) : a + (b - a) * i / 5);
      for (const v of xticks) {
        const t = svg("text", {x: X(v), y: H - M.b + 16, "text-anchor": "middle", class: "tick"}); t.textContent = fmt(v, 2); s.append(t);
      }
      const xl = svg("text", {x: (M.l + W - M.r) / 2, y: H - 8, "text-anchor": "middle", class: "axis"}); xl.textContent = block.xlabel; s.append(xl);
      const yl = svg("text", {x: 14, y: (M.t + H - M.b) / 2, transform: `rotate(-90 14 ${(M.t + H - M.b) / 2})`, "text-anchor": "middle", class: "axis"});
      yl.textContent = block.ylabel; s.append(yl);
      for (const h of hl) {
        if (hidden.has(h.line)) continue;
        if (h.lo !== null && h.hi !== null && h.lo !== undefined)
          s.append(svg("rect", {x: M.l, width: W - M.l - M.r, y: Y(h.hi), height: Math.max(0.5, Y(h.lo) - Y(h.hi)), fill: "#000", "fill-opacity": 0.06}));
        const ln = svg("line", {x1: M.l, x2: W - M.r, y1: Y(h.y), y2: Y(h.y), stroke: "#000", "stroke-width": 1.5, "stroke-dasharray": dashOf(h.protocol) || "2 2",
          "data-line": h.line, class: "hline"});
        ln.append(svg("title", {})); ln.lastChild.textContent = `full · ${protoLabel(h.protocol)}: ${fmt(h.y)}`;
        s.append(ln);
      }
      if (block.gpu) {
        s.append(svg("line", {x1: M.l, x2: W - M.r, y1: Y(block.gpu), y2: Y(block.gpu), stroke: "#d62728", "stroke-width": 2, class: "gpu"}));
        const t = svg("text", {x: W - M.r - 4, y: Y(block.gpu) - 4, "text-anchor": "end", class: "tick gpu"}); t.textContent = `GPU ${block.gpu} GB`; s.append(t);
      }
      for (const se of ser) {
        if (hidden.has(se.line)) continue;
        const c = colour(se.line), band = se.points.filter(p => p.lo !== null && p.hi !== null && p.lo !== undefined);
        if (band.length > 1)
          s.append(svg("polygon", {points: band.map(p => `${X(p.x)},${Y(p.hi)}`).concat(band.slice().reverse().map(p => `${X(p.x)},${Y(p.lo)}`)).join(" "),
            fill: c, "fill-opacity": 0.12, "data-line": se.line, class: "band"}));
        s.append(svg("polyline", {points: se.points.map(p => `${X(p.x)},${Y(p.y)}`).join(" "), fill: "none", stroke: c, "stroke-width": 2,
          "stroke-dasharray": dashOf(se.protocol), "data-line": se.line, "data-protocol": se.protocol, class: "series"}));
        for (const p of se.points) {
          const hollow = se.protocol === "query_agnostic";  // markers tell the protocols apart where a line has one point
          const dot = svg("circle", {cx: X(p.x), cy: Y(p.y), r: 4, fill: hollow ? "#fff" : c, stroke: c, "stroke-width": 2, class: "pt", "data-run": p.run});
          dot.append(svg("title", {}));
          dot.lastChild.textContent = `${se.line} · ${protoLabel(se.protocol)}: x ${fmt(p.x)}, ${fmt(p.y)}` + (p.lo !== null && p.lo !== undefined ? ` [${fmt(p.lo)}, ${fmt(p.hi)}]` : "") +
            (p.run !== null && p.run !== undefined ? " — click for its items" : "");
          if (p.run !== null && p.run !== undefined) dot.addEventListener("click", () => showRun(p.run));
          s.append(dot);
        }
      }
      plot.replaceChildren(s);
    }
    function drawLegend() {
      legend.replaceChildren(el("div", {class: "legend-note", text: "solid line, filled dot: query-aware · dashed line, hollow dot: query-agnostic · black: the full cache · click to hide or show"}));
      for (const n of names()) {
        const item = el("label", {class: "lg" + (hidden.has(n) ? " off" : ""), "data-line": n},
          el("input", {type: "checkbox", checked: hidden.has(n) ? null : "checked"}), el("span", {class: "swatch", style: `background:${colour(n)}`}), n);
        item.querySelector("input").addEventListener("change", e => { e.target.checked ? hidden.delete(n) : hidden.add(n); item.classList.toggle("off", !e.target.checked); draw(); });
        legend.append(item);
      }
    }
    if (block.variants) {
      const sel = el("select", {class: "variant"});
      for (const k of Object.keys(block.variants)) sel.append(el("option", {value: k, text: k}));
      sel.addEventListener("change", () => { const v = block.variants[sel.value]; current = v || {series: block.series, hlines: block.hlines}; drawLegend(); draw(); });
      wrap.append(el("div", {class: "controls"}, "show: ", sel));
    }
    drawLegend(); draw();
    wrap.append(el("div", {class: "chartrow"}, plot, legend));
    return wrap;
  }

  // ---------------------------------------------------------------- table
  function table(block) {
    const t = el("table", {class: "sortable", "data-id": block.id || ""});
    const body = el("tbody");
    let rows = block.rows.slice(), sortCol = -1, asc = true;
    const colItems = block.colItems || {};
    function fill() {
      body.replaceChildren(...rows.map(r => {
        const tr = el("tr", {class: r.run !== undefined && r.run !== null ? "clickable" : null, "data-run": r.run});
        r.cells.forEach((v, i) => {
          const col = block.columns[i] || {};
          const td = el("td", {class: (col.num ? "num" : "") + (colItems[i] ? " cellitems" : ""), text: fmt(v, typeof v === "number" && Math.abs(v) >= 10 ? 2 : 3)});
          if (colItems[i]) td.addEventListener("click", e => {
            e.stopPropagation();
            const keys = colItems[i];
            showList(`${col.title || col.name}: ${keys.length} item(s) — ${runName(r.run)} highlighted`,
              keys.map(k => [k, ((D.items[k] || {}).settings || []).find(s => s.run === r.run)?.score]), r.run);
          });
          tr.append(td);
        });
        if (r.run !== undefined && r.run !== null) tr.addEventListener("click", () => showRun(r.run));
        return tr;
      }));
    }
    const head = el("tr", {}, ...block.columns.map((c, i) => el("th", {title: (c.title ? c.title + " — " : "") + "click to sort", on: {click: () => {
      asc = sortCol === i ? !asc : true; sortCol = i;
      rows.sort((p, q) => {
        const a = p.cells[i], b = q.cells[i];
        if (a === null || a === undefined) return 1;
        if (b === null || b === undefined) return -1;
        const c = (typeof a === "number" && typeof b === "number") ? a - b : String(a).localeCompare(String(b), undefined, {numeric: true});
        return asc ? c : -c;
      });
      for (const th of head.children) th.classList.remove("asc", "desc");
      head.children[i].classList.add(asc ? "asc" : "desc");
      fill();
    }}}, c.name)));
    t.append(el("thead", {}, head), body);
    fill();
    return el("div", {class: "tablewrap"}, t);
  }

  // ---------------------------------------------------------------- heatmaps
  function heat(v) {  // 0 red, 0.5 yellow, 1 green
    if (v === null || v === undefined) return "#eee";
    const h = Math.round(120 * Math.max(0, Math.min(1, v)));
    return `hsl(${h},70%,50%)`;
  }
  function heatmaps(block) {
    const wrap = el("div", {class: "heatmaps"});
    const models = [...new Set(block.maps.map(m => m.model))];
    for (const m of block.maps) {
      const xs = [...new Set(m.cells.map(c => c.x))].sort((a, b) => a - b), ys = [...new Set(m.cells.map(c => c.y))].sort((a, b) => a - b);
      const card = el("div", {class: "hcard", "data-run": m.run});
      card.append(el("div", {class: "htitle", text: `${models.length > 1 ? m.model + " · " : ""}${m.label} · ${m.protocol}`}));
      const pair = el("div", {class: "hpair"});
      for (const [field, name] of [["score", "score"], ["kept", "needle kept"]]) {
        const cw = 26, ch = 18, L = 44, T = 4;
        const s = svg("svg", {width: L + xs.length * cw + 4, height: T + ys.length * ch + 30, class: "heat", "data-field": field});
        ys.forEach((y, j) => { const t = svg("text", {x: L - 4, y: T + j * ch + 13, "text-anchor": "end", class: "tick"}); t.textContent = y; s.append(t); });
        xs.forEach((x, i) => { const t = svg("text", {x: L + i * cw + cw / 2, y: T + ys.length * ch + 12, "text-anchor": "middle", class: "tick"}); t.textContent = x; s.append(t); });
        const cap = svg("text", {x: L + xs.length * cw / 2, y: T + ys.length * ch + 26, "text-anchor": "middle", class: "axis"}); cap.textContent = `${name} (depth %)`; s.append(cap);
        for (const c of m.cells) {
          const r = svg("rect", {x: L + xs.indexOf(c.x) * cw, y: T + ys.indexOf(c.y) * ch, width: cw - 1, height: ch - 1, fill: heat(c[field]), class: "cell",
            "data-key": c.keys[0]});
          r.append(svg("title", {})); r.lastChild.textContent = `${c.y} tokens, depth ${c.x}%: ${name} ${fmt(c[field])} — click for the item`;
          r.addEventListener("click", () => showItem(c.keys[0], m.run));
          s.append(r);
        }
        pair.append(s);
      }
      card.append(pair);
      wrap.append(card);
    }
    return wrap;
  }

  // ---------------------------------------------------------------- intervals (forest)
  function intervals(block) {
    const rows = block.rows, W = 640, L = 300, R = 20, h = 20, H = rows.length * h + 30;
    const vals = rows.flatMap(r => [r.lo, r.hi, r.est, 0]).filter(v => v !== null && v !== undefined);
    let a = Math.min(...vals), b = Math.max(...vals); if (a === b) { a -= 1; b += 1; }
    const X = v => L + (v - a) / (b - a) * (W - L - R);
    const s = svg("svg", {width: W, height: H, class: "forest"});
    s.append(svg("line", {x1: X(0), x2: X(0), y1: 0, y2: H - 24, stroke: "#888", "stroke-dasharray": "3 3"}));
    rows.forEach((r, i) => {
      const y = i * h + 12;
      const t = svg("text", {x: L - 8, y: y + 4, "text-anchor": "end", class: "tick"}); t.textContent = r.label; s.append(t);
      if (r.lo !== null && r.lo !== undefined) s.append(svg("line", {x1: X(r.lo), x2: X(r.hi), y1: y, y2: y, stroke: "#1f77b4", "stroke-width": 2}));
      const d = svg("circle", {cx: X(r.est), cy: y, r: 4, fill: "#1f77b4", class: "pt"});
      d.append(svg("title", {})); d.lastChild.textContent = `${fmt(r.est)} [${fmt(r.lo)}, ${fmt(r.hi)}]`;
      if (r.run !== null && r.run !== undefined) d.addEventListener("click", () => showRun(r.run));
      s.append(d);
    });
    for (const v of [a, 0, b]) { const t = svg("text", {x: X(v), y: H - 6, "text-anchor": "middle", class: "tick"}); t.textContent = fmt(v, 2); s.append(t); }
    return el("div", {class: "chart"}, s);
  }

  // ---------------------------------------------------------------- page
  const KINDS = {chart, table, heatmaps, intervals};
  function overview(o) {
    const sec = el("section", {id: "overview"}, el("h2", {text: "Overview"}));
    sec.append(el("p", {}, `${o.runs.length} run(s) · models: ${o.models.join(", ") || "–"} · protocols: ${o.protocols.map(protoLabel).join(", ") || "–"} · `,
      `intervals: ${o.bootstrap.resamples} bootstrap resamples, seed ${o.bootstrap.seed}.`));
    for (const v of o.versions) sec.append(el("p", {class: "versions", text: v.replace(/`/g, "")}));
    sec.append(el("h3", {text: "What can be compared"}),
      el("p", {class: "muted", text: "Runs of one set ran the same items under the same task settings, model and protocol: their scores compare. " +
        "Across sets, the line says what differs from the first set of the same task (old -> this set); a set of another protocol is compared only through the reuse gap."}));
    sec.append(table({id: "sets", columns: [{name: "Set", num: true}, {name: "Task"}, {name: "Model"}, {name: "Protocol"}, {name: "Runs", num: true}, {name: "Differs"}],
      rows: o.sets.map(s => ({cells: [s.set, s.task, s.model, protoLabel(s.protocol), s.runs.length, s.differs || "reference of its task"]}))}));
    const det = el("details", {}, el("summary", {text: `All ${o.runs.length} runs (click a row for its items)`}));
    det.append(table({id: "runs", columns: ["Run", "Task", "Model", "Setting", "Protocol", "Status", "Code", "Device", "Dtype"].map(n => ({name: n})),
      rows: o.runs.map(r => ({run: r.id, cells: [r.rel, r.task, r.model, r.setting, protoLabel(r.protocol), r.status, r.code, r.device, r.dtype]}))}));
    sec.append(det);
    return sec;
  }
  function render() {
    const app = document.getElementById("app");
    const nav = el("nav", {}, el("a", {href: "#overview", text: "Overview"}), ...D.sections.map(s => el("a", {href: `#${s.id}`, text: s.title})));
    const main = el("main", {}, overview(D.overview));
    for (const s of D.sections) {
      const sec = el("section", {id: s.id}, el("h2", {text: s.title}));
      if (s.intro) sec.append(el("p", {class: "intro", text: s.intro}));
      for (const b of s.blocks) {
        const box = el("div", {class: `block ${b.kind}`, "data-kind": b.kind});
        if (b.title) box.append(el("h3", {text: b.title}));
        box.append(KINDS[b.kind](b));
        sec.append(box);
      }
      for (const n of s.notes || []) sec.append(el("p", {class: "muted", text: n.replace(/`/g, "")}));
      main.append(sec);
    }
    if (!D.sections.length) main.append(el("p", {text: "No benchmark results were found under this folder."}));
    app.replaceChildren(el("header", {}, el("h1", {text: D.title}), el("div", {class: "muted", text: `from ${D.folder}`})), nav, main, drawer);
    document.body.setAttribute("data-ready", "1");
  }
  window.kvReport = {showItem, showRun, data: D};
  render();
})();
