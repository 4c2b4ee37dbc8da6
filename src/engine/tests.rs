//! The engine on real models (the embedded tiny model, the GLM DSA fixture): sessions reuse
//! their prefix with outputs identical to a fresh prefill, saved contexts round-trip and
//! refuse damaged or foreign files with a typed error, idle sessions are evicted to disk
//! and come back intact.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::*;
use crate::decode::{DraftDepth, DraftSource, SamplingParams};

fn model_dir(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn open(rel: &str, spill: &Path, idle: Option<u64>) -> Engine {
    let opts = EngineOptions {
        usage_file: false,
        threads: 2,
        idle_session_bytes: idle,
        spill_dir: Some(spill.to_path_buf()),
        // These tests compare a reused prefix, a batch lane and a restored context with a
        // fresh prefill bit for bit; the int8 prefill arithmetic rounds each chunk of
        // activations by its own scales, so only the exact one is chunking-invariant.
        prefill: Some(crate::quant::kernels::Arithmetic::Exact),
        ..EngineOptions::default()
    };
    Engine::open(&model_dir(rel), &opts).expect("the model opens")
}

fn options(e: &Engine, sampled: bool) -> GenerateOptions {
    let mut o = e.default_generate_options();
    o.max_new_tokens = 12;
    o.draft = DraftSource::Mtp;
    o.stop_tokens.clear();
    if sampled {
        o.sampling = SamplingParams {
            temperature: 0.9,
            top_k: 20,
            top_p: 0.95,
            seed: Some(7),
            ..SamplingParams::default()
        };
    }
    o
}

fn run(e: &Engine, s: Option<&Session>, prompt: &[u32], sampled: bool) -> Completion {
    e.generate(
        s,
        prompt,
        &options(e, sampled),
        &mut |_| true,
        &AtomicBool::new(false),
    )
    .expect("generation runs")
}

const PROMPT: [u32; 9] = [1, 345, 67, 890, 12, 3456, 78, 901, 23];

/// Turn 2's prompt: turn 1's prompt and output, then new tokens.
fn follow_up(first: &Completion) -> Vec<u32> {
    let mut p = PROMPT.to_vec();
    p.extend(&first.tokens);
    p.extend([44, 555, 6]);
    p
}

#[test]
fn a_saved_context_continues_exactly_like_the_live_session() {
    for (rel, vocab) in [
        ("python/colibri/models/tiny", 4096),
        ("tests/fixtures/glm_dsa", 256),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let e = open(rel, tmp.path(), None);
        let prompt: Vec<u32> = PROMPT.iter().map(|t| t % vocab).collect();
        for sampled in [false, true] {
            let live = e.new_session().unwrap();
            let first = run(&e, Some(&live), &prompt, sampled);
            let file = tmp.path().join("ctx.colibri");
            let bytes = e.save_session(Some(&live), &file).unwrap();
            assert_eq!(bytes, std::fs::metadata(&file).unwrap().len());
            let loaded = e.load_session(&file).unwrap();
            assert_eq!(loaded.tokens().unwrap(), live.tokens().unwrap());
            assert_eq!(loaded.kv_bytes().unwrap(), live.kv_bytes().unwrap());
            let mut next: Vec<u32> = prompt.clone();
            next.extend(&first.tokens);
            next.extend([44 % vocab, 55 % vocab, 6]);
            let a = run(&e, Some(&live), &next, sampled);
            let b = run(&e, Some(&loaded), &next, sampled);
            let fresh = run(&e, Some(&e.new_session().unwrap()), &next, sampled);
            assert_eq!(
                a.tokens, fresh.tokens,
                "{rel} sampled={sampled}: live vs fresh"
            );
            assert_eq!(
                b.tokens, fresh.tokens,
                "{rel} sampled={sampled}: loaded vs fresh"
            );
            assert_eq!(b.stats.prompt_cached_tokens, a.stats.prompt_cached_tokens);
            assert!(
                a.stats.prompt_cached_tokens >= prompt.len(),
                "{rel}: {:?}",
                a.stats
            );
            assert_eq!(fresh.stats.prompt_cached_tokens, 0);
        }
    }
}

fn save_tiny(e: &Engine, dir: &Path) -> (PathBuf, Vec<u8>) {
    let s = e.new_session().unwrap();
    run(e, Some(&s), &PROMPT, false);
    let file = dir.join("ctx.colibri");
    e.save_session(Some(&s), &file).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    (file, bytes)
}

#[test]
fn damaged_or_foreign_contexts_are_refused_with_a_typed_error() {
    let tmp = tempfile::tempdir().unwrap();
    let e = open("python/colibri/models/tiny", tmp.path(), None);
    let (file, good) = save_tiny(&e, tmp.path());
    let header_len = u64::from_le_bytes(good[24..32].try_into().unwrap()) as usize;
    let payload_at = 32 + header_len;
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "too short"),
        ("truncated header", good[..40].to_vec(), "truncated"),
        (
            "truncated payload",
            good[..good.len() - 4].to_vec(),
            "truncated",
        ),
        (
            "appended bytes",
            [good.clone(), vec![0; 8]].concat(),
            "truncated or corrupt",
        ),
    ];
    let mut magic = good.clone();
    magic[0] ^= 1;
    cases.push(("magic", magic, "wrong magic"));
    let mut version = good.clone();
    version[16] = 9;
    cases.push(("version", version, "format version 9"));
    let mut flipped = good.clone();
    flipped[payload_at + 100] ^= 0x40;
    cases.push(("payload bit flip", flipped, "checksum"));
    let mut header = good.clone();
    header[33] = b'!';
    cases.push(("header garbage", header.clone(), "header checksum"));
    header[20..24].copy_from_slice(&[0; 4]); // a file from before the header's checksum
    cases.push(("header garbage, unchecked", header, "unreadable header"));
    // A token id of the header changed: the header's checksum catches it.
    let text = String::from_utf8_lossy(&good[32..payload_at]).into_owned();
    let at = text.find("\"tokens\":[").unwrap() + 10;
    let digit = good[32 + at];
    assert!(digit.is_ascii_digit());
    let mut token = good.clone();
    token[32 + at] = if digit == b'9' { b'8' } else { digit + 1 };
    cases.push(("token changed", token, "header checksum"));
    for (what, bytes, needle) in cases {
        std::fs::write(&file, &bytes).unwrap();
        let err = e
            .load_session(&file)
            .err()
            .unwrap_or_else(|| panic!("{what}: loaded"));
        let msg = err.to_string();
        assert!(
            matches!(err, Error::SavedContext { .. }) && msg.contains(needle),
            "{what}: {msg}"
        );
    }
    // Another model's context: same layout family, other fingerprint.
    std::fs::write(&file, &good).unwrap();
    let other = open("tests/fixtures/glm_dsa", tmp.path(), None);
    let msg = other.load_session(&file).err().unwrap().to_string();
    assert!(msg.contains("another model"), "{msg}");
    assert!(matches!(
        e.load_session(&tmp.path().join("missing")),
        Err(Error::Io { .. })
    ));
    // The engine is still fine, and the good file still loads.
    assert!(e.load_session(&file).is_ok());
    run(&e, None, &PROMPT, false);
}

fn open_without_mtp(rel: &str, spill: &Path) -> Engine {
    let opts = EngineOptions {
        usage_file: false,
        threads: 2,
        spill_dir: Some(spill.to_path_buf()),
        load_mtp: false,
        prefill: Some(crate::quant::kernels::Arithmetic::Exact),
        ..EngineOptions::default()
    };
    Engine::open(&model_dir(rel), &opts).expect("the model opens")
}

#[test]
fn a_context_saved_with_the_mtp_head_on_or_off_is_refused_by_the_other_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let with = open("python/colibri/models/tiny", tmp.path(), None);
    let without = open_without_mtp("python/colibri/models/tiny", tmp.path());
    let (on_file, on_bytes) = save_tiny(&with, tmp.path());
    let off_file = tmp.path().join("off.colibri");
    let s = without.new_session().unwrap();
    let mut opts = options(&without, false);
    opts.draft = DraftSource::Off;
    without
        .generate(
            Some(&s),
            &PROMPT,
            &opts,
            &mut |_| true,
            &AtomicBool::new(false),
        )
        .unwrap();
    without.save_session(Some(&s), &off_file).unwrap();
    for (engine, file, needle) in [
        (&without, &on_file, "MTP head on, and this model has it off"),
        (&with, &off_file, "MTP head off, and this model has it on"),
    ] {
        let err = engine.load_session(file).err().expect("refused");
        assert!(
            matches!(err, Error::SavedContext { .. }) && err.to_string().contains(needle),
            "{err}"
        );
    }
    assert!(with.load_session(&on_file).is_ok());
    assert!(without.load_session(&off_file).is_ok());
    // A file written before the head was recorded: its MTP rows still tell.
    let header_len = u64::from_le_bytes(on_bytes[24..32].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&on_bytes[32..32 + header_len]).unwrap();
    assert!(header.contains(",\"mtp_head\":true"), "{header}");
    let old = header.replace(",\"mtp_head\":true", "");
    let mut bytes = on_bytes[..20].to_vec();
    bytes.extend([0u8; 4]); // nor the header's checksum (recorded since)
    bytes.extend((old.len() as u64).to_le_bytes());
    bytes.extend(old.as_bytes());
    bytes.extend(&on_bytes[32 + header_len..]);
    let old_file = tmp.path().join("old.colibri");
    std::fs::write(&old_file, &bytes).unwrap();
    assert!(with.load_session(&old_file).is_ok());
    let err = without.load_session(&old_file).err().expect("refused");
    assert!(err.to_string().contains("MTP head on"), "{err}");
}

/// `bytes` (a saved context) with payload float `index` set to `value`, its checksums made
/// to match: a file written so, not damaged after.
fn with_float(bytes: &[u8], index: usize, value: f32) -> Vec<u8> {
    let header_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    let at = 32 + header_len;
    let mut payload = bytes[at..].to_vec();
    payload[index * 4..index * 4 + 4].copy_from_slice(&value.to_le_bytes());
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[32..at]).unwrap();
    header["crc32"] = crc32fast::hash(&payload).into();
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = bytes[..20].to_vec();
    out.extend(crc32fast::hash(&json).max(1).to_le_bytes());
    out.extend((json.len() as u64).to_le_bytes());
    out.extend(&json);
    out.extend(payload);
    out
}

#[test]
fn saved_contexts_refuse_fifos_non_finite_values_and_special_targets() {
    let tmp = tempfile::tempdir().unwrap();
    let e = open("python/colibri/models/tiny", tmp.path(), None);
    let (file, good) = save_tiny(&e, tmp.path());
    // A FIFO is refused at once (opening it would wait for a writer).
    let fifo = tmp.path().join("fifo.colibri");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let msg = e.load_session(&fifo).err().expect("refused").to_string();
    assert!(msg.contains("not a regular file"), "{msg}");
    // NaN written with a matching checksum: refused as the file's, not the weights', fault.
    std::fs::write(&file, with_float(&good, 10, f32::NAN)).unwrap();
    let err = e.load_session(&file).err().expect("refused");
    assert!(
        matches!(err, Error::SavedContext { .. }) && err.to_string().contains("NaN"),
        "{err}"
    );
    std::fs::write(&file, with_float(&good, 10, 0.5)).unwrap();
    assert!(
        e.load_session(&file).is_ok(),
        "a finite change with matching sums loads"
    );
    // A save never replaces what is not a regular file.
    let s = e.new_session().unwrap();
    run(&e, Some(&s), &PROMPT, false);
    for target in [Path::new("/dev/null"), fifo.as_path(), tmp.path()] {
        let err = e.save_session(Some(&s), target).expect_err("refused");
        assert!(err.to_string().contains("not a regular file"), "{err}");
    }
    assert!(
        fifo.exists()
            && std::fs::symlink_metadata(&fifo)
                .unwrap()
                .file_type()
                .is_fifo()
    );
}

#[test]
fn concurrent_saves_to_one_path_never_mix_and_dead_saves_are_cleaned() {
    let tmp = tempfile::tempdir().unwrap();
    let a = open("python/colibri/models/tiny", tmp.path(), None);
    let b = open("python/colibri/models/tiny", tmp.path(), None);
    let target = tmp.path().join("shared.colibri");
    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(4_194_304);
    let dead = tmp
        .path()
        .join(format!(".shared.colibri.tmp.{}.0", pid_max + 1));
    let ours = tmp
        .path()
        .join(format!(".shared.colibri.tmp.{}.999", std::process::id()));
    std::fs::write(&dead, b"left by a killed save").unwrap();
    std::fs::write(&ours, b"a save of this process, in flight").unwrap();
    std::thread::scope(|scope| {
        for e in [&a, &b] {
            let target = &target;
            scope.spawn(move || {
                let s = e.new_session().unwrap();
                run(e, Some(&s), &PROMPT, false);
                for _ in 0..10 {
                    e.save_session(Some(&s), target)
                        .expect("every save succeeds");
                    e.load_session(target).expect("the target is always whole");
                }
            });
        }
    });
    assert!(!dead.exists(), "a dead process's temporary file is removed");
    assert!(ours.exists(), "a live process's is not");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".shared.colibri.tmp.") && !n.ends_with(".999"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn spill_files_are_named_apart_and_dead_processes_files_are_swept() {
    let tmp = tempfile::tempdir().unwrap();
    let spill = tmp.path().join("spill");
    std::fs::create_dir_all(&spill).unwrap();
    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(4_194_304);
    let dead = pid_max + 1;
    let me = std::process::id();
    let stale = spill.join(format!("{dead}-00000000deadbeef-0-1.ctx"));
    let stale_tmp = spill.join(format!(".{dead}-00000000deadbeef-0-1.ctx.tmp.{dead}.0"));
    let live = spill.join(format!("{me}-00000000cafecafe-0-1.ctx"));
    let other = spill.join("notes.txt");
    for f in [&stale, &stale_tmp, &live, &other] {
        std::fs::write(f, b"x").unwrap();
    }
    let e = open("python/colibri/models/tiny", &spill, Some(0));
    assert!(
        !stale.exists() && !stale_tmp.exists(),
        "a dead process's files are swept"
    );
    assert!(
        live.exists() && other.exists(),
        "a live process's, and others', are kept"
    );
    // This engine's spill names carry the process and a random nonce.
    let a = e.new_session().unwrap();
    run(&e, Some(&a), &PROMPT, false);
    let b = e.new_session().unwrap();
    run(&e, Some(&b), &PROMPT, false);
    assert!(a.is_evicted().unwrap());
    let name = a
        .spill_path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let parts: Vec<&str> = name.trim_end_matches(".ctx").split('-').collect();
    assert_eq!(parts.len(), 4, "{name}");
    assert_eq!(parts[0], me.to_string());
    assert!(
        parts[1].len() == 16 && parts[1] != "00000000cafecafe",
        "{name}"
    );
}

#[test]
fn idle_sessions_beyond_the_budget_go_to_disk_and_come_back_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let spill = tmp.path().join("spill");
    let e = open("python/colibri/models/tiny", &spill, Some(0));
    let a = e.new_session().unwrap();
    let first = run(&e, Some(&a), &PROMPT, false);
    let held = a.kv_bytes().unwrap();
    assert!(held > 0 && !a.is_evicted().unwrap());
    // B's generation makes A idle: a zero budget sends A to disk.
    let b = e.new_session().unwrap();
    run(&e, Some(&b), &PROMPT, false);
    assert!(a.is_evicted().unwrap());
    assert_eq!(a.kv_bytes().unwrap(), 0);
    assert_eq!(
        a.kv_tokens().unwrap(),
        PROMPT.len() + first.tokens.len() - 1
    );
    assert!(a.spill_path.is_file());
    let next = follow_up(&first);
    let again = run(&e, Some(&a), &next, false);
    assert!(!a.is_evicted().unwrap() && !a.spill_path.exists());
    assert!(b.is_evicted().unwrap());
    let fresh = run(&e, Some(&e.new_session().unwrap()), &next, false);
    assert_eq!(again.tokens, fresh.tokens);
    assert_eq!(
        again.stats.prompt_cached_tokens,
        PROMPT.len() + first.tokens.len() - 1
    );

    // A spill file that vanished costs the reuse, not the output.
    run(&e, Some(&b), &PROMPT, false);
    assert!(a.is_evicted().unwrap());
    std::fs::remove_file(&a.spill_path).unwrap();
    let lost = run(&e, Some(&a), &next, false);
    assert_eq!(lost.tokens, fresh.tokens);
    assert_eq!(lost.stats.prompt_cached_tokens, 0);

    // Dropping an evicted session removes its file.
    run(&e, Some(&b), &PROMPT, false);
    let path = a.spill_path.clone();
    assert!(path.is_file());
    drop(a);
    assert!(!path.exists());
}

#[test]
fn a_generous_budget_keeps_idle_sessions_in_ram() {
    let tmp = tempfile::tempdir().unwrap();
    let e = open("python/colibri/models/tiny", tmp.path(), None);
    let a = e.new_session().unwrap();
    run(&e, Some(&a), &PROMPT, false);
    let b = e.new_session().unwrap();
    run(&e, Some(&b), &PROMPT, false);
    assert!(!a.is_evicted().unwrap());
    assert!(e.info().idle_session_bytes >= e.info().max_context as u64);
}

#[test]
fn a_session_of_another_engine_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let e1 = open("python/colibri/models/tiny", tmp.path(), None);
    let e2 = open("python/colibri/models/tiny", tmp.path(), None);
    let s = e1.new_session().unwrap();
    let err = e2
        .generate(
            Some(&s),
            &PROMPT,
            &options(&e2, false),
            &mut |_| true,
            &AtomicBool::new(false),
        )
        .unwrap_err();
    assert!(err.to_string().contains("another model"), "{err}");
}

#[test]
fn a_batch_gives_each_session_what_it_gets_alone() {
    for (rel, vocab) in [
        ("python/colibri/models/tiny", 4096u32),
        ("tests/fixtures/glm_dsa", 256),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let e = open(rel, tmp.path(), None);
        let prompts: Vec<Vec<u32>> = vec![
            PROMPT.iter().map(|t| t % vocab).collect(),
            vec![5, 17, 99 % vocab, 3],
            (0..23).map(|i| (i * 37 + 11) % vocab).collect(),
        ];
        let mut sampled = options(&e, true);
        sampled.logprobs = Some(3);
        let mut penalised = options(&e, false);
        penalised.sampling.repetition_penalty = 1.4;
        penalised.sampling.presence_penalty = 0.3;
        penalised.max_new_tokens = 7;
        // Each lane drafts its own way inside the batch: MTP (greedy and sampled) and
        // prompt lookup.
        penalised.draft = DraftSource::Ngram;
        let mut greedy = options(&e, false);
        greedy.depth = DraftDepth::Fixed(2);
        let opts = [greedy, sampled, penalised];
        let sessions: Vec<_> = (0..3).map(|_| e.new_session().unwrap()).collect();
        for turn in 0..2 {
            let prompts_now: Vec<Vec<u32>> = prompts
                .iter()
                .zip(&sessions)
                .map(|(p, s)| {
                    let mut held = s.tokens().unwrap();
                    if turn == 0 {
                        p.clone()
                    } else {
                        held.extend([1, 2, 3]);
                        held
                    }
                })
                .collect();
            let requests: Vec<BatchRequest> = sessions
                .iter()
                .zip(&prompts_now)
                .zip(&opts)
                .map(|((s, p), o)| BatchRequest {
                    session: s.clone(),
                    prompt: p.clone(),
                    options: o.clone(),
                })
                .collect();
            let mut streamed = vec![Vec::new(); 3];
            let out = e
                .generate_batch(
                    requests,
                    &mut |i, t| {
                        streamed[i].extend_from_slice(t);
                        true
                    },
                    &AtomicBool::new(false),
                )
                .unwrap();
            let alone_engine = open(rel, tmp.path(), None);
            for (i, r) in out.into_iter().enumerate() {
                let got = r.unwrap();
                // Alone with the same drafting, and alone without any: the same tokens.
                for draft in [opts[i].draft, DraftSource::Off] {
                    let mut o = opts[i].clone();
                    o.draft = draft;
                    let alone = alone_engine
                        .generate(
                            Some(&alone_engine.new_session().unwrap()),
                            &prompts_now[i],
                            &o,
                            &mut |_| true,
                            &AtomicBool::new(false),
                        )
                        .unwrap();
                    assert_eq!(
                        got.tokens, alone.tokens,
                        "{rel} turn {turn} request {i} vs alone with {draft:?}"
                    );
                    assert_eq!(
                        got.logprobs, alone.logprobs,
                        "{rel} turn {turn} request {i}"
                    );
                }
                if i == 0 {
                    assert!(
                        got.stats.mtp_forwards > 0,
                        "request {i} drafted in the batch"
                    );
                    assert!(
                        got.stats.drafts_proposed.iter().sum::<u64>() > 0,
                        "request {i} verified drafts in the batch"
                    );
                }
                assert_eq!(streamed[i], got.tokens);
                assert_eq!(
                    sessions[i].kv_tokens().unwrap(),
                    prompts_now[i].len() + got.tokens.len() - 1
                );
                if turn == 1 {
                    assert!(got.stats.prompt_cached_tokens > 0, "turn 2 reuses turn 1");
                }
            }
        }
    }
}

/// Prompts that arrive together are prefilled in one forward, the long ones in the int8
/// prefill arithmetic: each lane still gets exactly what it gets alone on an engine with the
/// same arithmetic (int8 rounds each row's activations by its own scales, so rows of other
/// prompts in the forward change nothing), and a short prompt beside them stays exact.
#[test]
fn prompts_prefilled_together_in_int8_give_what_each_gets_alone() {
    use crate::quant::kernels::int8act::PREFILL_MIN_ROWS;
    let tmp = tempfile::tempdir().unwrap();
    let open_int8 = || {
        let opts = EngineOptions {
            usage_file: false,
            threads: 2,
            spill_dir: Some(tmp.path().to_path_buf()),
            prefill: Some(crate::quant::kernels::Arithmetic::Int8),
            ..EngineOptions::default()
        };
        Engine::open(&model_dir("python/colibri/models/tiny"), &opts).expect("the model opens")
    };
    let e = open_int8();
    let prompts: Vec<Vec<u32>> = [40usize, 64, PREFILL_MIN_ROWS, 100, 5]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n as u32)
                .map(|i| (i * 53 + 7 * k as u32 + 1) % 4096)
                .collect()
        })
        .collect();
    let opts: Vec<GenerateOptions> = (0..prompts.len())
        .map(|k| GenerateOptions {
            logprobs: Some(2),
            ..options(&e, k % 2 == 1)
        })
        .collect();
    let requests: Vec<BatchRequest> = prompts
        .iter()
        .zip(&opts)
        .map(|(p, o)| BatchRequest {
            session: e.new_session().unwrap(),
            prompt: p.clone(),
            options: o.clone(),
        })
        .collect();
    let out = e
        .generate_batch(requests, &mut |_, _| true, &AtomicBool::new(false))
        .unwrap();
    let alone = open_int8();
    let exact = open(
        "python/colibri/models/tiny",
        &tmp.path().join("exact"),
        None,
    );
    let mut differs_from_exact = 0;
    for (k, r) in out.into_iter().enumerate() {
        let got = r.unwrap();
        let want = alone
            .generate(
                Some(&alone.new_session().unwrap()),
                &prompts[k],
                &opts[k],
                &mut |_| true,
                &AtomicBool::new(false),
            )
            .unwrap();
        assert_eq!(
            got.tokens,
            want.tokens,
            "prompt {k} of {} tokens",
            prompts[k].len()
        );
        assert_eq!(got.tokens.len(), 12);
        assert_eq!(
            logprob_bits(&got.logprobs),
            logprob_bits(&want.logprobs),
            "prompt {k}: the batch's logprobs are bit for bit the lone run's"
        );
        let reference = exact
            .generate(
                Some(&exact.new_session().unwrap()),
                &prompts[k],
                &opts[k],
                &mut |_| true,
                &AtomicBool::new(false),
            )
            .unwrap();
        let same_as_exact = reference.tokens == got.tokens
            && logprob_bits(&reference.logprobs) == logprob_bits(&got.logprobs);
        if prompts[k].len() < PREFILL_MIN_ROWS {
            assert!(same_as_exact, "prompt {k} is short: exact prefill");
        } else if !same_as_exact {
            differs_from_exact += 1;
        }
    }
    // The negative control: the int8 arithmetic did run on the long prompts (otherwise the
    // comparison with the lone int8 engine would show nothing).
    assert!(
        differs_from_exact >= 1,
        "a long prompt's int8 prefill differs from the exact one somewhere"
    );
}

/// Every token id and logprob bit of `l`, flattened, so that two runs compare bit for bit.
fn logprob_bits(l: &[crate::decode::TokenLogprob]) -> Vec<u32> {
    let mut bits = Vec::new();
    for t in l {
        bits.extend([t.token, t.logprob.to_bits()]);
        for &(id, p) in &t.top {
            bits.extend([id, p.to_bits()]);
        }
    }
    bits
}

#[test]
fn a_batch_refuses_a_session_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let e = open("python/colibri/models/tiny", tmp.path(), None);
    let s = e.new_session().unwrap();
    let r = |s: &Arc<Session>| BatchRequest {
        session: s.clone(),
        prompt: PROMPT.to_vec(),
        options: options(&e, false),
    };
    let err = e
        .generate_batch(
            vec![r(&s), r(&s)],
            &mut |_, _| true,
            &AtomicBool::new(false),
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("each session once"), "{err}");
}

#[test]
fn the_load_reports_its_progress_up_to_every_resident_byte_and_can_be_stopped() {
    let calls: Arc<std::sync::Mutex<Vec<(u64, u64)>>> = Arc::default();
    let seen = calls.clone();
    let opts = EngineOptions {
        usage_file: false,
        threads: 2,
        load_progress: Some(LoadProgress(Arc::new(move |done, total| {
            seen.lock().unwrap().push((done, total));
            true
        }))),
        ..EngineOptions::default()
    };
    let dir = model_dir("python/colibri/models/tiny");
    let e = Engine::open(&dir, &opts).expect("the model opens");
    let calls = calls.lock().unwrap().clone();
    assert!(calls.len() > 10, "one call per tensor: {}", calls.len());
    assert!(
        calls.windows(2).all(|w| w[0].0 <= w[1].0),
        "done only grows"
    );
    assert!(calls.iter().all(|&(d, t)| d <= t));
    let (done, total) = *calls.last().unwrap();
    assert_eq!(done, total, "the last call ends the bar full");
    // Every byte of every tensor the model keeps resident: all but the routed experts and
    // the MTP layer's copies of the embedding and LM head (the head uses the main model's).
    let container = Container::open(&dir).unwrap();
    let loaded: u64 = container
        .names()
        .filter(|n| {
            let r = crate::container::names::classify(container.config(), n);
            use crate::container::names::Role;
            r.role != Role::RoutedExpert
                && !(matches!(r.role, Role::Embed | Role::LmHead) && r.layer.is_some())
        })
        .map(|n| container.info(n).unwrap().nbytes() as u64)
        .sum();
    assert_eq!(done, loaded);
    assert!(
        loaded < container.resident_bytes(),
        "the tiny model has an MTP layer"
    );
    drop(e);
    // A callback returning false stops the open.
    let stopping = EngineOptions {
        usage_file: false,
        load_progress: Some(LoadProgress(Arc::new(|done, _| done == 0))),
        ..EngineOptions::default()
    };
    assert!(matches!(
        Engine::open(&dir, &stopping),
        Err(Error::Cancelled)
    ));
}
