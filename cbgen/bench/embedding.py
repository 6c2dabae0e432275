"""The suite's embedding paths: cbgen's embeddings against sentence-transformers' `encode` on the same real texts and
threads (encode alone, each model loaded once), the same two as whole commands from a file (process start, imports,
model load, reading and writing included), and the dedup stage over 100,000 planted vectors.

The texts are the standard library's own docstrings (20 to 2,000 characters: most a sentence or two, some pages),
the same for a Python version on every machine; where more are asked for than it has, they repeat with a numbered
prefix. sentence-transformers runs as its users run it: `encode`, batch_size 32, float32.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

_MODULES = ("json os re collections itertools functools pathlib subprocess threading asyncio argparse logging email "
            "http.client urllib.request unittest typing dataclasses inspect pickle shutil tarfile zipfile csv sqlite3 "
            "decimal statistics random datetime calendar string textwrap difflib socket ssl io tempfile "
            "configparser hashlib struct enum math contextlib traceback ast doctest multiprocessing "
            "concurrent.futures queue smtplib mailbox html.parser xmlrpc.client ipaddress locale platform "
            "importlib").split()


def real_texts(count: int) -> list[str]:
    """`count` texts: the docstrings of some sixty standard-library modules' members, then of their classes'
    members, then those again with a numbered prefix."""
    members: dict[str, None] = {}
    methods: dict[str, None] = {}
    for name in _MODULES:
        for _, member in inspect.getmembers(importlib.import_module(name)):
            objects = [(members, member)]
            if inspect.isclass(member):
                objects += [(methods, value) for value in vars(member).values()]
            for found, obj in objects:
                try:
                    doc = inspect.getdoc(obj)
                except Exception:  # noqa: BLE001 - an object whose docstring cannot be read has none for us
                    continue
                if doc and len(doc) > 20:
                    found[doc[:2000]] = None
    unique = list(members) + [doc for doc in methods if doc not in members]
    texts = unique[:count]
    copy = 1
    while len(texts) < count:
        texts += [f"({copy}) {doc}" for doc in unique[: count - len(texts)]]
        copy += 1
    return texts


def sentence_transformers_model(location: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(location, device="cpu")


def encode_paths(texts: list[str], embedders: dict[str, Any], reference: Any) -> dict[str, Callable[[], Any]]:
    """Path name -> a call that embeds `texts` once: "sentence-transformers" and "cbgen <dtype>" for each of cbgen's
    `embedders` (cbgen.Embedder, loaded)."""
    paths: dict[str, Callable[[], Any]] = {
        "sentence-transformers": lambda: reference.encode(texts, batch_size=32, convert_to_numpy=True)}
    for name, embedder in embedders.items():
        paths[f"cbgen {name}"] = partial(embedder.embed, texts, progress=False)
    return paths


def lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cosine.min())


# sentence-transformers as a whole command: read the texts, load the model, encode, write the vectors
_ST_COMMAND = """
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
model = SentenceTransformer(sys.argv[2], device="cpu")
np.save(sys.argv[3], model.encode(texts, batch_size=32, convert_to_numpy=True))
"""


def command_paths(texts: list[str], folder: Path, model: str) -> dict[str, Callable[[], float]]:
    """Path name -> a call that runs one whole command over `texts` (written to a file in `folder`) and returns its
    seconds: `cbgen embed` with its defaults (Parquet out), and a Python script doing what a sentence-transformers
    user would (np.save out)."""
    source = folder / f"texts-{len(texts)}.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts)))
    cbgen_command = [sys.executable, "-m", "cbgen", "embed", str(source), "-o", str(folder / "cbgen-out"),
                     "--output-format", "parquet", "--overwrite", "-q", "--model", model]
    st_command = [sys.executable, "-c", _ST_COMMAND, str(source), model, str(folder / "st-out.npy")]
    return {"cbgen embed": lambda: _timed(cbgen_command), "sentence-transformers script": lambda: _timed(st_command)}


def _timed(command: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return seconds


def dedup_seconds(rows: int, dim: int = 384) -> tuple[float, dict[str, Any]]:
    """The dedup stage's table function over `rows` vectors with 5 % planted near-duplicates (threshold 0.95):
    its seconds, and recall and precision against the planted copies."""
    import pyarrow as pa

    from cbgen.pipelines import dedup

    vectors, planted = planted_set(rows, dim)
    table = pa.table({"id": [str(i) for i in range(len(vectors))],
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), dim)})
    started = time.perf_counter()
    _, dropped = dedup.dedup_table(table, {"embedding_column": "embedding", "threshold": 0.95})
    seconds = time.perf_counter() - started
    found = {int(i) for i in dropped.column("id").to_pylist()}
    true = len(found & planted)
    return seconds, {"recall": round(true / len(planted), 4), "precision": round(true / max(len(found), 1), 4)}


def planted_set(rows: int, dim: int, seed: int = 0) -> tuple[np.ndarray, set[int]]:
    """`rows` unit vectors clustered as real embeddings are (2,000 centres; nearest-neighbour cosine mostly 0.6-0.8),
    the last 5 % of them near-copies (cosine >= 0.97) of earlier rows: the vectors and the copies' indices."""
    rng = np.random.default_rng(seed)
    copies = rows // 20
    centres = rng.standard_normal((2000, dim)).astype(np.float32)
    base = centres[rng.integers(0, 2000, rows - copies)] + 0.9 * rng.standard_normal((rows - copies, dim),
                                                                                     dtype=np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    sources = np.sort(rng.choice(rows - copies, copies, replace=False))
    near = base[sources] + 0.01 * rng.standard_normal((copies, dim), dtype=np.float32)
    near /= np.linalg.norm(near, axis=1, keepdims=True)
    return np.concatenate([base, near]), set(range(rows - copies, rows))
