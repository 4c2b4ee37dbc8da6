//! Batched decode across sessions: several sessions' next rows — each its last token and
//! its own drafts — go through one forward ([`Model::forward`]), so an expert that any
//! of them routes to is read from disk once for all of them. docs/architecture.md, "Batched
//! decode", has the design and its limits.
//!
//! Every session runs the decode loop's own state machine ([`Decoding`]): prefix reuse and
//! the prefill alone, then cycles whose drafting (the MTP head on the session's own MTP
//! cache, or prompt lookup) is per session and whose verify forward is shared. Picking,
//! acceptance, rollback and emission are the loop's, so each session's output is the one
//! it gets alone (greedy and seeded sampling, drafting or not).
//!
//! [`Engine::run_batch`] is continuous: between forwards it admits new requests (each
//! prefilled before it joins) and hands back every finished one, so a server's requests
//! join and leave a running batch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{explain_non_finite, Completion, Engine, GenerationStats, Session};
use crate::decode::spec::Decoding;
use crate::decode::{FinishReason, GenerateOptions, StepOutput};
use crate::model::{KvCaches, Model, SeqRows, Sequence};
use crate::{Error, Result};

/// One generation of a batch.
pub struct BatchRequest {
    pub session: Arc<Session>,
    pub prompt: Vec<u32>,
    pub options: GenerateOptions,
}

/// A request while the batch decodes it: its session's caches are taken out of the
/// session for the duration (and put back when it ends).
struct Lane<'c> {
    id: u64,
    session: Arc<Session>,
    caches: KvCaches,
    decoding: Decoding<'static, 'c>,
}

/// The callbacks of a running batch.
pub struct BatchIo<'a> {
    /// Called before each forward with the number of requests running; returns the new
    /// requests to admit, each with the caller's id for it. A batch with nothing running
    /// and nothing admitted returns.
    pub admit: &'a mut dyn FnMut(usize) -> Vec<(u64, BatchRequest)>,
    /// Request `id`'s emitted tokens; returning false ends it with
    /// `FinishReason::Cancelled`.
    pub on_tokens: &'a mut dyn FnMut(u64, &[u32]) -> bool,
    /// Request `id` ended: its completion, or its error.
    pub on_done: &'a mut dyn FnMut(u64, Result<Completion>),
}

impl Engine {
    /// Generate for every request at once; returns one result per request, in order.
    /// `on_tokens(i, tokens)` gets request i's emitted tokens (returning false stops that
    /// request with `FinishReason::Cancelled`); `cancel` stops them all. The sessions must
    /// be distinct and this engine's.
    pub fn generate_batch(
        &self,
        requests: Vec<BatchRequest>,
        on_tokens: &mut dyn FnMut(usize, &[u32]) -> bool,
        cancel: &AtomicBool,
    ) -> Result<Vec<Result<Completion>>> {
        for (i, r) in requests.iter().enumerate() {
            self.check_session(&r.session)?;
            if requests[..i].iter().any(|o| o.session.id == r.session.id) {
                return Err(Error::invalid(
                    "sessions",
                    "a batch runs each session once; give each request its own session",
                ));
            }
        }
        let n = requests.len();
        let mut queue = Some(requests);
        let mut results: Vec<Option<Result<Completion>>> = (0..n).map(|_| None).collect();
        self.run_batch(
            BatchIo {
                admit: &mut |_| {
                    queue
                        .take()
                        .map(|q| (0u64..).zip(q).collect())
                        .unwrap_or_default()
                },
                on_tokens: &mut |id, t| on_tokens(id as usize, t),
                on_done: &mut |id, r| results[id as usize] = Some(r),
            },
            cancel,
        )?;
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::Internal("a batch lane never ended".into()))))
            .collect())
    }

    /// Run a continuous batch: admit requests through `io.admit`, decode every running one
    /// a cycle per shared forward, report tokens and completions as they come, and return
    /// once nothing runs and nothing is admitted. `cancel` ends every running request with
    /// `Error::Cancelled`. A request whose session is not this engine's, or is already
    /// running in the batch, ends at once with an error. The model is held for the whole
    /// run (other generations wait), each session only while it is admitted or put back.
    pub fn run_batch(&self, io: BatchIo<'_>, cancel: &AtomicBool) -> Result<()> {
        let BatchIo {
            admit,
            on_tokens,
            on_done,
        } = io;
        let generating = self.lock_generating()?;
        let model = &*self.model;
        self.store.reset_stats();
        let epoch = Instant::now();
        let clock = move || epoch.elapsed().as_secs_f64();
        let mut lanes: Vec<Lane<'_>> = Vec::new();
        loop {
            if !cancel.load(Ordering::Relaxed) {
                for (id, request) in admit(lanes.len()) {
                    if let Some(lane) = self.admit_lane(
                        model, id, request, &clock, &lanes, on_tokens, on_done, cancel,
                    ) {
                        lanes.push(lane);
                    }
                }
            }
            if lanes.is_empty() {
                break;
            }
            if cancel.load(Ordering::Relaxed) {
                for lane in lanes.drain(..) {
                    self.end_lane(model, lane, Err(Error::Cancelled), on_done);
                }
                break;
            }
            // Each lane drafts on its own caches.
            let mut i = 0;
            while i < lanes.len() {
                let lane = &mut lanes[i];
                let planned = lane
                    .decoding
                    .plan(&mut Sequence::new(model, &mut lane.caches), cancel);
                match planned {
                    Ok(None) => i += 1,
                    Ok(Some(finish)) => {
                        let lane = lanes.remove(i);
                        self.end_lane(model, lane, Ok(finish), on_done);
                    }
                    Err(e) => {
                        let lane = lanes.remove(i);
                        self.end_lane(model, lane, Err(e), on_done);
                    }
                }
            }
            if lanes.is_empty() {
                continue;
            }
            // One forward verifies every lane's rows.
            for lane in lanes.iter_mut() {
                lane.decoding.restart_verify_clock();
            }
            let outputs = {
                let mut seqs: Vec<SeqRows<'_>> = lanes
                    .iter_mut()
                    .map(|l| SeqRows {
                        caches: &mut l.caches,
                        tokens: l.decoding.feed(),
                        all_logits: true,
                    })
                    .collect();
                model.forward(&mut seqs)
            };
            let outputs = match outputs {
                Ok(o) => o,
                Err(e) => {
                    let e = explain_non_finite(e, model.container());
                    for lane in lanes.drain(..) {
                        let err = Error::Internal(format!("a batched forward failed: {e}"));
                        self.end_lane(model, lane, Err(err), on_done);
                    }
                    continue;
                }
            };
            let mut ended = Vec::new();
            for (k, (lane, f)) in lanes.iter_mut().zip(outputs).enumerate() {
                let out = StepOutput {
                    logits: f.logits,
                    hidden: f.carried,
                };
                let id = lane.id;
                let verified = lane.decoding.verified(
                    &mut Sequence::new(model, &mut lane.caches),
                    &out,
                    &mut |t| on_tokens(id, t),
                );
                match verified {
                    Ok(None) => {}
                    Ok(Some(finish)) => ended.push((k, Ok(finish))),
                    Err(e) => ended.push((k, Err(e))),
                }
            }
            for (k, finish) in ended.into_iter().rev() {
                let lane = lanes.remove(k);
                self.end_lane(model, lane, finish, on_done);
            }
        }
        drop(generating);
        Ok(())
    }

    /// Take a request into the batch: its session's caches out of the session, prefix
    /// reuse and its prefill (alone), the first token emitted. Returns the lane, or `None`
    /// when the request already ended (reported through `on_done`).
    #[allow(clippy::too_many_arguments)]
    fn admit_lane<'c>(
        &self,
        model: &Model,
        id: u64,
        request: BatchRequest,
        clock: &'c dyn Fn() -> f64,
        lanes: &[Lane<'_>],
        on_tokens: &mut dyn FnMut(u64, &[u32]) -> bool,
        on_done: &mut dyn FnMut(u64, Result<Completion>),
        cancel: &AtomicBool,
    ) -> Option<Lane<'c>> {
        let BatchRequest {
            session,
            prompt,
            options,
        } = request;
        if let Err(e) = self.check_session(&session) {
            on_done(id, Err(e));
            return None;
        }
        if lanes.iter().any(|l| l.session.id == session.id) {
            on_done(
                id,
                Err(Error::invalid(
                    "session",
                    "is already generating in this batch; give each request its own session",
                )),
            );
            return None;
        }
        let opts = self.capped(&options);
        let (mut caches, previous) = {
            let mut st = match session.lock() {
                Ok(st) => st,
                Err(e) => {
                    on_done(id, Err(e));
                    return None;
                }
            };
            self.restore(&session, &mut st);
            let caches = std::mem::replace(&mut st.caches, self.empty_caches.clone());
            (caches, std::mem::take(&mut st.cache))
        };
        let mut seq = Sequence::new(model, &mut caches);
        let started = Decoding::start(&mut seq, previous, &prompt, &opts, clock);
        let mut decoding = match started {
            Ok(d) => d,
            Err(e) => {
                // The caches are as they were, but nothing is known of them any more.
                if let Ok(mut st) = session.lock() {
                    st.caches = caches;
                    st.cache.clear();
                }
                on_done(id, Err(e));
                return None;
            }
        };
        let prefilled = decoding.prefill(&mut seq, &mut |t| on_tokens(id, t), cancel);
        let lane = Lane {
            id,
            session,
            caches,
            decoding,
        };
        match prefilled {
            Ok(None) => Some(lane),
            Ok(Some(finish)) => {
                self.end_lane(model, lane, Ok(finish), on_done);
                None
            }
            Err(e) => {
                self.end_lane(model, lane, Err(e), on_done);
                None
            }
        }
    }

    /// Settle a lane, put its caches (and what they hold) back into its session, and report
    /// its completion.
    fn end_lane(
        &self,
        model: &Model,
        lane: Lane<'_>,
        finish: Result<FinishReason>,
        on_done: &mut dyn FnMut(u64, Result<Completion>),
    ) {
        let Lane {
            id,
            session,
            mut caches,
            decoding,
        } = lane;
        let ended = decoding.end(&mut Sequence::new(model, &mut caches), finish);
        let result = match session.lock() {
            Ok(mut st) => {
                st.caches = caches;
                st.last_used = self.tick.fetch_add(1, Ordering::Relaxed) + 1;
                match ended {
                    Ok((generation, state)) => {
                        st.cache = state;
                        Ok(Completion {
                            stats: GenerationStats::new(&generation.stats, &self.store.stats()),
                            tokens: generation.tokens,
                            finish: generation.finish,
                            logprobs: generation.logprobs,
                        })
                    }
                    Err(e) => {
                        st.cache.clear();
                        Err(explain_non_finite(e, model.container()))
                    }
                }
            }
            Err(e) => Err(e),
        };
        // The routing history teaches the pinned set (see `generate`).
        let _ = self.store.save_usage();
        self.enforce_idle_budget(&session);
        on_done(id, result);
    }
}
