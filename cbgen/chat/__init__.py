"""Chat turns beyond text: the tools a request offers the model (checked, rendered through the chat template,
constrained when a call is required) and the parts of a reply a response template separates (reasoning, tool
calls, content)."""
