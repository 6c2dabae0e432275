"""Hugging Face datasets input: a dataset saved with `save_to_disk`, a dataset folder of data files (Parquet,
JSONL, CSV, as `datasets.load_dataset` reads them, with its split layout), or a hub dataset id where the hub is
reachable. The Arrow table is memory-mapped, so rows stream without being loaded whole."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cbgen.errors import CbgenError, first_line
from cbgen.inputs.base import (
    DATA_SUFFIXES,
    FROM_PATH,
    HUB_ID,
    ID_FIELD,
    JSONL_SUFFIXES,
    ColumnarReader,
    Reader,
    ReaderOptions,
)

if TYPE_CHECKING:
    from cbgen.inputs.scoring import ScoreFields
    from cbgen.render.templates import PromptTemplate

BATCH_SIZE = 1000


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _pick_split(dataset: Any, split: str | None, name: str) -> Any:
    import datasets

    if not isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return dataset
    splits = list(dataset)
    if split is None:
        if len(splits) == 1:
            return dataset[splits[0]]
        if "train" in splits:
            return dataset["train"]
        raise CbgenError(f"dataset '{name}' has the splits {', '.join(splits)}: choose one with --split")
    if split not in dataset:
        raise CbgenError(f"dataset '{name}' has no split '{split}'; its splits are: {', '.join(splits)}")
    return dataset[split]


def load(source: str, *, split: str | None, subset: str | None) -> Any:
    """The `datasets.Dataset` that `source` names, or a CbgenError that says why not and what to do."""
    import datasets

    from cbgen.process.quiet import quiet

    path = Path(source)
    try:
        with quiet("datasets"):
            dataset = _loaded(datasets, path, source, split=split, subset=subset)
    except CbgenError:
        raise
    except Exception as e:  # datasets raises many types: missing files, bad configs, network and auth errors
        if path.exists():
            raise CbgenError(f"cannot load dataset '{source}': {first_line(e)}") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " (HF_HUB_OFFLINE is set)" if offline else ""
        raise CbgenError(f"no local file or folder '{source}' exists, and the Hugging Face Hub{hint} gave no dataset "
                         f"of that name: {first_line(e)}") from None
    return _pick_split(dataset, split, source)


def _loaded(datasets: Any, path: Path, source: str, *, split: str | None, subset: str | None) -> Any:
    if path.is_dir() and is_saved_dataset(path):
        return datasets.load_from_disk(str(path))
    if path.exists():
        if not path.is_dir():
            raise CbgenError(f"'{source}' is a file; --input-format dataset takes a dataset folder or a hub id")
        return datasets.load_dataset(str(path), name=subset, split=split)
    return datasets.load_dataset(source, name=subset, split=split)


class DatasetReader(ColumnarReader):
    """Rows of one split of a Hugging Face dataset; only the needed columns are read."""

    FORMAT = "dataset"

    @classmethod
    def detect(cls, path: str, local: Path) -> tuple[str, str] | None:
        """A folder (a saved dataset, a flat folder of Parquet files, or a dataset folder the datasets library lays
        out), or the hub id of a dataset where no such local path exists."""
        if local.is_dir():
            if is_saved_dataset(local):
                return cls.FORMAT, FROM_PATH
            if any(local.glob("*.parquet")):  # streams without the datasets library's cache
                return "parquet", FROM_PATH
            if not any(p.is_file() and p.name.lower().endswith(DATA_SUFFIXES) for p in local.rglob("*")):
                raise CbgenError(f"input directory '{path}' contains no data files ({', '.join(DATA_SUFFIXES)}) and "
                                 "is not a dataset saved with save_to_disk")
            return cls.FORMAT, FROM_PATH  # the datasets library reads its files and split layout
        name = local.name.lower()
        if not local.exists() and HUB_ID.match(path) and not name.endswith((*JSONL_SUFFIXES, ".parquet", ".gz")):
            return cls.FORMAT, FROM_PATH
        return None

    @classmethod
    def open(cls, path: str, options: ReaderOptions) -> Reader:
        return cls(path, split=options.split, subset=options.subset, **options.rows())

    def __init__(self, source: str, *, split: str | None = None, subset: str | None = None,
                 prompt_column: str | None = None, id_column: str | None = None,
                 keep_columns: Sequence[str] = (), detect_id: bool = True,
                 template: PromptTemplate | None = None, score: ScoreFields | None = None) -> None:
        super().__init__(source, prompt_column=prompt_column, id_column=id_column, keep_columns=keep_columns,
                         detect_id=detect_id, template=template, score=score)
        dataset = load(source, split=split, subset=subset)
        self._schema = dataset.features.arrow_schema
        names = list(dataset.column_names)
        self._detect_id_column([ID_FIELD] if ID_FIELD in names else [])
        self.columns = self._resolve_columns(f"dataset '{source}'", names)
        self.dataset = dataset.select_columns(self.columns)

    @property
    def kept_schema(self):
        """The kept columns' Arrow types, from the dataset's features."""
        import pyarrow as pa

        schema = self.dataset.features.arrow_schema
        return pa.schema([schema.field(c) for c in self.keep_columns])

    @property
    def schema(self):
        """Every column's Arrow type, from the dataset's features."""
        return self._schema

    def settings_present(self) -> set[str]:
        return {c for c in self.columns if c in self.row_settings}

    def _batches(self, columns: list[str]) -> Iterator[dict[str, list[Any]]]:
        yield from self.dataset.select_columns(columns).iter(batch_size=BATCH_SIZE)

    def _rows(self) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
        n = 0
        for batch in self._batches(self.columns):
            for values in zip(*(batch[c] for c in self.columns)):
                n += 1
                yield f"{self.name} row {n}", dict(zip(self.columns, values)), None

    def _ids(self) -> Iterator[tuple[int, Any]]:
        assert self.id_column is not None
        position = 0
        for batch in self._batches([self.id_column]):
            for value in batch[self.id_column]:
                yield position, value
                position += 1

    def _where(self, position: int, first: int) -> tuple[str, str]:
        return f"{self.name} row {position + 1}", f"first seen in row {first + 1}"

    def count(self) -> int:
        return len(self.dataset)
