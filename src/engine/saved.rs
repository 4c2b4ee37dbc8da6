//! Saved contexts: a session's KV caches and token history in one file, so a long system
//! prompt or document is prefilled once and loaded back later (or by another process), and
//! so idle sessions can be evicted to disk. docs/architecture.md, "Saved contexts", has the
//! format; it is little-endian and versioned, and every field is checked on load.
//!
//! ```text
//! magic "colibri-context\0" (16 B) | version u32 | header CRC-32 u32 (never 0; files of
//! before it was recorded held 0 and are refused) | header length u64
//! header (JSON, `Header`) | payload: each cache's latents, roped keys, indexer keys
//! (main layers in order, then the MTP layer), f32; then the MTP-pending hidden states
//! ```

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::carried::Carried;
use crate::decode::CacheState;
use crate::model::KvCaches;
use crate::{Error, Result};

const MAGIC: &[u8; 16] = b"colibri-context\0";
/// Bump when the layout changes; a file of another version is refused, never misread.
pub const VERSION: u32 = 1;
const PREFIX_BYTES: usize = 16 + 4 + 4 + 8;
/// The header is a few numbers and the token list: 64 MiB is ~5M tokens, beyond any context.
const MAX_HEADER_BYTES: u64 = 64 << 20;

#[derive(Serialize, Deserialize)]
struct Header {
    /// The model's fingerprint (`ExpertStore::fingerprint`): a context is only valid for the
    /// weights that computed it.
    fingerprint: String,
    /// Row widths (kv_lora, rope_dim, index_dim) of every cache, the MTP layer's last.
    widths: Vec<[usize; 3]>,
    main_rows: usize,
    mtp_rows: usize,
    hidden_size: usize,
    pending_rows: usize,
    tokens: Vec<u32>,
    payload_bytes: u64,
    crc32: u32,
    /// Whether the saving model had its MTP head loaded (absent in files written before it
    /// was recorded; their MTP rows tell when they can).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mtp_head: Option<bool>,
    /// The saving model's routed experts per token when it ran fewer than its own k (the
    /// `experts_per_token` option); absent for the model's own k (and in files written before
    /// it was recorded, which all ran it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    experts_per_token: Option<usize>,
}

/// What the loading model must match (and what a saving model records).
pub struct Expect<'a> {
    pub fingerprint: &'a str,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    /// The model's MTP head is loaded: a context saved with it on holds MTP rows a model
    /// without it cannot use, and one saved with it off lacks the rows drafting needs.
    pub mtp_head: bool,
    /// The model's routed experts per token when fewer than its own k (`None`: its own):
    /// another value computed the caches with another model.
    pub experts_per_token: Option<usize>,
}

fn payload_bytes(
    widths: &[[usize; 3]],
    main_rows: usize,
    mtp_rows: usize,
    pending: usize,
    hidden: usize,
) -> Option<u64> {
    let mut floats: u64 = 0;
    let last = widths.len().checked_sub(1)?;
    for (i, w) in widths.iter().enumerate() {
        let rows = if i == last { mtp_rows } else { main_rows } as u64;
        let width = w.iter().try_fold(0u64, |a, &x| a.checked_add(x as u64))?;
        floats = floats.checked_add(rows.checked_mul(width)?)?;
    }
    floats = floats.checked_add((pending as u64).checked_mul(hidden as u64)?)?;
    floats.checked_mul(4)
}

/// Write `caches` and `state` to `path` atomically (a temporary file in the same directory,
/// synced, then renamed over it): a reader sees the old file or the new one, never a part.
pub fn save(path: &Path, model: &Expect<'_>, caches: &KvCaches, state: &CacheState) -> Result<u64> {
    let (fingerprint, hidden_size) = (model.fingerprint, model.hidden_size);
    let widths: Vec<[usize; 3]> = caches.all().map(|kv| kv.widths()).collect();
    let pending = state.mtp_pending().values();
    let pending_rows = pending.len() / hidden_size.max(1);
    let (main_rows, mtp_rows) = (caches.len(), caches.mtp_len());
    if state.tokens.len() != main_rows {
        return Err(Error::Internal(format!(
            "a session's history holds {} tokens and its caches {main_rows} rows",
            state.tokens.len()
        )));
    }
    let mut crc = crc32fast::Hasher::new();
    for kv in caches.all() {
        for part in kv.parts() {
            crc.update(bytemuck::cast_slice(part));
        }
    }
    crc.update(bytemuck::cast_slice(pending));
    let header = Header {
        fingerprint: fingerprint.to_owned(),
        payload_bytes: payload_bytes(&widths, main_rows, mtp_rows, pending_rows, hidden_size)
            .unwrap_or(0),
        widths,
        main_rows,
        mtp_rows,
        hidden_size,
        pending_rows,
        tokens: state.tokens.clone(),
        crc32: crc.finalize(),
        mtp_head: Some(model.mtp_head),
        experts_per_token: model.experts_per_token,
    };
    let json = serde_json::to_vec(&header).map_err(|e| Error::Internal(e.to_string()))?;
    check_target(path)?;
    let tmp = temporary_path(path);
    let write = || -> std::io::Result<()> {
        // A name of our own, created new: never a file another save writes, nor whatever a
        // symlink planted at a guessable name points to.
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600) // a conversation's KV: this user's alone
            .open(&tmp)?;
        // Held until the rename: the sweep of dead savers' temporaries leaves a locked one
        // (a live saver in another pid namespace, where its pid looks gone). Advisory and
        // best effort: a filesystem without flock only loses that guard.
        let _ = file.try_lock();
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        w.write_all(MAGIC)?;
        w.write_all(&VERSION.to_le_bytes())?;
        w.write_all(&header_crc(&json).to_le_bytes())?;
        w.write_all(&(json.len() as u64).to_le_bytes())?;
        w.write_all(&json)?;
        for kv in caches.all() {
            for part in kv.parts() {
                w.write_all(bytemuck::cast_slice(part))?;
            }
        }
        w.write_all(bytemuck::cast_slice(pending))?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Durability of the rename; a directory that cannot be opened is not an error.
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    };
    match write() {
        Ok(()) => {
            remove_stale_temporaries(path);
            Ok((PREFIX_BYTES + json.len()) as u64 + header.payload_bytes)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(Error::io(path, e))
        }
    }
}

/// The CRC-32 of the header's JSON, as the prefix records it (never 0, which means "not
/// recorded").
fn header_crc(json: &[u8]) -> u32 {
    crc32fast::hash(json).max(1)
}

/// A save replaces a regular file (or a symlink, itself), never a device, a FIFO or a
/// directory that happens to be at the path.
fn check_target(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !(m.is_file() || m.file_type().is_symlink()) => Err(Error::invalid(
            "path",
            format!(
                "{} exists and is not a regular file: a context is saved to a file path, \
                 and colibri does not replace anything else",
                path.display()
            ),
        )),
        _ => Ok(()),
    }
}

fn temporary_prefix(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(".{name}.tmp.")
}

/// `.NAME.tmp.<pid>.<n>.<random>`: the process (for the sweep of dead ones'), a
/// per-process count, so saves by two models of one process, or two threads, never share a
/// temporary file, and a random part, so no other user can plant something at the name
/// beforehand (the file is created new, 0600: a save fails rather than follow a link).
fn temporary_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = format!(
        "{}{}.{n}.{:016x}",
        temporary_prefix(path),
        std::process::id(),
        crate::container::regular_file::random_name_part()
    );
    path.with_file_name(name)
}

/// Remove the temporary files of saves to `path` whose process is gone (killed mid-save):
/// they are ours (our prefix, a regular file) and nobody will finish them. Only where
/// `/proc` tells which processes live, and only when no one holds the temporary's lock (a
/// saver in another pid namespace, sharing the directory, whose pid looks gone here).
fn remove_stale_temporaries(path: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefix = temporary_prefix(path);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        let regular = entry.file_type().is_ok_and(|t| t.is_file());
        if !alive && regular && unlocked(&entry.path()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Whether nobody holds the advisory lock on the file at `path` (false when it cannot be
/// opened: then it is kept).
fn unlocked(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .is_ok_and(|f| f.try_lock().is_ok())
}

/// Read a context written by [`save`] into `caches` (made by the loading model's
/// `new_caches`, whose layout the file must have) and return its cache state. A file that is
/// truncated, corrupt, of another version or of another model is a
/// [`Error::SavedContext`] saying which; `caches` is then left empty.
pub fn load(path: &Path, expect: &Expect<'_>, caches: &mut KvCaches) -> Result<CacheState> {
    let (file, size) = open_regular(path)?;
    let mut r = std::io::BufReader::with_capacity(1 << 20, file);
    let (h, header_len) = read_header(&mut r, path, size)?;
    let widths: Vec<[usize; 3]> = caches.all().map(|kv| kv.widths()).collect();
    check_model(path, &h, expect, &widths)?;
    check_rows(path, &h, expect)?;
    check_size(path, &h, header_len, size)?;
    match read_payload(&mut r, path, &h, caches) {
        Ok(pending) => Ok(CacheState::from_parts(
            h.tokens,
            Carried::from_saved(pending, h.hidden_size),
        )),
        Err(e) => {
            caches.release();
            Err(e)
        }
    }
}

/// The file at `path` opened for reading, and its size, if it is a regular file.
fn open_regular(path: &Path) -> Result<(std::fs::File, u64)> {
    let bad = |msg: String| Error::saved_context(path, msg);
    // Looked at before it is opened: opening a FIFO would wait for a writer forever. The
    // open itself does not block either, should the path change in between.
    let before = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !before.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| Error::io(path, e))?
    };
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    Ok((file, meta.len()))
}

/// The prefix (magic, version, header checksum and length) and the header of a file of
/// `size` bytes, checked; returns the header and its length.
fn read_header(r: &mut impl Read, path: &Path, size: u64) -> Result<(Header, u64)> {
    let bad = |msg: String| Error::saved_context(path, msg);
    let mut prefix = [0u8; PREFIX_BYTES];
    if size < PREFIX_BYTES as u64 {
        return Err(bad(format!(
            "{size} bytes: too short to be a saved context (truncated?)"
        )));
    }
    r.read_exact(&mut prefix).map_err(|e| Error::io(path, e))?;
    if &prefix[..16] != MAGIC {
        return Err(bad("not a colibri saved context (wrong magic bytes)".into()));
    }
    let word = |at: usize| {
        u32::from_le_bytes([prefix[at], prefix[at + 1], prefix[at + 2], prefix[at + 3]])
    };
    let version = word(16);
    if version != VERSION {
        return Err(bad(format!(
            "format version {version}; this colibri reads version {VERSION}: save the context again with this version"
        )));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&prefix[24..32]);
    let header_len = u64::from_le_bytes(len8);
    if header_len > MAX_HEADER_BYTES || header_len > size - PREFIX_BYTES as u64 {
        return Err(bad(format!(
            "header of {header_len} bytes in a {size}-byte file: truncated or corrupt"
        )));
    }
    let mut json = vec![0u8; header_len as usize];
    r.read_exact(&mut json).map_err(|e| Error::io(path, e))?;
    let recorded = word(20);
    // 0 was "not recorded" in files saved before 2026-12-06 (d4064af); accepting it would let
    // four zero bytes pass any header edit, so such a file must be saved again.
    if recorded == 0 {
        return Err(bad(
            "its header has no checksum (saved by a colibri before 2026-12-06, or damaged): \
             save the context again with this version"
                .into(),
        ));
    }
    if recorded != header_crc(&json) {
        return Err(bad(
            "header checksum mismatch: the file is corrupt (its token list or sizes changed)"
                .into(),
        ));
    }
    let h: Header =
        serde_json::from_slice(&json).map_err(|e| bad(format!("unreadable header: {e}")))?;
    Ok((h, header_len))
}

/// The header was saved by this model: its fingerprint, its MTP head, and caches of this
/// model's `widths`.
fn check_model(path: &Path, h: &Header, expect: &Expect<'_>, widths: &[[usize; 3]]) -> Result<()> {
    let bad = |msg: String| Error::saved_context(path, msg);
    if h.fingerprint != expect.fingerprint {
        return Err(bad(format!(
            "saved by another model (fingerprint {}, this model's is {}): a context is only valid for the weights that computed it",
            h.fingerprint, expect.fingerprint
        )));
    }
    let saved_head = h.mtp_head.or(if h.mtp_rows > 0 || h.pending_rows > 0 {
        Some(true)
    } else {
        None
    });
    if let Some(saved_head) = saved_head.filter(|&on| on != expect.mtp_head) {
        let (then, now) = if saved_head {
            ("on", "off")
        } else {
            ("off", "on")
        };
        return Err(bad(format!(
            "saved with the MTP head {then}, and this model has it {now}: open the model with mtp={} to use it, or save the context again from this model",
            if saved_head { "True" } else { "False" }
        )));
    }
    if h.experts_per_token != expect.experts_per_token {
        let name = |k: Option<usize>| k.map_or("the model's own k".to_owned(), |k| k.to_string());
        return Err(bad(format!(
            "saved with experts_per_token = {}, and this model routes {}: its caches were computed by another model; open the model with that experts_per_token to use it, or save the context again from this model",
            name(h.experts_per_token),
            name(expect.experts_per_token)
        )));
    }
    if h.widths != widths || h.hidden_size != expect.hidden_size {
        return Err(bad(format!(
            "its caches are shaped {:?} (hidden {}) and this model's {:?} (hidden {}): saved with other options (MTP head, sparse attention)",
            h.widths, h.hidden_size, widths, expect.hidden_size
        )));
    }
    Ok(())
}

/// The header's row counts agree with each other and its tokens fit this model's context
/// and vocabulary.
fn check_rows(path: &Path, h: &Header, expect: &Expect<'_>) -> Result<()> {
    let bad = |msg: String| Error::saved_context(path, msg);
    if h.tokens.len() != h.main_rows
        || h.mtp_rows > h.main_rows
        || h.pending_rows > h.main_rows - h.mtp_rows
    {
        return Err(bad(format!(
            "inconsistent header: {} tokens, {} main rows, {} MTP rows, {} pending rows",
            h.tokens.len(),
            h.main_rows,
            h.mtp_rows,
            h.pending_rows
        )));
    }
    if h.main_rows > expect.max_context {
        return Err(bad(format!(
            "{} tokens of context, more than this model's max_context of {}: open the model with a larger max_context",
            h.main_rows, expect.max_context
        )));
    }
    if let Some(t) = h.tokens.iter().find(|&&t| t as usize >= expect.vocab_size) {
        return Err(bad(format!(
            "token id {t} is outside the vocabulary ({} ids)",
            expect.vocab_size
        )));
    }
    Ok(())
}

/// The file's `size` is the prefix, the header and the payload the header describes.
fn check_size(path: &Path, h: &Header, header_len: u64, size: u64) -> Result<()> {
    let payload = payload_bytes(
        &h.widths,
        h.main_rows,
        h.mtp_rows,
        h.pending_rows,
        h.hidden_size,
    );
    let expected_size = payload.and_then(|p| p.checked_add(PREFIX_BYTES as u64 + header_len));
    if payload != Some(h.payload_bytes) || expected_size != Some(size) {
        return Err(Error::saved_context(
            path,
            format!(
                "{size} bytes where its header describes {}: truncated or corrupt",
                expected_size.map_or_else(|| "an impossible size".to_owned(), |s| s.to_string())
            ),
        ));
    }
    Ok(())
}

/// Read the payload into `caches` (the MTP layer's last) and return the MTP-pending hidden
/// states, the payload's checksum and finiteness checked. On an error `caches` may hold
/// part of it.
fn read_payload(
    r: &mut impl Read,
    path: &Path,
    h: &Header,
    caches: &mut KvCaches,
) -> Result<Vec<f32>> {
    let bad = |msg: String| Error::saved_context(path, msg);
    let mut crc = crc32fast::Hasher::new();
    let mut finite = true;
    let mut fill = |part: &mut [f32]| -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(part);
        r.read_exact(bytes).map_err(|e| Error::io(path, e))?;
        crc.update(bytes);
        finite &= part.iter().all(|x| x.is_finite());
        Ok(())
    };
    let last = h.widths.len() - 1;
    for (i, kv) in caches.all_mut().enumerate() {
        let rows = if i == last { h.mtp_rows } else { h.main_rows };
        kv.load_parts(rows, &mut fill)?;
    }
    let mut pending = vec![0f32; h.pending_rows * h.hidden_size];
    fill(&mut pending)?;
    if crc.finalize() != h.crc32 {
        return Err(bad("checksum mismatch: the file is corrupt".into()));
    }
    if !finite {
        return Err(bad(
            "it holds NaN or infinite values (its checksum matches, so it was written so): \
             it cannot continue a generation; save the context again"
                .into(),
        ));
    }
    Ok(pending)
}
