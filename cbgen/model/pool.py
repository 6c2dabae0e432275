"""Models loaded once and shared by the jobs that ask for the same one: a pipeline's stages (cbgen.pipelines)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cbgen.config import ModelSection
    from cbgen.model.load import LoadedModel


class ModelPool:
    """Keeps each model loaded under its `model` settings: a job asking for the same settings gets the same one. The
    LoRA adapters a job names are not the model's: they are merged while its rows run, over whichever job's model."""

    def __init__(self) -> None:
        self._loaded: dict[str, LoadedModel] = {}
        self.loads = 0  # how many models were actually loaded

    def load(self, settings: ModelSection) -> LoadedModel:
        from cbgen.model.load import load_model

        key = json.dumps(dataclasses.asdict(settings) | {"adapter": None, "adapter_any_base": None},
                         sort_keys=True)
        if key not in self._loaded:
            self._loaded[key] = load_model(settings)  # checks the adapters it names fit the model
            self.loads += 1
        elif settings.adapter is not None:
            from cbgen.model.adapter_fit import check_section

            check_section(settings, lambda: self._loaded[key].model)
        return self._loaded[key]
