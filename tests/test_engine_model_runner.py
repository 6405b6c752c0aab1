"""The paged engine's model runner (`agents.engine.model_runner`) on a tiny random Qwen2 model: compaction moves
each row's position and block table and none of its K/V (property-tested), and moving and clearing slots costs the
same number of ops whatever the layer count."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from agents.engine.scheduler import SlotTable

from .backend_hf_fixtures import (
    VOCAB,
    one_cpu_thread,  # noqa: F401  (one intra-op thread for tiny matmuls)
)
from .engine_fixtures import build, make_runner, prefill_rows, row_kv


# ------------------------------------------------------------------------------------------------- the model runner
@pytest.fixture(scope="module")
def small_engine_model():
    return build("qwen2", seed=3)


@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=8), data=st.data())
def test_compaction_moves_each_rows_position_and_block_table_and_no_kv(small_engine_model, lengths, data):
    runner, pool = make_runner(small_engine_model, context=32)
    table = SlotTable(8)
    ids = list(range(len(lengths)))
    slots = table.acquire(ids)
    prompts = [[(7 * r + j) % VOCAB for j in range(n)] for r, n in zip(ids, lengths)]
    rows, _ = prefill_rows(runner, pool, slots, prompts)
    leaving = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=len(ids) - 1))
    table.release([slots[r] for r in leaving])
    runner.free([slots[r] for r in leaving])
    before = {r: row_kv(runner, rows[r], lengths[r]) for _, r in table.occupied()}
    moves = table.compact()
    counter = OpCounter()
    with counter:
        runner.move(moves)
    now = runner.slot_lengths()
    for slot, r in table.occupied():
        assert now[slot] == lengths[r]
        assert runner.block_table(slot)[:len(rows[r].blocks)] == list(rows[r].blocks)
        assert all(torch.equal(a, b) for a, b in zip(row_kv(runner, rows[r], lengths[r]), before[r]))
    held = {slot for slot, _ in table.occupied()}
    assert all(now[slot] == 0 and set(runner.block_table(slot)) == {0} for slot in range(8) if slot not in held)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_moving_and_clearing_slots_costs_the_same_ops_whatever_the_layer_count():
    """A slot move (compaction) and a clearing free run a fixed number of ops, not a few per layer: each op of the
    host's is a wait for the interpreter lock when the caller's event loop is busy (mid-rollout, as rows end)."""
    counts = []
    for layers in (2, 6):
        model = build("qwen2", seed=3, num_hidden_layers=layers)
        runner, pool = make_runner(model, context=32)
        rows, _ = prefill_rows(runner, pool, [5, 6], [[1, 2, 3], [4, 5]])
        counter = OpCounter()
        with counter:
            runner.move([(5, 0), (6, 1)])
            runner.free([0], zero_blocks=rows[0].blocks)
        counts.append(counter.ops)
        assert runner.slot_lengths()[:2] == [0, 2]
        assert all(torch.equal(t, torch.zeros_like(t)) for t in row_kv(runner, rows[0], 3))
    assert counts[0] == counts[1]
