"""Rows into token ids: templates.py (prompt templates over a row's columns), sandbox.py (Jinja2's sandbox,
bounded), prompts.py (chat templates and tokenization, and the prefix-aware order)."""
