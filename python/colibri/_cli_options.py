"""The ``colibri`` command line's shared parts: the model flags, the generation flags (made
from :class:`colibri.sampling.GenerateOptions`), loading a model with a progress bar, and
the llama.cpp-style timing lines."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Literal

from colibri import _core


def _human(n: float) -> str:
    """Bytes for people: ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


#: The values of ``--pin-mtp``.
PIN_MTP_VALUES = ("auto", "on", "off")


def bare_pin_mtp(argv: list[str]) -> list[str]:
    """``argv`` with a bare ``--pin-mtp`` (the flag of before, "on") written ``--pin-mtp=on``,
    so that a positional argument after it (``colibri generate --pin-mtp "def f"``) stays
    the positional it was."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--":
            break
        if a == "--pin-mtp" and (i + 1 == len(out) or out[i + 1] not in PIN_MTP_VALUES):
            out[i] = "--pin-mtp=on"
    return out


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "-m",
        "--model",
        default=None,
        help="model directory, Hugging Face repo id (owner/name), or embedded model name "
        "(default: the embedded model)",
    )
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    g.add_argument("--threads", type=int, default=0, help="compute threads, 0 = all cores")
    g.add_argument(
        "--io",
        default="auto",
        choices=_core.choices()["io"],
        help="how experts are read from disk (default auto)",
    )
    g.add_argument(
        "--prefetch",
        default="auto",
        choices=_core.choices()["prefetch"],
        help="router-lookahead prefetch of experts (default auto)",
    )
    g.add_argument(
        "--prefill",
        default="auto",
        choices=_core.choices()["prefill"],
        help="arithmetic of prompts: exact or int8; auto (default) = the --decode arithmetic "
        "when given, else int8 where the CPU has AVX-512 VNNI or AVX2",
    )
    g.add_argument(
        "--decode",
        default="auto",
        choices=_core.choices()["decode"],
        help="arithmetic of decode steps (and of prompts with --prefill auto): int8 "
        "activations (within a small tolerance of exact) or exact f32; auto = int8 where the "
        "CPU has AVX-512 VNNI or AVX2, else exact",
    )
    g.add_argument(
        "--ram-budget",
        default=None,
        help="bytes the expert cache may hold, e.g. 8GB (default: from available memory)",
    )
    g.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="longest context in tokens, bounds the KV cache (default: the model's limit, "
        "or what fits in the RAM left for the KV cache)",
    )
    g.add_argument(
        "--cache-dir",
        default=None,
        help="per-model state (routing history) directory (default: $COLIBRI_CACHE_DIR, "
        "$XDG_CACHE_HOME/colibri or ~/.cache/colibri)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEXT",
        help="a jinja chat template (a file, or the template text) instead of the model's",
    )
    g.add_argument(
        "--trace-routing",
        default=None,
        metavar="FILE",
        help="write every forward's routed experts to FILE (a routing trace, JSON lines; "
        "docs/expert-store.md)",
    )
    g.add_argument(
        "--experts-per-token",
        type=int,
        default=None,
        metavar="K",
        help="route each token to the best K experts instead of the model's "
        "num_experts_per_tok (1..k): fewer bytes read per token, and a different (lossy) "
        "model; see docs/expert-store.md (default: the model's k)",
    )
    g.add_argument(
        "--experts",
        default=None,
        metavar="ray://ADDRESS",
        help="run the routed experts that Ray expert workers hold (colibri experts-worker) "
        "there; ADDRESS is auto or the Ray head's host:port (docs/distributed.md)",
    )
    g.add_argument("--no-mtp", action="store_true", help="do not load the MTP head")
    g.add_argument(
        "--pin-mtp",
        nargs="?",
        const="on",
        default="auto",
        choices=PIN_MTP_VALUES,
        help="keep the MTP layer's experts in RAM (beyond --ram-budget) so drafts read no "
        "disk: auto (default) when drafting is on and they fit in free memory, else MTP "
        "drafting starts disabled; on (also a bare --pin-mtp) always, an error when they do "
        "not fit; off: streamed",
    )


#: Help of the generation flags (the rest read "see colibri.SamplingOptions"); every flag is
#: one of :class:`colibri.sampling.GenerateOptions`' keywords, made by :func:`_generation_flags`.
_FLAG_HELP = {
    "temperature": "0 = greedy (default: generation_config.json, greedy if it does not sample)",
    "top_k": "keep the k most likely tokens",
    "top_p": "nucleus mass in (0, 1]",
    "min_p": "keep tokens >= this share of the top one",
    "seed": "seed for reproducible sampling",
    "stop": "stop string (repeatable)",
    "stop_token_ids": "a token id that ends the generation (repeatable; replaces the EOS ids)",
    "include_stop_str_in_output": "keep the stop string (or stop token's text) at the end",
    "ignore_eos": "do not stop at EOS tokens",
    "repetition_penalty": "> 1 discourages tokens already in the prompt or output (1 = off)",
    "presence_penalty": "subtracted once per seen token",
    "frequency_penalty": "subtracted per occurrence",
    "logit_bias": "TOKEN=BIAS added to a token's logit (repeatable; -inf bans it)",
    "min_tokens": "no stop token before this many tokens",
    "guided_json": "the output is JSON matching this JSON schema (its text)",
    "guided_regex": "the output matches this regular expression",
    "guided_grammar": "the output follows this Lark grammar",
    "draft": "speculative drafter (default auto: MTP when the model has it)",
    "draft_depth": "draft tokens per step, 1-8 or auto (default auto)",
}
#: Keywords with no flag: an alias, a callback, and results the commands do not print.
_NO_FLAG = {"max_tokens", "prefill_progress", "logprobs", "prompt_logprobs"}


def _generation_flags() -> dict[str, dict[str, Any]]:
    """``add_argument`` keywords of each generation flag, by field, from the types of
    :class:`colibri.sampling.GenerateOptions` (a new keyword gets its flag here)."""
    import typing
    from collections import abc

    from colibri.sampling import GenerateOptions

    flags: dict[str, dict[str, Any]] = {}
    for name, hint in typing.get_type_hints(GenerateOptions).items():
        if name in _NO_FLAG or name == "max_new_tokens":
            continue
        kinds = {a for a in typing.get_args(hint) if a is not type(None)}
        help_text = _FLAG_HELP.get(name, f"see colibri.SamplingOptions.{name}")
        spec: dict[str, Any] = {"default": None, "help": help_text}
        if name == "draft":
            spec.update(default="auto", choices=_core.choices()["draft"])
        elif name == "draft_depth":
            spec.update(default="auto", metavar="DEPTH")
        elif name == "logit_bias":
            spec.update(action="append", metavar="TOKEN=BIAS")
        elif kinds == {bool}:
            spec.update(action="store_true", default=None)
        elif kinds == {int} or kinds == {float}:
            spec["type"] = kinds.pop()
        elif str in kinds:  # text, or text and a richer form (a schema, a list of texts)
            spec["metavar"] = "TEXT"
            if any(typing.get_origin(k) is abc.Sequence for k in kinds):
                spec["action"] = "append"
        elif len(kinds) == 1 and typing.get_args(next(iter(kinds))) == (int,):
            spec.update(action="append", type=int, metavar="ID")  # a sequence of token ids
        else:
            raise TypeError(f"no command-line form for the generation keyword {name!r}: {hint}")
        flags[name] = spec
    return flags


def _add_sampling_options(p: argparse.ArgumentParser, *, max_new_tokens: int | None = None) -> None:
    g = p.add_argument_group("generation")
    g.add_argument(
        "-n",
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help=f"at most this many new tokens (default {max_new_tokens})"
        if max_new_tokens is not None
        else "at most this many new tokens (default: generation_config.json's max_new_tokens, "
        "else 128)",
    )
    for name, spec in _generation_flags().items():
        flag = "--" + name.replace("_", "-")
        names = ["-t", flag] if name == "temperature" else [flag]
        g.add_argument(*names, dest=name, **spec)


def _bias(text: str) -> tuple[int, float]:
    """``TOKEN=BIAS`` of ``--logit-bias``."""
    token, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(value)
    except ValueError:
        from colibri.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"invalid value for 'logit_bias': {text!r}; expected TOKEN=BIAS, e.g. 42=-inf"
        ) from None


def _depth(text: str) -> int | Literal["auto"]:
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        from colibri.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"invalid value for 'draft_depth': {text!r}; expected 1-8 or 'auto'"
        ) from None


def _load(args: argparse.Namespace) -> Any:
    from colibri.model import Model

    return Model(
        args.model,
        revision=args.revision,
        ram_budget=args.ram_budget,
        io=args.io,
        prefill=args.prefill,
        decode=args.decode,
        prefetch=args.prefetch,
        draft=getattr(args, "draft", "auto"),
        draft_depth=_depth(getattr(args, "draft_depth", "auto")),
        threads=args.threads,
        mtp=not args.no_mtp,
        pin_mtp="off" if args.no_mtp else args.pin_mtp,
        max_context=args.max_context,
        cache_dir=args.cache_dir,
        chat_template=args.chat_template,
        load_progress=_load_bar(),
        trace_routing=args.trace_routing,
        experts_per_token=args.experts_per_token,
        experts=getattr(args, "experts", None),
    )


def _gen_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``generate``'s keywords of the generation flags (a flag not given is ``None``)."""
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    for name in _generation_flags():
        kwargs[name] = getattr(args, name)
    kwargs["draft_depth"] = _depth(kwargs["draft_depth"])
    if kwargs["logit_bias"] is not None:
        kwargs["logit_bias"] = dict(_bias(t) for t in kwargs["logit_bias"])
    return kwargs


def _timings(s: Any) -> str:
    """llama.cpp-style timing lines: prompt processing, then generation."""

    def line(what: str, secs: float, n: int) -> str:
        ms = secs * 1000.0
        per = ms / n if n else 0.0
        rate = n / secs if secs > 0 else 0.0
        return (
            f"{what} = {ms:10.2f} ms / {n:5d} tokens ({per:8.2f} ms per token, "
            f"{rate:8.2f} tokens per second)"
        )

    prefilled = s.prompt_tokens - s.prompt_cached_tokens
    return "\n".join(
        [
            line("prompt eval time", s.prefill_seconds, prefilled)
            + (f", {s.prompt_cached_tokens} cached" if s.prompt_cached_tokens else ""),
            line("       eval time", s.decode_seconds, max(s.generated_tokens - 1, 0)),
            line("      total time", s.prefill_seconds + s.decode_seconds, s.generated_tokens),
        ]
    )


def _stats_line(s: Any) -> str:
    acc = sum(s.drafts_accepted)
    prop = sum(s.drafts_proposed)
    recall = "-" if s.prefetch_recall is None else f"{s.prefetch_recall:.0%}"
    return (
        f"{s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {s.forwards} forwards "
        f"({s.tokens_per_forward:.2f} tok/fwd), drafts {acc}/{prop} accepted, experts "
        f"{s.expert_hits} hits / {s.expert_misses} misses / {_human(s.expert_bytes_read)} "
        f"read, prefetch recall {recall}"
    )


def _progress_bar(desc: str, unit: str, minimum: int, **tqdm_args: Any) -> Any:
    """A ``(done, total)`` progress callback drawing a tqdm bar on a terminal's stderr when
    the work is larger than ``minimum`` (None when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bar:
            if total <= minimum:
                return
            bar.append(tqdm(total=total, desc=desc, unit=unit, leave=False, **tqdm_args))
        if bar[0].total != total:
            bar[0].total = total
        bar[0].update(done - bar[0].n)
        if done >= total:
            bar[0].close()

    return update


def _prefill_bar() -> Any:
    """Prefill progress: a bar for prompts of more than two chunks."""
    return _progress_bar("prompt", "tok", 1024)


def _load_bar() -> Any:
    """Model-load progress: a bar for more than 256 MB of resident weights."""
    return _progress_bar("loading", "B", 256 << 20, unit_scale=True, unit_divisor=1024)
