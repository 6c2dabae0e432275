"""What int8 arithmetic would cost in answers: greedy tokens of a model whose linear layers hold int8 weights (Q8_0's
scheme, cbgen.model.int8), computed three ways, against the same weights dequantized to float32 and run by stock
transformers (the reference cbgen's int8 path is held to: the first 32 tokens of at least 95 % of rows equal):

- activations quantized as llama.cpp's Q8_0 path does (each row's every 32 inputs scaled by their largest magnitude
  to int8; `--quantize w8a8`, cbgen.model.int8.quantize_rows): what an int8 x int8 kernel (VPDPBUSD) computes,
  simulated here in float32 (its int32 sums are exact, so only the activations' rounding differs from the reference);
- the same per 32 inputs with two int8 digits each (a 15-bit activation), for scale;
- bfloat16 (weights and activations rounded to bfloat16, float32 sums): what a bfloat16 model of the same weights
  answers.

The rows are chat prompts of the embedded model (`--model` another folder or GGUF file), left-padded into one batch,
`--tokens` new tokens each. Figures: rows whose first 32 tokens equal the reference's, and where each row first
differs. About 1 minute on 2 cores for the embedded model.

    python benchmarks/int8_activations.py
    python benchmarks/int8_activations.py --rows 96 --model ~/models/Llama-3.2-1B-Instruct
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or GGUF file (default: the embedded model)")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    import torch

    from cbgen.config import ModelSection
    from cbgen.model import int8
    from cbgen.model.load import load_model

    loaded = load_model(ModelSection(model=args.model, dtype="float32", device="cpu", quantize="none"))
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.in_features % int8.GROUP == 0 and
              m is not model.get_output_embeddings()]  # as --quantize int8 picks them
    with torch.no_grad():  # the reference: the int8 weights dequantized, float32 (cbgen.model.int8's own arithmetic)
        for m in layers:
            m.weight.copy_(int8.dequantize(*int8.quantize(m.weight)))
    colours = ["red", "green", "blue", "amber"]
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Tell me about the number {i} and the colour {colours[i % 4]}."}],
        tokenize=False, add_generation_prompt=True) for i in range(args.rows)]
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)

    def greedy() -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                 pad_token_id=pad)
        return out[:, batch["input_ids"].shape[1]:]

    def two_digits(x: torch.Tensor) -> torch.Tensor:
        """Each row's every 32 inputs as two int8 digits over one scale."""
        blocks = x.float().reshape(*x.shape[:-1], -1, int8.GROUP)
        d = blocks.abs().amax(-1, keepdim=True) / (127 * 128)
        q = (blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))).round()
        return (q * d).reshape(x.shape).to(x.dtype)

    reference = greedy()
    answers = {}
    for name, rows in (("activations in int8 (w8a8)", int8.quantize_rows), ("activations in two int8 digits",
                                                                               two_digits)):
        hooks = [m.register_forward_pre_hook(lambda _, a, f=rows: (f(a[0]),)) for m in layers]
        answers[name] = greedy()
        for hook in hooks:
            hook.remove()
    model.to(torch.bfloat16)
    answers["bfloat16 weights and activations"] = greedy()
    first = min(32, args.tokens)
    print(f"{args.rows} rows, {args.tokens} new tokens, against the dequantized int8 model in float32 "
          f"(stock transformers, greedy); {len(layers)} int8 layers")
    for name, tokens in answers.items():
        differs = [next((j for j in range(first) if tokens[i, j] != reference[i, j]), first)
                   for i in range(args.rows)]
        same = sum(d == first for d in differs)
        print(f"  {name:40} first {first} tokens equal in {same} of {args.rows} rows ({same / args.rows:.0%}); "
              f"first difference at token {sorted(differs)[len(differs) // 2]} (median)")


if __name__ == "__main__":
    main()
