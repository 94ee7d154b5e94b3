"""`batchembed verify`: check a finished output against its manifest, reading every part, and
(--sample) a random sample of its rows against sentence-transformers, re-embedded from the input."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .. import fidelity
from ..embed.matryoshka import l2_normalise
from ..embed.vectors import (
    PACKED,
    SCALAR,
    SPARSE_TYPE,
    comparable,
    multi_vector_rows,
    sparse_rows,
    vector_array,
    vector_matrix,
)
from ..errors import JobError
from ..inputs.rows import select_rows
from ..output.layout import MANIFEST, SUCCESS, OutputFolder
from ..plan import Task
from ..reuse import TEXT_HASH, text_hashes
from ..storage import concurrently

if TYPE_CHECKING:
    from ..job import Prepared

SAMPLE_PARTS = 8  # parts a sample is drawn from: each one's input is read up to its last sampled row
EXAMPLES = 3  # rows below the threshold named in the message


def verify_output(uri: str, storage_options: dict[str, Any] | None = None,
                  threads: int = 16) -> tuple[list[str], dict]:
    """(problems, summary). No problems means: _SUCCESS is there, every part the manifest
    lists exists with its row count and vector columns, every vector has norm 1, no part
    or other data is there that the manifest does not list, and its index is there. Parts
    are read `threads` at a time."""
    out = OutputFolder.open(uri, storage_options, key="OUTPUT_URI")
    manifest = out.read_manifest()
    if manifest is None:
        return [f"no {MANIFEST} at {uri}: not a finished batchembed output"], {}
    problems: list[str] = []
    if not out.finished():
        problems.append(f"no {SUCCESS}: the output is unfinished" +
                        (f" ({len(manifest.failed)} input files failed)" if manifest.failed else ""))
    emb = manifest.embedding
    columns = emb.columns
    packed = emb.packed_bits  # binary / ubinary: 8 dimensions a byte, no norm
    quantized = packed or emb.output_dtype in SCALAR  # no norm to check
    tol = 1e-2 if emb.output_dtype == "float16" else 1e-3
    listed = {p.name: p for p in manifest.parts}
    extras = {r: getattr(emb, r) for r in ("sparse", "multi_vector") if getattr(emb, r)}
    present = set(out.part_names())
    for extra in sorted(present - set(listed)):
        problems.append(f"{extra}: a part the manifest does not list")
    for stray in out.strays():
        problems.append(f"{stray}: data that is no batchembed part (readers of the output see its rows)")
    index = manifest.index or {}
    if index.get("built") and index.get("name") not in out.fmt.index_names(out):
        problems.append(f"the manifest lists the index {index.get('name')}, the output has none of that name")
    todo = []
    for name, entry in listed.items():
        if name in present:
            todo.append((name, entry))
        elif entry.rows or out.fmt.empty_parts_kept:  # Lance keeps nothing of an empty part
            problems.append(f"{name}: listed in the manifest, missing")

    def check(item) -> tuple[list[str], int, int, float]:
        """One part: (problems, rows, vectors checked, its largest |norm - 1|)."""
        name, entry = item
        found: list[str] = []
        vectors, worst = 0, 0.0
        url = out.part_url(name)
        with out.open_part(name) as part:
            if part.num_rows != entry.rows:
                found.append(f"{url}: {part.num_rows} rows, the manifest says {entry.rows}")
            for dim, col in columns.items():
                field = part.schema.field(col) if col in part.schema.names else None
                width = int(dim) // 8 if packed else int(dim)
                if field is None or getattr(field.type, "list_size", None) != width:
                    found.append(f"{url}: column {col} is {field.type if field else 'missing'}, "
                                 f"expected {width} values per row")
                    continue
                if quantized:
                    continue
                for batch in part.iter_batches(columns=[col]):
                    arr = batch.column(0).drop_null()
                    if len(arr) == 0:
                        continue
                    m = vector_matrix(arr)
                    worst = max(worst, float(np.abs(np.linalg.norm(m, axis=1) - 1).max()))
                    vectors += len(arr)
            for r, spec in extras.items():
                if spec["column"] not in part.schema.names:
                    found.append(f"{url}: column {spec['column']} ({r}) is missing")
                    continue
                counted = 0
                for batch in part.iter_batches(columns=[spec["column"]]):
                    problem, n, off = check_representation(r, spec, batch.column(0))
                    if problem:
                        found.append(f"{url}: column {spec['column']}: {problem}")
                        break
                    counted, worst = counted + n, max(worst, off)
                key = "sparse_weights" if r == "sparse" else "multi_vectors"
                if key in entry.counts and entry.counts[key] != counted:
                    found.append(f"{url}: {counted} {key.replace('_', ' ')}, the manifest says {entry.counts[key]}")
            return found, part.num_rows, vectors, worst

    results = concurrently(check, todo, threads)
    rows = sum(r[1] for r in results)
    vectors = sum(r[2] for r in results)
    worst = max((r[3] for r in results), default=0.0)
    problems += [p for r in results for p in r[0]]
    if worst > tol:
        problems.append(f"a vector's norm is off 1 by {worst:.2e} (tolerance {tol})")
    if rows != manifest.counts["rows"]:
        problems.append(f"parts hold {rows} rows, the manifest counts {manifest.counts['rows']}")
    summary = {"output": uri, "parts": len(listed), "rows": rows, "vectors_checked": vectors,
               "failed_rows": manifest.counts.get("failed_rows", 0),
               "max_norm_error": worst, "norms_checked": not quantized, "ok": not problems}
    return problems, summary


def check_sample(p: Prepared, rows: int, seed: int, threads: int = 16) -> tuple[list[str], dict]:
    """(problems, summary) of re-embedding `rows` rows of the job's finished output with
    sentence-transformers (on CPU) and comparing them, quantised and truncated as stored, with
    the stored vectors: the fidelity check of the whole run, where the one at the engine's start
    saw its first 16 rows in a call of their own. The rows are drawn at random (`seed`) from up to
    SAMPLE_PARTS parts; their texts are read from the job's input and matched by text_hash. Rows
    with no vector (null or failed), empty texts and chunked long texts are not comparable."""
    manifest = p.out.read_manifest()
    if manifest is None:
        return [f"no {MANIFEST} at {p.out.url}: not a finished batchembed output"], {}
    if manifest.job.get("digest") != p.fingerprint.digest:
        raise JobError(f"--sample: the job file describes another output than {p.out.url} (job digest "
                       f"{p.fingerprint.digest}, the output's {manifest.job.get('digest')})")
    reason = fidelity.reference_unavailable(p, beside_engine=False)
    if reason is not None:
        raise JobError(f"--sample: no reference vectors for {p.model.path}: {reason}")
    emb = manifest.embedding
    dtype, columns = emb.output_dtype, emb.columns
    ranges = {d: np.asarray(emb.calibration["ranges"][str(d)], dtype=np.float32) for d in columns} \
        if dtype in SCALAR else {}
    id_col = p.spec.input.id_column
    rng = np.random.default_rng(seed)
    parts = [e for e in manifest.parts if e.rows]
    if not parts:
        return [], {"rows": 0, "seed": seed, "parts": 0, "skipped": {}, "columns": {},
                    "min_cosine_required": p.spec.fidelity_min_cosine}
    parts = [parts[i] for i in sorted(rng.choice(len(parts), size=min(SAMPLE_PARTS, len(parts)), replace=False))]
    offsets = np.cumsum([0] + [e.rows for e in parts])
    drawn = np.sort(rng.choice(offsets[-1], size=min(rows, int(offsets[-1])), replace=False))
    files = {f.fingerprint["path"]: f for f in p.files}
    problems: list[str] = []

    def read(k: int) -> tuple[pa.Table, list[tuple[str, int, str | None]]] | None:
        """Part k's drawn rows as stored (id, text_hash, vectors), and for each its (part, row,
        input text); None where none was drawn or its input changed."""
        entry = parts[k]
        mine = drawn[(drawn >= offsets[k]) & (drawn < offsets[k + 1])] - offsets[k]
        if not len(mine):
            return None
        f = files.get(entry.input["path"])
        a, b = entry.input["row_groups"]
        task = Task(-1, f, tuple(range(a, b)), entry.rows, 0) if f is not None else None
        if task is None or task.input_fingerprint != entry.input:  # as resume tells a changed input
            problems.append(f"{entry.name}: its input {entry.input['path']} is gone or changed since the run; "
                            "not sampled")
            return None
        with p.out.open_part(entry.name) as part:
            stored = part.read([id_col, TEXT_HASH, *columns.values()]).take(mine)
        texts: dict[int, str | None] = {}
        seen, want = 0, set(mine.tolist())
        for batch in p.iter_batches(task, 8192):
            _, batch_texts, _ = select_rows(p.spec.input, batch)
            texts.update((seen + i, t) for i, t in enumerate(batch_texts) if seen + i in want)
            seen += len(batch_texts)
            if seen > mine[-1]:
                break
        return stored, [(entry.name, int(r), texts.get(int(r))) for r in mine]

    found = [r for r in concurrently(read, list(range(len(parts))), threads) if r is not None]
    stored = pa.concat_tables([t for t, _ in found], promote_options="permissive") if found else None
    where = [w for _, ws in found for w in ws]  # (part, row, input text) of each row of `stored`
    skipped = {"no vector": 0, "empty text": 0, "chunked": 0}
    keep: list[int] = []
    if stored is not None:
        texts = [text for _, _, text in where]
        has_vector = np.logical_and.reduce([stored.column(c).is_valid().to_numpy(zero_copy_only=False)
                                            for c in columns.values()])
        matches = text_hashes(texts) == stored.column(TEXT_HASH).fill_null(0).to_numpy(zero_copy_only=False)
        for i, (name, r, text) in enumerate(where):
            if not has_vector[i] or text is None:
                skipped["no vector"] += 1
            elif not matches[i]:
                problems.append(f"{name} row {r} (id {stored.column(id_col)[i].as_py()}): its text_hash is not "
                                "that of the input's text there (the input changed since the run?)")
            elif text == "":
                skipped["empty text"] += 1
            else:
                keep.append(i)
        chunked = p.tokenizer()([texts[i] for i in keep]).chunks or {}
        skipped["chunked"] = len(chunked)
        keep = [i for j, i in enumerate(keep) if j not in chunked]
    required = sign_cosine(p.spec.fidelity_min_cosine) if dtype in PACKED else p.spec.fidelity_min_cosine
    summary: dict = {"rows": len(keep), "seed": seed, "parts": len(parts), "skipped": skipped,
                     "min_cosine_required": round(required, 6), "columns": {}}
    if not keep:
        problems.append("--sample: none of the drawn rows could be compared (" +
                        ", ".join(f"{n} {why}" for why, n in skipped.items() if n) + ")")
        return problems, summary
    ref = fidelity.reference_vectors(str(p.model.path), p.max_length, p.spec.model.text_prefix,
                                     [where[i][2] for i in keep])
    stored = stored.take(keep)
    valid = np.ones(len(keep), dtype=bool)
    for d, col in columns.items():
        expected = vector_array(l2_normalise(ref[:, :int(d)]), valid, dtype, ranges.get(d))
        cos = fidelity.cosines(comparable(stored.column(col), dtype, ranges.get(d)),
                               comparable(expected, dtype, ranges.get(d)))
        summary["columns"][col] = {"min_cosine": round(float(cos.min()), 6), "mean_cosine": round(float(cos.mean()), 6)}
        low = np.flatnonzero(cos < required)
        if len(low):
            named = "; ".join(f"{where[keep[j]][0]} row {where[keep[j]][1]} (id {stored.column(id_col)[j].as_py()}): "
                              f"{cos[j]:.4f}" for j in low[:EXAMPLES])
            what = (f"{required:.4f} (the sign bits' agreement that fidelity_min_cosine "
                    f"{p.spec.fidelity_min_cosine} allows)" if dtype in PACKED
                    else f"fidelity_min_cosine {p.spec.fidelity_min_cosine}")
            problems.append(f"{col}: {len(low)} of {len(keep)} sampled rows are below {what} against "
                            f"sentence-transformers: {named}")
    return problems, summary


def check_representation(r: str, spec: dict, col) -> tuple[str | None, int, float]:
    """One batch of a sparse or multi-vector column: (its first problem or None, the weights or
    vectors it holds, the largest |norm - 1| of its token vectors)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if r == "sparse":
        if col.type != SPARSE_TYPE:
            return f"is {col.type}, expected {SPARSE_TYPE}", 0, 0.0
        n = 0
        for row in sparse_rows(col):
            if row is None:
                continue
            ids, ws = row
            if len(ids) != len(ws):
                return "a row has as many ids as weights", 0, 0.0
            if len(ids) and (np.any(np.diff(ids) <= 0) or ids[0] < 0
                             or (spec.get("vocab_size") and ids[-1] >= spec["vocab_size"])):
                return "a row's ids are not ascending vocabulary ids", 0, 0.0
            if len(ws) and not (np.all(np.isfinite(ws)) and ws.min() > 0):
                return "a row holds a weight that is not a positive number", 0, 0.0
            n += len(ids)
        return None, n, 0.0
    inner = getattr(col.type, "value_type", None)
    if getattr(inner, "list_size", None) != spec["dimension"]:
        return f"is {col.type}, expected lists of {spec['dimension']}-value vectors", 0, 0.0
    rows = [m for m in multi_vector_rows(col) if m is not None and len(m)]
    if not rows:
        return None, 0, 0.0
    m = np.concatenate(rows)
    off = 0.0 if spec.get("dtype") == "int8" else float(np.abs(np.linalg.norm(m, axis=1) - 1).max())
    return None, len(m), off


def sign_cosine(cosine: float) -> float:
    """The cosine of two vectors' sign bits (as +1 / -1) to expect when the vectors' own cosine is
    `cosine`: a sign differs with probability angle / pi (random hyperplanes, as in SimHash), so
    1 - 2 * arccos(cosine) / pi. Binary outputs hold only the signs, and a float error that a
    float output's threshold allows flips the signs of the components near zero."""
    return 1 - 2 * float(np.arccos(np.clip(cosine, -1, 1))) / np.pi

