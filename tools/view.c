/*
 * view.c -- snapshot JSON -> one self-contained HTML page (see view.h).
 *
 * The page carries the snapshot verbatim in a <script type=
 * "application/json"> element and draws it with its own script: one row per
 * region, the region's bar to scale against the largest region, each chunk
 * an absolutely positioned box to scale within it, coloured by state (in
 * use: the owning shard's hue; free: grey; pending fence: hatched orange;
 * freeing: red); hovering a chunk shows its address, allocation id, sizes
 * and state; tables summarise the context and each shard.  A snapshot
 * that carries an OOM report ("oom", an oom_dump file) opens with it: the
 * diagnosis line, the request, each shard's free bytes and largest free
 * piece (bounds, marked so, for an expandable shard, beside the largest
 * block it could hand out without mapping), and the pool's free spans.  The only
 * transformation of the JSON is escaping "</" (and "<!--") so the text cannot
 * close or confuse the script element; "<\/" is the same JSON string.
 *
 * The C side checks that the input parses (json-c, strict) and has the shape of
 * a snapshot, so a wrong file fails here with a message instead of in the
 * browser.  The page reports script errors in its #status element
 * (data-state="error"), and data-state="ok" once drawn, which the tests and
 * a headless browser can read.
 */
#include "view.h"

#include <string.h>

#include "json_read.h"
#include "toolutil.h"

static const char page_head[] =
    "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>";

static const char page_style[] =
    "</title>\n<style>\n"
    "body{font:13px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:16px 20px;color:#222;background:#fff}\n"
    "h1{font-size:18px;margin:0 0 4px}h2{font-size:15px;margin:18px 0 4px}\n"
    "table{border-collapse:collapse;margin:6px 0 10px}\n"
    "th,td{border:1px solid #ccc;padding:2px 7px;text-align:right;white-space:nowrap}\n"
    "th{background:#f2f2f2;font-weight:600}td.l,th.l{text-align:left}\n"
    ".sw{display:inline-block;width:12px;height:12px;border:1px solid #777;vertical-align:-2px;margin-right:4px}\n"
    ".region{display:flex;align-items:center;margin:4px 0}\n"
    ".rlabel{width:300px;flex:none;font:11px monospace;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}\n"
    ".rtrack{flex:1;min-width:200px}\n"
    ".rbar{position:relative;height:24px;background:#fafafa;border:1px solid #888;box-sizing:border-box;"
    "overflow:hidden}\n"
    ".c{position:absolute;top:0;bottom:0;box-sizing:border-box;border-right:1px solid rgba(255,255,255,.8);"
    "min-width:1px}\n"
    ".c.free{background:#e2e2e2}\n"
    ".c.pending{background:repeating-linear-gradient(45deg,#f09a20 0,#f09a20 4px,#ffe0a8 4px,#ffe0a8 8px)}\n"
    ".c.freeing{background:#d02828}\n"
    ".c:hover{outline:2px solid #000;z-index:2}\n"
    "#tip{position:fixed;pointer-events:none;background:#fffbe3;border:1px solid #a99;padding:4px 7px;"
    "font:12px monospace;display:none;white-space:pre;z-index:10;box-shadow:1px 1px 4px rgba(0,0,0,.2)}\n"
    ".legend{margin:6px 0}.legend .sw{margin-left:12px}\n"
    "#status{color:#777;font-size:12px}\n"
    ".note{color:#555;font-size:12px;margin:2px 0 8px}\n"
    "#oom .diag{border-left:5px solid #d02828;background:#fff1f1;padding:6px 10px;margin:6px 0;font-weight:600}\n"
    "</style>\n</head>\n<body>\n";

static const char page_body[] =
    "<div id=\"status\" data-state=\"loading\">rendering&hellip;</div>\n"
    "<div id=\"head\"></div>\n"
    "<div id=\"oom\"></div>\n"
    "<div id=\"summary\"></div>\n"
    "<h2>Shards</h2>\n<div id=\"shards\"></div>\n"
    "<h2>Regions</h2>\n"
    "<div class=\"legend\">in use: <i>shard colour</i>"
    "<span class=\"sw\" style=\"background:#e2e2e2\"></span>free"
    "<span class=\"sw\" style=\"background:repeating-linear-gradient(45deg,#f09a20 0,#f09a20 3px,#ffe0a8 3px,"
    "#ffe0a8 6px)\"></span>pending fence"
    "<span class=\"sw\" style=\"background:#d02828\"></span>freeing (in a remote-free queue)</div>\n"
    "<div id=\"regions\"></div>\n<div id=\"tip\"></div>\n"
    "<script type=\"application/json\" id=\"snapshot\">";

static const char page_script[] =
    "</script>\n<script>\n"
    "\"use strict\";\n"
    "(function () {\n"
    "  var status = document.getElementById('status');\n"
    "  function setStatus(state, text) { status.setAttribute('data-state', state); status.textContent = text; }\n"
    "  window.addEventListener('error', function (e) { setStatus('error', 'script error: ' + e.message); });\n"
    "  function el(tag, cls, text) {\n"
    "    var e = document.createElement(tag);\n"
    "    if (cls) e.className = cls;\n"
    "    if (text !== undefined) e.textContent = text;\n"
    "    return e;\n"
    "  }\n"
    "  function bytes(n) {\n"
    "    if (n === undefined || n === null) return '';\n"
    "    var u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], i = 0, v = n;\n"
    "    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }\n"
    "    return (i ? v.toFixed(v < 10 ? 2 : 1) : String(v)) + ' ' + u[i];\n"
    "  }\n"
    "  function pct(f) { return (100 * (f || 0)).toFixed(1) + '%'; }\n"
    "  /* A context's peak that is an upper bound (key + '_bound'; version 1\n"
    "   * snapshots gave the same bound under the bare key): shown as one. */\n"
    "  function bound(o, k) {\n"
    "    var v = o[k + '_bound'] !== undefined ? o[k + '_bound'] : o[k];\n"
    "    return v === undefined ? '' : '\\u2264 ' + bytes(v);\n"
    "  }\n"
    "  function hex(base, off) {\n"
    "    try { return '0x' + (BigInt(base) + BigInt(off)).toString(16); } catch (e) { return base + '+' + off; }\n"
    "  }\n"
    "  function table(head, rows) {\n"
    "    var t = el('table'), tr = el('tr');\n"
    "    head.forEach(function (h, i) { tr.appendChild(el('th', i ? '' : 'l', h)); });\n"
    "    t.appendChild(tr);\n"
    "    rows.forEach(function (r) {\n"
    "      var tr = el('tr');\n"
    "      r.forEach(function (c, i) {\n"
    "        var td = el('td', i ? '' : 'l');\n"
    "        if (c instanceof Node) td.appendChild(c); else td.textContent = c;\n"
    "        tr.appendChild(td);\n"
    "      });\n"
    "      t.appendChild(tr);\n"
    "    });\n"
    "    return t;\n"
    "  }\n"
    "  var snap = JSON.parse(document.getElementById('snapshot').textContent);\n"
    "  var shards = snap.shards || [], tot = snap.totals || {}, pool = snap.pool || {};\n"
    "  /* Distinct colours, never the red/orange/grey of freeing, pending and free;\n"
    "   * beyond the palette, golden-angle hues in [90, 330). */\n"
    "  var palette = ['#1f77b4', '#2ca02c', '#9467bd', '#17becf', '#8c564b', '#e377c2', '#bcbd22',\n"
    "                 '#3949ab', '#00897b', '#6d4c41'];\n"
    "  var colour = {};\n"
    "  shards.forEach(function (s, i) {\n"
    "    colour[s.stream_id] = i < palette.length ? palette[i] :\n"
    "      'hsl(' + (90 + Math.round(i * 137.508) % 240) + ',62%,46%)';\n"
    "  });\n"
    "  function shardColour(id) { return colour[id] || '#555'; }\n"
    "  /* The title, then the OOM report when there is one, then the summary. */\n"
    "  var head = document.getElementById('head'), sum = document.getElementById('summary');\n"
    "  head.appendChild(el('h1', '', 'libshardbfc memory map'));\n"
    "  head.appendChild(el('div', '', 'snapshot version ' + snap.version + ', backend ' + snap.backend +\n"
    "      (snap.host ? ' (host pinned)' : '') + ', device ' + snap.device + ', allow_growth ' +\n"
    "      snap.allow_growth + ', limit ' + bytes(snap.limit)));\n"
    "  sum.appendChild(table(['context', 'reserved', 'peak reserved', 'allocated', 'peak allocated',\n"
    "      'requested', 'peak requested', 'free', 'largest free', 'fragmentation', 'pending', 'shards',\n"
    "      'regions', 'allocs', 'frees', 'OOMs'],\n"
    "    [['total', bytes(tot.bytes_reserved), bytes(tot.peak_bytes_reserved), bytes(tot.bytes_in_use),\n"
    "      bound(tot, 'peak_bytes_in_use'), bytes(tot.bytes_requested), bound(tot, 'peak_bytes_requested'),\n"
    "      bytes(tot.bytes_free),\n"
    "      bytes(tot.largest_free_chunk), pct(tot.fragmentation), tot.num_pending_frees + ' / ' +\n"
    "      bytes(tot.bytes_pending), tot.num_shards, tot.num_regions, tot.num_allocs, tot.num_frees,\n"
    "      tot.num_ooms]]));\n"
    "  sum.appendChild(el('div', 'note', 'allocated = chunk bytes, requested = what callers asked for,' +\n"
    "      ' reserved = held from the device; \\u2264: an upper bound (the sum of the shards\\' peaks,' +\n"
    "      ' capped by the peak reserved), every other figure is exact; fragmentation = 1 - largest' +\n"
    "      ' free chunk / free bytes.'));\n"
    "  sum.appendChild(table(['pool', 'held', 'peak held', 'lent to shards', 'free in pool'],\n"
    "    [['pool', bytes(pool.held), bytes(pool.peak_held), bytes(pool.committed), bytes(pool.free)]]));\n"
    "  /* The OOM report (oom_dump files, or any snapshot taken after a failure):\n"
    "   * why the request failed, then where the free memory was. */\n"
    "  var oom = snap.oom;\n"
    "  if (oom) {\n"
    "    var ob = document.getElementById('oom');\n"
    "    ob.appendChild(el('h2', '', 'Out of memory'));\n"
    "    ob.appendChild(el('div', 'diag', oom.diagnosis));\n"
    "    /* A context's shards are all expandable or all classic: with\n"
    "     * expandable ones the free figures count mapped memory and are bounds\n"
    "     * (the requesting shard's largest is its largest_ready, exact). */\n"
    "    var ob_b = (oom.shards || []).some(function (s) { return s.expandable; }) ? '\\u2264 ' : '';\n"
    "    var ob_retired = (oom.shards || []).filter(function (s) { return s.retired; }).length;\n"
    "    ob.appendChild(table(['request', 'size', 'chunk bytes', 'stream', 'cause', 'limit', 'reserved',\n"
    "        'unreserved', 'in use', 'pending fences', 'free in this shard', 'its largest',\n"
    "        'free in other shards', 'their largest', 'free in pool', 'largest span', 'fenced in pool'],\n"
    "      [['failed', bytes(oom.size), bytes(oom.rounded), oom.stream, oom.cause, bytes(oom.bytes_limit),\n"
    "        bytes(oom.bytes_reserved), bytes(oom.bytes_unreserved), bytes(oom.bytes_in_use),\n"
    "        bytes(oom.bytes_pending), ob_b + bytes(oom.stream_free), bytes(oom.stream_largest_free),\n"
    "        ob_b + bytes(oom.other_free), ob_b + bytes(oom.other_largest_free), bytes(oom.pool_free),\n"
    "        bytes(oom.pool_largest_span), bytes(oom.pool_fenced)]]));\n"
    "    ob.appendChild(el('div', '', 'Each shard at the failure (' + oom.num_shards +\n"
    "      (ob_retired ? ', and ' + ob_retired + ' retired' : '') + ')' +\n"
    "      (oom.shards_omitted ? ', ' + oom.shards_omitted + ' not listed' : '') + ':'));\n"
    "    ob.appendChild(table(['stream id', 'stream', 'requesting', 'retired', 'free', 'largest free piece',\n"
    "        'largest block without a map', 'pending', 'in use', 'reserved'],\n"
    "      (oom.shards || []).map(function (s) {\n"
    "      /* expandable: free figures are bounds (mapped pieces), and the\n"
    "       * largest block it can serve without mapping is its own figure\n"
    "       * (doc/snapshot.md) */\n"
    "      var b = s.expandable ? '\\u2264 ' : '';\n"
    "      return [s.stream_id, s.stream, s.requesting ? 'yes' : '', s.retired ? 'yes' : '', b + bytes(s.free),\n"
    "        b + bytes(s.largest_free),\n"
    "        s.expandable ? bytes(s.largest_ready) : '', bytes(s.pending), bytes(s.in_use),\n"
    "        bytes(s.reserved)]; })));\n"
    "    ob.appendChild(el('div', '', 'Free spans of the pool (' + oom.num_pool_spans + ')' +\n"
    "      (oom.spans_omitted ? ', ' + oom.spans_omitted + ' not listed' : '') + ':'));\n"
    "    ob.appendChild(table(['base', 'size', 'state'], (oom.pool_spans || []).map(function (s) {\n"
    "      return [s.base, bytes(s.size), s.fenced ? 'free, still fenced by stream id ' + s.stream_id :\n"
    "        'free']; })));\n"
    "  }\n"
    "  var rows = shards.map(function (s) {\n"
    "    var st = s.stats || {}, sw = el('span', 'sw');\n"
    "    sw.style.background = shardColour(s.stream_id);\n"
    "    var name = el('span'); name.appendChild(sw);\n"
    "    name.appendChild(document.createTextNode(s.stream_id + (s.retired ? ' (retired)' : '')));\n"
    "    return [name, s.stream, (s.regions || []).length, bytes(st.bytes_reserved), bytes(st.bytes_in_use),\n"
    "      bytes(st.peak_bytes_in_use), bytes(st.bytes_requested), bytes(st.peak_bytes_requested),\n"
    "      bytes(st.bytes_free),\n"
    "      bytes(st.largest_free_chunk), pct(st.fragmentation), st.num_pending_frees + ' / ' +\n"
    "      bytes(st.bytes_pending), st.num_allocs, st.num_frees, st.num_remote_frees, st.num_ooms];\n"
    "  });\n"
    "  document.getElementById('shards').appendChild(table(['stream id', 'stream', 'regions', 'reserved',\n"
    "      'allocated', 'peak allocated', 'requested', 'peak requested', 'free', 'largest free',\n"
    "      'fragmentation', 'pending',\n"
    "      'allocs', 'frees', 'remote frees', 'OOMs'], rows));\n"
    "  var maxSize = 1, nreg = 0, nchunk = 0;\n"
    "  shards.forEach(function (s) { (s.regions || []).forEach(function (r) {\n"
    "    if (r.size > maxSize) maxSize = r.size; }); });\n"
    "  var box = document.getElementById('regions');\n"
    "  shards.forEach(function (s) {\n"
    "    (s.regions || []).slice().sort(function (a, b) {\n"
    "      return BigInt(a.base) < BigInt(b.base) ? -1 : 1; }).forEach(function (r) {\n"
    "      nreg++;\n"
    "      var row = el('div', 'region'), label = el('div', 'rlabel');\n"
    "      row.setAttribute('data-base', r.base);\n"
    "      label.textContent = r.base + '  ' + bytes(r.size) + '  shard ' + r.owner + (r.large ? ' (large)' : '');\n"
    "      label.title = label.textContent;\n"
    "      label.style.borderLeft = '6px solid ' + shardColour(s.stream_id);\n"
    "      label.style.paddingLeft = '4px';\n"
    "      var track = el('div', 'rtrack'), bar = el('div', 'rbar');\n"
    "      bar.style.width = Math.max(0.5, 100 * r.size / maxSize) + '%';\n"
    "      (r.chunks || []).forEach(function (c) {\n"
    "        nchunk++;\n"
    "        var d = el('div', 'c ' + c.state);\n"
    "        d.style.left = (100 * c.offset / r.size) + '%';\n"
    "        d.style.width = (100 * c.size / r.size) + '%';\n"
    "        if (c.state === 'in_use') d.style.background = shardColour(s.stream_id);\n"
    "        d.info = hex(r.base, c.offset) + '  (offset ' + c.offset + ')\\n' + 'state       ' + c.state +\n"
    "          '\\nsize        ' + c.size + ' (' + bytes(c.size) + ')' +\n"
    "          (c.state === 'free' ? '' : '\\nrequested   ' + c.requested + ' (' + bytes(c.requested) + ')' +\n"
    "           '\\nalloc id    ' + c.allocation_id) + '\\nshard       ' + s.stream_id;\n"
    "        bar.appendChild(d);\n"
    "      });\n"
    "      track.appendChild(bar); row.appendChild(label); row.appendChild(track); box.appendChild(row);\n"
    "    });\n"
    "  });\n"
    "  if (!nreg) box.appendChild(el('div', '', 'no regions'));\n"
    "  var tip = document.getElementById('tip');\n"
    "  box.addEventListener('mousemove', function (e) {\n"
    "    var t = e.target;\n"
    "    if (!t.info) { tip.style.display = 'none'; return; }\n"
    "    tip.textContent = t.info; tip.style.display = 'block';\n"
    "    var x = e.clientX + 14, y = e.clientY + 14;\n"
    "    if (x + tip.offsetWidth > window.innerWidth) x = e.clientX - tip.offsetWidth - 8;\n"
    "    if (y + tip.offsetHeight > window.innerHeight) y = e.clientY - tip.offsetHeight - 8;\n"
    "    tip.style.left = x + 'px'; tip.style.top = y + 'px';\n"
    "  });\n"
    "  box.addEventListener('mouseleave', function () { tip.style.display = 'none'; });\n"
    "  setStatus('ok', 'rendered: ' + shards.length + ' shards, ' + nreg + ' regions, ' + nchunk + ' chunks');\n"
    "})();\n"
    "</script>\n</body>\n</html>\n";

static void write_escaped_text(FILE *out, const char *s)
{
    for (; *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", out); break;
        case '<': fputs("&lt;", out); break;
        case '>': fputs("&gt;", out); break;
        case '"': fputs("&quot;", out); break;
        default: fputc(*s, out);
        }
    }
}

/* The JSON inside <script>: only "</" and "<!--" need care, and both can
 * occur only inside strings, where "<\/" and "\u003c!--" mean the same. */
static void write_json_for_script(FILE *out, const char *json, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        if (json[i] == '<' && i + 1 < len && json[i + 1] == '/') {
            fputs("<\\/", out);
            i++;
        } else if (json[i] == '<' && i + 3 < len && memcmp(json + i, "<!--", 4) == 0) {
            fputs("\\u003c", out);
        } else {
            fputc(json[i], out);
        }
    }
}

int bfc_view_write_html(const char *json, size_t len, const char *title, FILE *out, char *err, size_t errlen)
{
    char jerr[256];
    json_object *v;
    if (bfc_json_parse(json, len, &v, jerr, sizeof(jerr)) != 0) {
        set_err(err, errlen, "not valid JSON: %s", jerr);
        return -1;
    }
    int bad = bfc_json_snapshot_check(v, err, errlen);
    json_object_put(v);
    if (bad)
        return -1;
    fputs(page_head, out);
    write_escaped_text(out, title ? title : "libshardbfc memory map");
    fputs(page_style, out);
    fputs(page_body, out);
    write_json_for_script(out, json, len);
    fputs(page_script, out);
    if (ferror(out)) {
        set_err(err, errlen, "write error");
        return -1;
    }
    return 0;
}
