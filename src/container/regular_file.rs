//! Opening a file that must be a regular one without ever waiting on something else named
//! like it: `open()` of a FIFO blocks until a writer comes, before any check can run.

use std::fs::File;
use std::path::Path;

/// Open `path` read-only, non-blocking, and check the open descriptor: a FIFO, device or
/// directory named like the file is an error of kind `InvalidInput` ("not a regular
/// file"), never a wait, and a swap between a check and the open cannot make one. Reads of
/// a regular file ignore `O_NONBLOCK`.
pub fn open_read(path: &Path) -> std::io::Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path)?;
    if !file.metadata()?.is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

/// The error [`open_read`] returns for what is not a regular file.
pub fn not_regular() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file")
}

/// Whether `e` is [`open_read`]'s refusal of something that is not a regular file.
pub fn is_not_regular(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::InvalidInput && e.to_string() == "not a regular file"
}

/// A random 64-bit value for the name of a file about to be created new (a temporary file,
/// a private directory), so that no other user can plant something at the name first:
/// SipHash of the time under random keys (std draws them from the OS; each call moves on).
pub fn random_name_part() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_or_a_directory_is_refused_without_waiting() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("model.safetensors");
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a file system node.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        // Without O_NONBLOCK this open would wait for a writer forever.
        let e = open_read(&fifo).expect_err("a FIFO");
        assert!(is_not_regular(&e), "{e}");
        let e = open_read(dir.path()).expect_err("a directory");
        assert!(is_not_regular(&e), "{e}");
        let file = dir.path().join("f");
        std::fs::write(&file, b"abc").expect("write");
        assert_eq!(
            open_read(&file)
                .expect("a file")
                .metadata()
                .expect("meta")
                .len(),
            3
        );
    }
}
