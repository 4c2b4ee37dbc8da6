//! The model: embeddings, decoder layers, final norm, LM head, the MTP head, and their KV
//! caches. `step_all` runs S positions in one forward (prefill and verify); weights are read
//! once per forward whatever S is.
//!
//! Per layer (activations in f32):
//! ```text
//! x += MLA(rmsnorm(x, input_layernorm))
//! h  = rmsnorm(x, post_attention_layernorm)
//! x += dense MLP(h) if the layer is dense else MoE(h)
//! logits = lm_head(rmsnorm(x, model.norm))
//! ```

use std::sync::Arc;

use crate::config::{ModelConfig, ModelFamily};
use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::model::attention::{Attention, Form, LayerKv};
use crate::model::carried::Carried;
use crate::model::indexer::{Indexer, Selection};
use crate::model::linear;
use crate::model::moe::{ExpertProvider, Mlp, Moe, ResidentExperts};
use crate::model::norm::{rmsnorm, rmsnorm_inplace};
use crate::model::rope::Rope;
use crate::quant::kernels::int8act::PREFILL_MIN_ROWS;
use crate::quant::kernels::Arithmetic;
use crate::quant::pack::reference_dequantize_row;

/// The feed-forward half of a decoder layer.
enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

/// One decoder layer (main model or the MTP block).
struct Layer {
    input_layernorm: Vec<f32>,
    self_attn: Attention,
    post_attention_layernorm: Vec<f32>,
    ffn: Ffn,
}

impl Layer {
    fn load(c: &Container, cfg: &ModelConfig, index: usize, dsa: bool) -> Result<Self> {
        let p = format!("model.layers.{index}");
        let h = cfg.hidden_size;
        let ffn = if cfg.is_moe_layer(index) {
            Ffn::Moe(Moe::load(c, cfg, index)?)
        } else {
            Ffn::Dense(Mlp::load(c, &format!("{p}.mlp"), h, cfg.intermediate_size)?)
        };
        Ok(Layer {
            input_layernorm: linear::load_vector(c, &format!("{p}.input_layernorm.weight"), h)?,
            self_attn: Attention::load(c, cfg, &p, index, dsa)?,
            post_attention_layernorm: linear::load_vector(
                c,
                &format!("{p}.post_attention_layernorm.weight"),
                h,
            )?,
            ffn,
        })
    }

    /// Attention half: `x += MLA(input_layernorm(x))`, in place on [s, hidden]. Returns the
    /// DSA selection of a full layer (a shared layer attends to `shared`).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        x: &mut [f32],
        s: usize,
        start: usize,
        rope_start: usize,
        kv: &mut LayerKv,
        rope: &Rope,
        eps: f32,
        pool: Option<&rayon::ThreadPool>,
        shared: Option<&Selection>,
    ) -> Result<Option<Selection>> {
        let xn = rmsnorm(x, &self.input_layernorm, eps);
        let (a, selected) = self.self_attn.forward(
            &xn,
            s,
            start,
            rope_start,
            kv,
            rope,
            pool,
            shared,
            Form::Auto,
        )?;
        for (v, d) in x.iter_mut().zip(&a) {
            *v += d;
        }
        Ok(selected)
    }

    /// An empty KV cache for this layer.
    fn new_kv(&self, cfg: &ModelConfig) -> LayerKv {
        LayerKv::new(
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            self.self_attn.index_key_dim(),
        )
    }

    /// Feed-forward half: `x += FFN(post_attention_layernorm(x))`. `resident` is
    /// [`Layer::resident_ffn`]'s output when the router lookahead already computed it.
    fn feed_forward(
        &self,
        x: &mut [f32],
        s: usize,
        eps: f32,
        experts: &dyn ExpertProvider,
        pool: Option<&rayon::ThreadPool>,
        resident: Option<Vec<f32>>,
    ) -> Result<()> {
        let h = rmsnorm(x, &self.post_attention_layernorm, eps);
        let y = match (&self.ffn, resident) {
            (Ffn::Dense(_), Some(y)) => y,
            (Ffn::Dense(mlp), None) => mlp.forward(&h, s, pool)?,
            (Ffn::Moe(moe), resident) => moe.forward(&h, s, experts, pool, resident)?,
        };
        for (v, d) in x.iter_mut().zip(&y) {
            *v += d;
        }
        Ok(())
    }

    /// The resident part of this layer's feed-forward on `x` (after attention): the whole
    /// output of a dense layer, or the shared experts' output of a MoE layer. The router
    /// lookahead adds it to the residual: it is what the next layer will see, minus the
    /// routed experts.
    fn resident_ffn(
        &self,
        x: &[f32],
        s: usize,
        eps: f32,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Option<Vec<f32>>> {
        let h = rmsnorm(x, &self.post_attention_layernorm, eps);
        match &self.ffn {
            Ffn::Dense(mlp) => mlp.forward(&h, s, pool).map(Some),
            Ffn::Moe(moe) => moe.shared_output(&h, s, pool),
        }
    }

    /// Router lookahead for this layer: its router applied to `x` (another layer's residual
    /// after attention) — top-`k` ids per row, the union in first-seen order.
    fn predict(
        &self,
        x: &[f32],
        s: usize,
        k: usize,
        eps: f32,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<usize>> {
        let Ffn::Moe(moe) = &self.ffn else {
            return Ok(Vec::new());
        };
        let h = rmsnorm(x, &self.post_attention_layernorm, eps);
        let mut ids = Vec::new();
        for r in moe.router.route(&h, s, k, pool)? {
            for id in r.ids {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        Ok(ids)
    }
}

/// The multi-token-prediction head (DeepSeek-V3 style), at layer index `num_hidden_layers`.
///
/// As in transformers (the oracle), the head uses the main model's embedding and LM head; the
/// copies a checkpoint ships under `model.layers.N.embed_tokens` / `shared_head.head` are
/// identical and are not loaded.
struct MtpHead {
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    /// [hidden, 2·hidden]: applied to [enorm(embed(t)) ; hnorm(norm(h))].
    eh_proj: Weight,
    layer: Layer,
    shared_head_norm: Vec<f32>,
}

impl MtpHead {
    fn load(c: &Container, cfg: &ModelConfig, index: usize, dsa: bool) -> Result<Self> {
        let p = format!("model.layers.{index}");
        let h = cfg.hidden_size;
        Ok(MtpHead {
            enorm: linear::load_vector(c, &format!("{p}.enorm.weight"), h)?,
            hnorm: linear::load_vector(c, &format!("{p}.hnorm.weight"), h)?,
            eh_proj: linear::load(c, &format!("{p}.eh_proj.weight"), h, 2 * h)?,
            layer: Layer::load(c, cfg, index, dsa)?,
            shared_head_norm: linear::load_vector(c, &format!("{p}.shared_head.norm.weight"), h)?,
        })
    }

    /// Whether every tensor the head needs is present (a checkpoint may ship without it).
    fn present(c: &Container, index: usize) -> bool {
        let p = format!("model.layers.{index}");
        [
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
        ]
        .iter()
        .all(|n| c.contains(&format!("{p}.{n}")))
    }
}

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
    /// The arithmetic of [`Model::prefill`] forwards of at least
    /// [`PREFILL_MIN_ROWS`](crate::quant::kernels::int8act::PREFILL_MIN_ROWS) rows; every
    /// other forward is exact.
    pub prefill_arithmetic: Arithmetic,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            threads: 0,
            load_mtp: true,
            prefetch_top_k: 0,
            prefill_arithmetic: Arithmetic::Exact,
        }
    }
}

/// Logits and final pre-norm hidden states of the rows of one main-model forward.
#[derive(Debug, Clone, Default)]
pub struct Forward {
    /// [rows, vocab]: every row, or only the last when asked.
    pub logits: Vec<f32>,
    /// [s, hidden]: the residual stream after the last layer, *before* `model.norm`
    /// ([`Model::final_norm`] gives what the MTP head carries).
    pub pre_norm_hidden: Vec<f32>,
    /// (layer, selection) of every DSA full layer, when [`Model::set_trace_selections`] is on
    /// (tests and debugging; empty otherwise).
    pub selections: Vec<(usize, Selection)>,
}

/// Logits and normed output states of the rows of one MTP-head forward.
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

/// One sequence's KV caches (every main layer's and the MTP layer's), detached from the
/// model: a session keeps its own and swaps them in for its generations
/// ([`Model::swap_caches`]).
#[derive(Clone)]
pub struct KvCaches {
    layers: Vec<LayerKv>,
    mtp: LayerKv,
}

impl KvCaches {
    /// Bytes held (main layers and MTP layer).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::bytes).sum::<usize>() + self.mtp.bytes()
    }
    /// Rows in the main caches.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forget every row.
    pub fn clear(&mut self) {
        for kv in self.all_mut() {
            kv.truncate(0);
        }
    }
    /// Keep the first `len` rows (of the main layers; the MTP layer's at most as many).
    pub fn truncate(&mut self, len: usize) {
        for kv in self.all_mut() {
            kv.truncate(len);
        }
    }
    /// Forget every row and give the memory back (an evicted session's).
    pub fn release(&mut self) {
        for kv in self.all_mut() {
            kv.release();
        }
    }
    /// Rows in the MTP layer's cache.
    pub fn mtp_len(&self) -> usize {
        self.mtp.len()
    }
    /// Every cache, main layers in order then the MTP layer's: the layout a saved context
    /// records (their row widths) and the order its payload follows.
    pub fn all(&self) -> impl Iterator<Item = &LayerKv> {
        self.layers.iter().chain(std::iter::once(&self.mtp))
    }
    pub fn all_mut(&mut self) -> impl Iterator<Item = &mut LayerKv> {
        self.layers.iter_mut().chain(std::iter::once(&mut self.mtp))
    }
}

/// A loaded model with its KV caches.
pub struct Model {
    cfg: ModelConfig,
    container: Arc<Container>,
    embed_tokens: Weight,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when the embeddings are tied.
    lm_head: Option<Weight>,
    rope: Rope,
    kv: Vec<LayerKv>,
    mtp: Option<MtpHead>,
    mtp_kv: LayerKv,
    experts: Arc<dyn ExpertProvider>,
    /// Shared so that [`Model::step`] can run a whole forward on it (see there).
    pool: Arc<rayon::ThreadPool>,
    prefetch_top_k: usize,
    prefill_arithmetic: Arithmetic,
    /// GLM DSA: the checkpoint's lightning indexers are in use (see `max_exact_context`).
    dsa: bool,
    trace_selections: bool,
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
        let c = &*container;
        let h = cfg.hidden_size;
        let dsa = uses_dsa(c);
        let embed_tokens = linear::load(c, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| Layer::load(c, &cfg, l, dsa))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings && !c.contains("lm_head.weight") {
            None
        } else {
            Some(linear::load(c, "lm_head.weight", cfg.vocab_size, h)?)
        };
        let mtp = match cfg.mtp_layer_index() {
            Some(i) if opts.load_mtp && MtpHead::present(c, i) => {
                Some(MtpHead::load(c, &cfg, i, dsa)?)
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
        let mut model = Model {
            rope: Rope::new(&cfg),
            kv: Vec::new(),
            norm: linear::load_vector(c, "model.norm.weight", h)?,
            cfg,
            container,
            embed_tokens,
            layers,
            lm_head,
            mtp,
            mtp_kv: LayerKv::new(1, 0, 0),
            experts,
            pool,
            prefetch_top_k: opts.prefetch_top_k,
            prefill_arithmetic: opts.prefill_arithmetic,
            dsa,
            trace_selections: false,
        };
        let mut caches = model.new_caches();
        model.swap_caches(&mut caches);
        Ok(model)
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

    /// Empty caches shaped for this model (a new session's).
    pub fn new_caches(&self) -> KvCaches {
        KvCaches {
            layers: self.layers.iter().map(|l| l.new_kv(&self.cfg)).collect(),
            mtp: match &self.mtp {
                Some(m) => m.layer.new_kv(&self.cfg),
                None => LayerKv::new(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim, 0),
            },
        }
    }

    /// Exchange the model's caches with `caches` (made by [`new_caches`](Self::new_caches)
    /// of this model): the model then computes that sequence.
    pub fn swap_caches(&mut self, caches: &mut KvCaches) {
        std::mem::swap(&mut self.kv, &mut caches.layers);
        std::mem::swap(&mut self.mtp_kv, &mut caches.mtp);
    }

    /// Whether GLM's sparse attention (the DSA lightning indexers) is in use.
    pub fn uses_dsa(&self) -> bool {
        self.dsa
    }

    /// Return every DSA full layer's selection in [`Forward::selections`] (off by default:
    /// a long prefill's selections are rows × index_topk × layers positions).
    pub fn set_trace_selections(&mut self, on: bool) {
        self.trace_selections = on;
    }

    /// Rows in the main KV cache (= the next position to compute).
    pub fn kv_len(&self) -> usize {
        self.kv.first().map_or(0, LayerKv::len)
    }
    pub fn mtp_kv_len(&self) -> usize {
        self.mtp_kv.len()
    }
    /// Bytes held by the main KV cache (latents, roped keys and DSA indexer keys).
    pub fn kv_bytes(&self) -> usize {
        self.kv.iter().map(LayerKv::bytes).sum()
    }
    /// KV bytes one more token adds: every main layer's row plus the MTP layer's, when loaded.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.cfg.kv_bytes_per_token(self.dsa, self.mtp.is_some())
    }

    /// Bytes held by the MTP layer's KV cache.
    pub fn mtp_kv_bytes(&self) -> usize {
        self.mtp_kv.bytes()
    }

    /// Benchmarks only: append `rows` rows of random values to every KV cache (main layers,
    /// indexer keys, the MTP layer), so that a decode step can be timed at a long context
    /// without prefilling it. The rows are not a real context; what follows computes
    /// nothing meaningful, at the cost of a real one.
    pub fn append_synthetic_context(&mut self, rows: usize, seed: u64) {
        let mut state = seed | 1;
        // xorshift64 → two uniforms → one Box-Muller normal.
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let mut normal = move || {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        };
        for kv in self.kv.iter_mut().chain(std::iter::once(&mut self.mtp_kv)) {
            kv.append_random(rows, &mut normal);
        }
    }

    /// Seconds the DSA indexers have spent selecting keys since the model was loaded.
    pub fn indexer_seconds(&self) -> f64 {
        let layers = self
            .layers
            .iter()
            .chain(self.mtp.as_ref().map(|m| &m.layer));
        layers.map(|l| l.self_attn.indexer_seconds()).sum()
    }

    /// Drop main-model KV rows from `len` on (roll back rejected positions).
    pub fn truncate(&mut self, len: usize) {
        for kv in &mut self.kv {
            kv.truncate(len);
        }
    }
    pub fn mtp_truncate(&mut self, len: usize) {
        self.mtp_kv.truncate(len);
    }
    /// Forget everything (a new sequence).
    pub fn reset(&mut self) {
        self.truncate(0);
        self.mtp_truncate(0);
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

    fn check_tokens(&self, tokens: &[u32], start: usize, kv_len: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::invalid("tokens", "at least one token is required"));
        }
        if start != kv_len {
            return Err(Error::invalid(
                "start_pos",
                format!("must equal the cached length {kv_len}, got {start}"),
            ));
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

    fn embed(&self, w: &Weight, tokens: &[u32]) -> Vec<f32> {
        let h = self.cfg.hidden_size;
        let view = w.view();
        let mut x = vec![0.0f32; tokens.len() * h];
        for (r, &t) in tokens.iter().enumerate() {
            reference_dequantize_row(&view, t as usize, &mut x[r * h..(r + 1) * h]);
        }
        x
    }

    fn head_logits(&self, head: &Weight, xn: &[f32], rows: usize) -> Result<Vec<f32>> {
        linear::apply(head, xn, rows, Some(&*self.pool))
    }

    /// One forward over `tokens` at positions `start..`, appending their KV rows. Returns the
    /// logits of every row (`all_logits`) or of the last row only, and every row's hidden state.
    ///
    /// The forward runs on a thread of the compute pool, so each matmul's parallel split is a
    /// cheap fork inside the pool; called from outside, every matmul paid a round trip to the
    /// pool and back (~10 µs on the 2-core development VM, a large share of a small model's
    /// step).
    pub fn step(&mut self, tokens: &[u32], start: usize, all_logits: bool) -> Result<Forward> {
        self.on_pool(|m| m.step_here(tokens, start, all_logits))
    }

    /// [`step`](Self::step) for the rows of a prompt: in the model's prefill arithmetic
    /// ([`ModelOptions::prefill_arithmetic`]) when there are at least
    /// [`PREFILL_MIN_ROWS`](crate::quant::kernels::int8act::PREFILL_MIN_ROWS) of them, else
    /// exactly. Decode steps and verify forwards go through `step`, always exact.
    pub fn prefill(&mut self, tokens: &[u32], start: usize, all_logits: bool) -> Result<Forward> {
        let arith = if tokens.len() >= PREFILL_MIN_ROWS {
            self.prefill_arithmetic
        } else {
            Arithmetic::Exact
        };
        self.on_pool(|m| linear::with_arithmetic(arith, || m.step_here(tokens, start, all_logits)))
    }

    /// The arithmetic of long prefills.
    pub fn prefill_arithmetic(&self) -> Arithmetic {
        self.prefill_arithmetic
    }

    /// Run `f` on a thread of the compute pool (see [`step`](Self::step)).
    fn on_pool<R: Send>(&mut self, f: impl FnOnce(&mut Self) -> R + Send) -> R {
        let pool = Arc::clone(&self.pool);
        pool.install(|| f(self))
    }

    fn step_here(&mut self, tokens: &[u32], start: usize, all_logits: bool) -> Result<Forward> {
        self.check_tokens(tokens, start, self.kv_len())?;
        let s = tokens.len();
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        let mut x = self.embed(&self.embed_tokens, tokens);
        let pool = Some(&*self.pool);
        let top_k = self.prefetch_top_k;
        let trace = self.trace_selections;
        let mut traced = Vec::new();
        let result = (|| {
            // The latest DSA full layer's selection, which shared layers reuse.
            let mut selection: Option<Selection> = None;
            for (i, (layer, kv)) in self.layers.iter().zip(self.kv.iter_mut()).enumerate() {
                self.experts.begin_layer(i);
                let selected = layer.attend(
                    &mut x,
                    s,
                    start,
                    start,
                    kv,
                    &self.rope,
                    eps,
                    pool,
                    selection.as_ref(),
                )?;
                if let Some(sel) = selected {
                    if trace {
                        traced.push((i, sel.clone()));
                    }
                    selection = Some(sel);
                }
                // Router lookahead: predict layer i+1's experts from this residual plus this
                // layer's resident feed-forward output, so their loads overlap this layer's
                // routed experts. The resident output is reused, not recomputed.
                let mut resident_out = None;
                if let (Some(next), true) = (self.layers.get(i + 1), top_k > 0) {
                    let resident = layer.resident_ffn(&x, s, eps, pool)?;
                    let ids = match &resident {
                        Some(y) => {
                            let ahead: Vec<f32> = x.iter().zip(y).map(|(a, b)| a + b).collect();
                            next.predict(&ahead, s, top_k, eps, pool)?
                        }
                        None => next.predict(&x, s, top_k, eps, pool)?,
                    };
                    if !ids.is_empty() {
                        self.experts.prefetch(i + 1, &ids);
                    }
                    resident_out = resident;
                }
                layer.feed_forward(&mut x, s, eps, &*self.experts, pool, resident_out)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            // Leave the cache as it was before this call: no half-written rows.
            self.truncate(start);
            return Err(e);
        }
        let rows = if all_logits { s } else { 1 };
        let last = &x[(s - rows) * h..];
        let xn = rmsnorm(last, &self.norm, eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let logits = self.head_logits(head, &xn, rows)?;
        Ok(Forward {
            logits,
            pre_norm_hidden: x,
            selections: traced,
        })
    }

    /// One forward over several sequences at once (batched decode across sessions):
    /// sequence b's `tokens` at positions `caches[b].len()..`, attending to its own caches,
    /// which get the new rows. Every row goes through the dense and routed feed-forward
    /// together, so an expert one row routes to is read once for all of them. Returns, per
    /// sequence, the logits of every row and `model.norm` of every row's hidden state (the
    /// MTP head's carried state). The result is each sequence's [`step`](Self::step) alone:
    /// every per-row computation is independent of the other rows (S-invariance).
    /// On error every cache is left as it was.
    pub fn step_batch(
        &mut self,
        seqs: &mut [(&mut KvCaches, &[u32])],
    ) -> Result<Vec<(Vec<f32>, Carried)>> {
        self.on_pool(|m| m.step_batch_here(seqs))
    }

    fn step_batch_here(
        &mut self,
        seqs: &mut [(&mut KvCaches, &[u32])],
    ) -> Result<Vec<(Vec<f32>, Carried)>> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        let mut spans = Vec::with_capacity(seqs.len());
        let mut all_tokens = Vec::new();
        for (caches, tokens) in seqs.iter() {
            if caches.layers.len() != self.layers.len() {
                return Err(Error::invalid(
                    "session",
                    "its caches are shaped for another model",
                ));
            }
            let start = caches.len();
            self.check_tokens(tokens, start, start)?;
            spans.push((all_tokens.len(), tokens.len(), start));
            all_tokens.extend_from_slice(tokens);
        }
        let rows = all_tokens.len();
        let mut x = self.embed(&self.embed_tokens, &all_tokens);
        let pool = Some(&*self.pool);
        let top_k = self.prefetch_top_k;
        let result = (|| {
            let mut selections: Vec<Option<Selection>> = vec![None; seqs.len()];
            for (i, layer) in self.layers.iter().enumerate() {
                self.experts.begin_layer(i);
                for (b, (caches, _)) in seqs.iter_mut().enumerate() {
                    let (at, n, start) = spans[b];
                    let selected = layer.attend(
                        &mut x[at * h..(at + n) * h],
                        n,
                        start,
                        start,
                        &mut caches.layers[i],
                        &self.rope,
                        eps,
                        pool,
                        selections[b].as_ref(),
                    )?;
                    if selected.is_some() {
                        selections[b] = selected;
                    }
                }
                let mut resident_out = None;
                if let (Some(next), true) = (self.layers.get(i + 1), top_k > 0) {
                    let resident = layer.resident_ffn(&x, rows, eps, pool)?;
                    let ids = match &resident {
                        Some(y) => {
                            let ahead: Vec<f32> = x.iter().zip(y).map(|(a, b)| a + b).collect();
                            next.predict(&ahead, rows, top_k, eps, pool)?
                        }
                        None => next.predict(&x, rows, top_k, eps, pool)?,
                    };
                    if !ids.is_empty() {
                        self.experts.prefetch(i + 1, &ids);
                    }
                    resident_out = resident;
                }
                layer.feed_forward(&mut x, rows, eps, &*self.experts, pool, resident_out)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            for (b, (caches, _)) in seqs.iter_mut().enumerate() {
                for kv in caches.layers.iter_mut() {
                    kv.truncate(spans[b].2);
                }
            }
            return Err(e);
        }
        let xn = rmsnorm(&x, &self.norm, eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let logits = self.head_logits(head, &xn, rows)?;
        let vocab = self.cfg.vocab_size;
        Ok(spans
            .iter()
            .map(|&(at, n, _)| {
                (
                    logits[at * vocab..(at + n) * vocab].to_vec(),
                    Carried::new(xn[at * h..(at + n) * h].to_vec(), h),
                )
            })
            .collect())
    }

    /// The state the MTP head consumes for main-model hidden states: `model.norm(hidden)`
    /// of [`Forward::pre_norm_hidden`] rows.
    pub fn final_norm(&self, hidden: &[f32]) -> Carried {
        let normed = rmsnorm(hidden, &self.norm, self.cfg.rms_norm_eps);
        Carried::new(normed, self.cfg.hidden_size)
    }

    /// The MTP head over `s` rows: row j takes token `tokens[j]` and the carried state
    /// `carried[j]` — `model.norm(h)` of the main model's hidden at the previous position, or
    /// the head's own previous output when chaining — and appends MTP KV rows at `start..`:
    /// ```text
    /// z = MTPLayer(eh_proj · [enorm(embed(t)) ; hnorm(carried)])
    /// out = shared_head.norm(z);  logits = lm_head(out)
    /// ```
    /// Returns the logits (predicting the token after `tokens[j]`) of every row
    /// (`all_logits`) or of the last row only (absorbing rows into the MTP KV reads no others),
    /// and `out` of every row, the state a chained draft carries (transformers' convention:
    /// the normed output, not raw z). Runs on the compute pool, as `step`.
    pub fn mtp_step(
        &mut self,
        tokens: &[u32],
        carried: &Carried,
        start: usize,
        all_logits: bool,
    ) -> Result<MtpForward> {
        self.on_pool(|m| m.mtp_step_here(tokens, carried, start, all_logits))
    }

    fn mtp_step_here(
        &mut self,
        tokens: &[u32],
        carried: &Carried,
        start: usize,
        all_logits: bool,
    ) -> Result<MtpForward> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        let s = tokens.len();
        self.check_tokens(tokens, start, self.mtp_kv_len())?;
        let Some(mtp) = self.mtp.as_ref() else {
            return Err(Error::invalid(
                "draft",
                "this model has no MTP head (or it was disabled); use draft='ngram' or 'off'",
            ));
        };
        let carried = carried.values();
        if carried.len() != s * h {
            return Err(Error::invalid(
                "hidden",
                format!("expected {s}×{h} values, got {}", carried.len()),
            ));
        }
        let mut e = self.embed(&self.embed_tokens, tokens);
        rmsnorm_inplace(&mut e, &mtp.enorm, eps);
        let hn = rmsnorm(carried, &mtp.hnorm, eps);
        let mut cat = Vec::with_capacity(s * 2 * h);
        for r in 0..s {
            cat.extend_from_slice(&e[r * h..(r + 1) * h]);
            cat.extend_from_slice(&hn[r * h..(r + 1) * h]);
        }
        let mut z = linear::apply(&mtp.eh_proj, &cat, s, Some(&*self.pool))?;
        // MTP row p pairs h_p with token p+1 and sits at rope position p+1 (transformers).
        let pool = Some(&*self.pool);
        // The MTP layer's indexer (a full one: transformers builds the layer as index 0 of
        // its own stack) selects among the MTP layer's own cached rows.
        let run = mtp
            .layer
            .attend(
                &mut z,
                s,
                start,
                start + 1,
                &mut self.mtp_kv,
                &self.rope,
                eps,
                pool,
                None,
            )
            .and_then(|selected| {
                mtp.layer
                    .feed_forward(&mut z, s, eps, &*self.experts, pool, None)
                    .map(|()| selected)
            });
        let selected = match run {
            Ok(sel) => sel,
            Err(err) => {
                self.mtp_kv.truncate(start);
                return Err(err);
            }
        };
        let out = rmsnorm(&z, &mtp.shared_head_norm, eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        let rows = if all_logits { s } else { 1 };
        let logits = self.head_logits(head, &out[(s - rows) * h..], rows)?;
        let selections = match (self.trace_selections, selected) {
            (true, Some(sel)) => vec![(self.cfg.num_hidden_layers, sel)],
            _ => Vec::new(),
        };
        Ok(MtpForward {
            logits,
            post_norm_hidden: Carried::new(out, h),
            selections,
        })
    }
}
