"""Errors that cross the package boundary."""


class RequestError(ValueError):
    """An invalid request (docs/contract.md §2). ``status`` is the HTTP status a server answers with.

    ``message`` (and ``str(error)``) is the contract's exact wording. ``detail``, when given, names the problem in
    this request (``"question 'urgency': criteria is missing; ..."``, or the served model names); the server puts
    it in its error body (``detail[0].ctx.reason``) and ``eval`` in its report. (It is not an exception note:
    ``pytest.raises(match=...)`` and other callers matching the whole text must keep seeing the contract's
    message alone.)
    """

    def __init__(self, message: str, status: int = 422, *, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.detail = detail


class CheckpointError(ValueError):
    """A checkpoint (export directory, published package or base directory) that cannot be used."""


class InputFileError(ValueError):
    """A file given to a command (other than a checkpoint or a request) that cannot be used, e.g. warm-up shapes."""


class UsageError(ValueError):
    """An option this machine cannot honour: a CUDA device where there is none, a port already in use."""


class InferenceError(RuntimeError):
    """A failure inside inference (docs/contract.md §2: status 500 ``model inference failed``)."""

    status = 500
