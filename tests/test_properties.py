"""Property tests of the conversation → ids → mask → batch pipeline, on three chat-template formats.

Formats: Qwen2.5 with tools (prefix-safe), Qwen3 (strips earlier reasoning; also with enable_thinking=False) and
Llama-3.1 JSON tools (trims contents) — mt_env's own templates on the offline tokenizers, and the official Qwen
tokenizers and templates when ../shared is present.
"""

from __future__ import annotations

import pickle
import pickletools
import struct
import threading
import unicodedata
from array import array

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mt_env import wire
from mt_env.batch import collate, pack
from mt_env.chat_format import ChatFormat
from mt_env.conformance import check_template
from mt_env.conversation import Conversation, TokenBudget
from mt_env.errors import ConversationError, DriftError
from mt_env.sample import Sample, Seg, Segment
from mt_env.tokenizer import offline_tokenizer

from .conftest import LOOKUP_TOOL, shared_tokenizer
from .strategies import CONTROL_TEXTS, conversation_plan, play, untrusted_text

FORMATS = {
    "qwen2.5": lambda: ChatFormat(offline_tokenizer("qwen2.5"), tools=[LOOKUP_TOOL]),
    "qwen3": lambda: ChatFormat(offline_tokenizer("qwen3"), tools=[LOOKUP_TOOL]),
    "qwen3-nothink": lambda: ChatFormat(offline_tokenizer("qwen3"), tools=[LOOKUP_TOOL],
                                        template_kwargs={"enable_thinking": False}),
    "llama3.1": lambda: ChatFormat(offline_tokenizer("llama3.1"), tools=[LOOKUP_TOOL]),
    "official-qwen2.5": lambda: ChatFormat(shared_tokenizer("qwen2.5-instruct"), tools=[LOOKUP_TOOL]),
    "official-qwen3": lambda: ChatFormat(shared_tokenizer("qwen3"), tools=[LOOKUP_TOOL]),
}
_cache: dict[str, ChatFormat] = {}


@pytest.fixture(params=list(FORMATS), scope="module")
def fmt(request) -> ChatFormat:
    if request.param not in _cache:
        _cache[request.param] = FORMATS[request.param]()
    return _cache[request.param]


@pytest.mark.parametrize("name,conforms", [("qwen2.5", True), ("qwen3", False), ("qwen3-nothink", False),
                                           ("llama3.1", False)])
def test_checker_verdicts(name, conforms):
    assert check_template(FORMATS[name]()).conforms is conforms


@given(plan=conversation_plan())
def test_ids_mask_segments_are_one_record(fmt, plan):
    conv = play(fmt, plan)
    for sample in conv.samples():
        n = len(sample.ids)
        kinds, turns, mask = sample.kinds(), sample.turns(), sample.loss_mask()
        assert len(kinds) == len(turns) == len(mask) == len(sample.logprobs) == len(sample.rewards) == n
        # segments tile the sample exactly
        assert [s.start for s in sample.segments[1:]] == [s.end for s in sample.segments[:-1]]
        assert sample.segments[0].start == 0 and sample.segments[-1].end == n
        # the mask is 1 exactly on sampled tokens
        assert mask == [int(k == Seg.SAMPLED) for k in kinds]
        # rewards only on sampled tokens
        assert all(m == 1 for m, r in zip(mask, sample.rewards) if r != 0)
    # decoding the masked-in tokens gives back each assistant output, verbatim
    for turn in conv.turns:
        sample = conv.samples_[turn.sample]
        seg = next(s for s in sample.segments if s.kind == Seg.SAMPLED and s.turn == turn.index)
        assert sample.ids[seg.start:seg.end] == turn.ids
        assert conv.fmt.decode(turn.ids) == turn.text + (conv.fmt.end_of_turn if turn.closed else "")
        planned = plan.turns[turn.index][0]
        assert unicodedata.normalize("NFC", turn.text) == unicodedata.normalize("NFC", planned)
        assert sample.logprobs[seg.start:seg.end] == turn.logprobs


@given(plan=conversation_plan())
def test_incremental_equals_full_rendering_or_raises(fmt, plan):
    """Strict incremental mode: either the ids equal the template's full rendering around the sampled text, or
    DriftError is raised — never silent. Judged independently, by decoding the ids."""
    conv = play(fmt, plan, mode="incremental", strict=False)
    sample = conv.current
    last = sample.segments[-1]
    upto = last.start if last.kind == Seg.SAMPLED else len(sample.ids)
    n_msgs = conv.turns[last.turn].message_index if last.kind == Seg.SAMPLED else len(conv.template_messages)
    rendered = fmt.render(conv.template_messages[:n_msgs], add_generation_prompt=True)
    # the tokenizers normalize to NFC (trap 4), so texts are compared in that form
    nfc = lambda text: unicodedata.normalize("NFC", text)  # noqa: E731
    matches = nfc(fmt.decode(sample.ids[:upto])) == nfc(rendered)
    if matches:
        conv.check_drift()
    else:
        with pytest.raises(DriftError):
            conv.check_drift()
    if check_template(fmt).conforms:
        assert matches, "a conforming template drifted"


@given(plan=conversation_plan())
def test_conforming_template_canonical_ids_equal_full_tokenization(fmt, plan):
    """With canonical sampling and no whitespace at a turn start (trap 1: it merges with the generation prompt's
    newline), the incremental ids are exactly the tokenization of the whole rendered conversation."""
    if not check_template(fmt).conforms:
        pytest.skip("only meaningful for prefix-safe templates")
    plan.turns = [("A" + text.lstrip(), splits, closed) for text, splits, closed in plan.turns]
    conv = play(fmt, plan, mode="incremental", canonical=True)
    text = "".join(s.text for s in conv.current.segments)
    assert conv.current.ids == fmt.encode(text)


@given(plan=conversation_plan())
def test_per_turn_samples_are_what_the_model_saw(fmt, plan):
    conv = play(fmt, plan, mode="per_turn")
    samples = conv.samples()
    assert len(samples) == len(conv.samples_)
    for turn in conv.turns:
        sample = samples[turn.sample]
        history = conv.template_messages[:turn.message_index]
        assert sample.ids[:sample.prompt_len] == fmt.encode(fmt.render(history, add_generation_prompt=True))
        assert sample.ids[sample.prompt_len:] == turn.ids
        assert sum(sample.loss_mask()) == len(turn.ids)


@given(plan=conversation_plan(), ids=st.lists(st.integers(-2**63, 2**63 - 1), max_size=20),
       logprobs=st.lists(st.floats(allow_nan=False) | st.sampled_from([-0.0, float("inf"), -float("inf")]),
                         max_size=20))
def test_samples_come_back_from_the_pipe_codec_as_they_went(fmt, plan, ids, logprobs):
    """Samples cross processes through `mt_env.wire`: plain samples with lists come back, the same values, types and
    segments — for a real conversation's samples, and for per-token lists of any 64-bit ids and floats (a list too
    large for int64, or a nan, comes back too). A plain pickle of a sample (no codec) is the same sample too."""
    samples = play(fmt, plan, mode="per_turn").samples()
    odd = Sample(ids=ids + [2**64], logprobs=logprobs + [float("nan")], rewards=None)
    tagged = Sample(ids=ids, logprobs=logprobs, rewards=[1.0] * len(ids), trainable=False, episode_reward=0.5,
                    group=3, episode=7, prompt_len=len(ids) // 2, n_messages=2)
    for sample in [*samples, odd, tagged]:
        for back in (wire.loads(wire.dumps(sample)), pickle.loads(pickle.dumps(sample))):
            assert type(back) is Sample and len(back) == len(sample) and back.segments == sample.segments
            assert all(type(a) is type(b) and a.kind is b.kind for a, b in zip(back.segments, sample.segments))
            for name in ("ids", "logprobs", "rewards"):
                got, want = getattr(back, name), getattr(sample, name)
                assert type(got) is type(want) and [type(v) for v in got or []] == [type(v) for v in want or []]
                assert _bits(got) == _bits(want), name
            assert sample is odd or back == sample  # (nan is unequal to itself)


def _bits(values):
    """Values compared bit for bit (nan equal to itself, -0.0 unequal to 0.0)."""
    return None if values is None else [struct.pack("<d", v) if type(v) is float else v for v in values]


def test_an_encoded_sample_costs_opcodes_per_segment_not_per_token():
    """Decoding a sample is one buffer copy per per-token list: the encoding's opcodes do not grow with its tokens
    (a plain pickle's do: one per token)."""
    def opcodes(tokens: int, dumps) -> int:
        sample = Sample(ids=list(range(tokens)), logprobs=[-0.5] * tokens, rewards=[0.0] * tokens,
                        segments=[Segment(Seg.PROMPT, -1, 0, tokens // 2, "p"), Segment(Seg.SAMPLED, 0, tokens // 2,
                                                                                        tokens, "s")])
        return sum(1 for _ in pickletools.genops(dumps(sample)))

    assert opcodes(10_000, wire.dumps) <= opcodes(10, wire.dumps) + 8  # a few more: wider ints, 64 KiB frames
    assert opcodes(10_000, pickle.dumps) > 10_000


def test_the_codec_sends_whatever_else_a_message_holds_as_pickle_does():
    """A message is any picklable object: what is not a sample or a segment comes back as pickle would bring it."""
    message = ("finished", {"key": [1, 2.5, None, "x"], "arrays": array("i", [1, 2])}, Seg.SAMPLED)
    assert wire.loads(wire.dumps(message)) == pickle.loads(pickle.dumps(message)) == message
    with pytest.raises(TypeError, match="cannot pickle"):
        wire.dumps(("finished", threading.Lock()))


@given(plans=st.lists(conversation_plan(max_turns=3), min_size=1, max_size=4))
def test_decoded_samples_batch_as_the_originals(fmt, plans):
    """`collate` makes the same batch of samples that crossed the pipe codec as of the originals."""
    samples = [s for plan in plans for s in play(fmt, plan, mode="per_turn").samples()]
    loaded = wire.loads(wire.dumps(samples))
    want, got = collate(samples, pad_token_id=0), collate(loaded, pad_token_id=0)
    for name in ("input_ids", "attention_mask", "position_ids", "loss_mask", "rewards", "rollout_logprobs",
                 "turn_ids", "group", "episode", "episode_rewards"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_a_sample_holding_arrays_of_other_types_batches_as_with_lists():
    """Per-token values set by hand as arrays of another type than the packed ones (int32 ids, float32 logprobs)
    batch as the same values in lists do."""
    def sample(ids, logprobs):
        return Sample(ids=ids, logprobs=logprobs, segments=[Segment(Seg.PROMPT, -1, 0, 2, "p"),
                                                            Segment(Seg.SAMPLED, 0, 2, 4, "s")])

    want = collate([sample([5, 6, 7, 8], [0.0, 0.0, -0.5, -0.25])], pad_token_id=0)
    got = collate([sample(array("i", [5, 6, 7, 8]), array("f", [0.0, 0.0, -0.5, -0.25]))], pad_token_id=0)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.rollout_logprobs, want.rollout_logprobs)


def sample_fields(s) -> dict[str, list]:
    """A sample's per-token lists, as a batch row must give them back (floats rounded to float32 like tensors)."""

    def f32(x):
        return torch.tensor(x, dtype=torch.float32).tolist()

    return dict(ids=list(s.ids), position_ids=list(range(len(s.ids))), loss_mask=f32(s.loss_mask()),
                rewards=f32(s.rewards), rollout_logprobs=f32(s.logprobs), turn_ids=s.turns())


def batch_rows(batch) -> list[dict[str, list]]:
    """The same lists read back from a batch: each row's real tokens (attention mask 1)."""
    names = dict(ids="input_ids", position_ids="position_ids", loss_mask="loss_mask", rewards="rewards",
                 rollout_logprobs="rollout_logprobs", turn_ids="turn_ids")
    real = batch.attention_mask.bool()
    return [{key: getattr(batch, name)[b][real[b]].tolist() for key, name in names.items()} for b in range(len(batch))]


@given(plans=st.lists(conversation_plan(max_turns=3), min_size=1, max_size=4))
def test_batch_and_packing_round_trip(fmt, plans):
    samples = [s for p in plans for s in play(fmt, p).samples()]
    batch = collate(samples, pad_token_id=fmt.tokenizer.pad_token_id)
    assert batch_rows(batch) == [sample_fields(s) for s in samples]
    am, pos = batch.attention_mask, batch.position_ids
    assert am.sum(1).tolist() == [len(s.ids) for s in samples] and bool(am[:, 0].all())  # real tokens first
    assert bool((batch.input_ids[am == 0] == fmt.tokenizer.pad_token_id).all())
    assert not batch.loss_mask[am == 0].any() and bool((batch.turn_ids[am == 0] == -1).all())
    # positions are defined everywhere: 0..n-1 over the real tokens, the last one repeated on padding
    assert all(pos[b].tolist() == list(range(len(s))) + [len(s) - 1] * (am.shape[1] - len(s))
               for b, s in enumerate(samples))
    # one row selection gives the rows of every field
    rows = torch.arange(len(samples) - 1, -1, -1)
    assert batch_rows(batch[rows]) == batch_rows(batch)[::-1] and torch.equal(batch[rows].group, batch.group[rows])
    # packed: the real tokens end to end, positions restarting per sequence, and back again
    packed = pack(batch)
    assert packed.input_ids.shape == (1, sum(len(s.ids) for s in samples))
    assert packed.input_ids[0].tolist() == [t for s in samples for t in s.ids]
    assert packed.position_ids[0].tolist() == [p for s in samples for p in range(len(s.ids))]
    assert packed.seq_ids[0].tolist() == [b for b, s in enumerate(samples) for _ in s.ids]
    assert torch.equal(packed.unpack(packed.loss_mask), batch.loss_mask)
    assert torch.equal(packed.unpack(packed.input_ids), batch.input_ids * am)


@given(
    plan=conversation_plan(),
    max_response=st.one_of(st.none(), st.integers(1, 120)),
    slack=st.one_of(st.none(), st.integers(1, 200)),
    max_obs=st.one_of(st.none(), st.integers(1, 40)),
    keep=st.sampled_from(["head", "tail", "middle"]),
)
def test_budgets_hold(fmt, plan, max_response, slack, max_obs, keep):
    prompt_len = Conversation(fmt, plan.prompt).prompt_len
    max_total = None if slack is None else prompt_len + slack
    budget = TokenBudget(max_response_tokens=max_response, max_total_tokens=max_total, max_observation_tokens=max_obs,
                         observation_keep=keep)
    conv = play(fmt, plan, budget=budget)
    for sample in conv.samples_:
        assert len(sample.ids) - conv.prompt_len <= (max_response if max_response is not None else 10**9)
        assert len(sample.ids) <= (budget.max_total_tokens or 10**9)
    if max_obs is not None and conv.mode == "incremental":
        for seg in conv.current.segments:
            if seg.kind == Seg.OBSERVATION:
                assert len(seg) <= max_obs
    if len(conv.turns) < len(plan.turns):  # stopped early: only a budget does that
        assert conv.truncated and conv.truncation_reason
        with pytest.raises(ConversationError):
            conv.add_assistant([1])


@given(plan=conversation_plan(max_turns=1))
def test_single_turn_loss_mask_equals_classic_eos_mask(fmt, plan):
    """For one turn, the loss mask is the classic response mask: 1 up to and including the first EOS, 0 after."""
    (sample,) = play(fmt, plan).samples()
    batch = collate([sample], pad_token_id=fmt.tokenizer.pad_token_id)
    n = sample.prompt_len
    response = batch.input_ids[0, n:]
    is_eos = (response == fmt.end_of_turn_id).long()
    before_or_at_first_eos = (is_eos.cumsum(0) - is_eos) == 0
    real = batch.attention_mask[0, n:].bool()
    assert torch.equal(batch.loss_mask[0, n:].bool(), before_or_at_first_eos & real)
    assert not batch.loss_mask[0, :n].any()


@pytest.fixture(scope="session")
def official_qwen25():
    return shared_tokenizer("qwen2.5-instruct")


@given(text=st.one_of(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=200),
                      st.text(st.sampled_from("ab 12\n\t<|>_/imendtool_call"), max_size=80)))
def test_offline_tokenizer_encodes_like_the_official_one(official_qwen25, text):
    mine = offline_tokenizer("qwen2.5")
    assert mine(text, add_special_tokens=False).input_ids == official_qwen25(text, add_special_tokens=False).input_ids


@given(pieces=st.lists(st.one_of(untrusted_text, st.sampled_from(CONTROL_TEXTS)), max_size=12))
def test_chat_format_encoding_equals_the_tokenizer(fmt, pieces):
    """ChatFormat.encode reuses encodings of text between control tokens; it must equal plain tokenization."""
    text = "".join(pieces) * 3  # long enough for the piece cache, with repeats for cache hits
    assert fmt.encode(text) == fmt.tokenizer(text, add_special_tokens=False).input_ids


@given(contents=st.lists(untrusted_text, min_size=1, max_size=4), generation_prompt=st.booleans(),
       with_tools=st.booleans())
def test_chat_format_render_reuse_equals_a_fresh_render(fmt, contents, generation_prompt, with_tools):
    """ChatFormat.render reuses the text of messages it rendered before (a GRPO group's episodes share a prompt);
    the text must be the template's own, for these messages and no others, also after the messages change."""
    messages = [{"role": "user" if i % 2 == 0 else "tool", "content": c} for i, c in enumerate(contents)]
    fresh = fmt.tokenizer.apply_chat_template(messages, tools=fmt.tools if with_tools else None, tokenize=False,
                                              add_generation_prompt=generation_prompt, **fmt.template_kwargs)
    assert fmt.render(messages, generation_prompt, with_tools) == fresh
    assert fmt.render(messages, generation_prompt, with_tools) == fresh  # from the reuse
    messages[-1]["content"] += "!"
    assert fmt.render(messages, generation_prompt, with_tools) != fresh


def test_a_template_that_reads_the_clock_is_rendered_every_time():
    """A template calling strftime_now is rendered anew each time (the date may have changed since)."""
    tokenizer = offline_tokenizer("qwen2.5")
    tokenizer.chat_template = ("{{ strftime_now('%Y') }}" + tokenizer.chat_template)
    fmt = ChatFormat(tokenizer)
    calls, render = [], tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *a, **k: calls.append(1) or render(*a, **k)
    for _ in range(3):
        fmt.render([{"role": "user", "content": "hi"}], True)
    assert len(calls) == 3
