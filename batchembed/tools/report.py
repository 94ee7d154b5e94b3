"""`batchembed report`: one self-contained HTML page about an output, for people who would
rather look than read JSON.

- token lengths of the embedded rows (a histogram the run recorded in the manifest),
- engine throughput over the last run (tokens/s per time slice, also from the manifest),
- a Matryoshka chart: for a sample of rows, recall@10 of each row's nearest neighbours at
  each smaller dimension against the largest stored one, beside the bytes per row, so
  dimensions can be picked by looking.

Charts are inline SVG: the page needs no network, no JavaScript, and opens anywhere.
"""

from __future__ import annotations

import html
import json
from typing import Any

import numpy as np

from ..embed.vectors import vector_matrix
from ..errors import JobError
from ..output.layout import MANIFEST, OutputFolder


def sample_vectors(out: OutputFolder, column: str, rows: int) -> np.ndarray:
    """Up to `rows` non-null vectors of one float column, from the parts in name order."""
    vectors: list[np.ndarray] = []
    have = 0
    for name in out.part_names():
        with out.open_part(name) as part:
            for batch in part.iter_batches(columns=[column], batch_size=4096):
                arr = batch.column(0).drop_null()
                if len(arr):
                    m = vector_matrix(arr)
                    vectors.append(m)
                    have += len(m)
                if have >= rows:
                    return np.concatenate(vectors)[:rows]
    return np.concatenate(vectors) if vectors else np.zeros((0, 0), np.float32)


def matryoshka_recall(vectors: np.ndarray, dims: list[int], queries: int = 200, k: int = 10) -> dict[int, float]:
    """recall@k of each query row's k nearest neighbours (cosine, itself excluded) at each
    dimension d (truncate, renormalise) against the neighbours at the full width of `vectors`."""
    n = len(vectors)
    k = min(k, n - 1)
    q = min(queries, n)
    if k < 1:
        return {}

    def top(m: np.ndarray) -> np.ndarray:
        m = m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)
        sims = m[:q] @ m.T
        sims[np.arange(q), np.arange(q)] = -np.inf
        return np.argpartition(-sims, k, axis=1)[:, :k]

    truth = top(vectors)
    result = {}
    for d in dims:
        got = top(vectors[:, :d])
        result[d] = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(got.tolist(), truth.tolist())]))
    return result


def _svg(kind: str, ident: str, xs: list[float], ys: list[float], x_label: str, y_label: str,
         y_max: float | None = None, width: int = 640, height: int = 260) -> str:
    """A bar or line chart as inline SVG, with axis labels and min/max ticks."""
    left, bottom, top_pad, right = 60, 40, 16, 16
    w, h = width - left - right, height - bottom - top_pad
    y_max = y_max or (max(ys) if ys and max(ys) > 0 else 1.0)
    x_min, x_max = (min(xs), max(xs)) if xs else (0, 1)
    span = (x_max - x_min) or 1

    def px(x):
        return left + (x - x_min) / span * w

    def py(y):
        return top_pad + h - y / y_max * h

    parts = [f'<svg id="{ident}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{html.escape(y_label)} by {html.escape(x_label)}">',
             f'<line x1="{left}" y1="{top_pad + h}" x2="{left + w}" y2="{top_pad + h}" stroke="#555"/>',
             f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{top_pad + h}" stroke="#555"/>']
    if kind == "bar" and xs:
        bw = max(1.0, w / len(xs) - 1)
        for x, y in zip(xs, ys):
            parts.append(f'<rect class="bar" x="{left + (x - x_min) / span * (w - bw):.1f}" y="{py(y):.1f}" '
                         f'width="{bw:.1f}" height="{top_pad + h - py(y):.1f}" fill="#4878a8"/>')
    elif xs:
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#c05030" stroke-width="2"/>')
        parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="#c05030"/>' for x, y in zip(xs, ys)]
    for y in (0, y_max):
        parts.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end" font-size="11">{_num(y)}</text>')
    for x in (x_min, x_max):
        parts.append(f'<text x="{px(x):.1f}" y="{top_pad + h + 16}" text-anchor="middle" font-size="11">{_num(x)}</text>')
    parts.append(f'<text x="{left + w / 2}" y="{height - 6}" text-anchor="middle" font-size="12">{html.escape(x_label)}</text>')
    parts.append(f'<text x="14" y="{top_pad + h / 2}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {top_pad + h / 2})">{html.escape(y_label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _script_json(obj) -> str:
    """JSON safe inside a <script> element (which is not HTML-decoded)."""
    return json.dumps(obj, default=str).replace("</", "<\\/")


def _num(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.1f} M"
    if v >= 1e4:
        return f"{v / 1e3:.0f} k"
    return f"{v:.2f}" if isinstance(v, float) and v < 10 and v != int(v) else f"{v:,.0f}"


def build_report(uri: str, storage_options: dict[str, Any] | None = None, sample_rows: int = 2000) -> str:
    out = OutputFolder.open(uri, storage_options, key="OUTPUT_URI")
    manifest = out.read_manifest()
    if manifest is None:
        raise JobError(f"no {MANIFEST} at {out.url}: not a finished batchembed output")
    emb, counts, run = manifest.embedding, manifest.counts, manifest.last_run
    sections = []

    hist = manifest.token_histogram
    if hist and sum(hist["counts"]):
        width = hist["bin_width"]
        xs = [i * width for i in range(len(hist["counts"]))]
        sections.append(("Token lengths of the embedded rows",
                         _svg("bar", "token-lengths", xs, [float(c) for c in hist["counts"]],
                              f"tokens (bins of {width})", "rows") +
                         f"<p>{counts.get('truncated', 0):,} rows truncated at {manifest.model.max_length} "
                         f"tokens, {counts.get('chunked', 0):,} chunked.</p>"))
    else:
        sections.append(("Token lengths of the embedded rows", "<p>Not recorded by the run that made this output.</p>"))

    series = run.get("throughput") or []
    if series:
        sections.append(("Engine throughput over the last run",
                         _svg("line", "throughput", [float(t) for t, _ in series], [float(v) for _, v in series],
                              "seconds since the first engine call", "tokens/s") +
                         f"<p>{run.get('tokens_run', 0):,} tokens in {run.get('seconds', 0):.1f} s; engine idle "
                         f"{100 * (run.get('engine_idle_share') or 0):.1f} % of the pipeline's time.</p>"))
    else:
        sections.append(("Engine throughput over the last run", "<p>The last run embedded nothing (or did not record it).</p>"))

    columns = dict(emb.columns)
    full_d = max(columns, default=0)
    written = counts.get("rows", 0) - counts.get("nulls", 0) - counts.get("failed_rows", 0)
    if emb.sparse:
        sections.append(("Sparse weights", f"<p>{counts.get('sparse_weights', 0):,} non-zero weights in "
                         f"{emb.sparse['column']}, {counts.get('sparse_weights', 0) / max(written, 1):,.1f} per "
                         f"row; {counts.get('sparse_pruned', 0):,} pruned (top_k {emb.sparse.get('top_k')}, "
                         f"min_weight {emb.sparse.get('min_weight')}).</p>"))
    if emb.multi_vector:
        mv = emb.multi_vector
        per_row = counts.get("multi_vectors", 0) / max(written, 1)
        width = {"float32": 4, "float16": 2, "int8": 1}[mv["dtype"]] * mv["dimension"]
        sections.append(("Multi-vectors", f"<p>{counts.get('multi_vectors', 0):,} token vectors of "
                         f"{mv['dimension']} in {mv['column']}, {per_row:,.1f} per row: about "
                         f"{per_row * width:,.0f} bytes a row as {mv['dtype']}.</p>"))
    if not columns:
        pass  # no dense vectors: no Matryoshka section
    elif emb.output_dtype in ("float32", "float16"):
        vectors = sample_vectors(out, columns[full_d], sample_rows)
        dims = sorted({d for d in columns} | {2 ** i for i in range(4, 16) if 2 ** i < full_d})
        recall = matryoshka_recall(vectors, dims) if len(vectors) > 11 else {}
        if recall:
            rows = "".join(f"<tr><td>{d}</td><td>{recall[d]:.3f}</td><td>{d * 4:,}</td><td>{d * 2:,}</td>"
                           f"<td>{d:,}</td><td>{d / 8:,.0f}</td><td>{'stored' if d in columns else ''}</td></tr>"
                           for d in dims)
            sections.append((f"Matryoshka: recall@10 against {full_d} dimensions ({len(vectors):,} sampled rows)",
                             '<div class="side">' +
                             _svg("line", "matryoshka", [float(d) for d in dims], [recall[d] for d in dims],
                                  "dimensions", "recall@10", y_max=1.0) +
                             '<table id="matryoshka-table"><tr><th>dims</th><th>recall@10</th><th>float32 B/row</th>'
                             "<th>float16</th><th>int8</th><th>binary</th><th></th></tr>" + rows + "</table></div>"
                             + ("" if manifest.model.is_matryoshka else
                                "<p>The model does not declare Matryoshka training: recall drops faster "
                                "below its full width than for a model trained for it.</p>")))
        else:
            sections.append(("Matryoshka", "<p>Too few rows to sample.</p>"))
    else:
        sections.append(("Matryoshka", f"<p>The vectors are {emb.output_dtype}; the chart needs float ones.</p>"))

    title = f"batchembed report: {manifest.name}"
    facts = [("output", out.url), ("model", manifest.model.name),
             ("rows", f"{counts['rows']:,}"), ("embedded", f"{counts.get('embedded', 0):,}"),
             ("failed in the engine", f"{counts.get('failed_rows', 0):,} (listed in _errors/)"),
             ("dimensions", ", ".join(str(d) for d in sorted(columns, reverse=True))),
             ("stored as", emb.output_dtype), ("made", manifest.created_at),
             ("complete", str(manifest.complete))]
    body = "".join(f"<section><h2>{html.escape(h)}</h2>{content}</section>" for h, content in sections)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
.facts td:first-child {{ text-align: left; color: #666; }} .side {{ display: flex; gap: 2em; align-items: flex-start; }}
section {{ margin-top: 2em; }} .side svg {{ flex: none; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<table class="facts">{"".join(f"<tr><td>{k}</td><td>{html.escape(str(v))}</td></tr>" for k, v in facts)}</table>
{body}
<script type="application/json" id="manifest">{_script_json({k: manifest.to_json()[k] for k in ("name", "counts", "embedding", "last_run")})}</script>
</body></html>
"""
