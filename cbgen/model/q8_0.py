"""Reading a Q8_0 GGUF file straight into int8 layers: the model is built on torch's meta device (no memory), each
Q8_0 matrix is read from the file into cbgen's int8 panels (its int8 values and float16 scales as they are: Q8_0 is
cbgen.model.int8's scheme), and only the small tensors (norms, biases) become float32. No float copy of the weights
is ever made, so a job holds about what the file holds (transformers' own GGUF loader dequantizes every matrix to
float32 first: four times the file, then quantized again).

The embeddings and the output layer are Q8_0 in such files too, and stay int8 here: one table of panels serves both
when the model ties them (`Int8Embedding` reads its rows out of the output layer's panels).

Tensors are read with plain file reads, not through the reader's memory map, so the file's pages stay in the page
cache and out of the job's resident memory. The names, and the rows transformers reorders (Llama's query and key
projections), are transformers' own: its tensor-name map, and its tensor processor applied to each row's index, so
the int8 rows land where the dequantized ones would. An architecture whose processor does more than reorder rows
(MoE experts split, fused tensors reshaped) is unfit: it loads through transformers and is quantized after.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import numpy as np
import torch

from cbgen.model.int8 import GROUP, Int8Linear, Quantized, block_n, dequantize, kernel_ops

if TYPE_CHECKING:
    from cbgen.model.gguf import GgufCache

TABLE_ENTRY = "int8-table"  # the converted-GGUF cache's entry holding a Q8_0 file's Table
TABLE_FILE = "tensors.json"
_Q8_0_BLOCK = 2 + GROUP  # bytes of one block in the file: a float16 scale, then 32 int8 values


class Unfit(Exception):
    """The file cannot be read straight into int8 layers (the message says why); it loads the dequantizing way."""


class Int8Embedding(torch.nn.Module):
    """An embedding table held as int8 in an Int8Linear's panels (row v is output column v of `table`): a lookup
    dequantizes the rows it gathers, the values a float32 table of the dequantized weights holds."""

    def __init__(self, table: Int8Linear, padding_idx: int | None = None) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.padding_idx = padding_idx
        self.out_dtype = torch.float32  # the model's dtype (cbgen.model.int8.cast_around sets it)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        panel, column = flat // self.table.width, flat % self.table.width
        rows = dequantize(self.table.packed[panel, :, column], self.table.packed_scales[panel, :, column].float())
        return rows.to(self.out_dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 (32-input scales)"


class Tensor(NamedTuple):
    """Where one tensor lies in the file: what the loader needs of it (the gguf package's reader holds more)."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]  # GGUF's order: the fastest-moving dimension first
    n_bytes: int
    data_offset: int


@dataclass
class Table:
    """A GGUF file's architecture, its model config and its tensor table: all of the file a Q8_0 load reads before
    the weights, kept in the converted-GGUF cache (TABLE_ENTRY) so later loads parse none of its metadata (the
    tokenizer's: 0.3 GiB of Python objects for Llama 3's 128k tokens)."""

    architecture: str
    config: Any
    tensors: list[Tensor]

    @classmethod
    def parse(cls, path: Path) -> Table:
        import gguf
        from transformers import AutoConfig

        reader = gguf.GGUFReader(path)
        return cls(str(reader.fields["general.architecture"].contents()),
                   AutoConfig.from_pretrained(path.parent, gguf_file=path.name),
                   [Tensor(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), int(t.n_bytes),
                           int(t.data_offset)) for t in reader.tensors])

    def save(self, folder: Path) -> None:
        self.config.save_pretrained(folder)
        (folder / TABLE_FILE).write_text(json.dumps({"architecture": self.architecture, "tensors": [
            t._asdict() for t in self.tensors]}), encoding="utf-8")

    @classmethod
    def read(cls, folder: Path) -> Table:
        from transformers import AutoConfig

        saved = json.loads((folder / TABLE_FILE).read_text(encoding="utf-8"))
        tensors = [Tensor(**(t | {"shape": tuple(t["shape"])})) for t in saved["tensors"]]
        return cls(saved["architecture"], AutoConfig.from_pretrained(folder), tensors)


def file_table(path: Path, cache: GgufCache | None) -> Table:
    """The file's Table, from the cache where it holds it, else parsed (and written there)."""
    from cbgen.model.gguf import load_cached, rebuild

    table, failure = load_cached(cache, TABLE_ENTRY, Table.read)
    if table is not None:
        return table
    table = Table.parse(path)
    if cache is not None:
        with cache.converting(TABLE_ENTRY):
            if cache.find(TABLE_ENTRY) is None:
                rebuild(cache, TABLE_ENTRY, failure)
                cache.write(TABLE_ENTRY, table.save)
    return table


def _read(file: BinaryIO, tensor: Tensor, offset: int, size: int) -> np.ndarray:
    data = os.pread(file.fileno(), size, tensor.data_offset + offset)
    if len(data) != size:
        raise ValueError(f"{file.name}: the file ends inside the tensor '{tensor.name}' (a truncated download?)")
    return np.frombuffer(data, dtype=np.uint8)


def float_values(file: BinaryIO, tensor: Tensor) -> np.ndarray:
    """A tensor of the open file dequantized to float32 by the gguf package, in numpy's order of its dimensions."""
    import gguf

    raw = _read(file, tensor, 0, tensor.n_bytes).reshape(*reversed(tensor.shape[1:]), -1)
    return np.asarray(gguf.dequantize(raw, gguf.GGMLQuantizationType(tensor.tensor_type)), dtype=np.float32)


def panel_shapes(tensor: Tensor, width: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of a Q8_0 matrix's int8 panels of `width` outputs and of their scales (cbgen.model.int8's layout)."""
    columns, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest-moving dimension first
    panels = -(-rows // width)
    return (panels, columns, width), (panels, columns // GROUP, width)


def read_panels(file: BinaryIO, tensor: Tensor, order: torch.Tensor | None, packed: torch.Tensor,
                packed_scales: torch.Tensor) -> None:
    """Fills `packed` and `packed_scales` (of `panel_shapes`) with a Q8_0 matrix of the open file, the columns past its
    last row zero. Output row i is the file's row `order[i]` (all rows in order where None). Read a panel's rows at a
    time with plain file reads: nothing larger than a panel's rows is held besides the panels themselves."""
    columns, rows = (int(n) for n in tensor.shape)
    blocks = columns // GROUP
    row_bytes = blocks * _Q8_0_BLOCK
    sources = order.numpy() if order is not None else np.arange(rows)
    width = packed.shape[2]
    for panel in range(packed.shape[0]):
        wanted = sources[panel * width : (panel + 1) * width]
        low, high = int(wanted.min()), int(wanted.max()) + 1
        raw = _read(file, tensor, low * row_bytes, (high - low) * row_bytes).reshape(high - low, blocks,
                                                                                    _Q8_0_BLOCK)[wanted - low]
        count = len(wanted)
        packed[panel, :, :count] = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8)
                                                    .reshape(count, columns)).t()
        packed_scales[panel, :, :count] = torch.from_numpy(np.ascontiguousarray(raw[..., :2]).view(np.float16)
                                                           [..., 0]).t()
        packed[panel, :, count:] = 0
        packed_scales[panel, :, count:] = 0


class Arena:
    """One block of memory for all of a model's int8 panels, and one for their scales, handed out in the order the
    layers are asked for: a model's weights in two allocations (no heap left in holes between them as a load
    allocates and frees), and a decoder layer's projections side by side, so that merging them (cbgen.model.fused)
    is a view, not a copy."""

    def __init__(self, shapes: list[tuple[tuple[int, int, int], tuple[int, int, int]]]) -> None:
        self.values = torch.empty(sum(int(np.prod(p)) for p, _ in shapes), dtype=torch.int8)
        self.scales = torch.empty(sum(int(np.prod(s)) for _, s in shapes), dtype=torch.float16)
        self._at = [0, 0]

    def take(self, shapes: tuple[tuple[int, int, int], tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        views = []
        for index, (whole, shape) in enumerate(zip((self.values, self.scales), shapes, strict=True)):
            count = int(np.prod(shape))
            views.append(whole[self._at[index] : self._at[index] + count].view(shape))
            self._at[index] += count
        return views[0], views[1]


def _row_order(processor: Any, name: str, rows: int) -> torch.Tensor | None:
    """Where transformers' tensor processor puts each row of the tensor `name` (None: where they are); Unfit when it
    does more than reorder rows."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    result = processor.process(weights=index, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
    order = np.asarray(result.weights)
    if result.name != name or order.shape != (rows, 1) or \
            not np.array_equal(np.sort(order[:, 0]), np.arange(rows)):
        raise Unfit(f"transformers' GGUF processor does more than reorder the rows of '{name}'")
    return None if np.array_equal(order[:, 0], np.arange(rows)) else torch.from_numpy(order[:, 0].copy())


def _processor(architecture: str, config: Any) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor

    kind = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if kind not in (TensorProcessor, LlamaTensorProcessor):
        raise Unfit(f"the '{architecture}' architecture's tensors are rearranged as they load")
    return kind(config=config.to_dict())


def _check_shape(tensor: Tensor, hf_name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise ValueError(f"the GGUF tensor '{tensor.name}' has shape {shape}, the model's '{hf_name}' {expected}")


def _set_tensor(model: torch.nn.Module, tensor: Tensor, hf_name: str, value: torch.Tensor) -> None:
    module_name, _, attribute = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, attribute)
    _check_shape(tensor, hf_name, tuple(value.shape), tuple(old.shape))
    if isinstance(old, torch.nn.Parameter):
        setattr(module, attribute, torch.nn.Parameter(value, requires_grad=False))
    else:
        setattr(module, attribute, value)


def _materialize_buffers(model: torch.nn.Module) -> None:
    """Buffers a model computes rather than loads (rotary frequencies) are made on the CPU and computed as
    transformers computes them for a model it loads (its `_init_weights`)."""
    for module in model.modules():
        meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        for name in meta:
            setattr(module, name, torch.empty_like(getattr(module, name), device="cpu"))
        if meta:
            model._init_weights(module)  # type: ignore[operator]


def load_q8_0(path: Path, table: Table, attn: str | None) -> tuple[torch.nn.Module, Quantized]:
    """The model of the file (its `table`) with its weights: its Q8_0 matrices as int8 layers, the rest float32."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from cbgen.model.gguf_parse import forget

    processor = _processor(table.architecture, table.config)  # Unfit: the parsed reader is kept for the fallback
    forget(path)  # else its objects are freed before any weight is read
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(table.config, dtype=torch.float32, attn_implementation=attn)
    names = get_gguf_hf_weights_map(model, processor)
    ops, why = kernel_ops()
    done = Quantized(kernel=why, loader="read as int8 from the file")
    tensors = [t for t in table.tensors if t.name in names]
    int8_rows = {t.name for t in tensors if _as_int8(model, names[t.name], t)}
    position = {name: index for index, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    as_int8 = sorted((t for t in tensors if t.name in int8_rows),
                     key=lambda t: position[names[t.name].rpartition(".")[0]])  # the model's order of layers
    width = block_n()  # this machine's panels (cbgen.model.int8.block_n)
    shapes = {t.name: panel_shapes(t, width) for t in as_int8}  # in the model's order, as the arena hands them out
    arena = Arena(list(shapes.values()))
    with open(path, "rb") as file:
        for tensor in tensors:  # the float tensors first: an int8 layer takes its bias from its float Linear
            if tensor.name not in int8_rows:
                values = processor.process(weights=float_values(file, tensor), name=tensor.name,
                                           tensor_key_mapping=names, parsed_parameters={"tensors": {}}).weights
                _set_tensor(model, tensor, names[tensor.name], torch.from_numpy(np.array(values, dtype=np.float32)))
        layers = {names[t.name]: _int8_layer(model, file, t, names[t.name], processor, arena.take(shapes[t.name]),
                                             ops, done) for t in as_int8}
    _tie_or_place(model, layers, done)
    _materialize_buffers(model)
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise Unfit(f"the file holds no tensor for '{left[0]}'" + (f" and {len(left) - 1} more" if left[1:] else ""))
    return model.eval(), done


def _as_int8(model: torch.nn.Module, hf_name: str, tensor: Tensor) -> bool:
    """Whether the file's tensor becomes int8: a Q8_0 matrix that is a linear layer's or an embedding table's weight."""
    import gguf

    module_name, _, attribute = hf_name.rpartition(".")
    module = model.get_submodule(module_name)
    return tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0 and attribute == "weight" and \
        len(tensor.shape) == 2 and type(module) in (torch.nn.Linear, torch.nn.Embedding)


def _int8_layer(model: torch.nn.Module, file: BinaryIO, tensor: Tensor, hf_name: str, processor: Any,
                panels: tuple[torch.Tensor, torch.Tensor], ops: Any, done: Quantized) -> Int8Linear:
    module = model.get_submodule(hf_name.rpartition(".")[0])
    rows = int(tensor.shape[1])
    _check_shape(tensor, hf_name, (rows, int(tensor.shape[0])), tuple(module.get_parameter("weight").shape))
    packed, packed_scales = panels
    read_panels(file, tensor, _row_order(processor, tensor.name, rows), packed, packed_scales)
    bias = getattr(module, "bias", None) if isinstance(module, torch.nn.Linear) else None
    layer = Int8Linear(packed, packed_scales, bias, rows, ops)
    done.bytes_before += rows * int(tensor.shape[0]) * 4
    done.bytes_after += layer.bytes()
    return layer


def _tie_or_place(model: Any, tables: dict[str, Int8Linear], done: Quantized) -> None:
    """Each int8 table takes its module's place: a linear layer's as itself, an embedding's as an Int8Embedding;
    a tied output layer reads the embedding's panels. `model`: a transformers causal LM."""
    head = model.get_output_embeddings()
    tied_head = head is not None and getattr(head, "weight", None) is getattr(model.get_input_embeddings(), "weight",
                                                                              None)
    for hf_name, table in tables.items():
        module = model.get_submodule(hf_name.rpartition(".")[0])
        if isinstance(module, torch.nn.Embedding):
            _replace(model, module, Int8Embedding(table, module.padding_idx))
            done.embeddings = "int8"
            if tied_head:
                _replace(model, head, table)
                done.layers += 1
        else:
            _replace(model, module, table)
            done.layers += 1


def _replace(model: torch.nn.Module, module: torch.nn.Module, replacement: torch.nn.Module) -> None:
    """`replacement` wherever the model holds `module`."""
    for parent in model.modules():
        for child, value in list(parent.named_children()):
            if value is module:
                setattr(parent, child, replacement)
