#!/usr/bin/env python3
"""Build tiny random DeepSeek-V3 / GLM-MoE-DSA checkpoints and their golden outputs.

Developer tool only: it needs torch and transformers (run it with /opt/devvenv/bin/python).
Tests and CI never import it; they read the committed files under ``tests/fixtures/``.

For every fixture it writes ``<out>/<name>/config.json``, ``model.safetensors`` (F32, the
official per-expert tensor names, MTP layer at index ``num_hidden_layers``) and
``golden.safetensors`` (prompt, prefill logits, greedy continuation, MTP drafts; for the
sparse DSA fixture the indexer's selections), and ``golden_int4.safetensors``
(transformers' logits on the dequantised weights of the default ``colibri convert``
container). Every number is computed by transformers' own modules; docs/fixtures.md
documents each tensor. A full run also writes ``dsa_indexer_types.json`` (what
``GlmMoeDsaConfig`` derives as ``indexer_types`` from a few configs).

This file is the driver; the work is in the modules beside it, one job each:
``_fixtures_specs`` (the fixtures and the checks' constants), ``_fixtures_model`` (the main
model, its tensors and forwards), ``_fixtures_mtp`` (the MTP layer and its goldens),
``_fixtures_indexer`` (DSA selections), ``_fixtures_candidate`` (one seed's model, goldens
and verdict), ``_fixtures_numpy`` (the float64 reference) and ``_fixtures_quantized``
(``golden_int4.safetensors``).

Usage::

    /opt/devvenv/bin/python tools/make_fixtures.py --out tests/fixtures
    /opt/devvenv/bin/python tools/make_fixtures.py --out /tmp/fx --only glm_dsa
    /opt/devvenv/bin/python tools/make_fixtures.py --out tests/fixtures --quantized-goldens
    /opt/devvenv/bin/python tools/make_fixtures.py --indexer-types-json PATH
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import load_file
from transformers import GlmMoeDsaConfig
from transformers.utils import logging as transformers_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fixtures_candidate import Candidate, build_candidate
from _fixtures_indexer import canonical_topk, full_layers, record_indexers
from _fixtures_model import model_class, official_state_dict, prefill, save_tensors, write_config
from _fixtures_mtp import (
    check_glm_with_transformers_mtp,
    check_with_transformers_mtp,
    mtp_official_tensors,
    reload_glm_mtp,
)
from _fixtures_numpy import NumpyReference
from _fixtures_quantized import write_quantized_golden
from _fixtures_specs import (
    MAX_ATTEMPTS,
    MIN_DENSE_DIFF,
    NEW_TOKENS,
    SEED,
    SPECS,
    TIE_MARGIN,
    TOL_NUMPY,
    TOL_RELOAD,
    FixtureSpec,
)


def make_fixture(spec: FixtureSpec, out_root: Path, index: int) -> None:
    """Build, write and verify one fixture directory.

    Seeds ``SEED + 1000 * index + attempt`` are tried in order; the first model whose
    greedy text and routing are non-degenerate is kept, so the result is deterministic.
    """
    cand: Candidate | None = None
    for attempt in range(MAX_ATTEMPTS):
        cand = build_candidate(spec, SEED + 1000 * index + attempt)
        if not cand.problems:
            break
        print(f"{spec.name}: seed {cand.seed} rejected: {'; '.join(cand.problems)}")
    assert cand is not None
    if cand.problems:
        raise RuntimeError(f"{spec.name}: no acceptable seed in {MAX_ATTEMPTS} attempts")
    model, cfg = cand.model, cand.model.config
    tied = bool(cfg.tie_word_embeddings)

    fixture_dir = out_root / spec.name
    fixture_dir.mkdir(parents=True, exist_ok=True)
    write_config(cfg, spec, fixture_dir / "config.json")
    tensors = official_state_dict(model, tied)
    tensors.update(mtp_official_tensors(cand.mtp_layer, model, cfg.num_hidden_layers))
    save_tensors(tensors, fixture_dir / "model.safetensors")
    save_tensors(cand.golden, fixture_dir / "golden.safetensors")

    # Reload the written checkpoint with transformers: proves the names are what it expects.
    reloaded = model_class(spec).from_pretrained(
        fixture_dir, dtype=torch.float32, attn_implementation="eager"
    )
    reloaded.eval()
    written = load_file(str(fixture_dir / "model.safetensors"))
    main_keys = {k for k in written if not k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    assert main_keys == set(official_state_dict(reloaded, tied)), "main tensor names differ"
    re_logits, re_hidden = prefill(reloaded, cand.prompt)
    d_reload = max(
        (re_logits - cand.golden["logits"]).abs().max().item(),
        (re_hidden - cand.golden["hidden"]).abs().max().item(),
    )
    assert d_reload < TOL_RELOAD, f"reloaded checkpoint differs by {d_reload}"
    t = spec.prompt_len
    full = torch.cat([cand.prompt, cand.golden["greedy_ids"]])
    long_ids = full[:-1] if spec.sparse_dsa else full
    with record_indexers(reloaded) as calls:
        re_full, _ = prefill(reloaded, long_ids)
    greedy_rows = re_full[t - 1 : t - 1 + NEW_TOKENS]
    assert torch.equal(greedy_rows.argmax(-1), cand.golden["greedy_ids"])
    if spec.sparse_dsa:
        for layer in full_layers(cfg):
            (call,) = calls[f"model.layers.{layer}.self_attn.indexer"]
            got = canonical_topk(call.indices, int(cfg.index_topk))
            assert torch.equal(got, cand.golden[f"dsa_topk_{layer}"]), f"reloaded L{layer} DSA"
    if spec.family == "deepseek_v3":
        mtp_note = check_with_transformers_mtp(
            fixture_dir, cand.prompt, cand.mtp, cand.hidden_normed
        )
    else:
        mtp_note = reload_glm_mtp(spec, fixture_dir, cfg, reloaded, cand)
        mtp_note += "; " + check_glm_with_transformers_mtp(fixture_dir, cand)

    numpy_ref = NumpyReference(fixture_dir)
    ref = numpy_ref.compare(np_load_file(str(fixture_dir / "golden.safetensors")))
    worst = max(ref.values())
    assert worst < TOL_NUMPY, f"numpy reference (docs/fixtures.md) differs: {ref}"
    dsa_notes: list[str] = []
    if cand.dsa_scores:
        ref_logits, _, _ = numpy_ref.forward(long_ids.numpy())
        noise = 0.0
        for layer, tf_scores in cand.dsa_scores.items():
            ref_scores = numpy_ref.index_scores[f"model.layers.{layer}."]
            for r in range(ref_scores.shape[0]):
                row = ref_scores[r, : r + 1]
                diff = np.abs(row - tf_scores[r, : r + 1].double().numpy()).max()
                noise = max(noise, float(diff / np.abs(row).max()))
        dsa_notes.append(
            f"DSA index scores, transformers f32 vs numpy float64: max deviation {noise:.1e}"
            f" of the row's max|score| (TIE_MARGIN is {TIE_MARGIN / noise:.0f}x that)"
        )
        # An engine that attends densely in "shared" layers (ignoring indexer_types).
        numpy_ref.shared_dense = True
        wrong, _, _ = numpy_ref.forward(long_ids.numpy())
        numpy_ref.shared_dense = False
        d_shared = float(np.abs(wrong - ref_logits).max())
        assert d_shared > MIN_DENSE_DIFF, f"shared layers barely matter ({d_shared})"
        dsa_notes.append(
            f"numpy reference with the shared layers attending densely: logits move by up to"
            f" {d_shared:.2f}"
        )

    sizes = {p.name: p.stat().st_size for p in sorted(fixture_dir.iterdir())}
    total = sum(sizes.values())
    print(f"wrote {fixture_dir} (seed {cand.seed}): {total / 1e6:.2f} MB {sizes}")
    print(f"  reload max|d|={d_reload:.2e}; {mtp_note}")
    print(f"  numpy float64 reference (docs/fixtures.md) max|d| over all goldens: {worst:.2e}")
    for note in cand.notes + dsa_notes:
        print(f"  {note}")
    write_quantized_golden(spec, fixture_dir)


# --------------------------------------------------------------------------------------
# indexer_types derivation oracle

INDEXER_TYPES_CASES: list[dict[str, Any]] = [
    {"num_hidden_layers": 78, "index_topk_freq": 4},  # GLM-5.2
    {"num_hidden_layers": 78},  # GLM-5 (no schedule: every layer full)
    {"num_hidden_layers": 10},
    {"num_hidden_layers": 10, "index_topk_freq": 3, "index_skip_topk_offset": 4},
    {"num_hidden_layers": 10, "index_topk_freq": 4, "index_skip_topk_offset": 1},
    {"num_hidden_layers": 6, "index_topk_pattern": "FSSFSF"},
    {"num_hidden_layers": 4, "index_topk_pattern": ["full", "full", "shared", "full"]},
    {"num_hidden_layers": 6, "index_topk_pattern": "FSFSFS", "index_topk_freq": 3},
    {"num_hidden_layers": 5, "index_topk_freq": 2, "index_skip_topk_offset": 0},
    {"num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"]},
    {
        "num_hidden_layers": 4,
        "indexer_types": ["full", "full", "shared", "shared"],
        "index_topk_freq": 3,
        "index_topk_pattern": "FSFS",
    },
]


def write_indexer_types_json(path: Path) -> None:
    """Write what ``GlmMoeDsaConfig(**kwargs).indexer_types`` derives for each test case.

    A list of ``{"config": kwargs, "indexer_types": [...]}``: the oracle for an engine's
    own derivation (explicit list > ``index_topk_pattern`` > ``index_topk_freq`` /
    ``index_skip_topk_offset``, defaults 1 / 2).
    """
    cases = []
    for kwargs in INDEXER_TYPES_CASES:
        kinds = list(GlmMoeDsaConfig(**copy.deepcopy(kwargs)).indexer_types)
        assert len(kinds) == kwargs["num_hidden_layers"] and set(kinds) <= {"full", "shared"}
        cases.append({"config": kwargs, "indexer_types": kinds})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[\n" + ",\n".join(json.dumps(c) for c in cases) + "\n]\n")
    counts = ", ".join(
        f"{c['indexer_types'].count('full')}/{len(c['indexer_types'])}" for c in cases
    )
    print(f"wrote {path}: {len(cases)} cases, full layers {counts}")


def main(argv: list[str] | None = None) -> int:
    """Regenerate every fixture under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    parser.add_argument("--only", nargs="*", default=None, help="fixture names to build")
    parser.add_argument(
        "--quantized-goldens",
        action="store_true",
        help="only (re)write golden_int4.safetensors from the fixtures already under --out",
    )
    parser.add_argument(
        "--indexer-types-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="only write the indexer_types derivation oracle to PATH (a full run writes"
        " <out>/dsa_indexer_types.json)",
    )
    args = parser.parse_args(argv)
    if args.indexer_types_json is not None:
        write_indexer_types_json(args.indexer_types_json)
        return 0
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for index, spec in enumerate(SPECS):
        if args.only and spec.name not in args.only:
            continue
        if args.quantized_goldens:
            write_quantized_golden(spec, args.out / spec.name)
        else:
            make_fixture(spec, args.out, index)
    if not args.only and not args.quantized_goldens:
        write_indexer_types_json(args.out / "dsa_indexer_types.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
