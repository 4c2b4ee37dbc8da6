//! The I/O worker pool: a few named threads that run expert loads (blocking reads) while the
//! caller computes with experts that are already resident. A plain rayon pool, separate from
//! the compute pool so that blocked reads never starve the kernels.

use crate::error::{Error, Result};

pub(crate) struct IoPool {
    pool: rayon::ThreadPool,
}

impl IoPool {
    pub fn new(threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("colibri-io-{i}"))
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the I/O pool: {e}")))?;
        Ok(IoPool { pool })
    }

    /// Run `job` on a worker. The job must not panic (callers wrap it in `catch_unwind`).
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        self.pool.spawn(job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_jobs_concurrently_on_named_threads() {
        let pool = IoPool::new(2).expect("pool");
        let (tx, rx) = std::sync::mpsc::channel();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        for _ in 0..2 {
            let (tx, b) = (tx.clone(), barrier.clone());
            // Both jobs must run at once to pass the barrier.
            pool.spawn(move || {
                b.wait();
                let name = std::thread::current().name().map(str::to_owned);
                tx.send(name).expect("send");
            });
        }
        for _ in 0..2 {
            let name = rx.recv().expect("job ran").expect("named");
            assert!(name.starts_with("colibri-io-"));
        }
    }
}
