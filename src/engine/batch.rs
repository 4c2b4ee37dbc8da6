//! Batched decode across sessions: several sessions' next tokens go through one forward
//! ([`Model::step_batch`]), so an expert that any of them routes to is read from disk once
//! for all of them. docs/architecture.md, "Batched decode", has the design and its limits.
//!
//! Each session is prefilled alone (prefix reuse included) through the decode loop, which
//! also picks its first token; the batch then decodes every session one token per forward
//! with the same sampler, history and uniform stream as the decode loop, so each session's
//! output is the one it gets alone with drafting off (greedy and seeded sampling). Batched
//! rows carry no drafts yet: speculation and batching do not combine in this version.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::{explain_non_finite, Completion, Engine, GenerationStats, Session};
use crate::decode::rng::Rng;
use crate::decode::sampling::{pick, token_logprob};
use crate::decode::{
    self, CacheState, DecodeStats, DraftSource, FinishReason, GenerateOptions, History,
    TokenLogprob,
};
use crate::{Error, Result};

/// One generation of a batch.
pub struct BatchRequest<'a> {
    pub session: &'a Session,
    pub prompt: &'a [u32],
    /// `draft` is ignored (batched rows are not drafted).
    pub options: GenerateOptions,
}

/// A request's state while the batch decodes.
struct Lane {
    ctx: Vec<u32>,
    prompt_len: usize,
    rng: Rng,
    history: History,
    logprobs: Vec<TokenLogprob>,
    stats: DecodeStats,
    finish: Option<FinishReason>,
    failed: Option<Error>,
}

impl Engine {
    /// Generate for every request at once; returns one result per request, in order.
    /// `on_tokens(i, tokens)` gets request i's emitted tokens (returning false stops that
    /// request with `FinishReason::Cancelled`); `cancel` stops them all. The sessions must
    /// be distinct and this engine's.
    pub fn generate_batch(
        &self,
        requests: &[BatchRequest<'_>],
        on_tokens: &mut dyn FnMut(usize, &[u32]) -> bool,
        cancel: &AtomicBool,
    ) -> Result<Vec<Result<Completion>>> {
        for (i, r) in requests.iter().enumerate() {
            self.check_session(r.session)?;
            if requests[..i].iter().any(|o| o.session.id == r.session.id) {
                return Err(Error::invalid(
                    "sessions",
                    "a batch runs each session once; give each request its own session",
                ));
            }
        }
        let mut model = self.lock_model()?;
        let mut states = Vec::with_capacity(requests.len());
        for r in requests {
            let mut st = r.session.lock()?;
            self.restore(r.session, &mut st, &model);
            states.push(st);
        }
        self.store.reset_stats();
        let container = model.container().clone();
        let mut lanes = Vec::with_capacity(requests.len());
        // Prefill each alone: prefix reuse, the first token, its logprob.
        for (i, (r, st)) in requests.iter().zip(states.iter_mut()).enumerate() {
            let mut opts = r.options.clone();
            opts.max_context = Some(
                opts.max_context
                    .map_or(self.info.max_context, |m| m.min(self.info.max_context)),
            );
            let seed = opts.sampling.seed.unwrap_or_else(Rng::entropy_seed);
            opts.sampling.seed = Some(seed);
            let mut first = opts.clone();
            first.max_new_tokens = 1;
            first.draft = DraftSource::Off;
            model.swap_caches(&mut st.caches);
            let out = decode::generate_after(
                &mut *model,
                &mut st.cache,
                r.prompt,
                &first,
                &mut |t| on_tokens(i, t),
                cancel,
            );
            model.swap_caches(&mut st.caches);
            let mut rng = Rng::from_seed(seed);
            rng.next_f64(); // the first token's uniform
            let mut history = History::new(r.prompt, &opts.sampling, &opts.stop_tokens);
            let mut lane = Lane {
                ctx: r.prompt.to_vec(),
                prompt_len: r.prompt.len(),
                rng,
                history: History::default(),
                logprobs: Vec::new(),
                stats: DecodeStats::default(),
                finish: None,
                failed: None,
            };
            match out {
                Ok(g) => {
                    for &t in &g.tokens {
                        history.push(t, &opts.sampling);
                    }
                    lane.ctx.extend(&g.tokens);
                    lane.logprobs = g.logprobs;
                    lane.stats = g.stats;
                    lane.finish = match g.finish {
                        FinishReason::Length if opts.max_new_tokens > 1 => None,
                        other => Some(other),
                    };
                }
                Err(e) => lane.failed = Some(explain_non_finite(e, &container)),
            }
            lane.history = history;
            lanes.push((lane, opts));
        }
        // Decode every live lane one token per batched forward.
        let mut failure: Option<Error> = None;
        loop {
            for (lane, opts) in lanes.iter_mut() {
                if lane.finish.is_none() && lane.failed.is_none() {
                    if let Some(mc) = opts.max_context {
                        if lane.ctx.len() >= mc {
                            lane.finish = Some(FinishReason::ContextFull);
                        }
                    }
                }
            }
            let live: Vec<usize> = (0..lanes.len())
                .filter(|&i| lanes[i].0.finish.is_none() && lanes[i].0.failed.is_none())
                .collect();
            if live.is_empty() {
                break;
            }
            if cancel.load(Ordering::Relaxed) {
                failure = Some(Error::Cancelled);
                break;
            }
            let feeds: Vec<[u32; 1]> = live
                .iter()
                .map(|&i| [lanes[i].0.ctx[lanes[i].0.ctx.len() - 1]])
                .collect();
            let mut seqs: Vec<(&mut crate::model::KvCaches, &[u32])> =
                Vec::with_capacity(live.len());
            for (st, feed) in states
                .iter_mut()
                .enumerate()
                .filter(|(j, _)| live.contains(j))
                .map(|(_, st)| st)
                .zip(&feeds)
            {
                seqs.push((&mut st.caches, &feed[..]));
            }
            let t = Instant::now();
            let outputs = match model.step_batch(&mut seqs) {
                Ok(o) => o,
                Err(e) => {
                    failure = Some(explain_non_finite(e, &container));
                    break;
                }
            };
            drop(seqs);
            let secs = t.elapsed().as_secs_f64();
            for (k, &i) in live.iter().enumerate() {
                let (lane, opts) = &mut lanes[i];
                lane.stats.forwards += 1;
                lane.stats.decode_forwards += 1;
                lane.stats.verify_secs += secs;
                if let Some(plain) = lane.stats.depth_histogram.first_mut() {
                    *plain += 1;
                }
                let row = &outputs[k].0;
                let processed = lane.history.process(row, &opts.sampling, &[]);
                let tok = match pick(&processed, &opts.sampling, lane.rng.next_f64()) {
                    Ok(t) => t,
                    Err(e) => {
                        lane.failed = Some(explain_non_finite(e, &container));
                        continue;
                    }
                };
                if let Some(top) = opts.logprobs {
                    match token_logprob(&processed, &opts.sampling, tok, top) {
                        Ok(lp) => lane.logprobs.push(lp),
                        Err(e) => lane.failed = Some(e),
                    }
                }
                lane.ctx.push(tok);
                lane.history.push(tok, &opts.sampling);
                if opts.stop_tokens.contains(&tok) {
                    lane.finish = Some(FinishReason::Stop);
                } else if lane.ctx.len() - lane.prompt_len >= opts.max_new_tokens {
                    lane.finish = Some(FinishReason::Length);
                }
                if !on_tokens(i, &[tok]) && lane.finish.is_none() {
                    lane.finish = Some(FinishReason::Cancelled);
                }
            }
        }
        // Settle every session: its caches hold every context token but the last.
        let store = self.store.stats();
        let mut results = Vec::with_capacity(lanes.len());
        for ((lane, _), st) in lanes.into_iter().zip(states.iter_mut()) {
            let keep = if lane.ctx.len() > lane.prompt_len {
                lane.ctx.len() - 1
            } else {
                0
            };
            st.caches.truncate(keep);
            st.cache = CacheState::from_parts(lane.ctx[..keep].to_vec(), Vec::new());
            st.last_used = self.tick.fetch_add(1, Ordering::Relaxed) + 1;
            let Lane {
                ctx,
                prompt_len,
                logprobs,
                mut stats,
                finish,
                failed,
                ..
            } = lane;
            results.push(match (failed, finish, &failure) {
                (Some(e), _, _) => Err(e),
                (None, Some(finish), _) => {
                    // Its time: its prefill, then the batched forwards it took part in.
                    let secs = stats.prefill_secs + stats.verify_secs;
                    stats.finish(ctx.len() - prompt_len, secs);
                    Ok(Completion {
                        tokens: ctx[prompt_len..].to_vec(),
                        finish,
                        stats: GenerationStats::new(&stats, &store),
                        logprobs,
                    })
                }
                (None, None, Some(Error::Cancelled)) => Err(Error::Cancelled),
                (None, None, Some(e)) => {
                    Err(Error::Internal(format!("batched forward failed: {e}")))
                }
                (None, None, None) => Err(Error::Internal("a batch lane never finished".into())),
            });
        }
        drop(states);
        let _ = self.store.save_usage();
        if let Some(first) = requests.first() {
            self.enforce_idle_budget(first.session);
        }
        drop(model);
        Ok(results)
    }
}
