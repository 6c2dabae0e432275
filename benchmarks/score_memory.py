"""Peak memory of scoring one long text: `cbgen score` against a plain forward pass that holds every position's
logits and their log-softmax.

A model of SmolLM2-135M's shape (random weights, its 49,152-token vocabulary) with a 32k-token context scores one
text of about 32,000 tokens, each way in a fresh process; the script prints each peak RSS and the size that
tokens × vocabulary float32 logits alone would take. cbgen works the log-softmax 64 MB of logits at a time.

    python benchmarks/score_memory.py                    # cbgen score, 32,000 tokens
    python benchmarks/score_memory.py --naive            # and the plain forward pass (needs about 20 GB)
    python benchmarks/score_memory.py --tokens 8000 --naive
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""

NAIVE = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM

os.environ["CBGEN_RESULT_CACHE"] = "off"  # every timed run computes: the result cache would answer repeats
config = AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
ids = json.load(open(sys.argv[2]))
with torch.inference_mode():
    logprobs = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    total = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum()
print(float(total))
"""

SHAPE = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=2, torch_dtype="bfloat16")


def _peak(command: list[str]) -> tuple[int, float, float]:
    """(exit code, peak RSS in GB, seconds) of `command` in a fresh process."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True, check=True)
    code, kilobytes = out.stdout.split()[-2:]
    return int(code), int(kilobytes) / 1e6, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32_000)
    parser.add_argument("--layers", type=int, default=30, help="Decoder layers (SmolLM2-135M has 30).")
    parser.add_argument("--naive", action="store_true", help="Also measure the plain forward pass.")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from cbgen.bench.workloads import WORDS
    from cbgen.model.source import embedded_model_path

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = folder / "config.json"
        config.write_text(json.dumps({**SHAPE, "num_hidden_layers": args.layers,
                                      "max_position_embeddings": max(32_768, args.tokens + 16)}))
        words = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(args.tokens))
        ids = tokenizer(words)["input_ids"][: args.tokens]
        text = tokenizer.decode(ids)
        (folder / "rows.jsonl").write_text(json.dumps({"id": "long", "text": text}) + "\n")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        os.environ.update(env)
        command = str(Path(sys.executable).parent / "cbgen")  # this environment's, whatever PATH holds
        code, cbgen_gb, cbgen_s = _peak([command, "score", str(folder / "rows.jsonl"), "-o", str(folder / "out"),
                                         "--model", str(config), "--dtype", "bfloat16", "-q"])
        row = json.loads((folder / "out").glob("part-*.jsonl").__next__().read_text())
        tokens = row["num_scored_tokens"] + 1
        logits_gb = tokens * SHAPE["vocab_size"] * 4 / 1e9
        print(f"text of {tokens:,} tokens, vocabulary {SHAPE['vocab_size']:,}, {args.layers} layers (bfloat16)")
        print(f"  float32 logits of every position alone would take {logits_gb:.1f} GB "
              f"(their log-softmax as much again)")
        print(f"  cbgen score: exit {code}, peak RSS {cbgen_gb:.2f} GB, {cbgen_s:.1f} s (logprob {row['logprob']:.1f})")
        if args.naive:
            (folder / "ids.json").write_text(json.dumps(tokenizer(text)["input_ids"]))
            code, naive_gb, naive_s = _peak([sys.executable, "-c", NAIVE, str(config), str(folder / "ids.json")])
            print(f"  plain forward + log-softmax: exit {code}, peak RSS {naive_gb:.2f} GB, {naive_s:.1f} s")


if __name__ == "__main__":
    main()
