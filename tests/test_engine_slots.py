"""Property tests of the paged engine's slot bookkeeping (`agents.engine.scheduler`): the slot table's invariants
over any order of acquires, releases and compactions (the lowest free slots, no row lost or held twice), and the
batch buckets' bound on padding."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agents.engine.scheduler import SlotTable, batch_buckets, bucket_for

from .backend_hf_fixtures import one_cpu_thread  # noqa: F401  (one intra-op thread for tiny tensors)

# ------------------------------------------------------------------------------------------------- properties
ops = st.lists(st.one_of(st.tuples(st.just("acquire"), st.integers(1, 40)),
                         st.tuples(st.just("release"), st.integers(0, 10**6)),
                         st.tuples(st.just("compact"), st.just(0))), max_size=40)


@given(size=st.integers(1, 300), ops=ops)
def test_slot_table_invariants(size, ops):
    table, rows, counter = SlotTable(size), {}, 0  # rows: row id -> slot, as the table should have it
    for op, arg in ops:
        if op == "acquire":
            n = min(arg, table.free_count())
            free_before = sorted(set(range(size)) - set(rows.values()))
            new = list(range(counter, counter + n))
            counter += n
            slots = table.acquire(new)
            assert slots == free_before[:n]  # the lowest free slots, in order
            rows.update(zip(new, slots))
        elif op == "release" and rows:
            row = sorted(rows)[arg % len(rows)]
            table.release([rows.pop(row)])
        elif op == "compact":
            before = dict(rows)
            moves = table.compact()
            target = bucket_for(len(rows), table.buckets)
            for src, dst in moves:
                assert src >= target > dst and dst not in before.values()
                row = next(r for r, s in before.items() if s == src)
                rows[row] = dst
            assert table.bucket() <= target
        held = table.occupied()
        assert {row: slot for slot, row in held} == rows  # no row lost, none held twice, the table agrees
        assert len({slot for slot, _ in held}) == len(held)


@given(size=st.integers(1, 1200))
def test_batch_buckets_bound_the_padding(size):
    buckets = batch_buckets(size)
    assert buckets == sorted(set(buckets)) and buckets[-1] == size
    for n in range(1, size + 1, max(1, size // 50)):
        b = bucket_for(n, buckets)
        assert n <= b <= size and b - n <= (32 if n <= 256 else 64)
