"""Typed errors of the rollout library.

Every error raised for bad input names the offending field, so that a server can turn it into a
4xx response with a message a user can act on, and a Python caller can catch it by type. An
error never carries more than a short excerpt of a value: a request may hold megabytes in one
field, and an error that echoes it costs its size again in every log line and response.
"""

import logging
import reprlib
import secrets

# A value in a message is a short excerpt: one level of a container, 80 characters of a string.
_EXCERPT = reprlib.Repr()
_EXCERPT.maxlevel = 1
_EXCERPT.maxstring = _EXCERPT.maxother = 80
# Room for a field name and for a message with an excerpt or two; an HTTP error body holds the
# message twice (`error` and `detail`) and stays under 2 KB.
_MAX_FIELD_CHARS = 100
MAX_REASON_CHARS = 500
_MAX_MESSAGE_CHARS = _MAX_FIELD_CHARS + MAX_REASON_CHARS + 100


def short_repr(value) -> str:
    """`repr(value)`, cut short; its cost does not grow with the value's size."""
    return _EXCERPT.repr(value)


def clip(text: str, limit: int = _MAX_FIELD_CHARS) -> str:
    """`text` if it is at most `limit` characters, else its start and its end around a count of the
    rest, `limit` characters in all: clipping twice changes nothing (Ray re-makes errors it unpickles).

    The end is kept because messages end in advice ("use a digit such as '7'").
    """
    if len(text) <= limit:
        return text
    half = (limit - 40) // 2  # 40: room for the marker, whose count has up to 12 digits
    return f"{text[:half]}...({len(text) - 2 * half} characters left out)...{text[-half:]}"


def logged_failure(error: BaseException, log: logging.Logger, what: str) -> str:
    """`error` as a client may be told of it: its type and an id. Its text (paths, PIDs, device
    messages) is logged under that id, with its traceback, for the server's operator only."""
    error_id = secrets.token_hex(4)
    log.error("%s failed (error id %s)", what, error_id, exc_info=error)
    return f"{type(error).__name__} (error id {error_id}; the server log has its message)"


class RolloutError(Exception):
    """Base class of every error this library raises on purpose; its message is clipped, so that
    no raiser can echo a whole value into a response or a log line."""

    def __init__(self, *args):
        super().__init__(*(clip(arg, _MAX_MESSAGE_CHARS) if isinstance(arg, str) else arg for arg in args))


class FieldError(RolloutError, ValueError):
    """Bad input, named.

    Attributes:
        field: Name of the offending field, as the caller spelled it (e.g. ``"num_inference_steps"``).
        reason: What is wrong with it and what the limit is.
    """

    def __init__(self, field: str, reason: str):
        # Clipped here so that no raiser, in this library or a model's code, can echo a whole value.
        self.field = clip(field)
        self.reason = clip(reason, MAX_REASON_CHARS)
        super().__init__(f"{self.field}: {self.reason}")

    def __reduce__(self):
        # Errors cross process boundaries (Ray pickles them); rebuild from both fields.
        return (type(self), (self.field, self.reason))


class InvalidRequestError(FieldError):
    """A request field has a value the library cannot serve."""


class WeightUpdateError(FieldError):
    """A weight update that cannot be applied (a missing weight, a bad file, a refusing replica);
    nothing was changed."""


class ModelLoadError(FieldError):
    """A model cannot be loaded as configured (``model.path``, ``model.name``, ...): raised at start-up."""


class RequestSchemaError(InvalidRequestError):
    """The request does not fit the request schema: a wrong type, a missing or an unknown field.

    Its `InvalidRequestError` siblings are well-typed values the server cannot serve. The two
    kinds get different HTTP statuses (422 and 400), as in SGLang's rollout API.

    Attributes:
        errors: one entry per problem, shaped like FastAPI's validation errors:
            ``{"type": ..., "loc": ["body", <field>, ...], "msg": ...}``.
    """

    def __init__(self, field: str, reason: str, errors: list[dict] | None = None):
        super().__init__(field, reason)
        self.errors = errors if errors is not None else [{"type": "value_error", "loc": ["body", field], "msg": reason}]

    def __reduce__(self):
        return (type(self), (self.field, self.reason, self.errors))


class UnknownPromptError(InvalidRequestError):
    """The model does not know how to condition on this prompt."""


class CodecError(RolloutError, ValueError):
    """A tensor envelope is malformed or does not match its declared shape or dtype."""


class SamplingAbandoned(RolloutError):
    """A sampler call stopped between steps: no one waited for any of its samples any more
    (`rollout.sampler.sample_tree`'s `abandoned`)."""


class NonFiniteOutputError(RolloutError):
    """Sampling produced NaN or infinite values: the request fails rather than return them as a rollout."""


class ScorerError(RolloutError):
    """A scorer failed or ran out of time on samples it was given; the message names the scorer.

    Attributes:
        scorer: the scorer's name, as the request names it in ``rollout_reward_models``.
        reason: what went wrong.
    """

    def __init__(self, scorer: str, reason: str):
        self.scorer = clip(scorer)
        self.reason = clip(reason, MAX_REASON_CHARS)
        super().__init__(f"scorer {self.scorer!r}: {self.reason}")

    def __reduce__(self):
        return (type(self), (self.scorer, self.reason))
