//! Test doubles: a small deterministic "language model" implementing [`Target`], with an MTP
//! head that knows the model and is wrong on purpose some of the time, and forced drafters.
//!
//! The mock's logits at position p are a fixed random table row indexed by (t_{p−1}, t_p).
//! Its hidden state encodes that pair, so its MTP layer can predict exactly when it is given
//! the true (t_{p+1}, h_p) pairs: the mock therefore checks the MTP bookkeeping strictly and
//! returns an error on any row that breaks it.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::AtomicBool;

use super::rng::Rng;
use super::sampling::argmax;
use super::{ByteCosts, Drafter, StepOutput, Target};
use crate::carried::Carried;
use crate::{Error, Result};

/// Hidden width of the mock: [prev token, token, position, kind] with kind 1 = main, 2 = MTP.
pub const H: usize = 4;
const MAIN: f32 = 1.0;
const MTP: f32 = 2.0;

#[derive(Clone, Debug)]
pub struct MockConfig {
    pub vocab: usize,
    pub seed: u64,
    /// Logits are uniform in [−scale, scale].
    pub logit_scale: f32,
    pub has_mtp: bool,
    /// Probability that an MTP draft is replaced by a wrong token (decided by a hash).
    pub mtp_error: f64,
    /// Virtual seconds a `step_all` over S rows advances the mock's clock: base + per_row · S.
    pub cost_base: f64,
    pub cost_per_row: f64,
    /// Virtual seconds an `mtp_step` advances the clock per row.
    pub mtp_cost_per_row: f64,
    /// What the mock reports as `Target::mtp_draft_share`.
    pub mtp_draft_share: f64,
    /// What the mock reports as `Target::byte_costs` (free by default: all in RAM).
    pub byte_costs: ByteCosts,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            vocab: 16,
            seed: 1,
            logit_scale: 3.0,
            has_mtp: true,
            mtp_error: 0.2,
            cost_base: 0.0,
            cost_per_row: 0.0,
            mtp_cost_per_row: 0.0,
            mtp_draft_share: 0.0,
            byte_costs: ByteCosts::FREE,
        }
    }
}

pub struct MockTarget {
    pub cfg: MockConfig,
    /// [(V + 1) · V, V]: logits after (prev, cur); prev = V means "no previous token".
    table: Vec<f32>,
    /// Tokens and hidden states of the main KV rows.
    kv_tokens: Vec<u32>,
    kv_hidden: Vec<[f32; H]>,
    /// MTP KV rows: (token, hidden).
    mtp_kv: Vec<(u32, [f32; H])>,
    pub step_calls: usize,
    pub mtp_calls: usize,
    /// Virtual time, advanced by `step_all` (see [`MockTarget::clock`]).
    time: Rc<Cell<f64>>,
}

fn hash(a: u64, b: u64, c: u64, seed: u64) -> u64 {
    let mut x = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(c.wrapping_mul(0x1656_67B1_9E37_79F9))
        ^ seed;
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

impl MockTarget {
    pub fn new(cfg: MockConfig) -> Self {
        let v = cfg.vocab;
        let mut rng = Rng::from_seed(cfg.seed);
        let table = (0..(v + 1) * v * v)
            .map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * cfg.logit_scale)
            .collect();
        MockTarget {
            cfg,
            table,
            kv_tokens: Vec::new(),
            kv_hidden: Vec::new(),
            mtp_kv: Vec::new(),
            step_calls: 0,
            mtp_calls: 0,
            time: Rc::new(Cell::new(0.0)),
        }
    }

    /// A clock for `spec::run` that reads the mock's virtual time.
    pub fn clock(&self) -> impl Fn() -> f64 {
        let time = Rc::clone(&self.time);
        move || time.get()
    }

    /// Logits for the token after `cur` when it follows `prev` (`None` at position 0).
    pub fn logits(&self, prev: Option<u32>, cur: u32) -> &[f32] {
        let v = self.cfg.vocab;
        let p = prev.map_or(v, |p| p as usize);
        let row = p * v + cur as usize;
        &self.table[row * v..(row + 1) * v]
    }

    /// The MTP head's prediction of the token after `next`, which follows `cur`.
    fn mtp_predict(&self, cur: u32, next: u32, pos: usize) -> Result<u32> {
        let v = self.cfg.vocab as u64;
        let right = argmax(self.logits(Some(cur), next))?;
        let hsh = hash(u64::from(cur), u64::from(next), pos as u64, self.cfg.seed);
        let u = (hsh >> 11) as f64 / (1u64 << 53) as f64;
        if u < self.cfg.mtp_error {
            Ok(((u64::from(right) + 1 + (hsh % (v - 1))) % v) as u32)
        } else {
            Ok(right)
        }
    }

    /// The invariant `generate` promises on return; an error string otherwise.
    pub fn check_settled(
        &self,
        prompt_len: usize,
        emitted: usize,
    ) -> std::result::Result<(), String> {
        let want = if emitted == 0 {
            0
        } else {
            prompt_len + emitted - 1
        };
        if self.kv_tokens.len() != want {
            return Err(format!("main KV {} != {want}", self.kv_tokens.len()));
        }
        if self.mtp_kv.len() > want {
            return Err(format!("MTP KV {} > main KV {want}", self.mtp_kv.len()));
        }
        self.check_mtp_rows(true).map_err(|e| e.to_string())
    }

    /// MTP KV rows inside the main sequence must be true rows: (t_{q+1}, h_q). Chained rows
    /// (built on an MTP hidden) may only lie beyond it, and not at all when `settled`.
    fn check_mtp_rows(&self, settled: bool) -> Result<()> {
        for (q, (tok, hid)) in self.mtp_kv.iter().enumerate() {
            let bad = || Error::Internal(format!("mock: MTP KV row {q} is not a true row"));
            if hid[3] == MTP && !settled && q >= self.kv_hidden.len() {
                continue;
            }
            if hid[3] != MAIN || q >= self.kv_hidden.len() || *hid != self.kv_hidden[q] {
                return Err(bad());
            }
            if let Some(&t) = self.kv_tokens.get(q + 1) {
                if t != *tok {
                    return Err(bad());
                }
            }
        }
        Ok(())
    }

    fn advance_clock(&self, rows: usize) {
        let t = self.time.get() + self.cfg.cost_base + self.cfg.cost_per_row * rows as f64;
        self.time.set(t);
    }
}

/// `out` with the logits of its last row only.
fn last_row_only(mut out: StepOutput, vocab: usize) -> StepOutput {
    out.logits.drain(..out.logits.len() - vocab);
    out
}

impl Target for MockTarget {
    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    fn hidden_size(&self) -> usize {
        H
    }

    fn step_all(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        if start_pos != self.kv_tokens.len() || tokens.is_empty() {
            return Err(Error::Internal(format!(
                "mock: step_all at {start_pos} with KV {} ({} tokens)",
                self.kv_tokens.len(),
                tokens.len()
            )));
        }
        self.step_calls += 1;
        self.advance_clock(tokens.len());
        let v = self.cfg.vocab;
        let mut logits = Vec::with_capacity(tokens.len() * v);
        let mut hidden = Vec::with_capacity(tokens.len() * H);
        for &t in tokens {
            if t as usize >= v {
                return Err(Error::Internal(format!("mock: token {t} out of range")));
            }
            let p = self.kv_tokens.len();
            let prev = self.kv_tokens.last().copied();
            logits.extend_from_slice(self.logits(prev, t));
            let hid = [prev.map_or(-1.0, |x| x as f32), t as f32, p as f32, MAIN];
            hidden.extend_from_slice(&hid);
            self.kv_tokens.push(t);
            self.kv_hidden.push(hid);
        }
        Ok(StepOutput {
            logits,
            hidden: Carried::for_test(hidden, H),
        })
    }

    fn kv_len(&self) -> usize {
        self.kv_tokens.len()
    }

    fn truncate(&mut self, len: usize) {
        self.kv_tokens.truncate(len);
        self.kv_hidden.truncate(len);
    }

    fn has_mtp(&self) -> bool {
        self.cfg.has_mtp
    }

    /// The last row's logits only, as the real model returns them (exercises the callers'
    /// handling of the short form).
    fn step_last(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        let out = self.step_all(tokens, start_pos);
        out.map(|o| last_row_only(o, self.cfg.vocab))
    }
    fn mtp_step_last(
        &mut self,
        tokens: &[u32],
        hidden: &Carried,
        start_pos: usize,
    ) -> Result<StepOutput> {
        let out = self.mtp_step(tokens, hidden, start_pos);
        out.map(|o| last_row_only(o, self.cfg.vocab))
    }
    fn mtp_step(
        &mut self,
        tokens: &[u32],
        hidden: &Carried,
        start_pos: usize,
    ) -> Result<StepOutput> {
        let hidden = hidden.values();
        if !self.cfg.has_mtp {
            return Err(Error::Internal("mock: mtp_step without an MTP head".into()));
        }
        if start_pos != self.mtp_kv.len() || hidden.len() != tokens.len() * H || tokens.is_empty() {
            return Err(Error::Internal(format!(
                "mock: mtp_step at {start_pos} with MTP KV {} ({} tokens, {} hidden)",
                self.mtp_kv.len(),
                tokens.len(),
                hidden.len()
            )));
        }
        // Rows already there must still be true (a main rollback must not strand them).
        self.check_mtp_rows(false)?;
        self.mtp_calls += 1;
        let t = self.time.get() + self.cfg.mtp_cost_per_row * tokens.len() as f64;
        self.time.set(t);
        let v = self.cfg.vocab;
        let mut out_logits = Vec::with_capacity(tokens.len() * v);
        let mut out_hidden = Vec::with_capacity(tokens.len() * H);
        for (j, (&t, hrow)) in tokens.iter().zip(hidden.chunks_exact(H)).enumerate() {
            let q = start_pos + j;
            let hid: [f32; H] = [hrow[0], hrow[1], hrow[2], hrow[3]];
            if q < self.kv_hidden.len() {
                // A row inside the main sequence must pair the true hidden h_q with t_{q+1}.
                let true_tok = self.kv_tokens.get(q + 1).copied();
                if hid != self.kv_hidden[q] || true_tok.is_some_and(|x| x != t) {
                    return Err(Error::Internal(format!(
                        "mock: MTP row {q} does not pair (t_{{q+1}}, h_q): got token {t}, hidden {hid:?}"
                    )));
                }
            } else if hid[3] != MTP || hid[2] as usize != q {
                // Beyond the main sequence only chained rows may appear, each fed the MTP
                // hidden of the row just before it.
                return Err(Error::Internal(format!(
                    "mock: MTP row {q} beyond the main KV got hidden {hid:?}"
                )));
            }
            let cur = hid[1] as u32;
            let pred = self.mtp_predict(cur, t, q)?;
            let mut logits = vec![0.0f32; v];
            logits[pred as usize] = 1.0;
            out_logits.extend_from_slice(&logits);
            let z = [cur as f32, t as f32, q as f32 + 1.0, MTP];
            out_hidden.extend_from_slice(&z);
            self.mtp_kv.push((t, hid));
        }
        Ok(StepOutput {
            logits: out_logits,
            hidden: Carried::for_test(out_hidden, H),
        })
    }

    fn mtp_kv_len(&self) -> usize {
        self.mtp_kv.len()
    }

    fn mtp_truncate(&mut self, len: usize) {
        self.mtp_kv.truncate(len);
    }

    fn mtp_draft_share(&self) -> f64 {
        self.cfg.mtp_draft_share
    }

    fn byte_costs(&self) -> ByteCosts {
        self.cfg.byte_costs
    }
}

/// Forced drafters for the losslessness tests. They read the plain-decoding reference
/// continuation `reference` (prompt + output) to know what the target will pick.
pub enum Forced {
    /// Always the target's own next tokens: every draft is accepted.
    AcceptAll,
    /// A token the target never picks at that position: every draft is rejected.
    RejectAll,
    /// Right except at draft position k (0-based).
    WrongAt(usize),
    /// Arbitrary tokens from a seeded stream.
    Random(Rng),
}

pub struct ForcedDrafter {
    pub reference: Vec<u32>,
    pub vocab: u32,
    pub mode: Forced,
}

impl Drafter for ForcedDrafter {
    fn propose(
        &mut self,
        _target: &mut dyn Target,
        context: &[u32],
        max: usize,
        _cancel: &AtomicBool,
    ) -> Result<Vec<u32>> {
        let l = context.len();
        if self.reference.get(..l) != Some(context) {
            return Err(Error::Internal(
                "forced drafter: context left the reference".into(),
            ));
        }
        let wrong = |r: u32| (r + 1) % self.vocab;
        let mut out = Vec::new();
        for j in 0..max {
            let Some(&r) = self.reference.get(l + j) else {
                break;
            };
            out.push(match &mut self.mode {
                Forced::AcceptAll => r,
                Forced::RejectAll => wrong(r),
                Forced::WrongAt(k) if *k == j => wrong(r),
                Forced::WrongAt(_) => r,
                Forced::Random(rng) => rng.below(u64::from(self.vocab)) as u32,
            });
        }
        Ok(out)
    }
}
