//! One forward over a batch of sequences, for the main model ([`Model::forward`],
//! [`Model::prefill`]) and for the MTP head ([`Model::mtp_forward`]). Each sequence brings
//! its own caches and rows; attention runs per sequence on its own caches, and every
//! feed-forward runs over all the batch's rows at once, so an expert that any row routes to
//! is read once for all of them. A single generation is a batch of one.
//!
//! Every per-row computation is independent of the other rows (S-invariance of the exact
//! kernels; the int8 prefill arithmetic rounds each row's activations on their own), so a
//! sequence's result is the one it gets alone. On error every sequence's caches are left
//! as they were: no half-written rows.

use crate::carried::Carried;
use crate::error::{Error, Result};
use crate::model::attention::LayerKv;
use crate::model::caches::KvCaches;
use crate::model::forward::Model;
use crate::model::indexer::Selection;
use crate::model::layer::Layer;
use crate::model::linear;
use crate::model::moe::{ExpertProvider, Routing};
use crate::model::norm::{rmsnorm, rmsnorm_inplace};
use crate::model::remote::WithRemote;
use crate::model::routing_sink::{ForwardKind, RoutedRows};
use crate::quant::kernels::int8act::PREFILL_MIN_ROWS;

/// One sequence's rows in a main-model forward: `tokens` at positions `caches.len()..`,
/// attending to `caches`, which get their rows.
pub struct SeqRows<'a> {
    pub caches: &'a mut KvCaches,
    pub tokens: &'a [u32],
    /// Logits of every row (a verify, prompt log-probabilities) or of the last only (a
    /// prefill: spares the LM head every other row, ~1.9 GFLOP per row at GLM-5 size).
    pub all_logits: bool,
}

/// One sequence's rows in an MTP-head forward: row j takes `tokens[j]` and row j of
/// `carried` (`model.norm(h)` of the main model's hidden at the previous position, or the
/// head's own previous output when chaining), at MTP positions `caches.mtp_len()..`.
pub struct MtpRows<'a> {
    pub caches: &'a mut KvCaches,
    pub tokens: &'a [u32],
    pub carried: &'a Carried,
    /// As [`SeqRows::all_logits`] (absorbing rows into the MTP cache reads only the last).
    pub all_logits: bool,
}

/// One sequence's result of a main-model forward.
#[derive(Debug, Clone, Default)]
pub struct Forward {
    /// [rows, vocab]: every row, or only the last when asked.
    pub logits: Vec<f32>,
    /// [s, hidden]: the residual stream after the last layer, *before* `model.norm`.
    pub pre_norm_hidden: Vec<f32>,
    /// [s, hidden]: `model.norm` of every row, the state the MTP head carries.
    pub carried: Carried,
    /// (layer, selection) of every DSA full layer, when [`Model::set_trace_selections`] is on
    /// (tests and debugging; empty otherwise).
    pub selections: Vec<(usize, Selection)>,
}

/// One sequence's result of an MTP-head forward.
#[derive(Debug, Clone, Default)]
pub struct MtpForward {
    /// [rows, vocab]: every row, or only the last when asked.
    pub logits: Vec<f32>,
    /// [s, hidden]: the MTP head's output *after* its `shared_head.norm`: what the next
    /// draft step carries (and what the head computed its logits from).
    pub post_norm_hidden: Carried,
    /// (layer, selection) of the MTP layer's indexer, when tracing (see [`Forward`]).
    pub selections: Vec<(usize, Selection)>,
}

/// One sequence's traced DSA selections: (layer, selection).
type Traced = Vec<(usize, Selection)>;

/// Every row's routing in one MoE layer, over the batch's rows.
type LayerRouting = Vec<Routing>;

/// One layer's pass: each sequence's DSA selection (on a full layer) and, on a MoE layer,
/// every row's routing.
type LayerPassed = (Vec<Option<Selection>>, Option<LayerRouting>);

/// Where one sequence's rows sit in a batch: rows `at..at + rows` of the batch, positions
/// `start..` of its caches.
#[derive(Clone, Copy)]
struct Span {
    at: usize,
    rows: usize,
    start: usize,
    all_logits: bool,
}

impl Span {
    /// The rows the LM head reads: every row, or the last.
    fn head_rows(&self) -> std::ops::Range<usize> {
        let first = if self.all_logits {
            self.at
        } else {
            self.at + self.rows - 1
        };
        first..self.at + self.rows
    }
}

/// Lay out a batch: every sequence's span, in order.
fn spans<'a>(rows: impl Iterator<Item = (usize, usize, bool)> + 'a) -> Vec<Span> {
    let mut at = 0;
    rows.map(|(n, start, all_logits)| {
        let span = Span {
            at,
            rows: n,
            start,
            all_logits,
        };
        at += n;
        span
    })
    .collect()
}

impl Model {
    /// One forward over every sequence of `seqs` (decode steps, verifies) in the decode
    /// arithmetic. Returns each sequence's [`Forward`], in order.
    pub fn forward(&self, seqs: &mut [SeqRows<'_>]) -> Result<Vec<Forward>> {
        let mut all: Vec<&mut SeqRows<'_>> = seqs.iter_mut().collect();
        self.on_pool(|| {
            linear::with_arithmetic(self.decode_arithmetic, || {
                self.run(&mut all, ForwardKind::Decode)
            })
        })
    }

    /// [`forward`](Self::forward) for the rows of prompts. A [row-invariant](Self::row_invariant)
    /// model runs them all in one forward in its one arithmetic, as `forward` would. Otherwise
    /// the sequences of at least [`PREFILL_MIN_ROWS`] rows run in the prefill arithmetic
    /// ([`ModelOptions::prefill_arithmetic`](super::ModelOptions::prefill_arithmetic)), with the
    /// attention's form chosen by their row count, in one forward, and the others in the
    /// decode arithmetic in a second.
    pub fn prefill(&self, seqs: &mut [SeqRows<'_>]) -> Result<Vec<Forward>> {
        if self.row_invariant() {
            let mut all: Vec<&mut SeqRows<'_>> = seqs.iter_mut().collect();
            return self.on_pool(|| {
                linear::with_arithmetic(self.decode_arithmetic, || {
                    self.run(&mut all, ForwardKind::Prompt)
                })
            });
        }
        let long: Vec<bool> = seqs
            .iter()
            .map(|s| s.tokens.len() >= PREFILL_MIN_ROWS)
            .collect();
        let mut out: Vec<Option<Forward>> = vec![None; seqs.len()];
        for (in_group, arith) in [
            (true, self.prefill_arithmetic),
            (false, self.decode_arithmetic),
        ] {
            let members: Vec<usize> = (0..seqs.len()).filter(|&i| long[i] == in_group).collect();
            if members.is_empty() {
                continue;
            }
            let done = {
                let mut group: Vec<&mut SeqRows<'_>> = seqs
                    .iter_mut()
                    .zip(&long)
                    .filter(|(_, &l)| l == in_group)
                    .map(|(s, _)| s)
                    .collect();
                self.on_pool(|| {
                    linear::with_arithmetic(arith, || {
                        linear::with_row_dependent_attention(|| {
                            self.run(&mut group, ForwardKind::Prompt)
                        })
                    })
                })
            };
            match done {
                Ok(done) => {
                    for (i, f) in members.into_iter().zip(done) {
                        out[i] = Some(f);
                    }
                }
                Err(e) => {
                    // The first group's rows were kept: take them back too.
                    for (s, f) in seqs.iter_mut().zip(&out) {
                        if f.is_some() {
                            let keep = s.caches.len() - s.tokens.len();
                            s.caches.truncate_main(keep);
                        }
                    }
                    return Err(e);
                }
            }
        }
        out.into_iter()
            .map(|f| f.ok_or_else(|| Error::Internal("a prefill row group was lost".into())))
            .collect()
    }

    /// The forward of `seqs` in the caller's arithmetic, on the compute pool; a routing
    /// observer is told of it as a forward of `kind`.
    fn run(&self, seqs: &mut [&mut SeqRows<'_>], kind: ForwardKind) -> Result<Vec<Forward>> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        for seq in seqs.iter() {
            self.check_caches(seq.caches)?;
            self.check_tokens(seq.tokens, seq.caches.len())?;
        }
        let spans = spans(
            seqs.iter()
                .map(|s| (s.tokens.len(), s.caches.len(), s.all_logits)),
        );
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let mut x = self.embed(&tokens);
        let sink = self.routing_sink();
        let (traced, routed) = match self.layers_pass(&mut x, &spans, seqs, sink.is_some()) {
            Ok(t) => t,
            Err(e) => {
                for (seq, span) in seqs.iter_mut().zip(&spans) {
                    seq.caches.truncate_main(span.start);
                }
                return Err(e);
            }
        };
        let xn = rmsnorm(&x, &self.norm, eps);
        let logits = self.head_over(&xn, &spans)?;
        if let Some(sink) = sink {
            let ids = seqs.iter().map(|s| s.caches.id());
            sink.forward(kind, &routed_rows(&spans, ids, &routed));
        }
        Ok(spans
            .iter()
            .zip(logits)
            .zip(traced)
            .map(|((span, logits), selections)| {
                let rows = span.at * h..(span.at + span.rows) * h;
                Forward {
                    logits,
                    pre_norm_hidden: x[rows.clone()].to_vec(),
                    carried: Carried::new(xn[rows].to_vec(), h),
                    selections,
                }
            })
            .collect())
    }

    /// Every decoder layer over the batch's rows `x`; returns each sequence's traced
    /// selections (empty unless tracing) and, with `keep_routing`, every MoE layer's
    /// routing of every row.
    fn layers_pass(
        &self,
        x: &mut [f32],
        spans: &[Span],
        seqs: &mut [&mut SeqRows<'_>],
        keep_routing: bool,
    ) -> Result<(Vec<Traced>, Vec<LayerRouting>)> {
        let trace = self.tracing_selections();
        let mut traced = vec![Vec::new(); seqs.len()];
        let mut routed = Vec::new();
        // Each sequence's latest DSA full-layer selection, which shared layers reuse.
        let mut shared: Vec<Option<Selection>> = vec![None; seqs.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            self.experts.begin_layer(i);
            let next = match self.layers.get(i + 1) {
                Some(next) if self.prefetch_top_k > 0 => Some((i + 1, next)),
                _ => None,
            };
            let mut kvs: Vec<&mut LayerKv> =
                seqs.iter_mut().map(|s| &mut s.caches.layers[i]).collect();
            let (selected, routing) =
                self.layer_pass(layer, next, x, spans, &mut kvs, 0, &shared)?;
            if keep_routing {
                routed.extend(routing);
            }
            for (b, sel) in selected.into_iter().enumerate() {
                if let Some(sel) = sel {
                    if trace {
                        traced[b].push((i, sel.clone()));
                    }
                    shared[b] = Some(sel);
                }
            }
        }
        Ok((traced, routed))
    }

    /// One layer over a batch's rows `x`: attention per sequence, each on its own cache
    /// `kvs[b]` (rope positions `rope_offset` after the cache positions; a shared DSA layer
    /// attends to `shared[b]`), then the feed-forward over every row at once. With `next`
    /// (router lookahead on) it predicts that layer's experts from this residual plus this
    /// layer's resident feed-forward output and prefetches them, so their loads overlap
    /// this layer's routed experts; the resident output is reused, not recomputed. Returns
    /// each sequence's DSA selection (on a full layer) and, on a MoE layer, every row's
    /// routing.
    #[allow(clippy::too_many_arguments)]
    fn layer_pass(
        &self,
        layer: &Layer,
        next: Option<(usize, &Layer)>,
        x: &mut [f32],
        spans: &[Span],
        kvs: &mut [&mut LayerKv],
        rope_offset: usize,
        shared: &[Option<Selection>],
    ) -> Result<LayerPassed> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        let pool = Some(self.pool());
        let rows = x.len() / h;
        let mut selected = Vec::with_capacity(spans.len());
        for ((span, kv), shared) in spans.iter().zip(kvs.iter_mut()).zip(shared) {
            selected.push(layer.attend(
                &mut x[span.at * h..(span.at + span.rows) * h],
                span.rows,
                span.start,
                span.start + rope_offset,
                kv,
                &self.rope,
                eps,
                pool,
                shared.as_ref(),
            )?);
        }
        let remote = self.remote_experts();
        let with_remote = remote.as_deref().map(|remote| WithRemote {
            local: &*self.experts,
            remote,
        });
        let experts: &dyn ExpertProvider = match &with_remote {
            Some(w) => w,
            None => &*self.experts,
        };
        let mut resident_out = None;
        if let Some((index, next)) = next {
            let resident = layer.resident_ffn(x, rows, eps, pool)?;
            let ids = match &resident {
                Some(y) => {
                    let ahead: Vec<f32> = x.iter().zip(y).map(|(a, b)| a + b).collect();
                    next.predict(&ahead, rows, self.prefetch_top_k, eps, pool)?
                }
                None => next.predict(x, rows, self.prefetch_top_k, eps, pool)?,
            };
            if !ids.is_empty() {
                experts.prefetch(index, &ids);
            }
            resident_out = resident;
        }
        let routing = layer.feed_forward(x, rows, eps, experts, pool, resident_out)?;
        Ok((selected, routing))
    }

    /// The LM head over each span's head rows of `xn`, in one matmul; each span's logits.
    fn head_over(&self, xn: &[f32], spans: &[Span]) -> Result<Vec<Vec<f32>>> {
        let h = self.cfg.hidden_size;
        let vocab = self.cfg.vocab_size;
        let mut input = Vec::new();
        for span in spans {
            let r = span.head_rows();
            input.extend_from_slice(&xn[r.start * h..r.end * h]);
        }
        let rows = input.len() / h;
        let logits = self.head_logits(&input, rows)?;
        let mut at = 0;
        Ok(spans
            .iter()
            .map(|span| {
                let n = span.head_rows().len();
                let part = logits[at * vocab..(at + n) * vocab].to_vec();
                at += n;
                part
            })
            .collect())
    }

    /// The MTP head over every sequence of `seqs` in one forward in the decode arithmetic
    /// (drafts only propose: their arithmetic never changes the output); each appends MTP KV
    /// rows at `caches.mtp_len()..`:
    /// ```text
    /// z = MTPLayer(eh_proj · [enorm(embed(t)) ; hnorm(carried)])
    /// out = shared_head.norm(z);  logits = lm_head(out)
    /// ```
    /// Returns each sequence's logits (row j predicting the token after `tokens[j]`) and
    /// `out` of every row, the state a chained draft carries (transformers' convention: the
    /// normed output, not raw z).
    pub fn mtp_forward(&self, seqs: &mut [MtpRows<'_>]) -> Result<Vec<MtpForward>> {
        self.on_pool(|| linear::with_arithmetic(self.decode_arithmetic, || self.mtp_run(seqs)))
    }

    fn mtp_run(&self, seqs: &mut [MtpRows<'_>]) -> Result<Vec<MtpForward>> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        for seq in seqs.iter() {
            self.check_caches(seq.caches)?;
            self.check_tokens(seq.tokens, seq.caches.mtp_len())?;
        }
        let Some(mtp) = self.mtp.as_ref() else {
            return Err(Error::invalid(
                "draft",
                "this model has no MTP head (or it was disabled); use draft='ngram' or 'off'",
            ));
        };
        for seq in seqs.iter() {
            let (s, got) = (seq.tokens.len(), seq.carried.values().len());
            if got != s * h {
                return Err(Error::invalid(
                    "hidden",
                    format!("expected {s}×{h} values, got {got}"),
                ));
            }
        }
        let spans = spans(
            seqs.iter()
                .map(|s| (s.tokens.len(), s.caches.mtp_len(), s.all_logits)),
        );
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let rows = tokens.len();
        let mut e = self.embed(&tokens);
        rmsnorm_inplace(&mut e, &mtp.enorm, eps);
        let carried: Vec<f32> = seqs
            .iter()
            .flat_map(|s| s.carried.values().iter().copied())
            .collect();
        let hn = rmsnorm(&carried, &mtp.hnorm, eps);
        let mut cat = Vec::with_capacity(rows * 2 * h);
        for r in 0..rows {
            cat.extend_from_slice(&e[r * h..(r + 1) * h]);
            cat.extend_from_slice(&hn[r * h..(r + 1) * h]);
        }
        let mut z = linear::apply(&mtp.eh_proj, &cat, rows, Some(self.pool()))?;
        // MTP row p pairs h_p with token p+1 and sits at rope position p+1 (transformers).
        // The MTP layer's indexer is a full one (transformers builds the layer as index 0 of
        // its own stack): it selects among the MTP layer's own cached rows.
        let mut kvs: Vec<&mut LayerKv> = seqs.iter_mut().map(|s| &mut s.caches.mtp).collect();
        let none = vec![None; spans.len()];
        let layer = self.layer_pass(&mtp.layer, None, &mut z, &spans, &mut kvs, 1, &none);
        let (selected, routing) = match layer {
            Ok(done) => done,
            Err(err) => {
                for (kv, span) in kvs.iter_mut().zip(&spans) {
                    kv.truncate(span.start);
                }
                return Err(err);
            }
        };
        let out = rmsnorm(&z, &mtp.shared_head_norm, eps);
        let logits = self.head_over(&out, &spans)?;
        if let Some(sink) = self.routing_sink() {
            let ids = seqs.iter().map(|s| s.caches.id());
            let routed: Vec<Vec<Routing>> = routing.into_iter().collect();
            sink.forward(ForwardKind::Mtp, &routed_rows(&spans, ids, &routed));
        }
        let trace = self.tracing_selections();
        let mtp_index = self.cfg.num_hidden_layers;
        Ok(spans
            .iter()
            .zip(logits)
            .zip(selected)
            .map(|((span, logits), sel)| MtpForward {
                logits,
                post_norm_hidden: Carried::new(
                    out[span.at * h..(span.at + span.rows) * h].to_vec(),
                    h,
                ),
                selections: match (trace, sel) {
                    (true, Some(sel)) => vec![(mtp_index, sel)],
                    _ => Vec::new(),
                },
            })
            .collect())
    }
}

/// Each sequence's rows of a forward with their routing: `routed[layer][row]` over the
/// batch's rows, cut into the sequences' spans.
fn routed_rows(
    spans: &[Span],
    sequences: impl Iterator<Item = u64>,
    routed: &[Vec<Routing>],
) -> Vec<RoutedRows> {
    spans
        .iter()
        .zip(sequences)
        .map(|(span, sequence)| RoutedRows {
            sequence,
            start: span.start,
            experts: (span.at..span.at + span.rows)
                .map(|row| {
                    routed
                        .iter()
                        .map(|layer| layer[row].ids.iter().map(|&e| e as u16).collect())
                        .collect()
                })
                .collect(),
        })
        .collect()
}
