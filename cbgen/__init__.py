"""cbgen: offline batch generation on Hugging Face transformers' continuous batching."""

__version__ = "0.1.0"
