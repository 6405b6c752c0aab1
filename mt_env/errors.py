"""Every exception mt_env raises on purpose, in one place. All derive from `MtEnvError`."""

import pickle


class MtEnvError(Exception):
    """Base class of mt_env's errors."""


class TokenizerError(MtEnvError):
    """A tokenizer cannot be built or lacks what mt_env needs (e.g. a chat template)."""


class ChatFormatError(MtEnvError):
    """Messages or a chat template that mt_env cannot turn into token ids faithfully."""


class ConversationError(MtEnvError):
    """A conversation was used out of order: an observation before any assistant turn, a bad token id, ..."""


class BudgetError(ConversationError):
    """A token budget cannot be met, e.g. the prompt alone is longer than `max_prompt_tokens`."""


class DriftError(ConversationError):
    """The token ids no longer match what the chat template renders for the conversation's messages."""


class ToolError(MtEnvError):
    """A tool failed. Raised from `BaseTool.execute` with a message written for the model, it becomes the
    observation ``Error: <message>``; `ToolBox` raises it when an episode's tools cannot be created, or are called
    before `create_all`."""


class TransientToolError(ToolError):
    """A failure worth retrying (a dropped connection, a busy server); retried up to the tool's `retries` setting."""


class ToolConfigError(MtEnvError):
    """A tool configuration (YAML or dict), a tool schema, or a dataset row's tool selection that cannot be used."""


class CalculatorError(ToolError):
    """An expression the calculator refuses: bad syntax, division by zero, a number too large, ..."""


def portable(error: BaseException, fallback: type[Exception] = RuntimeError) -> BaseException:
    """`error` if it survives pickling (to be raised in another process), else a `fallback` saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return fallback(f"{type(error).__name__}: {error}")
