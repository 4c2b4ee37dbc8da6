"""The ``colibri`` command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from colibri import __version__, _core, build_info
from colibri._cli_options import (
    _add_model_options,
    _add_sampling_options,
    _gen_kwargs,
    _human,
    _load,
    _prefill_bar,
    _stats_line,
    _timings,
    bare_pin_mtp,
)
from colibri._cli_serve import _add_serve


def _cmd_version(_: argparse.Namespace) -> int:
    print(json.dumps(build_info(), indent=2))
    return 0


def _size(text: str) -> int:
    """Parse a byte size such as ``4GiB``, ``500MB`` or ``1048576``."""
    from colibri.validation import parse_size

    return parse_size("size", text)


def _cmd_convert(args: argparse.Namespace) -> int:
    from colibri.convert import convert

    report = convert(
        args.src,
        args.dst,
        expert_bits=args.expert_bits,
        group_size=args.group_size,
        dense_bits=args.dense_bits,
        mtp_bits=args.mtp_bits,
        embed_bits=args.embed_bits,
        lm_head_bits=args.lm_head_bits,
        indexer_bits=args.indexer_bits,
        max_shard_size=_size(args.max_shard_size),
        progress=not args.quiet,
    )
    formats = ", ".join(f"{k}: {v}" for k, v in sorted(report.formats.items()))
    print(
        f"wrote {report.shards_written} shard(s), skipped {report.shards_skipped} already "
        f"complete, into {report.dst} ({formats})"
    )
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint (BF16/F16/F32 or FP8) into a colibri container",
        description="Quantise a DeepSeek-V3 / GLM-MoE-DSA checkpoint into the int4 container "
        "layout (docs/container.md). Bits: 4 (int4), 8 (int8 per row), 16 (bf16), 32 (f32). "
        "Re-running resumes: complete output shards are skipped.",
    )
    p.add_argument("src", help="source model directory (config.json + *.safetensors)")
    p.add_argument("dst", help="output directory (not inside SRC)")
    p.add_argument("--expert-bits", type=int, default=4, help="routed experts (default 4)")
    p.add_argument(
        "--group-size", type=int, default=64, help="int4 group size, 0 for per-row (default 64)"
    )
    p.add_argument(
        "--dense-bits",
        type=int,
        default=4,
        help="attention, shared experts, dense MLPs (default 4)",
    )
    p.add_argument("--mtp-bits", type=int, default=8, help="the whole MTP layer (default 8)")
    p.add_argument("--embed-bits", type=int, default=8, help="embed_tokens (default 8)")
    p.add_argument("--lm-head-bits", type=int, default=8, help="lm_head (default 8)")
    p.add_argument(
        "--indexer-bits", type=int, default=8, help="GLM DSA indexer projections (default 8)"
    )
    p.add_argument(
        "--max-shard-size",
        default="4GiB",
        help="largest output shard, e.g. 4GiB or 500MB (default 4GiB)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)


# ----------------------------------------------------------------------------- model commands


def _cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    m = _load(args)
    kwargs = _gen_kwargs(args)
    kwargs["prefill_progress"] = _prefill_bar()
    stream = sys.stdout.isatty() if args.stream is None else args.stream
    if args.json:
        out = m.generate(prompt, **kwargs)
        print(json.dumps(_result_json(out), indent=2, ensure_ascii=False))
        return 0
    if stream:
        chunks = m.generate(prompt, stream=True, **kwargs)
        with chunks:
            for chunk in chunks:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        sys.stdout.write("\n")
        out = chunks.result
    else:
        out = m.generate(prompt, **kwargs)
        print(out.text)
    if args.verbose and out is not None:
        print(_stats_line(out.stats), file=sys.stderr)
        print(_timings(out.stats), file=sys.stderr)
    return 0


def _result_json(out: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "stats": asdict(out.stats),
    }


def _cmd_chat(args: argparse.Namespace) -> int:
    m = _load(args)
    kwargs = _gen_kwargs(args)
    tty = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    if tty:
        print("colibri chat: /reset clears the conversation, /exit (or Ctrl-D) quits.")
    while True:
        if tty:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            messages = list(system)
            print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": text})
        reply: list[str] = []
        try:
            with m.chat(messages, stream=True, **kwargs) as chunks:
                for chunk in chunks:
                    reply.append(chunk)
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from colibri._hub import resolve_model_dir
    from colibri.info import model_info

    path = resolve_model_dir(args.model, revision=args.revision)
    info = model_info(path, mtp_loaded=not args.no_mtp)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model: {info['path']}")
    print("config:")
    for k, v in info["config"].items():
        print(f"  {k}: {v}")
    print(f"tensors: {info['tensor_count']} ({_human(info['total_bytes'])})")
    for role, by_fmt in info["tensors"].items():
        fmts = ", ".join(f"{f} {_human(b)}" for f, b in sorted(by_fmt.items()))
        print(f"  {role}: {fmts}")
    mem = info["memory"]
    print("memory plan:")
    print(f"  dense weights resident in RAM: {_human(mem['dense_bytes'])}")
    print(f"  routed experts streamed from disk: {_human(mem['expert_bytes'])}")
    print(f"  KV cache per token: {_human(mem['kv_bytes_per_token'])}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from colibri.errors import InvalidArgumentError

    if args.runs < 1:
        raise InvalidArgumentError(
            f"invalid value for '--runs': {args.runs}; measure at least 1 run per mode"
        )
    if args.warmup < 0:
        raise InvalidArgumentError(
            f"invalid value for '--warmup': {args.warmup}; must be >= 0 (0 = no warm-up run)"
        )
    m = _load(args)
    modes = args.compare or ["off", m.default_draft]
    modes = list(dict.fromkeys(modes))
    report: dict[str, Any] = {"model": str(m.path), "runs": args.runs, "modes": {}}
    for mode in modes:
        runs = []
        for i in range(args.runs + args.warmup):
            kw = _gen_kwargs(args)
            kw["draft"] = mode
            # A fresh session per run: the prompt is processed in full every time (the
            # model's own conversation would reuse the previous run's KV).
            out = m.session().generate(args.prompt, **kw)
            if i >= args.warmup:
                runs.append(out.stats)
        tps = sorted(s.tokens_per_second for s in runs)
        med = tps[len(tps) // 2]
        pps = sorted(s.prompt_tokens_per_second for s in runs)
        pp_med = pps[len(pps) // 2]
        proposed = sum(sum(s.drafts_proposed) for s in runs)
        accepted = sum(sum(s.drafts_accepted) for s in runs)
        row = {
            "tokens_per_second_median": med,
            "tokens_per_second": tps,
            "prompt_tokens": runs[0].prompt_tokens,
            "prompt_tokens_per_second_median": pp_med,
            "prompt_tokens_per_second": pps,
            "generated_tokens": sum(s.generated_tokens for s in runs),
            "forwards": sum(s.forwards for s in runs),
            "tokens_per_forward": sum(s.tokens_per_forward for s in runs) / len(runs),
            "drafts_proposed": proposed,
            "drafts_accepted": accepted,
            "expert_hits": sum(s.expert_hits for s in runs),
            "expert_misses": sum(s.expert_misses for s in runs),
            "expert_bytes_read": sum(s.expert_bytes_read for s in runs),
        }
        report["modes"][mode] = row
        if not args.json:
            print(
                f"draft={mode:<6} {med:8.1f} tok/s (median of {len(runs)}), prompt "
                f"{pp_med:8.1f} tok/s ({row['prompt_tokens']} tokens), "
                f"{row['tokens_per_forward']:.2f} tok/fwd, drafts {accepted}/{proposed}, "
                f"experts {row['expert_hits']} hits / {row['expert_misses']} misses"
            )
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from colibri.plan import plan

    r = plan(
        args.model,
        args.ram,
        disk_bw=args.disk_bw,
        compute=args.compute,
        cache_dir=args.cache_dir,
        reserve=args.reserve,
        seed=args.seed,
    )
    if args.json:
        if not args.all:
            r["plan"].pop("scenarios", None)
        print(json.dumps(r, indent=2))
        return 0
    p, rec, d = r["plan"], r["recommended"], r["defaults"]
    gb = 1e9
    disk = (
        "given"
        if r["disk"] is None
        else f"probed, {'O_DIRECT' if r['disk']['direct'] else 'buffered'}"
    )
    comp = (
        "given"
        if r["compute"] is None
        else f"probed, {r['compute']['kernel_path']} x{r['compute']['threads']}"
    )
    m = p["model"]
    print(
        f"model      {m['name']}: {m['moe_layers']} MoE layers x {m['experts']} experts "
        f"of {_human(m['expert_bytes'])}, dense {_human(m['dense_bytes'])}"
    )
    print(f"disk       {r['disk_bytes_per_second'] / gb:.2f} GB/s ({disk})")
    print(f"compute    {r['compute_bytes_per_second'] / gb:.1f} GB/s of int4 weights ({comp})")
    budget, share = _human(p["expert_budget_bytes"]), 100 * p["budget_share"]
    print(f"budget     {budget} for experts = {share:.1f}% of them")
    print(f"routing    {p['workload']}")
    print(
        f"predicted  {r['predicted_tokens_per_second']:.3f} tok/s, "
        f"hit rate {100 * r['hit_rate']:.1f}%, {r['bytes_per_token'] / gb:.2f} GB read per token"
    )
    print(
        f"defaults   {d['tokens_per_second']:.3f} tok/s, hit rate {100 * d['hit_rate']:.1f}% "
        f"(pins 50%, prefetch, MTP depth {d['draft_depth']})"
    )
    kw = ", ".join(f"{k}={v!r}" for k, v in rec.items())
    print(f"recommend  colibri.Model(..., {kw}); store pin share {r['pin_share']:.2f}")
    if args.all:
        print("pins  depth prefetch   hit   GB/token  tok/fwd   tok/s  io share")
        for s in p["scenarios"]:
            print(
                f"{s['pin_share']:4.2f} {s['draft_depth']:6d} {s['prefetch']!s:>8} "
                f"{100 * s['hit_rate']:5.1f}% {s['bytes_per_token'] / gb:8.2f} "
                f"{s['tokens_per_forward']:8.2f} {s['tokens_per_second']:7.3f} "
                f"{100 * s['io_share']:7.1f}%"
            )
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plan",
        help="predict decode speed and hit rate for a RAM size, and the settings to use",
        description="Replay a GLM-5.2-calibrated routing workload (or the model's own routing "
        "history) through the expert cache with this host's disk and kernel speeds, and "
        "predict decode tok/s, hit rate and disk bytes per token for each setting.",
    )
    p.add_argument("model", help="a container directory, or a known config: glm-5.2, deepseek-v3")
    p.add_argument("--ram", required=True, type=_size, help="RAM for the process, e.g. 128GB")
    p.add_argument(
        "--disk-bw", help="disk read speed, e.g. 3.2GB/s (default: a 2 s O_DIRECT probe)"
    )
    p.add_argument(
        "--compute",
        help="int4 kernel speed in weight bytes/s, e.g. 20GB/s (default: probe this host)",
    )
    p.add_argument(
        "--reserve", default="4GiB", help="RAM kept for KV caches and the runtime (default 4GiB)"
    )
    p.add_argument(
        "--cache-dir", help="where the routing history lives (default: the colibri cache)"
    )
    p.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    p.add_argument("--all", action="store_true", help="also list every setting replayed")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_plan)


def _add_model_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="continue a prompt", description="Continue a prompt.")
    p.add_argument("prompt", nargs="?", help="the prompt; '-' or absent reads stdin")
    _add_model_options(p)
    _add_sampling_options(p)
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print text as it is generated (default: on when stdout is a terminal)",
    )
    p.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="print stats to stderr")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "chat",
        help="interactive chat (reads lines from stdin)",
        description="Chat with the model using its chat template. Each stdin line is a user "
        "turn; /reset clears the conversation, /exit quits.",
    )
    _add_model_options(p)
    _add_sampling_options(p, max_new_tokens=256)
    p.add_argument("--system", default=None, help="a system message")
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser(
        "info",
        help="config summary, tensor formats and sizes, memory plan",
        description="Describe a model: config, bytes per tensor role and format, and the "
        "memory plan (dense weights in RAM, experts on disk, KV cache per token).",
    )
    _add_model_options(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser(
        "bench",
        help="tokens/s and stats over several runs, draft on vs off",
        description="Generate from a prompt several times per draft mode and report the "
        "median tokens/s and the speculation and expert-store stats.",
    )
    _add_model_options(p)
    _add_sampling_options(p, max_new_tokens=64)
    p.add_argument("--prompt", default="The capital of France is", help="the prompt")
    p.add_argument("--runs", type=int, default=3, help="measured runs per mode, >= 1 (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs first, >= 0 (default 1)")
    p.add_argument(
        "--compare",
        action="append",
        choices=_core.choices()["draft"],
        help="draft modes to compare (repeatable; default: off and --draft)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bench)


def _cmd_experts_worker(args: argparse.Namespace) -> int:
    import time

    from colibri._hub import resolve_model_dir
    from colibri.distributed import (
        NAMESPACE,
        _import_ray,
        actor_name,
        read_usage,
        start_worker,
    )
    from colibri.errors import InvalidArgumentError

    try:
        i, n = (int(v) for v in args.shard.split("/"))
    except ValueError:
        raise InvalidArgumentError(
            f"invalid value for '--shard': {args.shard!r}; expected I/N, e.g. 1/3"
        ) from None
    path = resolve_model_dir(args.model, revision=args.revision)
    shipped = path / "colibri-usage.json"
    usage_file = args.usage if args.usage is not None else (shipped if shipped.is_file() else None)
    usage = None if usage_file is None else read_usage(usage_file)
    ray = _import_ray()
    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    # The actor lives as long as this handle (it is not detached): Ctrl-C ends both.
    actor = start_worker(
        path, i, n, usage=usage, threads=args.threads, max_restarts=args.max_restarts
    )
    print(f"{actor_name(i, n)}: holding its experts of {path}; Ctrl-C stops it", flush=True)
    while actor is not None:
        time.sleep(3600)
    return 0


def _add_experts_worker(sub: Any) -> None:
    p = sub.add_parser(
        "experts-worker",
        help="hold a shard of a model's routed experts in RAM for a head on Ray",
        description="Start the Ray actor colibri-experts-I-of-N (namespace colibri) on this "
        "machine: it holds shard I of N of the model's routed experts in its RAM and runs them "
        "for a head opened with --experts ray://ADDRESS (docs/distributed.md). Waits until "
        "Ctrl-C, which stops the actor.",
    )
    p.add_argument("model", help="model directory, Hugging Face repo id, or embedded model name")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument(
        "--address", required=True, help="the Ray cluster: auto or the Ray head's host:port"
    )
    p.add_argument("--shard", required=True, help="I/N: this worker's shard, 1 <= I <= N")
    p.add_argument("--threads", type=int, default=0, help="compute threads, 0 = all cores")
    p.add_argument(
        "--usage",
        default=None,
        help="a colibri-usage.json routing history that spreads the hot experts over the "
        "workers (default: the model directory's, if it ships one; give every worker the same)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=-1,
        help="how often Ray restarts the actor after it dies (-1, the default: always)",
    )
    p.set_defaults(func=_cmd_experts_worker)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Run Mixture-of-Experts language models with experts streamed from disk.",
    )
    parser.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("version", help="print version, CPU features and build facts")
    p.set_defaults(func=_cmd_version)
    _add_model_commands(sub)
    _add_serve(sub)
    _add_convert(sub)
    _add_plan(sub)
    _add_experts_worker(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``colibri`` console script.

    A :class:`colibri.ColibriError` prints ``error: <message>`` to stderr and returns 1;
    Ctrl-C returns 130. When stdout's reader goes away (``colibri generate ... | head``) the
    command stops quietly and returns 141, the status of a process killed by SIGPIPE.
    """
    from colibri.errors import ColibriError

    parser = build_parser()
    args = parser.parse_args(bare_pin_mtp(sys.argv[1:] if argv is None else list(argv)))
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                warnings.filterwarnings("default", category=UserWarning, module="colibri")
                status = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return status
        except ColibriError as e:
            sys.stdout.flush()
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
    except BrokenPipeError:
        _discard_stdout()
        return 128 + signal.SIGPIPE


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """Warnings as one line on stderr, like errors (no source location: not the user's)."""
    sys.stdout.flush()
    print(f"warning: {message}", file=sys.stderr)


def _discard_stdout() -> None:
    """Point stdout at /dev/null after its reader closed the pipe, so the interpreter's own
    flush at exit does not print a BrokenPipeError of its own (the recipe of Python's
    ``signal`` documentation, note on SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file (tests, embedding)
        pass


if __name__ == "__main__":
    sys.exit(main())
