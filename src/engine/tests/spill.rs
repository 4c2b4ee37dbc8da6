//! Idle sessions spilled to disk: files named apart, dead processes' files swept, sessions
//! back intact; a session of another engine refused.

use super::*;

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
