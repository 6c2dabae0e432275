"""The job configuration: defaults < YAML file < flags, validated before any model loads.

A job is described by six sections. `batching` mirrors transformers' `ContinuousBatchingConfig` field for field; the
other sections are cbgen's own. Every value is checked where it enters, and the message names where it came from.
Nothing here imports torch or transformers, so commands that load no model answer at once.
"""

from cbgen.config.batching import BATCHING_FIELDS, BATCHING_REDIRECTS, page_size
from cbgen.config.build import build_config, check_combinations, read_yaml
from cbgen.config.sections import (
    SECTIONS,
    GenerationSection,
    InputSection,
    JobConfig,
    ModelSection,
    OutputSection,
    RunSection,
)
from cbgen.config.template import config_template
from cbgen.config.values import check_value

__all__ = [
    "BATCHING_FIELDS",
    "BATCHING_REDIRECTS",
    "SECTIONS",
    "GenerationSection",
    "InputSection",
    "JobConfig",
    "ModelSection",
    "OutputSection",
    "RunSection",
    "build_config",
    "check_combinations",
    "check_value",
    "config_template",
    "page_size",
    "read_yaml",
]
