"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class EdgespecError(Exception):
    """Base class: the message is meant for the user, as one line."""

    exit_code = 2


class ModelError(EdgespecError):
    """A model file is missing, not GGUF, truncated, or cannot be loaded."""


class VocabMismatchError(EdgespecError):
    """The draft model's vocabulary differs from the target's."""


class ContextFullError(EdgespecError):
    """The prompt (or prompt plus generation) does not fit in the context."""


class CatalogError(EdgespecError):
    """An unknown catalog name, or a fetch that failed."""


class ChecksumError(CatalogError):
    """A fetched or cached file does not match the sha256 pinned in the catalog."""


class Cancelled(EdgespecError):
    """A generation's caller gave it up while its prompt was being read (`Lifecycle.cancelled`)."""
