"""PyLate's ColBERT, run in its own virtual environment (PyLate pins a sentence-transformers
older than the one the tests use): `python pylate_reference.py build BASE OUT SIZE` saves a random
PyLate ColBERT made from the BERT folder BASE, projecting to SIZE; `python pylate_reference.py encode MODEL TEXTS.json
OUT.npz` writes the document vectors PyLate computes for each text (arrays r0, r1, ...)."""

import json
import sys

import numpy as np


def main(argv: list[str]) -> int:
    import torch
    from pylate.models import ColBERT

    torch.manual_seed(0)
    if argv[0] == "build":
        base, out, size = argv[1], argv[2], int(argv[3])
        ColBERT(base, embedding_size=size, document_length=180, device="cpu").save(out)
        return 0
    model, texts, out = argv[1], json.load(open(argv[2])), argv[3]
    vectors = ColBERT(model, device="cpu").encode(texts, is_query=False, batch_size=8)
    np.savez(out, **{f"r{i}": np.asarray(v, dtype=np.float32) for i, v in enumerate(vectors)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
