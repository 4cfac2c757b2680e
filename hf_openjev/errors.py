"""Errors that cross the package boundary."""


class RequestError(ValueError):
    """An invalid request (contract §2). ``status`` is the HTTP status a server answers with."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.message = message
        self.status = status


class CheckpointError(ValueError):
    """A checkpoint (export directory, published package or base directory) that cannot be used."""


class InputFileError(ValueError):
    """A file given to a command (other than a checkpoint or a request) that cannot be used, e.g. warm-up shapes."""


class InferenceError(RuntimeError):
    """A failure inside inference (contract §2: status 500 ``model inference failed``)."""

    status = 500
