//! The progress of a model's load: every resident tensor read, reported as it is read.

use super::Container;
use crate::error::{Error, Result};

/// returning false stops the load with [`Error::Cancelled`].
pub type LoadReport = std::sync::Arc<dyn Fn(u64, u64) -> bool + Send + Sync>;

pub(super) struct LoadCounter {
    done: u64,
    total: u64,
    report: LoadReport,
}

impl std::fmt::Debug for LoadCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LoadCounter({} of {} bytes)", self.done, self.total)
    }
}

impl Container {
    /// Report every [`weight`](Self::weight) and [`vector`](Self::vector) read to `report`
    /// with the running total against [`resident_bytes`](Self::resident_bytes) (a model's
    /// load); `None` stops reporting. [`finish_loads`](Self::finish_loads) ends it.
    pub fn report_loads(&self, report: Option<LoadReport>) {
        let counter = report.map(|report| LoadCounter {
            done: 0,
            total: self.resident_bytes(),
            report,
        });
        if let Ok(mut slot) = self.load_progress.lock() {
            *slot = counter;
        }
    }

    /// End the reporting of [`report_loads`](Self::report_loads) with a last call whose
    /// total is what was read (tensors a load skips, such as a disabled MTP head, are not
    /// waited for), so a progress bar ends full.
    pub fn finish_loads(&self) {
        let counter = self.load_progress.lock().ok().and_then(|mut s| s.take());
        if let Some(c) = counter {
            (c.report)(c.done, c.done);
        }
    }

    pub(super) fn loaded(&self, bytes: usize) -> Result<()> {
        let Ok(mut slot) = self.load_progress.lock() else {
            return Ok(());
        };
        let Some(c) = slot.as_mut() else {
            return Ok(());
        };
        c.done += bytes as u64;
        c.total = c.total.max(c.done);
        let (done, total, report) = (c.done, c.total, c.report.clone());
        drop(slot);
        if report(done, total) {
            Ok(())
        } else {
            Err(Error::Cancelled)
        }
    }
}
