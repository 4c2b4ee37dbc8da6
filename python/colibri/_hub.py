"""Resolving a model name to a local directory: the embedded default, a local path, or a
Hugging Face repo id (through ``huggingface_hub``, honouring its cache and ``HF_HUB_OFFLINE``)."""

from __future__ import annotations

import os
from pathlib import Path

from colibri.errors import ColibriFileNotFoundError, InvalidArgumentError, ModelNotFoundError

#: Name of the model that ships inside the package.
DEFAULT_MODEL = "tiny"

_EMBEDDED_DIR = Path(__file__).resolve().parent / "models"


def embedded_models() -> list[str]:
    """Names of the models shipped inside the package."""
    if not _EMBEDDED_DIR.is_dir():
        return []
    return sorted(p.name for p in _EMBEDDED_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_dir(model: str | os.PathLike[str] | None, *, revision: str | None = None) -> Path:
    """Return the local directory holding ``model``.

    ``None`` or the name of an embedded model selects the model shipped in the package; an
    existing directory is used as is; anything else is treated as a Hugging Face repo id and
    fetched (or found in the local cache when offline).
    """
    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"invalid value for 'model': {model!r}; expected a model directory (a str or "
            "os.PathLike), a Hugging Face repo id ('owner/name') or an embedded model name "
            f"({', '.join(embedded_models()) or 'none'})"
        )
    name = os.fspath(model)
    if not isinstance(name, str):  # a bytes path
        name = os.fsdecode(name)
    if name in embedded_models():
        return _EMBEDDED_DIR / name
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a directory but has no config.json; point colibri at a model "
                "directory (config.json, *.safetensors, tokenizer.json)"
            )
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is a file; colibri expects a model directory")
    owner, _, repo = name.partition("/")
    looks_like_path = path.is_absolute() or name.startswith((".", "~"))
    if looks_like_path or name.count("/") > 1:
        raise ColibriFileNotFoundError(
            f"model directory {str(path)!r} does not exist; pass an existing model directory "
            "(config.json, *.safetensors, tokenizer.json), a Hugging Face repo id "
            f"(owner/name), or one of the embedded models: {', '.join(embedded_models()) or 'none'}"
        )
    is_repo_id = bool(owner) and bool(repo)
    if not is_repo_id:
        hint = ", ".join(embedded_models()) or "none"
        raise ModelNotFoundError(
            f"model {name!r} is neither an existing directory nor a Hugging Face repo id "
            f"(owner/name); embedded models: {hint}"
        )
    return _download(name, revision)


def _hub_cache_dir() -> str | None:
    """The hub cache as the environment names it now (``huggingface_hub`` reads it once, at
    import; reading it per call lets a process change it)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.environ[var])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def _download(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - a runtime dependency
        raise ModelNotFoundError(f"huggingface_hub is needed to fetch {repo_id!r}: {e}") from e
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    what = repo_id if revision is None else f"{repo_id} at revision {revision!r}"
    try:
        local = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=_hub_cache_dir(),
            local_files_only=offline,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"],
        )
    except LocalEntryNotFoundError as e:
        where = _hub_cache_dir() or "the default Hugging Face cache"
        cause = _root_cause(e)
        if offline:
            why = "HF_HUB_OFFLINE is set"
            fix = "or unset HF_HUB_OFFLINE"
        else:
            why = f"the hub could not be reached ({cause})"
            fix = "or check the network connection"
        rev = "" if revision is None else f" --revision {revision}"
        raise ModelNotFoundError(
            f"{what} is not in the local Hugging Face cache ({where}) and {why}; download it "
            f"first (e.g. `hf download {repo_id}{rev}`) {fix}"
        ) from e
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"cannot fetch {what} from the Hugging Face hub: {e}") from e
    except Exception as e:  # network errors surface as many types
        raise ModelNotFoundError(f"cannot fetch {what}: {type(e).__name__}: {e}") from e
    return Path(local)


def _root_cause(e: BaseException) -> str:
    """The innermost error of a chain (the network failure under the hub's wrapper)."""
    seen = {id(e)}
    while True:
        inner = e.__cause__ or e.__context__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        e = inner
    return f"{type(e).__name__}: {e}"
