//! Injected faults, refused O_DIRECT reads and truncated shards: typed errors, and a store
//! that stays usable.

use super::*;

/// Faults mid-generation give typed errors naming the file; the store stays usable.
#[test]
fn faults_are_typed_and_recoverable() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    // Experts 0..5 of layer 1 live in shard 0, layer 1 expert 5.. in shard 1.
    let shard0 = src.files[0].clone();
    let name0 = shard0
        .file_name()
        .and_then(|n| n.to_str())
        .expect("name")
        .to_owned();
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        let store = ExpertStore::open_source(src.clone(), opts(io, 0)).expect("open");
        for (kind, check) in [
            (FaultKind::Eio, "io"),
            (FaultKind::Missing, "io"),
            (FaultKind::ShortRead(100), "container"),
        ] {
            store.faults().inject(&name0, kind, Some(1));
            let err = store.with_experts(1, &[0, 1], &mut ok).expect_err("fault");
            match (&err, check) {
                (Error::Io { path, source }, "io") => {
                    assert_eq!(path, &shard0);
                    let want = if kind == FaultKind::Eio {
                        Some(libc::EIO)
                    } else {
                        Some(libc::ENOENT)
                    };
                    assert_eq!(source.raw_os_error(), want);
                }
                (Error::Container { file, tensor, .. }, "container") => {
                    assert_eq!(file, &shard0);
                    assert!(tensor
                        .as_deref()
                        .is_some_and(|t| t.contains("layers.1.mlp.experts")));
                }
                _ => panic!("{io:?} {kind:?}: unexpected {err:?}"),
            }
            store.faults().clear();
            store
                .with_experts(1, &[0, 1], &mut ok)
                .expect("usable after the fault");
        }
    }
}

/// A filesystem that refuses O_DIRECT reads (EINVAL): the direct store falls back to buffered
/// reads, delivers the same bytes, and reports the mode in effect as pread.
#[test]
fn refused_direct_reads_fall_back_to_buffered() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let name0 = src.files[0]
        .file_name()
        .and_then(|n| n.to_str())
        .expect("name")
        .to_owned();
    let store = ExpertStore::open_source(src.clone(), opts(IoMode::Direct, 0)).expect("open");
    if store.stats().io_mode != IoMode::Direct {
        // This filesystem already refused O_DIRECT at open time: the fallback under test ran.
        assert_eq!(store.stats().io_mode, IoMode::Pread);
        return;
    }
    store
        .faults()
        .inject(&name0, FaultKind::DirectRefused, Some(1));
    let mut got = Vec::new();
    store
        .with_experts(1, &[0, 1], &mut |e, v: &ExpertView<'_>| {
            got.push((e, digest(v)));
            Ok(())
        })
        .expect("falls back instead of failing");
    got.sort();
    assert_eq!(
        got,
        vec![(0, reference(&src, 1, 0)), (1, reference(&src, 1, 1))]
    );
    assert_eq!(
        store.stats().io_mode,
        IoMode::Pread,
        "the fallback is reported"
    );
    // Later loads keep working, buffered.
    store
        .with_experts(1, &[2, 6], &mut |e, v: &ExpertView<'_>| {
            assert_eq!(digest(v), reference(&src, 1, e));
            Ok(())
        })
        .expect("later loads");
}

#[test]
fn a_truncated_shard_is_an_error_not_a_crash() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let shard1 = src.files[1].clone();
    let full = std::fs::read(&shard1).expect("read");
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        let store = ExpertStore::open_source(src.clone(), opts(io, 0)).expect("open");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&shard1)
            .expect("open rw");
        f.set_len(1000).expect("truncate");
        // Layer 1 expert 6 lives in shard 1 (5 experts per shard).
        match store.with_experts(1, &[2, 6], &mut ok) {
            Err(Error::Container { file, .. }) => assert_eq!(file, shard1),
            other => panic!("{io:?}: expected a container error, got {other:?}"),
        }
        store
            .with_experts(1, &[0, 2], &mut ok)
            .expect("other shards still work");
        std::fs::write(&shard1, &full).expect("restore");
        store
            .with_experts(1, &[6], &mut |id, v| {
                assert_eq!(digest(v), reference(&src, 1, id));
                Ok(())
            })
            .expect("works again once restored");
    }
    // A shard deleted after open keeps serving its bytes (the descriptor stays open).
    let store = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 0)).expect("open");
    std::fs::remove_file(&shard1).expect("rm");
    store
        .with_experts(1, &[6], &mut ok)
        .expect("deleted but open");
}
