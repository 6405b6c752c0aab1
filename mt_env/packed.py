"""Per-token lists pickled as typed arrays: one buffer per list instead of one pickled object per token.

Why: an episode's training samples cross a process boundary when it ends in an env process
(`agents.rollout_processes`) or in a rollout process of a distributed run (`trainers.async_rollout`), and the
driver's process loads them on the rollout's critical path (at its end, the last turns' records all at once, while
its event loop also sends the last answers). A list of 600 ids pickles as 600 opcodes and loads one int object at a
time; as an ``array`` it is one bytes copy, and ``tolist`` builds the list in C (a 615-token sample of three turns,
measured: 83 -> 47 us to load, 63 -> 44-52 us to dump). Loaded, they stay arrays until first read: the lists'
Python objects — ~1,800 per sample, made one by one and then visited by the garbage collector's young collection —
are what the driver's process spent its rollout's end on (H200 timeline: records read at 0.22 ms each, then a 16.6
ms collection), and a consumer that takes arrays (`mt_env.batch.collate`, through `view`) never makes them.
Measured on the H200 (256 episodes; `benchmarks/results/h200/driver_knobs/README.md`): with 8 env processes the
records were read at 0.09 instead of 0.22 ms each, then a 1.8 instead of a 16.6 ms collection (timelines), and
driver / engine 0.947 -> 0.953 in one call; with 4 processes no gain (10 runs paired on the same seeds: 0.944
against 0.946), as each process's own share of the last step's episodes then takes as long as the reading.

Read as attributes, the lists are the same values: ids as ints, logprobs and rewards as floats (Python floats are C
doubles, so every value, nan and -0.0 included, is exact; an int in a float list comes back as that float).

A list that does not fit its array type (an id beyond 64 bits, something that is not a number) is pickled as it
is, so nothing fails here that plain pickling would not.
"""

from __future__ import annotations

from array import array
from typing import Any

INT_CODE, FLOAT_CODE = "q", "d"  #: int64 and C double
PENDING = "_packed"  #: where a loaded object keeps the per-token arrays not read yet


def reduce_packed(obj: Any, ints: tuple[str, ...] = (), floats: tuple[str, ...] = ()) -> tuple:
    """A ``__reduce__`` value for a plain object (state in ``__dict__``) whose attributes named in `ints` and
    `floats` are per-token lists: pickled packed; loaded, each stays an array until it is first read
    (`unpack_attribute`) — a consumer that takes arrays (`view`) never makes the lists."""
    state = dict(obj.__dict__)
    pending = state.pop(PENDING, {})
    for code, names in ((INT_CODE, ints), (FLOAT_CODE, floats)):
        for name in names:
            state[name] = _packed(code, state[name]) if name in state else pending[name]
    return _load, (type(obj), state, ints + floats)


def unpack_attribute(obj: Any, name: str) -> Any:
    """For the class's ``__getattr__``: a per-token attribute still packed, as its list (kept from then on). Threads
    reading it for the first time together get the same list: it is stored before its array is dropped."""
    held = obj.__dict__
    pending = held.get(PENDING)
    if not pending or name not in pending:
        if name in held:  # another thread unpacked it since this lookup missed it
            return held[name]
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    value = held.setdefault(name, pending[name].tolist())
    pending.pop(name, None)
    if not pending:
        held.pop(PENDING, None)
    return value


def view(obj: Any, name: str) -> Any:
    """A per-token attribute as it is held: its array while still packed (no Python object per token), else its
    value."""
    held = obj.__dict__
    if name in held:
        return held[name]
    pending = held.get(PENDING)
    return pending[name] if pending and name in pending else getattr(obj, name)


def _load(cls: type, state: dict, names: tuple[str, ...]) -> Any:
    obj = cls.__new__(cls)
    pending = {name: state.pop(name) for name in names if type(state[name]) is array}
    if pending:
        state[PENDING] = pending
    obj.__dict__.update(state)
    return obj


def _packed(code: str, values: Any) -> Any:
    if type(values) is not list:  # None, or a sequence of another type: pickled as it is
        return values
    try:
        return array(code, values)
    except (TypeError, OverflowError):
        return values
