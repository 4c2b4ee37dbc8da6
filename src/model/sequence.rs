//! One sequence on a model: its weights and this sequence's caches, the batch of one that
//! a single generation (and the decode loop's `Target`) computes.

use std::borrow::BorrowMut;

use crate::carried::Carried;
use crate::error::{Error, Result};
use crate::model::batch::{Forward, MtpForward, MtpRows, SeqRows};
use crate::model::caches::KvCaches;
use crate::model::forward::Model;

/// A sequence: `model`'s forwards over `caches`, borrowed (a session's, the default) or
/// owned ([`Sequence::owned`]).
pub struct Sequence<'a, C: BorrowMut<KvCaches> = &'a mut KvCaches> {
    model: &'a Model,
    caches: C,
}

/// The one result of a batch of one.
fn only<T>(mut out: Vec<T>) -> Result<T> {
    match (out.pop(), out.is_empty()) {
        (Some(one), true) => Ok(one),
        _ => Err(Error::Internal(
            "a forward of one sequence returned another count".into(),
        )),
    }
}

/// Positions are appended in order: `start` must be the cached length.
fn check_start(start: usize, len: usize) -> Result<()> {
    if start != len {
        return Err(Error::invalid(
            "start_pos",
            format!("must equal the cached length {len}, got {start}"),
        ));
    }
    Ok(())
}

impl<'a> Sequence<'a> {
    /// `caches` must have been made by `model.new_caches()` (a forward checks their shape).
    pub fn new(model: &'a Model, caches: &'a mut KvCaches) -> Self {
        Sequence { model, caches }
    }
}

impl<'a> Sequence<'a, KvCaches> {
    /// A new sequence with caches of its own.
    pub fn owned(model: &'a Model) -> Self {
        Sequence {
            model,
            caches: model.new_caches(),
        }
    }
}

impl<'a, C: BorrowMut<KvCaches>> Sequence<'a, C> {
    pub fn model(&self) -> &'a Model {
        self.model
    }

    pub fn caches(&self) -> &KvCaches {
        self.caches.borrow()
    }

    pub fn caches_mut(&mut self) -> &mut KvCaches {
        self.caches.borrow_mut()
    }

    /// One exact forward over `tokens` at positions `start..` (= [`kv_len`](Self::kv_len)),
    /// appending their KV rows: logits of every row (`all_logits`) or of the last.
    pub fn step(&mut self, tokens: &[u32], start: usize, all_logits: bool) -> Result<Forward> {
        check_start(start, self.caches().len())?;
        only(self.model.forward(&mut [self.rows(tokens, all_logits)])?)
    }

    /// [`step`](Self::step) for the rows of a prompt, in the model's prefill arithmetic when
    /// there are enough of them ([`Model::prefill`]).
    pub fn prefill(&mut self, tokens: &[u32], start: usize, all_logits: bool) -> Result<Forward> {
        check_start(start, self.caches().len())?;
        only(self.model.prefill(&mut [self.rows(tokens, all_logits)])?)
    }

    /// The MTP head over `tokens` with `carried` ([`Model::mtp_forward`]) at MTP positions
    /// `start..` (= [`mtp_kv_len`](Self::mtp_kv_len)).
    pub fn mtp_step(
        &mut self,
        tokens: &[u32],
        carried: &Carried,
        start: usize,
        all_logits: bool,
    ) -> Result<MtpForward> {
        check_start(start, self.caches().mtp_len())?;
        only(self.model.mtp_forward(&mut [MtpRows {
            caches: self.caches.borrow_mut(),
            tokens,
            carried,
            all_logits,
        }])?)
    }

    fn rows<'s>(&'s mut self, tokens: &'s [u32], all_logits: bool) -> SeqRows<'s> {
        SeqRows {
            caches: self.caches.borrow_mut(),
            tokens,
            all_logits,
        }
    }

    /// Rows in the main caches (= the next position to compute).
    pub fn kv_len(&self) -> usize {
        self.caches().len()
    }
    pub fn mtp_kv_len(&self) -> usize {
        self.caches().mtp_len()
    }
    /// Drop main-model KV rows from `len` on (roll back rejected positions).
    pub fn truncate(&mut self, len: usize) {
        self.caches_mut().truncate_main(len);
        if let Some(sink) = self.model.routing_sink() {
            sink.truncated(self.caches().id(), len);
        }
    }
    pub fn mtp_truncate(&mut self, len: usize) {
        self.caches_mut().truncate_mtp(len);
    }
    /// Forget everything (a new sequence).
    pub fn reset(&mut self) {
        self.caches_mut().clear();
    }
}
