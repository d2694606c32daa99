"""The HTML and JavaScript of the report page, live (pushed) or static (data embedded).

One page for both: the static export embeds the data ``collect`` returned in a
``<script type="application/json">`` element; the live page keeps ``api/stream``
open (server-sent events: each message carries the panels that changed, see
``_live``) and redraws only those in place (``Plotly.react``), each in a task of its own, the
panels in view first (a changed panel out of view is redrawn when it scrolls into view).
plotly.js is a file beside the page (``plotly.min.js``),
from the plotly package: nothing is loaded from the internet.
"""

from __future__ import annotations

import html
import json
import os
from typing import Any

PLOTLY_JS = "plotly.min.js"


def payload_location(url: str | None, payload: str | None, query: Any = None) -> str:
    """Where the store's payload is: the location the store recorded (``payload``,
    ``--payload`` or ``$TRAJSTORE_PAYLOAD_DIR``, when given, must name the same
    place), else (a store without a record) ``payload`` or the backend's default.
    Read through ``query`` (a read-only connection's), else a new one."""
    from trajstore.errors import PayloadLocationError
    from trajstore.inspect.sql import read_only
    from trajstore.payload import _home as home
    from trajstore.log._registry import backend_of
    from trajstore.store import resolve_url

    url = resolve_url(url)
    if query is None:
        with read_only(url) as q:
            return payload_location(url, payload, q)
    given, source = payload, "--payload"
    if given is None and os.environ.get(home.ENV) and backend_of(url).payload_dir_from_env:
        given, source = os.environ[home.ENV], f"${home.ENV}"
    rows = query(f"SELECT value FROM store_settings WHERE name = '{home.LOCATION}'").rows
    if not rows:
        return given if given is not None else backend_of(url).default_payload_dir(url)
    recorded = home.opened_form(rows[0][0], url)
    if given is not None and not home.same_place(given, recorded, url):
        raise PayloadLocationError(f"payload location {given!r} (from {source}) disagrees with {recorded!r}, the "
                                   "one this store recorded; leave it out")
    return given if given is not None else recorded


def store_label(url: str | None) -> str:
    """The store URL as the page shows it (no password)."""
    from sqlalchemy.engine import make_url

    from trajstore.store import resolve_url

    return make_url(resolve_url(url)).render_as_string(hide_password=True)

_CSS = """
body{font-family:system-ui,-apple-system,sans-serif;margin:0;color:#1d1d1f;background:#f4f5f7}
header{background:#1f2937;color:#fff;padding:10px 24px;display:flex;flex-wrap:wrap;gap:4px 24px;align-items:baseline}
header h1{font-size:20px;margin:0}
header .meta{font-size:13px;color:#cbd5e1}
#status{font-size:13px}
#status.error{color:#fecaca;font-weight:bold}
main{max-width:1280px;margin:0 auto;padding:12px 24px}
nav{font-size:13px;margin:8px 0 12px}
nav a{margin-right:12px;color:#2563eb;text-decoration:none}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 16px;margin:12px 0}
.card h2{font-size:16px;margin:0 0 4px}
.caption{font-size:13px;color:#4b5563;margin:0 0 6px}
.note{padding:28px;text-align:center;color:#6b7280;background:#f9fafb;border-radius:6px}
#empty{padding:48px;text-align:center}
#empty h2{font-size:22px}
table.summary{border-collapse:collapse;font-size:14px}
table.summary td,table.summary th{padding:3px 14px 3px 0;border-bottom:1px solid #eee;text-align:left}
details{font-size:12px;margin-top:4px}
details summary{cursor:pointer;color:#2563eb}
pre{background:#f6f8fa;padding:8px;white-space:pre-wrap;word-break:break-word;margin:4px 0;font-size:12px}
.grid{display:grid;grid-template-columns:1fr;gap:0}
.trace-link{margin-right:10px;color:#2563eb;font-family:ui-monospace,monospace}
"""

_JS = r"""
(function () {
  "use strict";
  const cfg = JSON.parse(document.getElementById("trajstore-config").textContent);
  const plotConfig = {displaylogo: false, responsive: true};
  const $ = (id) => document.getElementById(id);
  let refreshes = 0, redraws = 0;

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c) e.appendChild(c);
    return e;
  }

  function sqlDetails(sql) {
    const d = el("details", {}, el("summary", {text: "SQL"}));
    for (const q of sql) d.appendChild(el("pre", {text: q}));
    return d;
  }

  function renderSummary(data) {
    const box = $("summary");
    const rows = (data.summary_header ? [data.summary_header] : []).concat(data.summary);
    const shown = box.querySelectorAll("table.summary tr");
    if (!data.empty && shown.length === rows.length &&
        rows.every((row, i) => shown[i].cells.length === row.length)) {
      // the same table: only the cells whose text changed are touched (no new layout for the page)
      rows.forEach((row, i) => row.forEach((v, j) => {
        const cell = shown[i].cells[j];
        if (cell.textContent !== String(v)) cell.textContent = v;
      }));
      return;
    }
    box.replaceChildren();
    if (data.empty) return;
    const t = el("table", {class: "summary"});
    if (data.summary_header) t.appendChild(el("tr", {}, ...data.summary_header.map((v) => el("th", {text: v}))));
    for (const row of data.summary) t.appendChild(el("tr", {}, ...row.map((v) => el("td", {text: v}))));
    box.appendChild(el("h2", {text: "Run"}));
    box.appendChild(t);
    box.appendChild(sqlDetails(data.summary_sql));
    box.hidden = false;
  }

  function renderEmpty(data) {
    const box = $("empty");
    box.hidden = !data.empty;
    if (!data.empty) return;
    box.replaceChildren(
      el("h2", {text: "No data yet"}),
      el("p", {text: "The store has no trajectories. " + (cfg.live
        ? "This page draws the panels as soon as the first events arrive."
        : "Run trajstore report again once rollouts have been recorded.")}),
      sqlDetails(data.summary_sql.slice(0, 1)));
  }

  function samePanels(data) {
    const have = Array.from(document.querySelectorAll("#panels > section")).map((s) => s.dataset.panel);
    return have.join() === data.panels.map((p) => p.name).join();
  }

  function buildPanels(data) {
    const root = $("panels"), nav = $("nav");
    for (const s of document.querySelectorAll("#panels .plot")) Plotly.purge(s);
    root.replaceChildren();
    nav.replaceChildren();
    for (const p of data.panels) {
      nav.appendChild(el("a", {href: "#" + p.name, text: p.title}));
      root.appendChild(el("section", {class: "card", id: p.name, "data-panel": p.name},
        el("h2", {text: p.title}), el("p", {class: "caption", text: p.caption}),
        el("div", {class: "plot"}), el("div", {class: "note"}), el("div", {class: "links"}),
        el("div", {class: "sql"})));
    }
  }

  // changed: the names of the panels whose content changed (null: all of them). A changed
  // figure is queued and drawn in a task of its own, the panels in view first: the summary and
  // the panels on screen show without waiting for the rest. The first data draws every panel;
  // later, a changed panel out of view is drawn when it scrolls into view (data-stale until then),
  // so an open page spends its time on what is seen.
  const queued = new Map();  // panel name -> its newest data, not drawn yet
  let eager = true, draining = false, seenVersion = 0;
  function section(name) { return document.querySelector('#panels > section[data-panel="' + name + '"]'); }
  function inView(s) {
    if (!s || document.hidden) return false;
    const r = s.getBoundingClientRect();
    return r.bottom > -100 && r.top < window.innerHeight + 100;
  }

  function renderPanels(data, changed) {
    if (!samePanels(data)) { buildPanels(data); changed = null; eager = true; queued.clear(); }
    for (const p of data.panels) {
      if (changed && !changed.has(p.name)) continue;
      const s = section(p.name);
      s.querySelector(".links").replaceChildren(...traceLinks(p));
      s.querySelector(".sql").replaceChildren(sqlDetails(p.sql));
      queued.set(p.name, p);
      s.dataset.stale = "1";
    }
    drain();
  }

  function drawPanel(p) {
    const s = section(p.name);
    if (!s) return;
    const plot = s.querySelector(".plot"), note = s.querySelector(".note");
    if (p.figure) {
      note.hidden = true;
      plot.hidden = false;
      // uirevision keeps what the viewer changed while the figure's own value stays; a time axis's range
      // moves with the run's clock, so the viewer's time zoom is put back after the draw
      const drawn = Plotly.react(plot, p.figure.data, Object.assign({uirevision: p.name}, p.figure.layout), plotConfig);
      hookPlot(plot);
      if (viewerZoom) drawn.then(() => keepZoom(plot));
      s.dataset.state = "plotted";
    } else {
      Plotly.purge(plot);
      delete plot.dataset.hooked;
      plot.hidden = true;
      note.hidden = false;
      note.textContent = p.note;
      s.dataset.state = "note";
    }
    delete s.dataset.stale;
    s.dataset.draws = String(Number(s.dataset.draws || 0) + 1);
    redraws += 1;
  }

  // one queued panel per task: in view first; every one while the first data is drawn
  function drain() {
    if (draining) return;
    let next = null;
    for (const name of queued.keys()) if (inView(section(name))) { next = name; break; }
    if (next === null && eager && queued.size) next = queued.keys().next().value;
    if (next === null) {  // what is in view is drawn: the data counts as shown
      eager = false;
      if (seenVersion !== shownVersion) {
        seenVersion = shownVersion;
        refreshes += 1;
        document.body.dataset.refreshes = String(refreshes);
        document.body.dataset.redraws = String(redraws);
        document.body.dataset.drawn = String(shownVersion);
      }
      return;
    }
    draining = true;
    setTimeout(() => {
      draining = false;
      const p = queued.get(next);
      queued.delete(next);
      if (p) drawPanel(p);
      document.body.dataset.redraws = String(redraws);
      drain();
    }, 0);
  }
  const onSight = () => { if (queued.size) drain(); };
  window.addEventListener("scroll", onSight, {passive: true});
  window.addEventListener("resize", onSight);
  document.addEventListener("visibilitychange", onSight);

  // -- the trace view: trajectory ids a panel's traces carry (meta.trajectory_ids) open it --
  let traceFiles = {};
  function traceHref(id) {
    if (cfg.live) return "trace/" + encodeURIComponent(id);
    return Object.prototype.hasOwnProperty.call(traceFiles, id) ? traceFiles[id] : null;
  }

  function linkedIds(p) {
    const ids = [];
    for (const t of (p.figure && p.figure.data) || []) {
      for (const id of ((t.meta && t.meta.trajectory_ids) || [])) if (!ids.includes(id)) ids.push(id);
    }
    return ids;
  }

  function traceLinks(p) {
    const ids = linkedIds(p).filter((id) => traceHref(id) !== null).slice(0, 24);
    if (!ids.length) return [];
    const box = el("p", {class: "caption"}, el("span", {text: "trace view: "}));
    for (const id of ids) box.appendChild(el("a", {href: traceHref(id), class: "trace-link", text: id}));
    return [box];
  }

  // -- shared zoom: a zoom on one time axis applies to every time axis on the page --
  let syncing = false;
  let viewerZoom = null;  // the time range the viewer chose; null: the run's own
  function keepZoom(plot) {
    if (!viewerZoom || !plot._fullLayout) return;
    const update = {};
    for (const ax of timeAxes(plot)) update[ax + ".range"] = viewerZoom.slice();
    if (!Object.keys(update).length) return;
    plot.dataset.keeping = "1";
    Plotly.relayout(plot, update).finally(() => {
      delete plot.dataset.keeping;
      document.body.dataset.zoomsKept = String(Number(document.body.dataset.zoomsKept || 0) + 1);
    });
  }
  function timeAxes(plot) {
    const fl = plot._fullLayout || {};
    return Object.keys(fl).filter((k) => /^xaxis[0-9]*$/.test(k) && fl[k] && fl[k].type === "date");
  }

  function hookPlot(plot) {
    if (plot.dataset.hooked) return;
    plot.dataset.hooked = "1";
    plot.on("plotly_click", (ev) => {
      const pt = ev && ev.points && ev.points[0];
      const ids = pt && pt.data && pt.data.meta && pt.data.meta.trajectory_ids;
      const href = ids && ids[pt.pointIndex] !== undefined ? traceHref(ids[pt.pointIndex]) : null;
      if (href) window.location.href = href;
    });
    plot.on("plotly_relayout", (ev) => {
      if (syncing || !ev || plot.dataset.keeping) return;
      let range = null, auto = false;
      for (const ax of timeAxes(plot)) {
        if (ev[ax + ".range[0]"] !== undefined) range = [ev[ax + ".range[0]"], ev[ax + ".range[1]"]];
        else if (ev[ax + ".range"]) range = ev[ax + ".range"].slice();
        if (ev[ax + ".autorange"]) auto = true;
      }
      if (!range && !auto) return;
      viewerZoom = range ? range.slice() : null;
      syncing = true;
      const jobs = [];
      for (const other of document.querySelectorAll("#panels .plot")) {
        if (other === plot || other.hidden || !other._fullLayout) continue;
        const update = {};
        for (const ax of timeAxes(other)) {
          if (range) update[ax + ".range"] = range.slice(); else update[ax + ".autorange"] = true;
        }
        if (Object.keys(update).length) jobs.push(Plotly.relayout(other, update));
      }
      document.body.dataset.zoomSyncs = String(Number(document.body.dataset.zoomSyncs || 0) + 1);
      Promise.all(jobs).finally(() => { syncing = false; });
    });
  }

  let shownVersion = 0;
  function render(data, changed) {
    traceFiles = data.trace_files || {};
    shownVersion += 1;
    renderEmpty(data);
    renderSummary(data);
    const when = new Date(data.generated_at * 1000);
    $("status").className = "";
    $("status").textContent = (cfg.live ? "live (redrawn when the store changes); " : "static export; ") +
      "data of " + when.toISOString().replace("T", " ").slice(0, 19) + " UTC";
    document.body.dataset.generatedAt = String(data.generated_at);
    document.body.dataset.panels = String(data.panels.length);
    document.body.dataset.shown = String(shownVersion);
    renderPanels(data, changed || null);  // draws in tasks of their own; refreshes counts once they are
  }

  function showError(text) {
    $("status").className = "error";
    $("status").textContent = text;
  }

  // -- live: one stream of messages {version, head, order, panels: {name: panel}}, where
  // panels holds only what changed since the last message this page was sent --
  const have = {};
  function apply(msg) {
    const changed = new Set(Object.keys(msg.panels));
    Object.assign(have, msg.panels);
    for (const name of Object.keys(have)) if (!msg.order.includes(name)) delete have[name];
    const data = Object.assign({}, msg.head, {panels: msg.order.map((n) => have[n])});
    render(data, changed);
    document.body.dataset.version = String(msg.version);
  }

  function stream() {
    const source = new EventSource(cfg.stream);
    source.onmessage = (ev) => apply(JSON.parse(ev.data));
    source.addEventListener("problem", (ev) => {
      const body = JSON.parse(ev.data);
      showError("store: " + ((body.error && body.error.message) || "unavailable") + " (showing the last data)");
    });
    source.onerror = async () => {
      if (source.readyState !== EventSource.CLOSED) {  // the browser reconnects by itself
        showError("report server unreachable (showing the last data); reconnecting");
        return;
      }
      source.close();  // refused: find out whether the credentials or the server
      try {
        const r = await fetch(cfg.health, {cache: "no-store", credentials: "same-origin"});
        if (r.status === 401) {
          showError("not authorized: open this page as /?token=TOKEN");
          return;  // no point asking again with the same credentials
        }
      } catch (e) { /* unreachable: say so below */ }
      showError("report server unreachable (showing the last data); reconnecting");
      setTimeout(stream, cfg.refresh_s * 1000);
    };
  }

  if (cfg.live) stream();
  else render(JSON.parse($("trajstore-data").textContent));
})();
"""


def _json_in_html(value: Any, **dumps: Any) -> str:
    """JSON safe inside a <script> element: no '<' can end it early."""
    return json.dumps(value, **dumps).replace("<", "\\u003c")


def page(title: str, store: str, *, live: bool, refresh_s: float = 5.0, data_json: str | None = None) -> str:
    """The page. ``data_json``: the static page's data (JSON text of ``collect``'s dict)."""
    e = html.escape
    config = _json_in_html({"live": live, "refresh_s": refresh_s, "api": "api/data", "stream": "api/stream",
                            "health": "healthz"})
    data = ("" if data_json is None else
            f"<script id='trajstore-data' type='application/json'>{data_json.replace('<', chr(92) + 'u003c')}</script>")
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        "<link rel='icon' href='data:,'>"
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{e(title)}</h1><span class='meta'>store <code>{e(store)}</code></span>"
        "<span class='meta' id='status'>loading…</span></header>"
        "<main><div id='empty' class='card' hidden></div><div id='summary' class='card' hidden></div>"
        "<nav id='nav'></nav><div id='panels' class='grid'></div>"
        "<p class='caption'>Every panel's SQL runs as written under <code>trajstore sql</code> (read-only); "
        "the views and their columns are documented in docs/sql.md.</p></main>"
        f"<script id='trajstore-config' type='application/json'>{config}</script>{data}"
        f"<script src='{PLOTLY_JS}'></script><script>{_JS}</script></body></html>\n")
