"""A job, read to written: plan.py (every decision, made once, into a JobPlan), sequence.py (what every run does
with a plan: requests prepared in order, the engine, the rows), request_settings.py (a row's settings over the
job's), run.py (a job over files: the library entry point behind `cbgen run` and `cbgen score`), dry_run.py
(`--dry-run`)."""
