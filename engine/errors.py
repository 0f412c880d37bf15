"""Errors raised by the engine."""


class RequestValidationError(ValueError):
    """A request cannot be served as given (empty prompt, too long, bad phase combination...)."""
