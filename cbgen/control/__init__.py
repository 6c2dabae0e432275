"""Control inside each step: what a job's requests need of it (needs.py), per-request sampler stages (sampling.py),
structured outputs (grammars.py: llguidance, over the formats of cbgen.chat.formats), the model's own logprobs and
top logprobs, and seeded sampling independent of batch-mates (processor.py)."""
