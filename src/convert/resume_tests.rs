//! A source that changes between runs or during one: the progress record's fingerprints.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::tests::write_source;
use super::*;
use crate::error::Error;

const SRC1: &str = "model-00001-of-00002.safetensors";
const SRC2: &str = "model-00002-of-00002.safetensors";

fn opts() -> ConvertOptions {
    ConvertOptions {
        max_shard_bytes: 40_000,
        chunk_bytes: 1000,
        ..ConvertOptions::default()
    }
}

/// The weights and config.json of a container, by file name.
fn output(dst: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dst)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_str().unwrap();
            n.ends_with(".safetensors") || n == "config.json"
        })
        .map(|p| {
            let n = p.file_name().unwrap().to_str().unwrap().to_owned();
            (n, std::fs::read(&p).unwrap())
        })
        .collect()
}

fn set_mtime(path: &Path, t: SystemTime) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.set_modified(t).unwrap();
}

/// Where a safetensors file's data starts.
fn data_start(path: &Path) -> u64 {
    let b = std::fs::read(path).unwrap();
    8 + u64::from_le_bytes(b[..8].try_into().unwrap())
}

/// Change the low byte of every BF16 value of `path` in place (same size, same inode; the
/// values stay finite).
fn rewrite_values_in_place(path: &Path) {
    use std::os::unix::fs::FileExt;
    let start = data_start(path) as usize;
    let mut b = std::fs::read(path).unwrap();
    for x in b[start..].iter_mut().step_by(2) {
        *x ^= 0x5a;
    }
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&b[start..], start as u64).unwrap();
}

/// A copy of `path` with its data zero-filled, renamed over it (a new inode).
fn rename_zero_copy_over(path: &Path) {
    let start = data_start(path) as usize;
    let mut b = std::fs::read(path).unwrap();
    b[start..].fill(0);
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, &b).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Convert `src` in a fresh directory: what a resumed conversion must equal.
fn fresh(src: &Path, dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let clean = dir.join("fresh");
    convert(src, &clean, &opts()).unwrap();
    let out = output(&clean);
    std::fs::remove_dir_all(&clean).unwrap();
    out
}

/// Write the first `n` shards only, as a conversion that was stopped would.
fn interrupted(src: &Path, dst: &Path, n: usize) -> usize {
    let p = plan(src, dst, &opts()).unwrap();
    for i in 0..n {
        p.write_shard(i, &mut |_| Ok(())).unwrap();
    }
    p.shards.len()
}

fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    write_source(&src, None);
    // Last changed an hour ago, so that a rewrite within the same tick of the file clock
    // as the test's own writes still changes the stamp.
    for name in [SRC1, SRC2] {
        set_mtime(
            &src.join(name),
            SystemTime::now() - Duration::from_secs(3600),
        );
    }
    (tmp, src, dst)
}

#[test]
fn an_untouched_resume_keeps_every_finished_shard() {
    let (tmp, src, dst) = setup();
    let total = interrupted(&src, &dst, 2);
    assert!(total >= 4, "{total} shards");
    let report = convert(&src, &dst, &opts()).unwrap();
    assert_eq!(
        (report.shards_skipped, report.shards_written),
        (2, total - 2)
    );
    assert!(report.redone.is_empty(), "{report:?}");
    assert_eq!(output(&dst), fresh(&src, tmp.path()));
}

#[test]
fn a_source_touched_but_unchanged_keeps_its_shards() {
    let (tmp, src, dst) = setup();
    let total = interrupted(&src, &dst, 3);
    // New stamps (mtime, ctime), same bytes: the shards' bytes are read again and match.
    for name in [SRC1, SRC2] {
        set_mtime(
            &src.join(name),
            SystemTime::now() - Duration::from_secs(7200),
        );
    }
    let report = convert(&src, &dst, &opts()).unwrap();
    assert_eq!(
        (report.shards_skipped, report.shards_written),
        (3, total - 3)
    );
    assert_eq!(output(&dst), fresh(&src, tmp.path()));
    // The new stamps are recorded: a later run matches them without reading.
    let p = plan(&src, &dst, &opts()).unwrap();
    let record = p.record.lock().unwrap();
    for entry in record.shards.values() {
        for s in &entry.sources {
            let meta = std::fs::metadata(src.join(&s.file)).unwrap();
            assert_eq!(s.stamp, record::Stamp::of(&meta), "{}", s.file);
        }
    }
}

#[test]
fn a_source_rewritten_between_runs_is_converted_again() {
    // Also with its modification time put back: the change time still differs.
    for restore_mtime in [false, true] {
        let (tmp, src, dst) = setup();
        let total = interrupted(&src, &dst, 3);
        let path = src.join(SRC1);
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        rewrite_values_in_place(&path);
        if restore_mtime {
            set_mtime(&path, mtime);
            assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
        }
        let report = convert(&src, &dst, &opts()).unwrap();
        assert_eq!(report.shards_written, total, "{report:?}");
        assert!(!report.redone.is_empty(), "{report:?}");
        for why in &report.redone {
            assert!(why.contains(&*path.to_string_lossy()), "{why}");
        }
        assert_eq!(
            output(&dst),
            fresh(&src, tmp.path()),
            "mtime put back: {restore_mtime}"
        );
    }
}

#[test]
fn a_copy_renamed_over_a_source_mid_run_is_an_error_naming_it() {
    let (tmp, src, dst) = setup();
    let path = src.join(SRC1);
    let p = plan(&src, &dst, &opts()).unwrap();
    p.write_shard(0, &mut |_| Ok(())).unwrap();
    let mut calls = 0;
    let e = p
        .write_shard(1, &mut |_| {
            calls += 1;
            if calls == 2 {
                rename_zero_copy_over(&path);
            }
            Ok(())
        })
        .expect_err("the source was replaced");
    match &e {
        Error::Container { file, msg, .. } => {
            assert_eq!(file, &path);
            assert!(
                msg.contains("changed while it was being converted"),
                "{msg}"
            );
            assert!(msg.contains("inode"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    let name = &p.shards[1].file_name;
    assert!(!dst.join(name).exists());
    assert!(!dst.join(format!(".{name}.partial")).exists());
    drop(p);
    // The next run converts the new contents, shard 0 (made from the old ones) included.
    let report = convert(&src, &dst, &opts()).unwrap();
    assert_eq!(report.shards_skipped, 0, "{report:?}");
    assert_eq!(report.redone.len(), 1, "{report:?}");
    assert_eq!(output(&dst), fresh(&src, tmp.path()));
}

#[test]
fn a_source_rewritten_in_place_mid_run_is_an_error_naming_it() {
    let (tmp, src, dst) = setup();
    let path = src.join(SRC1);
    let p = plan(&src, &dst, &opts()).unwrap();
    let mut calls = 0;
    let e = p
        .write_shard(0, &mut |_| {
            calls += 1;
            if calls == 3 {
                rewrite_values_in_place(&path);
            }
            Ok(())
        })
        .expect_err("the source was rewritten");
    assert!(
        matches!(&e, Error::Container { file, .. } if file == &path),
        "{e:?}"
    );
    drop(p);
    convert(&src, &dst, &opts()).unwrap();
    assert_eq!(output(&dst), fresh(&src, tmp.path()));
}

#[test]
fn a_source_truncated_mid_run_names_file_offset_and_sizes() {
    let (_tmp, src, dst) = setup();
    let path = src.join(SRC1);
    let start = data_start(&path);
    let p = plan(&src, &dst, &opts()).unwrap();
    let first = p.shards[0].tensors[0].name.clone();
    let size = std::fs::metadata(&path).unwrap().len();
    let e = p
        .write_shard(0, &mut |_| {
            // After the header, before the first tensor is read.
            let f = OpenOptions::new().write(true).open(&path).unwrap();
            f.set_len(start + 10).unwrap();
            Ok(())
        })
        .expect_err("the source was truncated");
    match &e {
        Error::Container { file, tensor, msg } => {
            assert_eq!(file, &path);
            assert_eq!(tensor.as_deref(), Some(first.as_str()));
            assert!(
                msg.contains("truncated while it was being converted"),
                "{msg}"
            );
            assert!(msg.contains(&format!("at offset {start}")), "{msg}");
            assert!(
                msg.contains(&format!("the file now has {}", start + 10)),
                "{msg}"
            );
            assert!(msg.contains(&format!("it had {size} when")), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!dst.join(&p.shards[0].file_name).exists());
}
