"""Type stubs for the compiled extension ``colibri._core`` (built from ``src/python.rs``)."""

from collections.abc import Callable
from os import PathLike
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

__version__: str

def cpu_features() -> list[str]:
    """CPU features the kernels can dispatch on, e.g. ``["avx2", "fma", "avx512f"]``."""

def build_info() -> dict[str, object]:
    """Version, architecture and CPU features of this build."""

# --- container reader and converter (src/python/container.rs) ---------------------------

def model_config(dir: str | PathLike[str]) -> dict[str, Any]:
    """The model's ``config.json`` as the engine reads it (aliases resolved, family defaults
    filled in, validated): ``model_type``, ``vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, ``num_nextn_predict_layers``, ``n_routed_experts``, ... under their
    transformers names. Raises ``ConfigError`` / ``ColibriFileNotFoundError``."""

class GenerateRequest(TypedDict, total=False):
    """A generation request as the engine takes it (the Rust ``GenerateRequest``): every
    field optional, its default the engine's."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: list[tuple[int, float]] | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    stop_ids: list[int] | None
    grammar: tuple[str, str] | None
    draft: str
    draft_depth: int

class Container:
    """An opened model directory: shard headers parsed; tensors are read when asked for."""

    def __init__(self, path: str | PathLike[str]) -> None:
        """Open ``path`` (config.json + *.safetensors); raises ``ContainerError`` /
        ``ConfigError`` / ``ColibriFileNotFoundError``."""
    @property
    def dir(self) -> Path:
        """The model directory."""
    @property
    def family(self) -> str:
        """``model_type`` of the config (``"deepseek_v3"`` or ``"glm_moe_dsa"``)."""
    def kv_bytes_per_token(self, mtp_loaded: bool = True) -> int:
        """KV-cache bytes per token of a model opened from this directory (latents, roped
        keys, DSA indexer keys, and the MTP layer's row when loaded)."""
    def names(self) -> list[str]:
        """Every tensor name (scales ``NAME.qs`` included) in shard and offset order."""
    def __len__(self) -> int:
        """The number of tensors."""
    def __contains__(self, name: str) -> bool:
        """Whether a tensor of this name exists."""
    def info(self, name: str) -> dict[str, object]:
        """``name``, ``dtype``, ``shape``, ``file``, ``start``/``end`` (byte range in the
        file), ``format`` and ``logical_shape`` (``[O, I]``) of one tensor."""
    def format(self, name: str) -> str | None:
        """The weight's format (``"int4_g64"``, ``"int8"``, ``"bf16"``, ...), or None for
        tensors that are not 2-D weights."""
    def expected_shape(self, name: str) -> tuple[int, int] | None:
        """The logical ``[O, I]`` the config gives this name, if it is a known 2-D weight."""
    def dequantize(self, name: str) -> npt.NDArray[np.float32]:
        """A 2-D weight dequantised to float32 ``[O, I]`` (reference dequantiser)."""
    def vector(self, name: str) -> npt.NDArray[np.float32]:
        """A 1-D F32/BF16/F16 tensor as float32."""
    def raw(self, name: str) -> bytes:
        """The raw stored bytes of a tensor."""
    def diagnose_non_finite(self, max_bytes: int = 4 << 30) -> str:
        """Why a forward produced a non-finite value, from a bounded scan of the stored
        floats: the tensor holding NaN/Inf or an implausible magnitude, else the largest
        stored value."""

class ConvertJob:
    """A planned conversion; see ``colibri.convert``."""

    def __init__(
        self,
        src: str | PathLike[str],
        dst: str | PathLike[str],
        *,
        expert_bits: int = 4,
        group_size: int = 64,
        dense_bits: int = 4,
        mtp_bits: int = 8,
        embed_bits: int = 8,
        lm_head_bits: int = 8,
        indexer_bits: int = 8,
        max_shard_bytes: int = ...,
        chunk_bytes: int = ...,
    ) -> None:
        """Plan converting the Hugging Face checkpoint ``src`` into a container at ``dst``."""
    def shards(self) -> list[tuple[str, int]]:
        """(file name, total bytes) of every planned output shard."""
    def is_done(self, i: int) -> bool:
        """Whether shard ``i`` already exists complete in ``dst``, made from the sources as
        they are now (it will be skipped)."""
    def status(self, i: int) -> tuple[bool, str | None]:
        """(done, why): whether shard ``i`` will be skipped, and, for a finished shard made
        from source contents that have changed since, why it will be converted again."""
    def write_shard(self, i: int, progress: Callable[[int], object] | None = None) -> None:
        """Write shard ``i``; ``progress(n_bytes)`` is called after each tensor. Ctrl-C or an
        exception from ``progress`` stops the write. A source file that changed while the
        shard was written is a ``ContainerError`` naming it (the shard is not kept)."""
    def finish(self) -> None:
        """Copy tokenizer/sidecar files, write config.json, and check the output opens."""
    def format_counts(self) -> dict[str, int]:
        """Output tensors per format name."""

def decode_fp8_e4m3(raw: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """FP8 e4m3fn bytes → float32."""

def dequant_fp8_blocks(
    raw: npt.NDArray[np.uint8],
    scale_inv: npt.NDArray[np.float32],
    block: tuple[int, int] = (128, 128),
) -> npt.NDArray[np.float32]:
    """w = fp8 · scale_inv[o/bo, i/bi] for an FP8 [O, I] weight."""

# --- the engine (src/python/engine.rs) -----------------------------------------------------

class Session:
    """One conversation's KV caches and the tokens they hold, from ``Engine.new_session`` or
    ``Engine.load_session``. Getters wait for a generation running on it."""

    @property
    def kv_bytes(self) -> int:
        """Bytes its KV caches hold in RAM (0 while evicted to disk)."""
    @property
    def kv_tokens(self) -> int:
        """Tokens of context it holds."""
    @property
    def evicted(self) -> bool:
        """Whether its caches were written to disk under the idle-session budget."""
    def tokens(self) -> list[int]:
        """The tokens of context it holds."""
    def reset(self) -> None:
        """Forget the conversation."""

class Engine:
    """The Rust engine: a loaded model with its expert store, decode loop and sessions.
    Calls are serialised by an internal lock; they run with the GIL released.
    ``colibri.Model`` wraps it."""

    def __init__(
        self,
        path: str | PathLike[str],
        *,
        threads: int = 0,
        io: str = "auto",
        ram_budget: int | None = None,
        prefetch: str = "auto",
        prefetch_top_k: int = 0,
        mtp: bool = True,
        usage_file: bool = True,
        cache_dir: str | PathLike[str] | None = None,
        pin: str = "auto",
        resident_layers: list[int] | None = None,
        max_context: int | None = None,
        idle_session_bytes: int | None = None,
        spill_dir: str | PathLike[str] | None = None,
        prefill: str = "auto",
        decode: str = "auto",
        load_progress: Callable[[int, int], object] | None = None,
        trace_routing: str | PathLike[str] | None = None,
        experts_per_token: int | None = None,
    ) -> None:
        """Load the model directory ``path``. ``io``, ``prefetch``, ``pin``: one of
        ``choices()[name]``; ``ram_budget``: expert-cache bytes (None: sized from available
        memory); ``prefetch_top_k``: experts predicted per layer (0: 1.5x the model's
        top-k); ``usage_file``: persist routing history for the pinned set, in ``cache_dir``
        (None: ``$COLIBRI_CACHE_DIR``, ``$XDG_CACHE_HOME/colibri`` or ``~/.cache/colibri``);
        ``resident_layers``: MoE layers whose experts are all loaded at open and kept, beyond
        ``ram_budget`` (the MTP layer is ``num_hidden_layers``); ``max_context``: the
        longest context in tokens (None: the model's exact limit, bounded by the RAM left
        for the KV cache); ``idle_session_bytes``: RAM idle sessions' KV may hold before the
        least recently used are written to ``spill_dir`` (None: one full context; the
        directory defaults to ``sessions/`` in the cache directory, else a private one made
        in the temporary directory; it must be this user's, not a symbolic link, and
        writable by no one else); ``decode``: the
        arithmetic of decode steps, verifies and drafts, ``"exact"`` or ``"int8"``
        (activations rounded to int8 per row and 64-element block; "auto": int8 where the
        CPU has AVX-512 VNNI or AVX2, which run an int8 decode kernel, else exact);
        ``prefill``: the arithmetic of prompt forwards ("auto": the decode arithmetic when
        ``decode`` is set, else int8 where the CPU has AVX-512 VNNI or AVX2; one other than
        the decode arithmetic applies to prompt forwards of 16 rows or more); ``load_progress(done,
        total)``: called after each resident tensor is read (bytes; the last call has both
        equal), where Ctrl-C is also checked; ``trace_routing``: a file that every forward's
        routing is written to, as a routing trace (JSON lines, docs/expert-store.md);
        ``experts_per_token``: routed experts per token, main and MTP layers, 1 to the
        model's ``num_experts_per_tok`` (None: the model's; fewer change the output,
        docs/expert-store.md, "Fewer experts per token"; out of range:
        ``InvalidArgumentError``)."""
    def config_json(self) -> str:
        """The model's ``config.json`` text."""
    def info(self) -> dict[str, Any]:
        """Facts fixed at load: ``has_mtp``, ``uses_dsa``, ``max_context``, ``vocab_size``,
        ``hidden_size``, ``eos_token_ids``, ``kv_bytes_per_token``, ``idle_session_bytes``,
        ``fingerprint``, ``prefill`` and ``decode`` (the arithmetic of prompts and of decode
        steps: "exact" or "int8"), ``row_invariant`` (whether they agree, so that every row
        is computed from its own tokens alone),
        ``lookahead`` (whether decode predicts the next layer's experts: off for
        ``prefetch="off"``, and for "auto" when the budget holds every routed expert),
        ``experts_per_token`` (routed experts per token in effect) and
        ``model_experts_per_token`` (the model's own ``num_experts_per_tok``)."""
    @property
    def usage_path(self) -> Path | None:
        """Where the routing history is saved, or None when it is not saved."""
    def load_vocabulary(self, tokenizer_json: str) -> None:
        """Give structured output the model's vocabulary: the text of its
        ``tokenizer.json``. Done once; later calls do nothing."""
    def check_grammar(self, kind: str, text: str) -> None:
        """Compile a structured-output constraint (``generate``'s ``grammar``, after
        :meth:`load_vocabulary`) and drop it; a bad one raises ``InvalidArgumentError``."""
    @property
    def has_vocabulary(self) -> bool:
        """Whether :meth:`load_vocabulary` was done."""
    def new_session(self) -> Session:
        """A new conversation with its own (empty) KV caches."""
    def save_session(self, path: str | PathLike[str], session: Session | None = None) -> int:
        """Write ``session``'s context (the engine's own when None) to ``path`` atomically;
        returns the bytes written."""
    def load_session(self, path: str | PathLike[str]) -> Session:
        """A new session holding the context saved at ``path``; a damaged, foreign or
        other-version file raises ``SavedContextError``."""
    def logits(self, ids: list[int]) -> npt.NDArray[np.float32]:
        """Logits of one forward over ``ids`` as a fresh sequence: float32
        ``[len(ids), vocab]``."""
    def generate(
        self,
        ids: list[int],
        request: GenerateRequest | None = None,
        *,
        on_tokens: Callable[[list[int], list[dict[str, Any]] | None], bool] | None = None,
        session: Session | None = None,
        prefill_progress: Callable[[int, int], object] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Generate after ``ids`` with ``request`` (any of :class:`GenerateRequest`'s fields, in
        the dict or as keywords; one it does not have, or a value of the wrong type or range, raises
        ``InvalidArgumentError`` naming it); returns ``{"tokens", "finish_reason", "stats"}``
        (stats keyed by ``generation_stats_fields()``). ``draft_depth`` 0 is auto; ``stop_ids``
        None uses the EOS ids; ``on_tokens(tokens, logprobs)`` gets the tokens each forward
        accepted, with their ``"logprobs"`` rows (None without ``logprobs``), and returns
        False to stop. Ctrl-C raises KeyboardInterrupt within one forward. The KV
        cache reused is ``session``'s, or the engine's own. The penalties, ``logit_bias``
        and ``min_tokens`` process every row's logits (verify rows included, so speculation
        stays lossless); ``logprobs`` k adds ``"logprobs"``: per token
        ``{"token", "logprob", "top": [(id, logprob)] * k}``. ``prefill_progress(done,
        total)`` is called after each prompt chunk (512 tokens), where Ctrl-C is also checked.
        ``grammar`` ``(kind, text)``, kind ``"json"`` (a JSON schema), ``"regex"`` or
        ``"grammar"`` (Lark), constrains the output with a token mask in every row (after
        :meth:`load_vocabulary`); a bad one raises ``InvalidArgumentError`` naming
        ``guided_json`` / ``guided_regex`` / ``guided_grammar``. ``prompt_logprobs`` k adds
        ``"prompt_logprobs"``: per prompt token after the first, its log-probability given
        the tokens before it (temperature-1 softmax) with k alternatives, from a prefill
        that reuses no cached prefix."""
    def generate_batch(
        self,
        requests: list[dict[str, Any]],
        sessions: list[Session],
        on_tokens: Callable[[int, list[int], list[dict[str, Any]] | None], bool] | None = None,
    ) -> list[dict[str, Any] | BaseException]:
        """Generate for several sessions at once, their decode forwards shared (batched
        decode). ``requests[i]``: ``"ids"`` and every keyword of :meth:`generate` but
        ``on_tokens``/``session``/``prefill_progress``; ``sessions[i]`` its (distinct)
        session. Returns per request the result dict, or its error as an exception object."""
    def run_batch(
        self,
        admit: Callable[[int], list[tuple[int, dict[str, Any], Session]]],
        on_tokens: Callable[[int, list[int], list[dict[str, Any]] | None], bool],
        on_done: Callable[[int, dict[str, Any] | BaseException], None],
    ) -> None:
        """A continuous batch: ``admit(running)`` is called before every forward and returns
        ``(id, request, session)`` triples to start (``request`` as in
        :meth:`generate_batch`); ``on_tokens(id, tokens, logprobs)`` gets each one's
        emitted tokens and their log-probability rows, as :meth:`generate`'s (False stops
        it); ``on_done(id, result)`` its result dict or its error. Returns once
        nothing runs and ``admit`` gives nothing; an exception raised by a callback cancels
        every running request and is raised here."""
    def set_remote_experts(self, remote: Any | None, held: list[tuple[int, int]] = ...) -> None:
        """Compute routed experts on ``remote`` (``colibri.distributed.RayExperts``:
        ``submit`` and ``collect``) where it holds them, ``held`` the ``(layer, expert)``
        pairs it holds; None puts every expert back on the local store."""
    def drop_page_cache(self) -> None:
        """Evict the model's expert bytes from the OS page cache (cold-start benchmarks)."""
    def expert_stats(self) -> dict[str, Any]:
        """Expert-store counters since the last generation started: totals and per layer."""

def choices() -> dict[str, list[str]]:
    """The accepted values of each string option (io, prefetch, pin, draft), "auto" first."""

def limits() -> dict[str, int]:
    """Limits the engine enforces: ``max_draft_depth``, ``max_top_logprobs``."""

def finish_reasons() -> list[str]:
    """Every ``finish_reason`` a generation's result dict can hold."""

def request_fields() -> list[str]:
    """The fields of :class:`GenerateRequest`, in the engine's order."""

def check_request(request: GenerateRequest) -> None:
    """Check a request's values as far as no model is needed (the checks of
    :meth:`Engine.generate` but token ids against a vocabulary and the grammar's
    compilation); raises ``InvalidArgumentError`` naming the first bad field."""

def generation_stats_fields() -> list[str]:
    """The names of the fields a generation's stats carry."""

# --- plan (src/python/plan.rs) ----------------------------------------------------------

def plan_model(
    model: str,
    ram_bytes: int,
    disk_bytes_per_second: float | None = None,
    compute_bytes_per_second: float | None = None,
    cache_dir: str | None = None,
    probe_dir: str | None = None,
    reserve_bytes: int = ...,
    seed: int = 1,
    probe_seconds: float = 2.0,
) -> str:
    """Plan ``model`` (a container directory or a known config) for ``ram_bytes`` of RAM;
    the report as JSON (see ``colibri.plan.plan``)."""

# --- kernels (src/python/kernels.rs) ---------------------------------------------------

def kernel_path() -> str:
    """The dequant-matmul kernel path calls use now: "scalar", "avx2", "avx512" or "neon"."""

def kernel_paths() -> list[str]:
    """The kernel paths this machine can run."""

def set_kernel_path(path: str | None) -> None:
    """Force every later call onto ``path`` (None: ``COLIBRI_KERNEL`` or auto-detection);
    a path this CPU cannot run raises InvalidArgumentError."""

class ExpertShard:
    """Part of a container's routed experts, resident in this process's RAM, run on request
    with the engine's kernels (a worker's side of ``colibri.distributed``)."""

    def __init__(
        self, path: str | PathLike[str], experts: list[tuple[int, int]], *, threads: int = 0
    ) -> None:
        """Load routed experts ``experts`` (``(layer, expert)`` pairs) of the container at
        ``path``; they run on ``threads`` threads (0: one per core)."""
    def run(
        self,
        layer: int,
        arithmetic: str,
        h: npt.NDArray[np.float32],
        want: list[tuple[int, list[int]]],
    ) -> list[tuple[int, npt.NDArray[np.float32]]]:
        """Run experts of ``layer`` on rows of ``h`` (float32 ``[s, hidden]``): ``want`` is a
        list of ``(expert, rows)``; returns ``[(expert, y)]``, y float32
        ``[len(rows) * hidden]`` (unweighted), in ``arithmetic`` ("exact" or "int8")."""
    @property
    def experts(self) -> list[tuple[int, int]]:
        """The ``(layer, expert)`` pairs held, sorted."""
    @property
    def nbytes(self) -> int:
        """Bytes of expert weights held."""
    @property
    def hidden_size(self) -> int:
        """The model's hidden size (the width of every row)."""
