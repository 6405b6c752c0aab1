"""Per-token lists pickled as typed arrays: one buffer per list instead of one pickled object per token.

Why: an episode's training samples cross a process boundary when it ends in an env process
(`agents.rollout_processes`) or in a rollout process of a distributed run (`trainers.async_rollout`), and the
driver's process loads them on the rollout's critical path (at its end, the last turns' records all at once, while
its event loop also sends the last answers). A list of 600 ids pickles as 600 opcodes and loads one int object at a
time; as an ``array`` it is one bytes copy, and ``tolist`` builds the list in C (a 615-token sample of three turns,
measured: 83 -> 47 us to load, 63 -> 44-52 us to dump). The lists come back as lists of the same values:
ids as ints, logprobs and rewards as floats (Python floats are C doubles, so every value, nan and -0.0 included, is
exact; an int in a float list comes back as that float).

A list that does not fit its array type (an id beyond 64 bits, something that is not a number) is pickled as it
is, so nothing fails here that plain pickling would not.
"""

from __future__ import annotations

from array import array
from typing import Any

INT_CODE, FLOAT_CODE = "q", "d"  #: int64 and C double

#: experiment (`benchmarks/bench_rollout.py --keep-samples-packed`): loaded objects keep the arrays instead of lists
#: (then unequal to lists): what the per-token Python objects cost the loading process — their creation and the
#: garbage collector's passes over them
KEEP_PACKED = False


def reduce_packed(obj: Any, ints: tuple[str, ...] = (), floats: tuple[str, ...] = ()) -> tuple:
    """A ``__reduce__`` value for a plain object (state in ``__dict__``) whose attributes named in `ints` and
    `floats` are per-token lists: pickled packed, loaded as lists again (its class kept, ``__init__`` not run)."""
    state = dict(obj.__dict__)
    for name in ints:
        state[name] = _packed(INT_CODE, state[name])
    for name in floats:
        state[name] = _packed(FLOAT_CODE, state[name])
    return _load, (type(obj), state, ints + floats)


def _load(cls: type, state: dict, names: tuple[str, ...]) -> Any:
    obj = cls.__new__(cls)
    for name in () if KEEP_PACKED else names:
        if type(state[name]) is array:
            state[name] = state[name].tolist()
    obj.__dict__.update(state)
    return obj


def _packed(code: str, values: Any) -> Any:
    if type(values) is not list:  # None, or a sequence of another type: pickled as it is
        return values
    try:
        return array(code, values)
    except (TypeError, OverflowError):
        return values
