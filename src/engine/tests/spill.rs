//! Idle sessions spilled to disk: files named apart, dead processes' files swept, sessions
//! back intact; a session of another engine refused.

use std::os::unix::fs::MetadataExt;

use super::*;
use crate::engine::spill as spilldir;

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

/// Containers sharing a cache volume each have their own pid namespace, where the other's
/// live process looks gone: its files are kept while it holds its owner lock (a spill
/// file) or the temporary's lock (a save under way), and swept once the lock is free.
#[test]
fn files_of_a_process_whose_pid_looks_gone_are_kept_while_it_holds_its_lock() {
    let tmp = tempfile::tempdir().unwrap();
    let spill = tmp.path().join("spill");
    std::fs::create_dir_all(&spill).unwrap();
    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(4_194_304);
    let elsewhere = pid_max + 1; // no such pid here: "another namespace's"
    let nonce = "00000000feedf00d";
    let ctx = spill.join(format!("{elsewhere}-{nonce}-1-1.ctx"));
    let tmp_file = spill.join(format!(".{elsewhere}-{nonce}-1-2.ctx.tmp.{elsewhere}.0.1"));
    let lock_path = spill.join(format!("{elsewhere}-{nonce}.lock"));
    for f in [&ctx, &tmp_file, &lock_path] {
        std::fs::write(f, b"x").unwrap();
    }
    let lock = std::fs::File::open(&lock_path).unwrap();
    lock.try_lock().unwrap();
    let e = open("python/colibri/models/tiny", &spill, Some(0));
    assert!(
        ctx.exists() && tmp_file.exists() && lock_path.exists(),
        "a locked owner's files are kept"
    );
    // This engine holds its own lock once it spills.
    let a = e.new_session().unwrap();
    run(&e, Some(&a), &PROMPT, false);
    let b = e.new_session().unwrap();
    run(&e, Some(&b), &PROMPT, false);
    assert!(a.is_evicted().unwrap());
    let own: Vec<String> = std::fs::read_dir(&spill)
        .unwrap()
        .flatten()
        .map(|d| d.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{}-", std::process::id())) && n.ends_with(".lock"))
        .collect();
    assert_eq!(own.len(), 1, "{own:?}");
    let held = std::fs::File::open(spill.join(&own[0])).unwrap();
    assert!(held.try_lock().is_err(), "the engine holds its owner lock");
    // The other process is gone: its lock free, its files swept at the next open.
    drop(lock);
    let _again = open("python/colibri/models/tiny", &spill, Some(0));
    assert!(
        !ctx.exists() && !tmp_file.exists() && !lock_path.exists(),
        "a gone owner's files and lock are swept"
    );
    assert!(a.spill_path.is_file(), "a live engine's spill file is kept");
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

fn mode_of(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn open_err(spill: &Path) -> String {
    let opts = EngineOptions {
        usage_file: false,
        threads: 1,
        spill_dir: Some(spill.to_path_buf()),
        ..EngineOptions::default()
    };
    match Engine::open(&model_dir("python/colibri/models/tiny"), &opts) {
        Ok(_) => panic!("{} was accepted as the spill directory", spill.display()),
        Err(e) => {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
            e.to_string()
        }
    }
}

#[test]
fn a_spill_directory_others_could_redirect_or_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    assert!(open_err(&link).contains("is a symbolic link"));
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert!(open_err(&file).contains("is not a directory"));
    let shared = tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let msg = open_err(&shared);
    assert!(
        msg.contains("mode 0777") && msg.contains("spill_dir"),
        "{msg}"
    );
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    assert!(open_err(&shared).contains("can be written by other users"));
    // Another user's directory, even a private one: refused for its owner.
    let theirs = tmp.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    let me = std::fs::metadata("/proc/self").unwrap().uid();
    let err = spilldir::check_private_as(&theirs, Some(me + 1)).unwrap_err();
    assert!(err.to_string().contains("belongs to another user"), "{err}");
    if me == 0 {
        // As root, a real one: a 0777 directory that uid 4242 made first, as on a shared /tmp.
        std::os::unix::fs::chown(&theirs, Some(4242), Some(4242)).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(open_err(&theirs).contains("belongs to another user (uid 4242)"));
    }
    // Ours, 0700 or 0755: taken.
    spilldir::check_private(&target).unwrap();
}

#[test]
fn without_a_cache_directory_sessions_spill_to_a_private_directory_of_their_own() {
    let parent = tempfile::tempdir().unwrap();
    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(4_194_304);
    let crashed = parent
        .path()
        .join(format!("colibri-sessions-{}-00000000deadbeef", pid_max + 1));
    std::fs::create_dir(&crashed).unwrap();
    std::fs::write(crashed.join("1-0-0-1.ctx"), b"x").unwrap();
    let a = spilldir::SpillDir::private_in(parent.path()).unwrap();
    let b = spilldir::SpillDir::private_in(parent.path()).unwrap();
    assert!(
        !crashed.exists(),
        "a dead process's private directory is swept"
    );
    assert_ne!(a.path, b.path, "each engine has its own");
    let name = a.path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with(&format!("colibri-sessions-{}-", std::process::id())),
        "{name}"
    );
    assert_eq!(mode_of(&a.path), 0o700);
    a.ensure().unwrap();
    let path = a.path.clone();
    drop(a);
    assert!(!path.exists(), "removed with its engine");
    assert!(b.path.is_dir());
    // With no spill_dir and no cache directory, the engine takes one in the temp directory.
    let none = spilldir::SpillDir::resolve(None, None).unwrap();
    assert!(
        none.path.starts_with(std::env::temp_dir()),
        "{:?}",
        none.path
    );
    assert_eq!(mode_of(&none.path), 0o700);
}

#[test]
fn a_spill_directory_is_made_private_and_a_link_planted_after_the_open_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let spill = tmp.path().join("cache").join("sessions");
    let e = open("python/colibri/models/tiny", &spill, Some(0));
    let a = e.new_session().unwrap();
    run(&e, Some(&a), &PROMPT, false);
    let b = e.new_session().unwrap();
    run(&e, Some(&b), &PROMPT, false);
    assert!(a.is_evicted().unwrap());
    assert_eq!(mode_of(&spill), 0o700, "made 0700");
    assert_eq!(
        mode_of(&a.spill_path),
        0o600,
        "a spill file is this user's alone"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&spill)
        .unwrap()
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().contains(".tmp."))
        .collect();
    assert!(leftovers.is_empty(), "no temporary file is left");
    // Someone replaces the directory with a link to theirs: the next spill is refused
    // (the session stays in RAM) and nothing is written through the link.
    run(&e, Some(&a), &PROMPT, false); // A back in RAM, B spilled
    assert!(b.is_evicted().unwrap());
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::rename(&spill, tmp.path().join("old")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &spill).unwrap();
    run(&e, Some(&b), &PROMPT, false); // would spill A
    assert!(!a.is_evicted().unwrap(), "kept in RAM");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    let again = run(&e, Some(&a), &PROMPT, false);
    assert!(!again.tokens.is_empty());
}
