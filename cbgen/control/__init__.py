"""Control inside each step: structured outputs (formats.py: what is asked; grammars.py: llguidance), the model's
own logprobs and top logprobs, and seeded sampling independent of batch-mates (processor.py)."""
