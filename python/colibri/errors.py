"""The colibri exception hierarchy.

Every error the engine raises is a :class:`ColibriError`. Subclasses also derive from the
builtin a Python user would expect (``ValueError`` for bad arguments, ``OSError`` for I/O),
so ``except ValueError`` keeps working.

Example:
    >>> import colibri
    >>> try:
    ...     colibri.Model("/no/such/model")
    ... except colibri.ColibriError as e:
    ...     print(type(e).__name__)
    ColibriFileNotFoundError
"""

from __future__ import annotations

__all__ = [
    "ColibriError",
    "ColibriFileNotFoundError",
    "ColibriIOError",
    "ColibriPermissionError",
    "ConfigError",
    "ContainerError",
    "ExpertWorkerWarning",
    "ForkedProcessError",
    "InternalError",
    "InvalidArgumentError",
    "MissingTensorError",
    "ModelNotFoundError",
    "NonFiniteWeightError",
    "SavedContextError",
    "ServerAddressError",
    "UnsupportedModelError",
]


class ColibriError(Exception):
    """Base class of every error colibri raises.

    The engine sets four attributes from the error's fields, each ``None`` where the error
    has none: ``filename`` (the file a config, container, saved-context or I/O error is
    about), ``errno`` (an OS error's code), ``param`` (the argument an
    :class:`InvalidArgumentError` names) and ``tensor`` (the tensor a container or
    non-finite-weight error names).
    """

    filename: str | None = None
    errno: int | None = None
    param: str | None = None
    tensor: str | None = None


class InvalidArgumentError(ColibriError, ValueError):
    """A parameter is out of range (e.g. ``temperature=-1``); the message names it."""


class ConfigError(ColibriError, ValueError):
    """``config.json`` is missing a field or holds a bad value."""


class UnsupportedModelError(ConfigError):
    """The model family (``model_type``) or a feature of it is not supported."""


class ContainerError(ColibriError, ValueError):
    """A weight file is corrupt, truncated, or disagrees with the config."""


class MissingTensorError(ContainerError, KeyError):
    """A tensor the model needs is absent from every shard."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NonFiniteWeightError(ContainerError):
    """Weights contain NaN or Inf: a source tensor given to the converter, or a model whose
    output (a logit) came out NaN/Inf; the message names the tensor where it can."""


class SavedContextError(ColibriError, ValueError):
    """A saved context file (:meth:`Session.save`) is truncated, corrupt, of another format
    version, or was made by another model."""


class ColibriIOError(ColibriError, OSError):
    """An operating-system I/O failure while reading model files."""

    # OSError's own slots, not ColibriError's class defaults (which come first in the MRO).
    filename = OSError.filename  # type: ignore[assignment]
    errno = OSError.errno  # type: ignore[assignment]

    def __str__(self) -> str:
        # The engine's message already names the file and the OS error; OSError would
        # rewrite it as "[Errno N] ..." once errno is set.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ServerAddressError(ColibriIOError):
    """``colibri serve`` / :func:`colibri.serve.serve` cannot listen at its address: the
    port is in use, privileged, or the host is not this machine's."""


class ColibriFileNotFoundError(ColibriIOError, FileNotFoundError):
    """A file or directory does not exist."""


class ColibriPermissionError(ColibriIOError, PermissionError):
    """A file or directory cannot be read (or, for our sidecar files, written)."""


class ModelNotFoundError(ColibriError, FileNotFoundError):
    """A model name is neither a local directory nor a reachable Hugging Face repo."""

    # OSError's own slots, not ColibriError's class defaults (which come first in the MRO).
    filename = OSError.filename  # type: ignore[assignment]
    errno = OSError.errno  # type: ignore[assignment]


class ForkedProcessError(ColibriError, RuntimeError):
    """A model loaded before ``os.fork()`` was used in the child process.

    The engine's I/O and compute threads do not survive a fork; load the model in the child,
    or use multiprocessing's ``spawn`` or ``forkserver`` start method.
    """


class InternalError(ColibriError, RuntimeError):
    """A bug in colibri (a caught panic included). Please report it with the message."""


class ExpertWorkerWarning(UserWarning):
    """An expert worker (``Model(..., experts="ray://...")``, docs/distributed.md) failed or
    did not answer in time, so its experts come from the local store until it answers again
    (the tokens are the same), or it answers again."""
