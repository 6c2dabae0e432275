"""The OpenAI shapes of a request and its reply: the tools a request offers the model (checked, rendered through the
chat template, constrained when a call is required: tools.py), the parts of a reply a response template separates
(reasoning, tool calls, content: responses.py), structured-output formats (formats.py) and Batch API lines, both
ways (openai_batch.py)."""
