"""Multi-LoRA in the forward pass: every slot's adapter weights stacked per projection, and the delta of a
batch that mixes the base model and several adapters.

Weights. Each fused projection of each layer (qkv_proj, o_proj, gate_up_proj, down_proj) gets a LoraStack:
    a    [max_loras, parts * max_rank, in]   lora_A of q, k and v (parts = 3) interleaved rank-major:
                                              row i * parts + j is rank row i of part j
    b_t  [max_loras, parts * max_rank, out]  lora_B transposed, times the adapter's scale; row i * parts + j
                                              is nonzero only in part j's output columns (q's, k's or v's)
Rank-major rows put an adapter of rank r in the first r * parts rows, so a slot computes with exactly its
own rank, not max_rank. A part the adapter does not target stays zero; a projection none of its parts
targets is skipped. Memory: for smollm2-135m (30 layers), 4 slots of rank 16 hold 29 M values
(116 MB in float32); they are allocated on the first load, so an engine that never loads an adapter pays
nothing.

A mixed batch. The runner reorders the step's sequences so that each slot's tokens are contiguous rows
(base tokens first, then by slot), computes every projection's base output for all rows as before, and
adds the deltas of the slots present in one of three layouts (batch_layout picks, per step):
  loop      per slot, y[rows] += (x[rows] @ a[slot]^T) @ b_t[slot]: two matmuls on row views; used for one
            slot, and for prefill-sized steps, where it computes exactly the rows that need it;
  view      consecutive slots with equal row counts (a decode step of 4 + 4 + 4 + 4 sequences) are one
            [slots, rows, in] view of x: two bmm calls for all slots, no copies;
  gathered  small uneven steps (a decode step of 7 + 4 + 3 + 2) gather the rows into a padded batch,
            two bmm calls, and read each row's delta back.
A batch without adapters runs the base path unchanged; base rows never get any LoRA work. No per-token
weights are ever copied. On a 2-core CPU (smollm2-135m, 4 adapters of rank 16 on all seven projections,
16 decode rows, the projections alone against the base): the loop cost 1.96x, the gathered batch 1.75x
and the view 1.64x, where a dense pair over all slots with a per-token slot mask cost 1.93x; at 512
prefill rows the loop cost 1.16-1.25x and the mask 1.26-1.36x. Copying per-token weights for a batched
matmul cost ~5x in prefill.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from kvgate.engine.lora.errors import AdapterLoadError
from kvgate.engine.lora.peft import PeftAdapter, projection_shape
from kvgate.engine.sequence import ModelInput

# HF module -> (our fused projection, its part index); parts are in row order of the fused weight.
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
# The largest padded batch of unequal slots (rows, padding included) computed as one bmm pair. On a 2-core
# CPU (smollm2-135m, 4 slots of rank 16, all projections, per forward against the base): rows 7+4+3+2 cost
# 1.75x batched and 1.96x in the loop; 20+16+16+12 cost 1.51x batched and 1.42x in the loop.
MAX_GATHERED_ROWS = 48
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class PaddedGroups:
    """A step's LoRA rows as one [num_slots, rows_per_slot] batch, so that every projection computes all
    slots' deltas in two bmm calls instead of two matmuls per slot. Slots first_slot .. first_slot +
    num_slots - 1; a slot of that range with fewer rows is padded (a slot with none is all padding)."""

    first_slot: int
    num_slots: int
    rows_per_slot: int
    row_start: int  # the LoRA rows are row_start .. row_end - 1 (base rows come first)
    row_end: int
    # The rows of x that make up the batch, [num_slots * rows_per_slot] (padding repeats row_start), and
    # for each LoRA row row_start .. row_end - 1 its place in the batch, to read its delta back. Both None
    # when every slot has exactly rows_per_slot rows: the rows are then already the batch (a view).
    gather: torch.Tensor | None
    scatter: torch.Tensor | None


@dataclass(frozen=True)
class LoraGroups:
    """Which rows of a step's flattened tokens use which slot: (slot, first row, end row), one range per
    slot present, ranges disjoint and in slot order. Rows in no range are base-model tokens. `padded`:
    the same as one batch, when that wastes little (see LoraSlots.arrange)."""

    ranges: tuple[tuple[int, int, int], ...]
    padded: PaddedGroups | None = None


class LoraStack:
    """The LoRA weights of every slot for one fused projection of one layer (layout in the module doc)."""

    def __init__(self, num_slots: int, max_rank: int, in_features: int, part_columns: tuple[tuple[int, int], ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.in_features = in_features
        self.part_columns = part_columns  # (first, end) output columns of each part
        self.dtype = dtype
        self.device = device
        self.num_rows = [0] * num_slots  # rows in use per slot: rank * parts, 0 when the slot adds nothing here
        self.a: torch.Tensor | None = None  # allocated on the first set()
        self.b_t: torch.Tensor | None = None

    def set(self, slot: int, rank: int, scale: float, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's weights in `slot`: parts maps part index -> (lora_A [rank, in], lora_B [out_j, rank])."""
        if not parts:
            self.clear(slot)
            return
        if self.a is None:
            num_parts, out_features = len(self.part_columns), self.part_columns[-1][1]
            rows = num_parts * self.max_rank
            self.a = torch.zeros(self.num_slots, rows, self.in_features, dtype=self.dtype, device=self.device)
            self.b_t = torch.zeros(self.num_slots, rows, out_features, dtype=self.dtype, device=self.device)
        num_parts = len(self.part_columns)
        a = torch.zeros(rank, num_parts, self.in_features)
        b_t = torch.zeros(rank, num_parts, self.b_t.shape[2])
        for part, (lora_a, lora_b) in parts.items():
            first, end = self.part_columns[part]
            a[:, part] = lora_a.float()
            b_t[:, part, first:end] = (lora_b.float() * scale).t()
        rows = rank * num_parts
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.a[slot, :rows] = a.reshape(rows, -1)
        self.b_t[slot, :rows] = b_t.reshape(rows, -1)
        self.num_rows[slot] = rows

    def clear(self, slot: int) -> None:
        self.num_rows[slot] = 0

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, groups: LoraGroups) -> None:
        """y[rows] += x[rows] A^T B^T (scaled) for each slot's rows; y is the base output, updated in place."""
        if groups.padded is not None:
            self._add_delta_batched(x, y, groups.padded)
            return
        for slot, start, end in groups.ranges:
            rows = self.num_rows[slot]
            if rows:
                y[start:end].addmm_(F.linear(x[start:end], self.a[slot, :rows]), self.b_t[slot, :rows])

    def _add_delta_batched(self, x: torch.Tensor, y: torch.Tensor, padded: PaddedGroups) -> None:
        first, count, per_slot = padded.first_slot, padded.num_slots, padded.rows_per_slot
        rows = max(self.num_rows[first:first + count])
        if rows == 0:
            return
        a = self.a[first:first + count, :rows].transpose(1, 2)  # [slots, in, rows]
        b_t = self.b_t[first:first + count, :rows]  # [slots, rows, out]
        start, end = padded.row_start, padded.row_end
        if padded.gather is None:
            shrunk = torch.bmm(x[start:end].reshape(count, per_slot, -1), a)
            y[start:end].view(count, per_slot, -1).baddbmm_(shrunk, b_t)
            return
        shrunk = torch.bmm(x.index_select(0, padded.gather).view(count, per_slot, -1), a)
        delta = torch.bmm(shrunk, b_t).view(count * per_slot, -1)
        y[start:end].add_(delta.index_select(0, padded.scatter))  # padding rows are never read back


class LoraSlots:
    """`max_loras` adapter slots across the model's projections: the manager's SlotLoader, and the
    arrangement of a mixed batch. Attaches a LoraStack to every projection of `layers` (model.py's
    DecoderLayer), whose Linear adds the delta when a step passes LoraGroups."""

    def __init__(self, layers, config, *, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.layers = layers
        self.max_loras = max_loras
        self.device = device
        self._names: list[str | None] = [None] * max_loras  # what each slot holds
        for layer in layers:
            for fused, modules in FUSED_MODULES.items():
                columns, start = [], 0
                for module in modules:
                    out_features = projection_shape(config, module)[1]
                    columns.append((start, start + out_features))
                    start += out_features
                in_features = projection_shape(config, modules[0])[0]
                getattr(layer, fused).lora = LoraStack(max_loras, max_rank, in_features, tuple(columns), dtype, device)

    def slot_of(self, name: str) -> int | None:
        return self._names.index(name) if name in self._names else None

    @torch.inference_mode()
    def load(self, slot: int, name: str, adapter: PeftAdapter) -> None:
        """Read the adapter's tensors and put them in `slot`. Raises AdapterLoadError for an unreadable
        file, or tensors that changed shape or hold NaN/inf since the adapter was validated."""
        tensors = self._read(adapter)
        self._names[slot] = None  # half-written until the end
        by_stack: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for pair in adapter.pairs:
            fused, part = FUSED_PARTS[pair.module]
            by_stack.setdefault((pair.layer, fused), {})[part] = tensors[pair.a_name], tensors[pair.b_name]
        for index, layer in enumerate(self.layers):
            for fused in FUSED_MODULES:
                getattr(layer, fused).lora.set(slot, adapter.rank, adapter.scale, by_stack.get((index, fused), {}))
        self._names[slot] = name

    def clear(self, slot: int) -> None:
        self._names[slot] = None
        for layer in self.layers:
            for fused in FUSED_MODULES:
                getattr(layer, fused).lora.clear(slot)

    def arrange(self, batch: ModelInput) -> tuple[ModelInput, LoraGroups, list[int] | None]:
        """Reorder `batch` so that each slot's sequences are contiguous (base ones first, then by slot, stable).
        Returns the reordered batch, its row groups, and for each sampling sequence of the ORIGINAL batch the
        index of its row among the reordered batch's sampling rows (None when the order did not change).
        Raises ValueError for a sequence whose adapter holds no slot."""
        seqs = batch.seqs
        slots = []
        for seq in seqs:
            slot = None if seq.adapter is None else self.slot_of(seq.adapter)
            if seq.adapter is not None and slot is None:
                raise ValueError(f"sequence {seq.seq_id}: adapter {seq.adapter!r} is not loaded in any slot")
            slots.append(slot)
        order = sorted(range(len(seqs)), key=lambda i: -1 if slots[i] is None else slots[i])
        ranges: list[tuple[int, int, int]] = []
        row = 0
        for i in order:
            end = row + len(seqs[i].token_ids)
            if slots[i] is not None:
                if ranges and ranges[-1][0] == slots[i]:
                    ranges[-1] = (slots[i], ranges[-1][1], end)
                else:
                    ranges.append((slots[i], row, end))
            row = end
        groups = LoraGroups(tuple(ranges), batch_layout(ranges, self.device))
        if order == sorted(order):
            return batch, groups, None
        reordered = dataclasses.replace(batch, seqs=tuple(seqs[i] for i in order))
        sampled_position = {i: k for k, i in enumerate(i for i in order if seqs[i].sample)}
        return reordered, groups, [sampled_position[i] for i in range(len(seqs)) if seqs[i].sample]

    def _read(self, adapter: PeftAdapter) -> dict[str, torch.Tensor]:
        path = adapter.weights_path
        tensors = {}
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for pair in adapter.pairs:
                    for name in (pair.a_name, pair.b_name):
                        tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError, KeyError) as exc:
            raise AdapterLoadError(f"{path}: cannot read the adapter's tensors: {exc}") from exc
        for pair in adapter.pairs:
            in_features, out_features = projection_shape(self.config, pair.module)
            expected = {pair.a_name: (adapter.rank, in_features), pair.b_name: (out_features, adapter.rank)}
            for name, shape in expected.items():
                tensor = tensors[name]
                if tuple(tensor.shape) != shape:
                    raise AdapterLoadError(f"{path}: tensor '{name}' has shape {list(tensor.shape)}; "
                                           f"expected {list(shape)} (the file changed since it was validated)")
                if not torch.isfinite(tensor).all():
                    raise AdapterLoadError(f"{path}: tensor '{name}' holds NaN or infinite values")
        return tensors


def batch_layout(ranges: list[tuple[int, int, int]], device: torch.device) -> PaddedGroups | None:
    """The batched form of LoraGroups `ranges` (in slot order), or None for the loop. One slot needs no
    batch (its loop is two matmuls). Consecutive slots with equal row counts batch as a view, at any
    size. Otherwise the rows are gathered into a padded batch only while it is small (MAX_GATHERED_ROWS)
    and at most half padding: decode steps, where the per-call overhead of the loop dominates; 16
    sequences over 4 adapters as 7+4+3+2 rows pad to 4 x 7 = 28. A 500-token prefill chunk beside
    single-token decodes stays in the loop."""
    if len(ranges) < 2:
        return None
    first, last = ranges[0][0], ranges[-1][0]
    count = last - first + 1
    sizes = {slot: end - start for slot, start, end in ranges}
    per_slot = max(sizes.values())
    row_start, row_end = ranges[0][1], ranges[-1][2]
    if count == len(ranges) and all(size == per_slot for size in sizes.values()):
        return PaddedGroups(first, count, per_slot, row_start, row_end, None, None)
    if count * per_slot > min(MAX_GATHERED_ROWS, 2 * (row_end - row_start)):
        return None
    gather, scatter = [], []
    by_slot = {slot: (start, end) for slot, start, end in ranges}
    for index, slot in enumerate(range(first, last + 1)):
        start, end = by_slot.get(slot, (row_start, row_start))
        gather += [*range(start, end), *[row_start] * (per_slot - (end - start))]
        scatter += range(index * per_slot, index * per_slot + end - start)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int64, device=device)  # noqa: E731
    return PaddedGroups(first, count, per_slot, row_start, row_end, as_tensor(gather), as_tensor(scatter))
