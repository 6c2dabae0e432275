"""Pipelines: stages that generate, score and query (SQL) one after another, each into its own output directory,
resumable stage by stage and row by row (`cbgen pipeline FILE -o OUT`).

    spec      the pipeline file: stages, what each reads, the order they run in
    plan      every stage checked before any model loads, and the schema of each stage's table inferred
    tables    what later stages read of a stage: its columns carried on, its own fields in a struct by its name
    runner    each stage run like make: up-to-date stages skipped, changed ones (and those after) run again
    sql       an sql stage's query over earlier stages' tables, its result put in place whole
    status    each stage's progress, for `cbgen status OUT`
"""

from cbgen.pipelines.spec import Pipeline, Stage, load_pipeline

__all__ = ["Pipeline", "Stage", "load_pipeline"]
