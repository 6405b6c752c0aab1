"""Every exception mt_env raises on purpose, in one place. All derive from `MtEnvError`. And how a command shows
them: `report` prints ``error: <message>`` (the traceback too with ``--debug`` or ``MT_ENV_DEBUG=1``)."""

import os
import pickle
import sys
import traceback


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


DEBUG_VARIABLE = "MT_ENV_DEBUG"  #: set to 1: `report` shows the traceback of the project's errors too


def debug_flag(parser) -> None:
    """Add ``--debug`` to a command's argparse `parser` (`report` reads it)."""
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error, not just its one line (or set {DEBUG_VARIABLE}=1)")


def report(error: BaseException, argv: list[str] | None = None) -> None:
    """Print the project's `error` (being handled) as a command shows it: ``error: <message>`` on stderr, after its
    traceback when `argv` (default: the process's) holds ``--debug`` or `DEBUG_VARIABLE` is set."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    if debug or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        traceback.print_exc()
    print(f"error: {error}", file=sys.stderr)
