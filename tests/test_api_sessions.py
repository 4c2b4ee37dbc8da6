"""The KV cache across calls: chat turns prefill only their new tokens, sessions keep
their own conversations, saved contexts load back (and bad ones are typed errors), and idle
sessions over the budget go to disk and come back."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import colibri
import pytest

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


# ----------------------------------------------------------------------------- sessions


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}])
def test_chat_turns_prefill_only_their_new_tokens(
    test_model_dir: Path, sampling: dict[str, Any]
) -> None:
    """Each turn keeps the earlier turns' KV: it prefills only what follows the previous
    prompt, and its output is what a model that never saw the earlier turns gives. (The
    replies here are fixed text: this model's random bytes do not survive a text round trip,
    and the cache can only hold what the next prompt's tokens repeat.)"""
    warm = colibri.Model(test_model_dir, threads=1)
    fresh = colibri.Model(test_model_dir, threads=1)
    messages: list[dict[str, str]] = []
    previous_prompt = 0
    for turn, text in enumerate(["hello", "tell me more", "and then?", "thanks"]):
        messages.append({"role": "user", "content": text})
        rendered = warm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_tokens = len(warm.encode(rendered, add_special_tokens=False))
        out = warm.chat(messages, max_new_tokens=12, **sampling)
        fresh.logits([3])  # empties the fresh model's cache
        assert out.token_ids == fresh.chat(messages, max_new_tokens=12, **sampling).token_ids
        s = out.stats
        assert s.prompt_tokens == prompt_tokens
        if turn == 0:
            assert s.prompt_cached_tokens == 0
        else:
            # The previous prompt (less one token with MTP drafting) comes from the cache.
            assert previous_prompt - 1 <= s.prompt_cached_tokens < prompt_tokens, turn
            new = prompt_tokens - previous_prompt
            assert s.prompt_tokens - s.prompt_cached_tokens <= new + 1, turn
        previous_prompt = prompt_tokens
        messages.append({"role": "assistant", "content": "ok"})


def test_sessions_keep_their_own_conversations(test_model_dir: Path) -> None:
    m = colibri.Model(test_model_dir, threads=1)
    fresh = colibri.Model(test_model_dir, threads=1)
    a, b = m.session(), m.session()
    kw: dict[str, Any] = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": []}
    pa, pb = [5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44]
    ra, rb = a.generate(pa, **kw), b.generate(pb, **kw)
    m.generate([99, 98, 97], **kw)  # the model's own cache, in between
    # Each session's next turn keeps its whole previous turn, whatever ran in between.
    pa2 = pa + ra.token_ids + [12, 13]
    pb2 = pb + rb.token_ids + [45]
    for s, p2 in [(b, pb2), (a, pa2)]:
        out = s.generate(p2, **kw)
        fresh.logits([3])
        assert out.token_ids == fresh.generate(p2, **kw).token_ids
        assert out.stats.prompt_cached_tokens >= len(p2) - 4
        assert s.kv_tokens == len(p2) + len(out.token_ids) - 1
        assert s.kv_bytes > 0
    # Chat and streaming on a session; reset forgets.
    text = "".join(a.chat([{"role": "user", "content": "hi"}], stream=True, **kw))
    assert isinstance(text, str)
    a.reset()
    assert a.kv_tokens == 0
    assert a.generate(pa, **kw).stats.prompt_cached_tokens == 0
    with pytest.raises(colibri.InvalidArgumentError, match="keyword"):
        a.generate(pa, max_length=3)
    other = colibri.Model(test_model_dir, threads=1).session()
    with pytest.raises(colibri.InvalidArgumentError, match="session"):
        m._start(pa, None, False, dict(kw), other._core)


def test_session_properties_wait_for_its_generation_without_deadlock(
    test_model_dir: Path,
) -> None:
    m = colibri.Model(test_model_dir, threads=1)
    s = m.session()
    kw: dict[str, Any] = {"max_new_tokens": 60, "temperature": 0, "stop_token_ids": []}
    stream = s.generate([5] * 5, stream=True, **kw)
    chunks = iter(stream)
    next(chunks)  # the generation now runs on the session, its callback needing the GIL
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.append(s.kv_tokens))
    reader.start()
    rest = list(chunks)
    reader.join(timeout=60)
    assert not reader.is_alive() and seen, "reading the session waited forever"
    assert stream.result is not None and isinstance(rest, list)
    assert s.kv_tokens == 5 + len(stream.result.token_ids) - 1


def test_idle_sessions_over_the_budget_go_to_disk_and_come_back(
    test_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    m = colibri.Model(test_model_dir, threads=1, cache_dir=cache, idle_session_budget=0)
    ref = colibri.Model(test_model_dir, threads=1, cache_dir=cache)
    kw: dict[str, Any] = {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": []}
    a, b = m.session(), m.session()
    first = a.generate([5, 6, 7, 8, 9], **kw)
    assert not a.evicted and a.kv_bytes > 0
    b.generate([30, 31, 32], **kw)
    assert a.evicted and a.kv_bytes == 0
    spilled = list((cache / "sessions").glob("*.ctx"))
    assert len(spilled) == 1
    nxt = [5, 6, 7, 8, 9, *first.token_ids, 10]
    out = a.generate(nxt, **kw)
    assert not a.evicted and b.evicted
    assert out.stats.prompt_cached_tokens == 5 + len(first.token_ids) - 1
    assert out.token_ids == ref.generate(nxt, **kw).token_ids
    del a, b
    gc.collect()
    assert list((cache / "sessions").glob("*.ctx")) == []


_SPILL_WITHOUT_A_CACHE = """
import gc, os, stat, sys, colibri
m = colibri.Model(sys.argv[1], threads=1, idle_session_budget=0)
kw = {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": []}
a, b = m.session(), m.session()
a.generate([5, 6, 7], **kw)
b.generate([8, 9], **kw)
assert a.evicted
tmp = os.environ["TMPDIR"]
dirs = [d for d in os.listdir(tmp) if d.startswith("colibri-sessions-")]
assert len(dirs) == 1, dirs
d = os.path.join(tmp, dirs[0])
files = sorted(os.listdir(d))  # the spill file, and the owner lock the sweep respects
assert len(files) == 2 and files[0].endswith(".ctx") and files[1].endswith(".lock"), files
mode = lambda p: oct(stat.S_IMODE(os.lstat(p).st_mode))
print(mode(d), *{mode(os.path.join(d, f)) for f in files})
del a, b, m
gc.collect()
print(os.path.exists(d))
"""


def test_without_a_cache_directory_sessions_spill_to_a_private_directory(
    test_model_dir: Path, tmp_path: Path
) -> None:
    """No COLIBRI_CACHE_DIR, XDG_CACHE_HOME or HOME: the spill goes to a directory made for
    the model (0700, files 0600) in the temporary directory, removed with the model; never
    to a shared fixed name such as /tmp/sessions."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLIBRI_CACHE_DIR", "XDG_CACHE_HOME", "HOME")}  # fmt: skip
    env["TMPDIR"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, "-c", _SPILL_WITHOUT_A_CACHE, str(test_model_dir)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0o700", "0o600", "False"], r.stdout
    assert not (tmp_path / "sessions").exists()


def test_a_spill_directory_others_can_write_or_redirect_is_refused(
    test_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "real").mkdir()
    shared = tmp_path / "shared"
    (shared / "sessions").mkdir(parents=True)
    (shared / "sessions").chmod(0o777)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "sessions").symlink_to(tmp_path / "real")
    for cache, needle in [(shared, "mode 0777"), (linked, "symbolic link")]:
        with pytest.raises(colibri.InvalidArgumentError, match=needle) as info:
            colibri.Model(test_model_dir, threads=1, cache_dir=cache)
        assert "spill_dir" in str(info.value)


def test_spill_files_of_a_live_process_in_another_pid_namespace_are_kept(
    test_model_dir: Path, tmp_path: Path
) -> None:
    """Containers sharing a cache volume see each other's pids as gone. A spill file whose
    pid is gone here is swept at the next open only once its owner lock is free: the probe
    (tools/probe_hostile.py, ``unshare --pid``) saw a second container's open delete a live
    process's spill file, so its session prefilled again."""
    import fcntl

    sessions = tmp_path / "cache" / "sessions"
    sessions.mkdir(parents=True, mode=0o700)
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    spill = sessions / f"{gone}-00000000feedf00d-1-1.ctx"
    lock = sessions / f"{gone}-00000000feedf00d.lock"
    spill.write_bytes(b"x")
    lock.write_bytes(b"")
    with lock.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
        assert spill.exists() and lock.exists()
    colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
    assert not spill.exists() and not lock.exists()


# ----------------------------------------------------------------------------- saved contexts


def test_a_context_saved_with_the_mtp_head_is_refused_without_it(tmp_path: Path) -> None:
    """The docs promise ``SavedContextError`` for a context saved with other options: with
    the MTP head on into a model without it, and the reverse (whose MTP rows would be
    missing, so drafting would throw the whole context away)."""
    with_head, without = colibri.Model(threads=1), colibri.Model(threads=1, mtp=False)
    for saver, loader, needle in [
        (with_head, without, "MTP head on, and this model has it off"),
        (without, with_head, "MTP head off, and this model has it on"),
    ]:
        s = saver.session()
        s.prefill("def add(a, b):")
        path = tmp_path / f"{needle[:11]}.ctx"
        s.save(path)
        with pytest.raises(colibri.SavedContextError, match=needle):
            loader.load_session(path)
        assert saver.load_session(path).token_ids == s.token_ids


def test_a_saved_context_loads_back_and_continues_like_the_live_session(
    test_model_dir: Path, tmp_path: Path
) -> None:
    m = colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
    kw: dict[str, Any] = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": []}
    doc = list(range(20, 60))
    s = m.session()
    s.prefill(doc)
    assert s.kv_tokens == len(doc) and s.token_ids == doc
    path = tmp_path / "doc.ctx"
    written = s.save(path)
    assert written == path.stat().st_size > 0
    # Another Model (another engine, as another process would be) of the same files.
    other = colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
    loaded = other.load_session(path)
    assert loaded.kv_tokens == len(doc) and loaded.token_ids == doc
    question = [*doc, 7, 8, 9]
    a, b = s.generate(question, **kw), loaded.generate(question, **kw)
    assert a.token_ids == b.token_ids == other.generate(question, **kw).token_ids
    assert b.stats.prompt_cached_tokens == len(doc)
    # Seeded sampling continues the same way too.
    sampled = {**kw, "temperature": 0.8, "seed": 3}
    s2, l2 = m.load_session(path), other.load_session(path)
    assert s2.generate(question, **sampled).token_ids == l2.generate(question, **sampled).token_ids


def test_damaged_foreign_or_missing_contexts_raise_typed_errors(
    test_model_dir: Path, tmp_path: Path
) -> None:
    m = colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
    s = m.session()
    s.prefill([5, 6, 7, 8])
    path = tmp_path / "c.ctx"
    s.save(path)
    good = path.read_bytes()
    for what, data, needle in [
        ("truncated", good[:-3], "truncated"),
        ("not a context", b"{}" * 40, "magic"),
        ("flipped", good[:-8] + bytes([good[-8] ^ 1]) + good[-7:], "checksum"),
    ]:
        path.write_bytes(data)
        with pytest.raises(colibri.SavedContextError, match=needle):
            m.load_session(path)
        assert isinstance(colibri.SavedContextError("x"), ValueError), what
    path.write_bytes(good)
    tiny = colibri.Model(threads=1, cache_dir=tmp_path / "cache")
    with pytest.raises(colibri.SavedContextError, match="another model"):
        tiny.load_session(path)
    with pytest.raises(colibri.ColibriFileNotFoundError):
        m.load_session(tmp_path / "absent.ctx")
    # The model is unharmed and the good file still loads.
    assert m.load_session(path).kv_tokens == 4


@pytest.mark.parametrize("bad", [5, None, 1.5, ""])
def test_context_paths_of_the_wrong_type_are_typed_errors(bad: Any, tmp_path: Path) -> None:
    m = colibri.Model(threads=1)
    s = m.session()
    s.prefill("def add(a, b):")
    with pytest.raises(colibri.InvalidArgumentError, match="'path'"):
        s.save(bad)
    with pytest.raises(colibri.InvalidArgumentError, match="'path'"):
        m.load_session(bad)
    as_bytes = os.fsencode(tmp_path / "ctx.colibri")  # bytes paths work, as in os
    s.save(as_bytes)
    assert m.load_session(as_bytes).token_ids == s.token_ids
    with pytest.raises(colibri.InvalidArgumentError, match="not a regular file"):
        s.save("/dev/null")
