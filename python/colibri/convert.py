"""Convert a Hugging Face checkpoint into a colibri container.

The source may be BF16/F16/F32 or FP8 e4m3 with 128x128 ``weight_scale_inv`` block scales
(as DeepSeek-V3 and GLM-5 ship). The output follows the layout the GLM-5.2 community uses
for streaming engines (``docs/container.md``): packed ``U8`` weights with ``.qs`` float32
scales, routed experts / attention / shared experts / dense MLPs int4 with group size 64,
embeddings and ``lm_head`` int8 per row, the whole MTP layer int8 per row, norms, router and
bias float32.

All quantising runs in Rust, shard by shard with bounded memory; finished output shards are
skipped when the conversion is run again, so an interrupted conversion resumes. A progress
record in ``dst`` fingerprints the source bytes each shard was made from: a shard whose
source has changed since is converted again (with a warning), and a source that changes
while it is being converted is a :class:`colibri.ContainerError` naming it.

Example:
    >>> from colibri.convert import convert
    >>> report = convert("GLM-5.2-FP8", "GLM-5.2-colibri-int4")  # doctest: +SKIP
    >>> report.shards_written, report.shards_skipped  # doctest: +SKIP
    (93, 0)
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from colibri import _core

__all__ = ["ConvertReport", "convert"]


@dataclass(frozen=True)
class ConvertReport:
    """What :func:`convert` did."""

    dst: Path
    """The output directory."""
    shards_written: int
    """Output shards written by this call."""
    shards_skipped: int
    """Output shards that already existed complete (resumed conversion)."""
    bytes_written: int
    """Bytes written by this call."""
    formats: dict[str, int] = field(default_factory=dict)
    """Output tensors per format name (``"int4_g64"``, ``"int8"``, ``"f32"``, ``"copy"``...)."""


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    expert_bits: int = 4,
    group_size: int = 64,
    dense_bits: int = 4,
    mtp_bits: int = 8,
    embed_bits: int = 8,
    lm_head_bits: int = 8,
    indexer_bits: int = 8,
    max_shard_size: int = 4 << 30,
    chunk_bytes: int = 64 << 20,
    progress: bool = True,
) -> ConvertReport:
    """Convert the checkpoint in ``src`` into a colibri container in ``dst``.

    Bit widths: 4 (int4, grouped by ``group_size``, or per row when ``group_size=0``),
    8 (int8 per row), 16 (bf16), 32 (f32).

    Args:
        src: Hugging Face model directory (``config.json`` + ``*.safetensors``).
        dst: Output directory; created if missing. Must not be inside ``src``, and must not
            hold weight files other than this conversion's own shards.
        expert_bits: Routed experts of the main layers.
        group_size: int4 group size: 16, 32, 48, 64, 96, 128, 192 or 256; 0 for per-row.
        dense_bits: Attention projections, shared experts and dense MLPs.
        mtp_bits: Every 2-D weight of the MTP layer except its router.
        embed_bits: ``model.embed_tokens``.
        lm_head_bits: ``lm_head``.
        indexer_bits: GLM DSA lightning-indexer projections.
        max_shard_size: Largest output shard in bytes (an expert is never split).
        chunk_bytes: Bound on the float32 working set per row block (memory knob).
        progress: Show a tqdm progress bar on stderr.

    Returns:
        A :class:`ConvertReport`.

    Warns:
        UserWarning: for each finished shard in ``dst`` whose source bytes have changed
            since it was written; it is converted again.

    Raises:
        colibri.ConfigError: ``config.json`` is missing a field or has a bad value.
        colibri.UnsupportedModelError: the model family is not DeepSeek-V3 or GLM-MoE-DSA.
        colibri.ContainerError: a source shard is corrupt or disagrees with the config, or
            changed (rewritten, replaced or truncated) while it was being converted; the
            message names the file (and, for a truncation, the offset). Run again once the
            source is complete: shards made from its old contents are redone.
        colibri.NonFiniteWeightError: a source weight holds NaN or Inf.
        colibri.InvalidArgumentError: a bad option, or ``dst`` inside ``src``.
    """
    job = _core.ConvertJob(
        os.fspath(src),
        os.fspath(dst),
        expert_bits=expert_bits,
        group_size=group_size,
        dense_bits=dense_bits,
        mtp_bits=mtp_bits,
        embed_bits=embed_bits,
        lm_head_bits=lm_head_bits,
        indexer_bits=indexer_bits,
        max_shard_bytes=max_shard_size,
        chunk_bytes=chunk_bytes,
    )
    shards = job.shards()
    todo = []
    for i in range(len(shards)):
        done, why = job.status(i)
        if why is not None:
            warnings.warn(why, UserWarning, stacklevel=2)
        if not done:
            todo.append(i)
    total = sum(shards[i][1] for i in todo)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert")
    written = 0
    try:
        for i in todo:
            if bar is not None:
                bar.set_postfix_str(shards[i][0], refresh=False)
                job.write_shard(i, bar.update)
            else:
                job.write_shard(i)
            written += shards[i][1]
    finally:
        if bar is not None:
            bar.close()
    job.finish()
    return ConvertReport(
        dst=Path(dst),
        shards_written=len(todo),
        shards_skipped=len(shards) - len(todo),
        bytes_written=written,
        formats=dict(job.format_counts()),
    )
