"""Errors that cross the package boundary."""


class RequestError(ValueError):
    """An invalid request (docs/contract.md §2). ``status`` is the HTTP status a server answers with.

    ``message`` is the contract's exact wording (what the server answers). ``detail``, when given, names the problem
    in this request: the question, the field and the bad value (``"question 'urgency': type is 'chose'; use ..."``),
    and for a list of requests the item's index (``"request [2]: ..."``); the server puts it in its error body
    (``detail[0].ctx.reason``) and ``eval`` in its report. ``str(error)`` is ``"<message> (<detail>)"``, so an
    uncaught error says what to fix.
    """

    def __init__(self, message: str, status: int = 422, *, detail: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.message} ({self.detail})" if self.detail else self.message

    def __reduce__(self):  # pickles (e.g. across processes) with its detail
        return (_rebuild_request_error, (self.message, self.status, self.detail))


def _rebuild_request_error(message: str, status: int, detail: str | None) -> RequestError:
    return RequestError(message, status, detail=detail)


def name_list_item(error: RequestError, index: int) -> RequestError:
    """``error`` of the request at ``index`` of a list, its detail prefixed with ``request [index]``."""
    where = f"request [{index}]"
    return RequestError(error.message, error.status, detail=f"{where}: {error.detail}" if error.detail else where)


class CheckpointError(ValueError):
    """A checkpoint (export directory, published package or base directory) that cannot be used."""


# Where a checkpoint error points a user who has none on disk yet: the section saying which repositories to download
# (ids and revisions) and how. tests/test_first_hour.py checks that the heading exists.
GET_CHECKPOINT_DOCS = 'docs/checkpoints.md "Getting a checkpoint"'


class InputFileError(ValueError):
    """A file given to a command (other than a checkpoint or a request) that cannot be used, e.g. warm-up shapes."""


class UsageError(ValueError):
    """An option this machine cannot honour: a CUDA device where there is none, a port already in use."""


class UnknownDtypeError(LookupError):
    """A dtype name that is none of the accepted ones, from ``JevModel.from_pretrained``: not a ``ValueError``, which
    Transformers' ``pipeline`` would take for a load failure and answer by loading again in float32."""


class InferenceError(RuntimeError):
    """A failure inside inference (docs/contract.md §2: status 500 ``model inference failed``)."""

    status = 500
