"""Stock `sdpa` vs cbgen's per-sequence attention in transformers' continuous batching, paired in one process.

For each number of sequences, runs the same greedy `generate_batch` (random prompts of a fixed length, a fixed
number of new tokens, no EOS) once on the stock attention and once inside `cbgen.attention.per_sequence_attention`,
and prints tokens/s (prompt + generated tokens over the wall time of the call) for each, the speed-up, and how many
sequences came out token-identical (bf16 drifts with batch composition even on the stock path; use
`--dtype float32` to check equality).

The default model is a random Llama with SmolLM2-135M's shape in bf16: no download, same cost per token.

    python benchmarks/attention.py                                  # 32 and 64 sequences, 128 + 64 tokens each
    python benchmarks/attention.py --sequences 4 --layers 2         # a quick check that it runs
    python benchmarks/attention.py --model HuggingFaceTB/SmolLM2-135M-Instruct --sequences 16
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from contextlib import nullcontext

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model to measure: `--model` when given, else a random Llama of the requested shape."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = DTYPES[args.dtype]
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.prompt_tokens + args.new_tokens),
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def generate(model, prompts: list[list[int]], args: argparse.Namespace, per_sequence: bool) -> tuple[float, list]:
    """Wall time of one greedy `generate_batch` and the generated tokens, in prompt order."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from cbgen.attention import per_sequence_attention

    generation = GenerationConfig(do_sample=False, max_new_tokens=args.new_tokens, eos_token_id=None)
    page_size = args.page_size
    blocks = len(prompts) * (math.ceil((args.prompt_tokens + args.new_tokens) / page_size) + 1)
    batching = ContinuousBatchingConfig(
        auto_switch_to_flash=False,
        page_size=page_size,
        num_blocks=blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_requests_per_batch,
    )
    context = per_sequence_attention(model, required=True) if per_sequence else nullcontext()
    with context:
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation, batching)
        elapsed = time.perf_counter() - start
    by_prompt = {tuple(out.prompt_ids): out.generated_tokens for out in outputs.values()}
    return elapsed, [by_prompt.get(tuple(prompt)) for prompt in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, nargs="+", default=[32, 64], help="numbers of sequences to measure")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", help="hub id or folder to measure instead of the random Llama")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="engine default when not given")
    parser.add_argument("--max-requests-per-batch", type=int, default=None, help="engine default when not given")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    vocab = model.config.vocab_size
    shape = args.model or f"random Llama {args.layers}x{args.hidden}, {args.heads}/{args.kv_heads} heads"
    print(f"{shape}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens per sequence")

    rng = random.Random(0)
    warmup = [[rng.randrange(vocab) for _ in range(8)] for _ in range(2)]
    saved_new_tokens, args.new_tokens = args.new_tokens, 2
    generate(model, warmup, args, per_sequence=False)
    generate(model, warmup, args, per_sequence=True)
    args.new_tokens = saved_new_tokens

    print(f"{'sequences':>9} {'stock tok/s':>12} {'per-seq tok/s':>14} {'speed-up':>9} {'identical':>10}")
    for count in args.sequences:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(count)]
        tokens = count * (args.prompt_tokens + args.new_tokens)
        stock_time, stock_tokens = generate(model, prompts, args, per_sequence=False)
        ours_time, our_tokens = generate(model, prompts, args, per_sequence=True)
        identical = sum(a == b for a, b in zip(stock_tokens, our_tokens))
        print(f"{count:>9} {tokens / stock_time:>12.1f} {tokens / ours_time:>14.1f} "
              f"{stock_time / ours_time:>8.2f}x {identical:>5}/{count:<4}")


if __name__ == "__main__":
    main()
