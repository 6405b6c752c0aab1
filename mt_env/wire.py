"""The pipe codec: messages that cross a process boundary as pickle bytes, with the training samples in them sent
compactly — each per-token list as one typed array (one buffer copy instead of one pickled object per token), each
segment as plain values.

    >>> from mt_env import wire
    >>> from mt_env.sample import Sample, Seg, Segment
    >>> sample = Sample(ids=[5, 6], logprobs=[0.0, -0.5], segments=[Segment(Seg.SAMPLED, 0, 0, 2, "hi")])
    >>> wire.loads(wire.dumps({"finished": [sample]}))["finished"][0] == sample
    True

`dumps` encodes, `loads` decodes: what comes back is plain `Sample`s with lists, the same values bit for bit (ids as
ints, logprobs and rewards as C doubles, nan and -0.0 included). A list that does not fit its array type (an id
beyond 64 bits, something that is not a number) is sent as it is, so nothing fails here that plain pickling would
not. Used where samples cross: env processes' episode records (`agents.rollout_processes`) and the one-step
off-policy generator's results (`trainers.async_rollout`). Its cost, measured: docs/processes.md.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import pickle
from array import array
from typing import Any

from .sample import Sample, Seg, Segment

INT_CODE, FLOAT_CODE = "q", "d"  #: int64 and C double


def dumps(obj: Any) -> bytes:
    """`obj` pickled, the samples and segments in it encoded (the highest pickle protocol)."""
    buffer = io.BytesIO()
    _Pickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """What `dumps` made, its samples decoded into plain `Sample`s (a plain ``pickle.loads``: each encoded sample
    names its decoder)."""
    return pickle.loads(data)


#: the per-token fields of a `Sample` and their array types; its other fields are sent as they are
PER_TOKEN = {"ids": INT_CODE, "logprobs": FLOAT_CODE, "rewards": FLOAT_CODE}
#: every field of a `Sample` in the class's order (its constructor's), with its array type or None
_FIELDS = tuple((f.name, PER_TOKEN.get(f.name)) for f in dataclasses.fields(Sample))


def _encode_sample(s: Sample) -> tuple:
    return _sample, tuple(_typed(code, getattr(s, name)) if code else getattr(s, name) for name, code in _FIELDS)


def _sample(*values: Any) -> Sample:
    return Sample(*(_listed(v) for v in values))


def _encode_segment(s: Segment) -> tuple:
    # plain values, the kind as its int: loads at a third of a slotted dataclass's pickled state
    return _segment, (int(s.kind), s.turn, s.start, s.end, s.text)


_KINDS = {int(kind): kind for kind in Seg}


def _segment(kind: int, turn: int, start: int, end: int, text: str) -> Segment:
    return Segment(_KINDS.get(kind, kind), turn, start, end, text)


def _typed(code: str, values: Any) -> Any:
    if type(values) is not list:  # None, or a sequence of another type: sent as it is
        return values
    try:
        return array(code, values)
    except (TypeError, OverflowError):
        return values


def _listed(values: Any) -> Any:
    return values.tolist() if type(values) is array else values


class _Pickler(pickle.Pickler):
    """A pickler whose reductions of `Sample` and `Segment` are the encoders above; every other object pickles as
    it would anyway. (A per-pickler ``dispatch_table``, so that the data types themselves carry no transport code
    and a plain ``pickle.dumps`` of a sample is the ordinary dataclass pickle.)"""

    dispatch_table = {**copyreg.dispatch_table, Sample: _encode_sample, Segment: _encode_segment}
