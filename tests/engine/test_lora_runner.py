"""The LoRA delta of a mixed batch, computed each of the three ways the runner picks from (a loop over
slots, a batch of equal slots viewed in place, a padded batch gathered from uneven slots), against the
definition: row i of slot s gets x_i A_s^T B_s^T * scale_s added in each adapted part's output columns."""

from __future__ import annotations

import pytest
import torch

from kvgate.engine.runner.lora import LoraGroups, LoraStack, batch_layout

IN, MAX_RANK = 5, 8
PARTS = ((0, 6), (6, 10))  # a fused projection of two parts: output columns 0..5 and 6..9
# slot -> (rank, scale, parts adapted)
ADAPTERS = {0: (2, 0.5, (0, 1)), 1: (8, 2.0, (1,)), 3: (4, 1.5, (0,))}


@pytest.fixture(scope="module")
def stack_and_weights():
    generator = torch.Generator().manual_seed(0)
    stack = LoraStack(4, MAX_RANK, IN, PARTS, torch.float32, torch.device("cpu"))
    weights = {}
    for slot, (rank, scale, parts) in ADAPTERS.items():
        weights[slot] = {part: (torch.randn(rank, IN, generator=generator),
                                torch.randn(PARTS[part][1] - PARTS[part][0], rank, generator=generator))
                         for part in parts}
        stack.set(slot, rank, scale, weights[slot])
    return stack, weights


def reference(x: torch.Tensor, y: torch.Tensor, ranges, weights) -> torch.Tensor:
    out = y.clone()
    for slot, start, end in ranges:
        scale = ADAPTERS[slot][1]
        for part, (a, b) in weights[slot].items():
            first, last = PARTS[part]
            out[start:end, first:last] += x[start:end] @ a.t() @ b.t() * scale
    return out


@pytest.mark.parametrize("ranges, layout", [
    ([(0, 2, 9)], "loop"),  # one slot: base rows 0..1, then slot 0
    ([(0, 1, 4), (1, 4, 7)], "view"),  # consecutive slots of 3 rows each
    ([(0, 0, 1), (1, 1, 4), (3, 4, 6)], "gathered"),  # 1, 3, 0 (slot 2 absent) and 2 rows: 4 x 3 padded
    ([(0, 0, 40), (1, 40, 41), (3, 41, 42)], "loop"),  # a long chunk beside two decodes: padding would be 3x
])
def test_every_layout_adds_each_rows_own_adapter_delta(stack_and_weights, ranges, layout: str) -> None:
    stack, weights = stack_and_weights
    generator = torch.Generator().manual_seed(1)
    num_rows = ranges[-1][2] + 1  # a trailing base row must stay untouched
    x, y = torch.randn(num_rows, IN, generator=generator), torch.randn(num_rows, 10, generator=generator)
    padded = batch_layout(ranges, torch.device("cpu"))
    assert {None: "loop"}.get(padded, "view" if padded and padded.gather is None else "gathered") == layout

    expected = reference(x, y, ranges, weights)
    stack.add_delta(x, y, LoraGroups(tuple(ranges), padded))

    torch.testing.assert_close(y, expected)


def test_a_cleared_slot_adds_nothing_and_a_new_adapter_overwrites_every_row_of_the_old(stack_and_weights) -> None:
    stack, _ = stack_and_weights
    fresh = LoraStack(2, MAX_RANK, IN, PARTS, torch.float32, torch.device("cpu"))
    a, b = torch.ones(8, IN), torch.ones(6, 8)
    fresh.set(0, 8, 1.0, {0: (a, b)})
    fresh.set(0, 2, 1.0, {1: (torch.ones(2, IN), torch.ones(4, 2))})  # rank 2 now: rows 2..7 must be zero
    x, y = torch.ones(1, IN), torch.zeros(1, 10)
    fresh.add_delta(x, y, LoraGroups(((0, 0, 1),)))
    assert y.tolist() == [[0.0] * 6 + [10.0] * 4]  # 5 inputs x rank 2, only in part 1's columns

    fresh.clear(0)
    y = torch.zeros(1, 10)
    fresh.add_delta(x, y, LoraGroups(((0, 0, 1),)))
    assert not y.any()
