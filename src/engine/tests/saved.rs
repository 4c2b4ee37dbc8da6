//! Saved contexts: they continue like the live session and refuse damaged, foreign or
//! special files with a typed error; concurrent saves never mix.

use super::*;

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
    cases.push(("header garbage, no checksum", header, "no checksum"));
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
        decode: Some(EngineOptions::default_decode()),
        prefill: Some(EngineOptions::default_decode()),
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
    // (Such files had no header checksum either and are refused now; this one is given one,
    // so that only the head's absence is tested.)
    bytes.extend(crc32fast::hash(old.as_bytes()).max(1).to_le_bytes());
    bytes.extend((old.len() as u64).to_le_bytes());
    bytes.extend(old.as_bytes());
    bytes.extend(&on_bytes[32 + header_len..]);
    let old_file = tmp.path().join("old.colibri");
    std::fs::write(&old_file, &bytes).unwrap();
    assert!(with.load_session(&old_file).is_ok());
    let err = without.load_session(&old_file).err().expect("refused");
    assert!(err.to_string().contains("MTP head on"), "{err}");
    // A header checksum of 0 (files of before it was recorded) is refused: it would let any
    // header edit through.
    bytes[20..24].copy_from_slice(&[0; 4]);
    std::fs::write(&old_file, &bytes).unwrap();
    let err = with.load_session(&old_file).err().expect("refused");
    assert!(err.to_string().contains("no checksum"), "{err}");
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
    // A save under way in another pid namespace (its pid gone here), holding its lock.
    let elsewhere = tmp
        .path()
        .join(format!(".shared.colibri.tmp.{}.1", pid_max + 1));
    std::fs::write(&dead, b"left by a killed save").unwrap();
    std::fs::write(&ours, b"a save of this process, in flight").unwrap();
    std::fs::write(&elsewhere, b"a save of another namespace, in flight").unwrap();
    let saving = std::fs::File::open(&elsewhere).unwrap();
    saving.try_lock().unwrap();
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
    assert!(elsewhere.exists(), "nor a locked one whose pid looks gone");
    drop(saving);
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.starts_with(".shared.colibri.tmp.") && !n.ends_with(".999") && !n.ends_with(".1")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // Its lock free (that saver died), the next save sweeps it.
    let s = a.new_session().unwrap();
    run(&a, Some(&s), &PROMPT, false);
    a.save_session(Some(&s), &target).unwrap();
    assert!(
        !elsewhere.exists(),
        "an unlocked one of a gone pid is swept"
    );
}
