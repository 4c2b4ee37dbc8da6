//! The model's weights: embeddings, decoder layers, final norm, LM head and the MTP head.
//! A `Model` holds no per-sequence state (`&self` everywhere, shareable as `Arc<Model>`):
//! each sequence's KV caches are a [`KvCaches`] its owner keeps (a session), and every
//! forward is one pass over a batch of sequences ([`Model::forward`], in `model::batch`);
//! a single generation is a batch of one ([`Sequence`](super::Sequence)).
//!
//! Per layer (activations in f32):
//! ```text
//! x += MLA(rmsnorm(x, input_layernorm))
//! h  = rmsnorm(x, post_attention_layernorm)
//! x += dense MLP(h) if the layer is dense else MoE(h)
//! logits = lm_head(rmsnorm(x, model.norm))
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::carried::Carried;
use crate::config::{ModelConfig, ModelFamily};
use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::experts::ReadPrice;
use crate::model::attention::LayerKv;
use crate::model::caches::KvCaches;
use crate::model::indexer::Indexer;
use crate::model::layer::{Layer, MtpHead};
use crate::model::linear;
use crate::model::moe::{self, ExpertProvider, ResidentExperts};
use crate::model::norm::rmsnorm;
use crate::model::remote::RemoteExperts;
use crate::model::rope::Rope;
use crate::model::routing_sink::RoutingSink;
use crate::quant::kernels::Arithmetic;
use crate::quant::pack::reference_dequantize_row;

/// Whether a model opened from `c` runs GLM's DSA sparse attention: a GLM checkpoint that
/// ships the indexers (layer 0 always has one). Without them dense MLA is the model only up
/// to index_topk keys.
pub fn uses_dsa(c: &Container) -> bool {
    let cfg = c.config();
    cfg.family == ModelFamily::GlmMoeDsa
        && cfg.index_topk.is_some()
        && Indexer::present(c, "model.layers.0")
}

/// Whether `c` ships a complete MTP head (a model opened with `load_mtp` loads it).
pub fn has_mtp_head(c: &Container) -> bool {
    c.config()
        .mtp_layer_index()
        .is_some_and(|i| MtpHead::present(c, i))
}

/// Options fixed at load time.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// Compute threads for the kernels (0 = all cores).
    pub threads: usize,
    /// Load the MTP head when the checkpoint has one.
    pub load_mtp: bool,
    /// Router-lookahead width: experts predicted per row for the next layer (0 = off).
    pub prefetch_top_k: usize,
    /// The arithmetic of decode steps, verifies and the MTP head, and of every prompt row
    /// when it equals [`prefill_arithmetic`](Self::prefill_arithmetic) (then each row's values
    /// depend on its own tokens alone, whatever the call it is in).
    pub decode_arithmetic: Arithmetic,
    /// The arithmetic of [`Model::prefill`]; when it differs from the decode arithmetic, it
    /// applies to prompt forwards of at least
    /// [`PREFILL_MIN_ROWS`](crate::quant::kernels::int8act::PREFILL_MIN_ROWS) rows and the
    /// shorter ones run in the decode arithmetic.
    pub prefill_arithmetic: Arithmetic,
    /// Routed experts per token, main and MTP layers alike: `None` = the model's own
    /// `num_experts_per_tok`; fewer (1..=k) route each token to the best of the same choice,
    /// their weights normalised as the model's own (see [`Router`](crate::model::moe::Router)).
    /// Fewer experts change the model's output; `Some(k)` is the model unchanged.
    pub experts_per_token: Option<usize>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            threads: 0,
            load_mtp: true,
            prefetch_top_k: 0,
            decode_arithmetic: Arithmetic::Exact,
            prefill_arithmetic: Arithmetic::Exact,
            experts_per_token: None,
        }
    }
}

/// A loaded model: weights only.
pub struct Model {
    pub(super) cfg: ModelConfig,
    container: Arc<Container>,
    pub(super) embed_tokens: Weight,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Vec<f32>,
    /// `None` when the embeddings are tied.
    lm_head: Option<Weight>,
    pub(super) rope: Rope,
    pub(super) mtp: Option<MtpHead>,
    pub(super) experts: Arc<dyn ExpertProvider>,
    /// Every forward runs on a thread of this pool (see [`Model::on_pool`]).
    pool: Arc<rayon::ThreadPool>,
    pub(super) prefetch_top_k: usize,
    pub(super) decode_arithmetic: Arithmetic,
    pub(super) prefill_arithmetic: Arithmetic,
    /// Routed experts per token in effect ([`ModelOptions::experts_per_token`] resolved).
    experts_per_token: usize,
    /// GLM DSA: the checkpoint's lightning indexers are in use (see `max_exact_context`).
    dsa: bool,
    trace_selections: AtomicBool,
    /// Told of every forward's routing (the engine's `trace_routing`); usually none.
    routing_sink: Mutex<Option<Arc<dyn RoutingSink>>>,
    /// Where routed experts are also computed (`model::remote`); usually none.
    remote: Mutex<Option<Arc<dyn RemoteExperts>>>,
}

impl Model {
    /// Load a model whose routed experts are all resident (small models, tests).
    pub fn load(container: Arc<Container>, opts: &ModelOptions) -> Result<Self> {
        let cfg = container.config().clone();
        let mut expert_layers: Vec<usize> = (0..cfg.num_hidden_layers)
            .filter(|&l| cfg.is_moe_layer(l))
            .collect();
        let mtp_index = cfg
            .mtp_layer_index()
            .filter(|&i| opts.load_mtp && MtpHead::present(&container, i));
        expert_layers.extend(mtp_index);
        let experts = Arc::new(ResidentExperts::load(&container, &cfg, &expert_layers)?);
        Self::load_with_experts(container, opts, experts)
    }

    /// Load the dense part and use `experts` for the routed experts.
    pub fn load_with_experts(
        container: Arc<Container>,
        opts: &ModelOptions,
        experts: Arc<dyn ExpertProvider>,
    ) -> Result<Self> {
        let cfg = container.config().clone();
        if cfg.qk_rope_head_dim > 512 || !cfg.qk_rope_head_dim.is_multiple_of(2) {
            return Err(Error::Unsupported(format!(
                "qk_rope_head_dim = {} (colibri supports even values up to 512)",
                cfg.qk_rope_head_dim
            )));
        }
        let top_k = moe::experts_per_token(opts.experts_per_token, cfg.num_experts_per_tok)?;
        let c = &*container;
        let h = cfg.hidden_size;
        let dsa = uses_dsa(c);
        let embed_tokens = linear::load(c, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Layer::load(c, &cfg, l, dsa, top_k))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings && !c.contains("lm_head.weight") {
            None
        } else {
            Some(linear::load(c, "lm_head.weight", cfg.vocab_size, h)?)
        };
        let mtp = match cfg.mtp_layer_index() {
            Some(i) if opts.load_mtp && MtpHead::present(c, i) => {
                Some(MtpHead::load(c, &cfg, i, dsa, top_k)?)
            }
            _ => None,
        };
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            opts.threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("colibri-compute-{i}"))
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the compute pool: {e}")))
            .map(Arc::new)?;
        Ok(Model {
            rope: Rope::new(&cfg),
            norm: linear::load_vector(c, "model.norm.weight", h)?,
            cfg,
            container,
            embed_tokens,
            layers,
            lm_head,
            mtp,
            experts,
            pool,
            prefetch_top_k: opts.prefetch_top_k,
            decode_arithmetic: opts.decode_arithmetic,
            prefill_arithmetic: opts.prefill_arithmetic,
            experts_per_token: top_k,
            dsa,
            trace_selections: AtomicBool::new(false),
            routing_sink: Mutex::new(None),
            remote: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn container(&self) -> &Arc<Container> {
        &self.container
    }
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
    /// Routed experts per token, main and MTP layers (the config's `num_experts_per_tok`
    /// unless [`ModelOptions::experts_per_token`] chose fewer).
    pub fn experts_per_token(&self) -> usize {
        self.experts_per_token
    }

    /// What the reads of a draft cost on this model's expert source, now (`None`: its
    /// experts are all resident).
    pub fn read_price(&self) -> Option<ReadPrice> {
        let mtp = self.mtp.as_ref().and_then(|_| self.cfg.mtp_layer_index());
        self.experts.read_price(self.experts_per_token, mtp)
    }

    /// Empty caches shaped for this model (a new sequence's).
    pub fn new_caches(&self) -> KvCaches {
        KvCaches::new(
            self.layers.iter().map(|l| l.new_kv(&self.cfg)).collect(),
            match &self.mtp {
                Some(m) => m.layer.new_kv(&self.cfg),
                None => LayerKv::new(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, 0),
            },
        )
    }

    /// Whether GLM's sparse attention (the DSA lightning indexers) is in use.
    pub fn uses_dsa(&self) -> bool {
        self.dsa
    }

    /// Return every DSA full layer's selection in [`Forward::selections`](super::Forward)
    /// (off by default: a long prefill's selections are rows × index_topk × layers
    /// positions).
    pub fn set_trace_selections(&self, on: bool) {
        self.trace_selections.store(on, Ordering::Relaxed);
    }

    pub(super) fn tracing_selections(&self) -> bool {
        self.trace_selections.load(Ordering::Relaxed)
    }

    /// Tell `sink` every forward's routing from now on (`None`: stop).
    pub fn set_routing_sink(&self, sink: Option<Arc<dyn RoutingSink>>) {
        *self.routing_sink.lock().unwrap_or_else(|e| e.into_inner()) = sink;
    }

    /// Compute routed experts on `remote` where it holds them (None: all local again).
    pub fn set_remote_experts(&self, remote: Option<Arc<dyn RemoteExperts>>) {
        *self.remote.lock().unwrap_or_else(|e| e.into_inner()) = remote;
    }

    /// The installed remote experts, if any.
    pub(super) fn remote_experts(&self) -> Option<Arc<dyn RemoteExperts>> {
        self.remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The installed routing observer, if any.
    pub(super) fn routing_sink(&self) -> Option<Arc<dyn RoutingSink>> {
        self.routing_sink
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The arithmetic of long prefills.
    pub fn prefill_arithmetic(&self) -> Arithmetic {
        self.prefill_arithmetic
    }

    /// The arithmetic of decode steps, verifies and the MTP head.
    pub fn decode_arithmetic(&self) -> Arithmetic {
        self.decode_arithmetic
    }

    /// Whether every forward computes each row from its own tokens alone (one arithmetic for
    /// prompts and decode, attention in one form): then the same tokens give the same logits
    /// bit for bit whether they were prefilled in any chunks, decoded, verified, batched or
    /// restored.
    pub fn row_invariant(&self) -> bool {
        self.decode_arithmetic == self.prefill_arithmetic
    }

    /// KV bytes one more token adds: every main layer's row plus the MTP layer's, when loaded.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.cfg.kv_bytes_per_token(self.dsa, self.mtp.is_some())
    }

    /// Seconds the DSA indexers have spent selecting keys since the model was loaded.
    pub fn indexer_seconds(&self) -> f64 {
        let layers = self
            .layers
            .iter()
            .chain(self.mtp.as_ref().map(|m| &m.layer));
        layers.map(|l| l.self_attn.indexer_seconds()).sum()
    }

    /// The longest context the engine computes exactly: `max_position_embeddings`, or, for
    /// a GLM checkpoint without its DSA indexers, `index_topk` (beyond it dense MLA would
    /// differ from the model, which attends to at most that many keys).
    pub fn max_exact_context(&self) -> usize {
        let limit = self.cfg.max_position_embeddings.max(1);
        match (self.cfg.family, self.cfg.index_topk, self.dsa) {
            (ModelFamily::GlmMoeDsa, Some(k), false) => limit.min(k),
            _ => limit,
        }
    }

    /// What sets [`max_exact_context`](Self::max_exact_context), for error messages.
    pub fn context_limit_reason(&self) -> &'static str {
        if self.max_exact_context() < self.cfg.max_position_embeddings.max(1) {
            "index_topk: this GLM checkpoint has no DSA indexer tensors, and dense attention \
             is the model only up to index_topk keys"
        } else {
            "max_position_embeddings"
        }
    }

    /// `caches` were made by [`new_caches`](Self::new_caches) of a model of this shape.
    pub(super) fn check_caches(&self, caches: &KvCaches) -> Result<()> {
        if caches.layers.len() != self.layers.len() {
            return Err(Error::invalid(
                "session",
                "its caches are shaped for another model",
            ));
        }
        Ok(())
    }

    /// `tokens` may be appended at `start` (the cached length): at least one, each in the
    /// vocabulary, the end within [`max_exact_context`](Self::max_exact_context).
    pub(super) fn check_tokens(&self, tokens: &[u32], start: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::invalid("tokens", "at least one token is required"));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::invalid(
                "tokens",
                format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    self.cfg.vocab_size
                ),
            ));
        }
        let end = start + tokens.len();
        if end > self.max_exact_context() {
            return Err(Error::invalid(
                "context",
                format!(
                    "{end} tokens exceed the {} this model is computed exactly for{}; shorten \
                     the prompt or max_new_tokens",
                    self.max_exact_context(),
                    if self.cfg.family == ModelFamily::GlmMoeDsa && !self.dsa {
                        " (this checkpoint has no DSA indexer tensors \
                         (model.layers.0.self_attn.indexer.*), and dense MLA is exact only up \
                         to index_topk keys)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(())
    }

    /// The embeddings of `tokens`, [tokens, hidden].
    pub(super) fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.cfg.hidden_size;
        let view = self.embed_tokens.view();
        let mut x = vec![0.0f32; tokens.len() * h];
        for (r, &t) in tokens.iter().enumerate() {
            reference_dequantize_row(&view, t as usize, &mut x[r * h..(r + 1) * h]);
        }
        x
    }

    /// The LM head over `rows` rows of `xn` (already normed).
    pub(super) fn head_logits(&self, xn: &[f32], rows: usize) -> Result<Vec<f32>> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        linear::apply(head, xn, rows, Some(&*self.pool))
    }

    pub(super) fn pool(&self) -> &rayon::ThreadPool {
        &self.pool
    }

    /// Run `f` on a thread of the compute pool. A forward runs there whole, so each
    /// matmul's parallel split is a cheap fork inside the pool; called from outside, every
    /// matmul paid a round trip to the pool and back (~10 µs on the 2-core development VM, a
    /// large share of a small model's step).
    pub(super) fn on_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// The state the MTP head consumes for main-model hidden states: `model.norm(hidden)`
    /// of [`Forward::pre_norm_hidden`](super::Forward::pre_norm_hidden) rows.
    pub fn final_norm(&self, hidden: &[f32]) -> Carried {
        let normed = rmsnorm(hidden, &self.norm, self.cfg.rms_norm_eps);
        Carried::new(normed, self.cfg.hidden_size)
    }
}
