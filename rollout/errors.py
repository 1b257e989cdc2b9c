"""Typed errors of the rollout library.

Every error raised for bad input names the offending field, so that a server can turn it into a
4xx response with a message a user can act on, and a Python caller can catch it by type.
"""


class RolloutError(Exception):
    """Base class of every error this library raises on purpose."""


class FieldError(RolloutError, ValueError):
    """Bad input, named.

    Attributes:
        field: Name of the offending field, as the caller spelled it (e.g. ``"num_inference_steps"``).
        reason: What is wrong with it and what the limit is.
    """

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")

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
