//! A session: one conversation's KV caches (main layers, MTP layer, DSA indexer keys) and
//! the tokens they hold. The model holds weights only: each of the session's generations runs
//! the model's forwards over these caches (`model::Sequence`). The engine keeps idle
//! sessions within a RAM budget by writing the least recently used to disk, and reads them
//! back on their next use.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use crate::decode::CacheState;
use crate::model::KvCaches;
use crate::{Error, Result};

pub(super) struct SessionState {
    pub caches: KvCaches,
    pub cache: CacheState,
    /// The caches (and the MTP-pending states) are in `spill_path`, not in RAM; `cache.tokens`
    /// stays in RAM.
    pub evicted: bool,
    /// The engine's tick at the session's last use (least recently used is evicted first).
    pub last_used: u64,
}

/// One conversation on an [`Engine`](super::Engine) (`Engine::new_session`).
pub struct Session {
    pub(super) engine: u64,
    pub(super) id: u64,
    pub(super) state: Mutex<SessionState>,
    /// Where the session goes when evicted (removed when it comes back, or is dropped).
    pub(super) spill_path: PathBuf,
}

impl Session {
    pub(super) fn new(engine: u64, id: u64, caches: KvCaches, spill_path: PathBuf) -> Self {
        Session {
            engine,
            id,
            state: Mutex::new(SessionState {
                caches,
                cache: CacheState::default(),
                evicted: false,
                last_used: 0,
            }),
            spill_path,
        }
    }

    pub(super) fn lock(&self) -> Result<MutexGuard<'_, SessionState>> {
        self.state
            .lock()
            .map_err(|_| Error::Internal("session lock poisoned".into()))
    }

    /// Tokens of context the session holds (its prompt and output so far, but the last
    /// token); waits for a generation running on it.
    pub fn kv_tokens(&self) -> Result<usize> {
        Ok(self.lock()?.cache.tokens.len())
    }

    /// The tokens themselves.
    pub fn tokens(&self) -> Result<Vec<u32>> {
        Ok(self.lock()?.cache.tokens.clone())
    }

    /// Bytes its KV caches hold in RAM (0 while evicted to disk).
    pub fn kv_bytes(&self) -> Result<usize> {
        Ok(self.lock()?.caches.bytes())
    }

    /// Whether the caches are on disk (evicted under the idle-session budget).
    pub fn is_evicted(&self) -> Result<bool> {
        Ok(self.lock()?.evicted)
    }

    /// Forget the conversation: the next generation prefills from scratch.
    pub fn reset(&self) -> Result<()> {
        let mut st = self.lock()?;
        st.caches.release();
        st.cache.clear();
        if std::mem::take(&mut st.evicted) {
            let _ = std::fs::remove_file(&self.spill_path);
        }
        Ok(())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let evicted = self.state.get_mut().map(|s| s.evicted).unwrap_or(true);
        if evicted {
            let _ = std::fs::remove_file(&self.spill_path);
        }
    }
}
