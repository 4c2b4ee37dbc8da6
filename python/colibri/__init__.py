"""colibri: run frontier Mixture-of-Experts language models on one machine.

Dense weights stay in RAM, routed experts stream from disk, and the model's own MTP head
drafts tokens that one batched forward verifies.
"""

from __future__ import annotations

from colibri import _core
from colibri._hub import DEFAULT_MODEL, embedded_models
from colibri.errors import (
    ColibriError,
    ColibriFileNotFoundError,
    ColibriIOError,
    ColibriPermissionError,
    ConfigError,
    ContainerError,
    ExpertWorkerWarning,
    ForkedProcessError,
    InternalError,
    InvalidArgumentError,
    MissingTensorError,
    ModelNotFoundError,
    NonFiniteWeightError,
    SavedContextError,
    ServerAddressError,
    UnsupportedModelError,
)
from colibri.model import Model, Session
from colibri.results import FinishReason, GenerationResult, GenerationStats
from colibri.sampling import GenerateOptions, SamplingOptions, SamplingParams
from colibri.stream import GenerationStream

__version__: str = _core.__version__

__all__ = [
    "DEFAULT_MODEL",
    "ColibriError",
    "ColibriFileNotFoundError",
    "ColibriIOError",
    "ColibriPermissionError",
    "ConfigError",
    "ContainerError",
    "ExpertWorkerWarning",
    "FinishReason",
    "ForkedProcessError",
    "GenerateOptions",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "InternalError",
    "InvalidArgumentError",
    "MissingTensorError",
    "Model",
    "ModelNotFoundError",
    "NonFiniteWeightError",
    "SamplingOptions",
    "SamplingParams",
    "SavedContextError",
    "ServerAddressError",
    "Session",
    "UnsupportedModelError",
    "__version__",
    "build_info",
    "embedded_models",
]


def build_info() -> dict[str, object]:
    """Facts about this build and machine: version, CPU architecture and features, the
    kernel path the dispatcher chose."""
    return dict(_core.build_info())
