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
//! [`Engine::run_batch`] is continuous: between forwards it admits new requests and hands
//! back every finished one, so a server's requests join and leave a running batch. Each
//! round runs at most two forwards: one prefill forward over the next prompt chunk of every
//! lane still in its prompt (so prompts that arrive together are prefilled together, each
//! expert read once for all of them), then one exact forward verifying every other lane's
//! rows (prefill and verify rows do not share a forward: a long prefill may run in the int8
//! arithmetic, decode never does).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{explain_non_finite, Completion, Engine, GenerationStats, Session};
use crate::decode::spec::Decoding;
use crate::decode::{Emitted, FinishReason, GenerateOptions, StepOutput};
use crate::model::{Forward, KvCaches, Model, SeqRows, Sequence};
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
    pub on_tokens: &'a mut dyn FnMut(u64, Emitted<'_>) -> bool,
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
        on_tokens: &mut dyn FnMut(usize, Emitted<'_>) -> bool,
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
                    if let Some(lane) = self.admit_lane(model, id, request, &clock, &lanes, on_done)
                    {
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
            // Lanes still in their prompt: the next chunk of each in one prefill forward.
            self.prefill_lanes(model, &mut lanes, on_tokens, on_done);
            // Lanes past it: a draft each, then one forward verifies them all.
            self.decode_lanes(model, &mut lanes, on_tokens, on_done, cancel);
        }
        drop(generating);
        Ok(())
    }

    /// Take a request into the batch: its session's caches out of the session and the
    /// reusable prefix kept (its prefill runs with the other lanes', in
    /// [`prefill_lanes`](Self::prefill_lanes)). Returns the lane, or `None` when the request
    /// already ended (reported through `on_done`).
    #[allow(clippy::too_many_arguments)]
    fn admit_lane<'c>(
        &self,
        model: &Model,
        id: u64,
        request: BatchRequest,
        clock: &'c dyn Fn() -> f64,
        lanes: &[Lane<'_>],
        on_done: &mut dyn FnMut(u64, Result<Completion>),
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
        let started = Decoding::start(
            &mut Sequence::new(model, &mut caches),
            previous,
            &prompt,
            &opts,
            clock,
        );
        match started {
            Ok(decoding) => Some(Lane {
                id,
                session,
                caches,
                decoding,
            }),
            Err(e) => {
                // The caches are as they were, but nothing is known of them any more.
                if let Ok(mut st) = session.lock() {
                    st.caches = caches;
                    st.cache.clear();
                }
                on_done(id, Err(e));
                None
            }
        }
    }

    /// One prefill forward over the next prompt chunk of every lane still in its prompt
    /// ([`Model::prefill`]: the long chunks together in the prefill arithmetic); a lane whose
    /// prompt is then done emits its first token. Lanes that end are settled.
    fn prefill_lanes(
        &self,
        model: &Model,
        lanes: &mut Vec<Lane<'_>>,
        on_tokens: &mut dyn FnMut(u64, Emitted<'_>) -> bool,
        on_done: &mut dyn FnMut(u64, Result<Completion>),
    ) {
        let outputs = {
            let mut seqs: Vec<SeqRows<'_>> = Vec::new();
            for lane in lanes.iter_mut() {
                let Lane {
                    caches, decoding, ..
                } = lane;
                if let Some(rows) = decoding.prefill_rows() {
                    debug_assert_eq!(rows.start, caches.len());
                    seqs.push(SeqRows {
                        caches,
                        tokens: rows.tokens,
                        all_logits: rows.all_logits,
                    });
                }
            }
            if seqs.is_empty() {
                return;
            }
            model.prefill(&mut seqs)
        };
        let prefilling = |l: &Lane<'_>| l.decoding.prefilling();
        self.take_outputs(model, lanes, prefilling, outputs, on_done, |lane, out| {
            let id = lane.id;
            lane.decoding.prefilled(out, &mut |t| on_tokens(id, t))
        });
    }

    /// A cycle of every lane past its prompt: each drafts on its own caches, then one exact
    /// forward verifies every lane's rows. Lanes that end are settled.
    fn decode_lanes(
        &self,
        model: &Model,
        lanes: &mut Vec<Lane<'_>>,
        on_tokens: &mut dyn FnMut(u64, Emitted<'_>) -> bool,
        on_done: &mut dyn FnMut(u64, Result<Completion>),
        cancel: &AtomicBool,
    ) {
        let mut i = 0;
        while i < lanes.len() {
            let lane = &mut lanes[i];
            if lane.decoding.prefilling() {
                i += 1;
                continue;
            }
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
        let decoding = |l: &Lane<'_>| !l.decoding.prefilling();
        let outputs = {
            let mut seqs: Vec<SeqRows<'_>> = Vec::new();
            for lane in lanes.iter_mut().filter(|l| decoding(l)) {
                lane.decoding.restart_verify_clock();
                seqs.push(SeqRows {
                    caches: &mut lane.caches,
                    tokens: lane.decoding.feed(),
                    all_logits: true,
                });
            }
            if seqs.is_empty() {
                return;
            }
            model.forward(&mut seqs)
        };
        self.take_outputs(model, lanes, decoding, outputs, on_done, |lane, out| {
            let id = lane.id;
            lane.decoding
                .verified(&mut Sequence::new(model, &mut lane.caches), out, &mut |t| {
                    on_tokens(id, t)
                })
        });
    }

    /// Hand a shared forward's `outputs` to the lanes `member` picks (in order) through
    /// `take`, and settle the lanes that end; a failed forward ends every one of them.
    fn take_outputs(
        &self,
        model: &Model,
        lanes: &mut Vec<Lane<'_>>,
        member: impl Fn(&Lane<'_>) -> bool,
        outputs: Result<Vec<Forward>>,
        on_done: &mut dyn FnMut(u64, Result<Completion>),
        mut take: impl FnMut(&mut Lane<'_>, &StepOutput) -> Result<Option<FinishReason>>,
    ) {
        let outputs = match outputs {
            Ok(o) => o,
            Err(e) => {
                let e = explain_non_finite(e, model.container());
                let mut k = 0;
                while k < lanes.len() {
                    if member(&lanes[k]) {
                        let lane = lanes.remove(k);
                        let err = Error::Internal(format!("a batched forward failed: {e}"));
                        self.end_lane(model, lane, Err(err), on_done);
                    } else {
                        k += 1;
                    }
                }
                return;
            }
        };
        let mut ended = Vec::new();
        let members = lanes.iter_mut().enumerate().filter(|(_, l)| member(l));
        for ((k, lane), f) in members.zip(outputs) {
            let out = StepOutput {
                logits: f.logits,
                hidden: f.carried,
            };
            match take(lane, &out) {
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
