//! Multi-head latent attention (MLA) with the compressed KV cache.
//!
//! The cache holds, per layer and position, only the normed latent c (kv_lora_rank) and the
//! roped shared key (qk_rope_head_dim). Attention runs "absorbed": the key half of kv_b is
//! folded into the query (q_lat = W_UKᵀ q_nope), scores are q_lat·c + q_rope·k_rope, and the
//! value half of kv_b is applied after the weighted sum of latents. That is the same function
//! transformers computes by expanding K and V, with far less work per decoded token.
//! Long prefills in the fast arithmetic expand K and V instead, where that costs fewer
//! multiply-adds (`mla_decompressed`).

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::model::indexer::{Indexer, Selection};
use crate::model::latent_attention;
use crate::model::linear;
use crate::model::mla_decompressed;
use crate::model::norm::{rmsnorm, rmsnorm_inplace};
use crate::model::rope::{self, Rope};
use crate::quant::kernels::vecops::VecOps;
use crate::quant::kernels::{self, Arithmetic};
use crate::quant::QMatrix;

/// Query projection: low-rank with its own norm, or one plain matrix.
enum QProj {
    Lora {
        q_a_proj: Weight,
        q_a_layernorm: Vec<f32>,
        q_b_proj: Weight,
    },
    Plain {
        q_proj: Weight,
    },
}

/// One layer's KV rows: [len, kv_lora_rank] latents, [len, qk_rope_head_dim] roped keys and,
/// on a DSA full layer, [len, index_head_dim] indexer keys.
#[derive(Debug, Clone)]
pub struct LayerKv {
    latent: Vec<f32>,
    rope_key: Vec<f32>,
    index_key: Vec<f32>,
    kv_lora: usize,
    rope_dim: usize,
    index_dim: usize,
}

impl LayerKv {
    /// An empty cache for rows of these widths (`index_dim` 0: no indexer keys).
    pub fn new(kv_lora: usize, rope_dim: usize, index_dim: usize) -> Self {
        LayerKv {
            latent: Vec::new(),
            rope_key: Vec::new(),
            index_key: Vec::new(),
            kv_lora,
            rope_dim,
            index_dim,
        }
    }
    pub fn len(&self) -> usize {
        self.latent.len() / self.kv_lora
    }
    pub fn is_empty(&self) -> bool {
        self.latent.is_empty()
    }
    pub fn truncate(&mut self, len: usize) {
        self.latent.truncate(len * self.kv_lora);
        self.rope_key.truncate(len * self.rope_dim);
        self.index_key.truncate(len * self.index_dim);
    }
    /// Append `rows` rows of standard-normal values (what the latent, key and indexer-key
    /// norms produce in scale): a stand-in context for timing decode at a long context
    /// without its prefill. `next` yields the values.
    pub fn append_random(&mut self, rows: usize, next: &mut impl FnMut() -> f32) {
        self.latent.extend((0..rows * self.kv_lora).map(|_| next()));
        self.rope_key
            .extend((0..rows * self.rope_dim).map(|_| next()));
        self.index_key
            .extend((0..rows * self.index_dim).map(|_| next()));
    }
    /// Bytes held (the KV accounting the tests check).
    pub fn bytes(&self) -> usize {
        (self.latent.len() + self.rope_key.len() + self.index_key.len())
            * std::mem::size_of::<f32>()
    }
    /// Row widths: (kv_lora, rope_dim, index_dim).
    pub fn widths(&self) -> [usize; 3] {
        [self.kv_lora, self.rope_dim, self.index_dim]
    }
    /// The stored rows: latents, roped keys, indexer keys (a saved context's payload).
    pub fn parts(&self) -> [&[f32]; 3] {
        [&self.latent, &self.rope_key, &self.index_key]
    }
    /// Replace the contents with `rows` rows that `fill` writes into the three parts (as
    /// [`parts`](Self::parts) returns them); on error the cache is left empty.
    pub fn load_parts(
        &mut self,
        rows: usize,
        fill: &mut dyn FnMut(&mut [f32]) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let widths = self.widths();
        for (part, width) in [&mut self.latent, &mut self.rope_key, &mut self.index_key]
            .into_iter()
            .zip(widths)
        {
            part.clear();
            part.resize(rows * width, 0.0);
        }
        let result = [&mut self.latent, &mut self.rope_key, &mut self.index_key]
            .into_iter()
            .try_for_each(|part| fill(part));
        if result.is_err() {
            self.release();
        }
        result
    }
    /// Forget every row and give the memory back.
    pub fn release(&mut self) {
        for part in [&mut self.latent, &mut self.rope_key, &mut self.index_key] {
            *part = Vec::new();
        }
    }
}

/// How a layer chooses the keys it attends to.
enum KeyChoice {
    /// Every earlier key (DeepSeek-V3; GLM without indexer tensors, exact up to index_topk).
    Dense,
    /// GLM DSA "full" layer: its own lightning indexer.
    Indexed(Box<Indexer>),
    /// GLM DSA "shared" layer: the previous full layer's selection.
    Shared,
}

pub struct Attention {
    q: QProj,
    kv_a_proj_with_mqa: Weight,
    kv_a_layernorm: Vec<f32>,
    kv_b_proj: Weight,
    o_proj: Weight,
    heads: usize,
    nope: usize,
    rope_dim: usize,
    v_dim: usize,
    kv_lora: usize,
    scale: f32,
    keys: KeyChoice,
}

/// How the attention product is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
// Outside the tests every forward runs `Auto`; the tests force each form to compare them.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Form {
    /// Absorbed (every decode, verify and exact forward): S-invariant, the reference form.
    Absorbed,
    /// Keys and values expanded per head (dense layers only; DSA layers stay absorbed).
    Decompressed,
    /// Decompressed in the fast prefill arithmetic where it costs fewer multiply-adds
    /// (`mla_decompressed::pays`), absorbed otherwise.
    Auto,
}

/// transformers builds `q_a_layernorm` and `kv_a_layernorm` without an eps argument, so both
/// families use the RMSNorm default of 1e-6 there, whatever `rms_norm_eps` says.
const LATENT_NORM_EPS: f32 = 1e-6;

impl Attention {
    /// Load layer `layer`'s attention (`prefix` = `model.layers.{layer}`). `dsa` says whether
    /// the checkpoint's DSA indexers are used (see `Model::load_with_experts`).
    pub fn load(
        c: &Container,
        cfg: &ModelConfig,
        prefix: &str,
        layer: usize,
        dsa: bool,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let heads = cfg.num_attention_heads;
        let qd = cfg.q_head_dim();
        let p = |n: &str| format!("{prefix}.self_attn.{n}");
        let q = match cfg.q_lora_rank {
            Some(r) => QProj::Lora {
                q_a_proj: linear::load(c, &p("q_a_proj.weight"), r, h)?,
                q_a_layernorm: linear::load_vector(c, &p("q_a_layernorm.weight"), r)?,
                q_b_proj: linear::load(c, &p("q_b_proj.weight"), heads * qd, r)?,
            },
            None => QProj::Plain {
                q_proj: linear::load(c, &p("q_proj.weight"), heads * qd, h)?,
            },
        };
        let kv_lora = cfg.kv_lora_rank;
        Ok(Attention {
            q,
            kv_a_proj_with_mqa: linear::load(
                c,
                &p("kv_a_proj_with_mqa.weight"),
                kv_lora + cfg.qk_rope_head_dim,
                h,
            )?,
            kv_a_layernorm: linear::load_vector(c, &p("kv_a_layernorm.weight"), kv_lora)?,
            kv_b_proj: linear::load(
                c,
                &p("kv_b_proj.weight"),
                heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                kv_lora,
            )?,
            o_proj: linear::load(c, &p("o_proj.weight"), h, heads * cfg.v_head_dim)?,
            heads,
            nope: cfg.qk_nope_head_dim,
            rope_dim: cfg.qk_rope_head_dim,
            v_dim: cfg.v_head_dim,
            kv_lora,
            scale: rope::softmax_scale(cfg),
            keys: match (dsa, cfg.indexer_is_full(layer)) {
                (false, _) => KeyChoice::Dense,
                (true, true) => KeyChoice::Indexed(Box::new(Indexer::load(c, cfg, prefix)?)),
                (true, false) => KeyChoice::Shared,
            },
        })
    }

    /// Seconds this layer's indexer has spent selecting keys (0 without one).
    pub fn indexer_seconds(&self) -> f64 {
        match &self.keys {
            KeyChoice::Indexed(ix) => ix.busy_seconds(),
            _ => 0.0,
        }
    }

    /// Width of this layer's cached indexer keys (0 when it has no indexer).
    pub fn index_key_dim(&self) -> usize {
        match &self.keys {
            KeyChoice::Indexed(ix) => ix.key_dim(),
            _ => 0,
        }
    }

    /// Attention over `s` rows of normed input `xn` ([s, hidden]) at cache rows
    /// `start..start+s` (rope positions `rope_start..`), its product in `form` (the model
    /// passes [`Form::Auto`]); appends their KV rows to `kv` (which must hold exactly `start`
    /// rows). Returns [s, hidden] and, on a DSA full layer, the keys its indexer selected; a
    /// shared layer attends to `shared` (the previous full layer's selection for these rows).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        xn: &[f32],
        s: usize,
        start: usize,
        rope_start: usize,
        kv: &mut LayerKv,
        rope: &Rope,
        pool: Option<&rayon::ThreadPool>,
        shared: Option<&Selection>,
        form: Form,
    ) -> Result<(Vec<f32>, Option<Selection>)> {
        // Read on the calling thread: the pool's workers do not carry the caller's arithmetic.
        let fast_prefill =
            linear::arithmetic() == Arithmetic::Int8 && linear::row_dependent_attention();
        debug_assert_eq!(kv.len(), start);

        let (mut q, selected) = self.query(xn, s, start, rope_start, kv, rope, pool)?;
        let selection = self.selection(selected.as_ref(), shared, s)?;
        self.append_kv(xn, s, rope_start, kv, rope, pool, &mut q)?;

        let decompress = match form {
            Form::Absorbed => false,
            Form::Decompressed => selection.is_none(),
            Form::Auto => {
                fast_prefill && selection.is_none() && mla_decompressed::pays(self.dims(), s, start)
            }
        };
        if decompress {
            let kvb = self.kv_b_proj.view();
            let inputs = mla_decompressed::Inputs {
                dims: self.dims(),
                q: &q,
                s,
                start,
                latent: &kv.latent,
                rope_key: &kv.rope_key,
                kv_b: &kvb,
                scale: self.scale,
            };
            let o = mla_decompressed::attend(&inputs, pool)?;
            return Ok((linear::apply(&self.o_proj, &o, s, pool)?, selected));
        }

        let kvb = self.kv_b_proj.view();
        let ops = VecOps::active()?;
        let q_lat = self.absorbed_query(&kvb, ops, &q, s, pool)?;
        // Causal attention over the latent cache in one pass; o_lat[s, head, kv_lora].
        let inputs = latent_attention::Inputs {
            heads: self.heads,
            kl: self.kv_lora,
            rd: self.rope_dim,
            nope: self.nope,
            q: &q,
            q_lat: &q_lat,
            s,
            start,
            latent: &kv.latent,
            rope_key: &kv.rope_key,
            selection,
            scale: self.scale,
        };
        let o_lat = latent_attention::attend(&inputs, ops, pool);
        let o = self.absorbed_values(&kvb, &o_lat, s, pool)?;
        Ok((linear::apply(&self.o_proj, &o, s, pool)?, selected))
    }

    /// The attention shape, as the decompressed form takes it.
    #[inline]
    fn dims(&self) -> mla_decompressed::Dims {
        mla_decompressed::Dims {
            heads: self.heads,
            nope: self.nope,
            rope: self.rope_dim,
            v: self.v_dim,
            kv_lora: self.kv_lora,
        }
    }

    /// q: [s, heads, nope + rope], not yet roped, and on a DSA full layer the keys its
    /// indexer selects (it appends these rows' indexer keys to `kv`); the indexer's query
    /// starts from the same q_a.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn query(
        &self,
        xn: &[f32],
        s: usize,
        start: usize,
        rope_start: usize,
        kv: &mut LayerKv,
        rope: &Rope,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<(Vec<f32>, Option<Selection>)> {
        let mut selected = None;
        let q = match &self.q {
            QProj::Lora {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => {
                let qa = rmsnorm(
                    &linear::apply(q_a_proj, xn, s, pool)?,
                    q_a_layernorm,
                    LATENT_NORM_EPS,
                );
                if let KeyChoice::Indexed(ix) = &self.keys {
                    selected = Some(ix.select(
                        xn,
                        &qa,
                        s,
                        start,
                        rope_start,
                        &mut kv.index_key,
                        rope,
                        pool,
                    )?);
                }
                linear::apply(q_b_proj, &qa, s, pool)?
            }
            QProj::Plain { q_proj } => linear::apply(q_proj, xn, s, pool)?,
        };
        Ok((q, selected))
    }

    /// The keys these `s` rows attend to: every earlier one (None), this layer's own
    /// selection, or the previous full layer's (`shared`); one row of it per row.
    #[inline]
    fn selection<'a>(
        &self,
        selected: Option<&'a Selection>,
        shared: Option<&'a Selection>,
        s: usize,
    ) -> Result<Option<&'a Selection>> {
        let selection: Option<&Selection> = match &self.keys {
            KeyChoice::Dense => None,
            KeyChoice::Indexed(_) => selected,
            KeyChoice::Shared => Some(shared.ok_or_else(|| {
                Error::Internal("a DSA shared layer ran without a full layer's selection".into())
            })?),
        };
        if let Some(sel) = selection {
            if sel.len() != s {
                return Err(Error::Internal(format!(
                    "DSA selection has {} rows for a forward of {s}",
                    sel.len()
                )));
            }
        }
        Ok(selection)
    }

    /// c: [s, kv_lora + rope] → normed latent and roped shared key, appended to the cache;
    /// ropes the rope half of every head of `q` ([s, heads, nope + rope]) at the same
    /// positions.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn append_kv(
        &self,
        xn: &[f32],
        s: usize,
        rope_start: usize,
        kv: &mut LayerKv,
        rope: &Rope,
        pool: Option<&rayon::ThreadPool>,
        q: &mut [f32],
    ) -> Result<()> {
        let (heads, nope, rd, kl) = (self.heads, self.nope, self.rope_dim, self.kv_lora);
        let qd = nope + rd;
        let ckv = linear::apply(&self.kv_a_proj_with_mqa, xn, s, pool)?;
        for r in 0..s {
            let row = &ckv[r * (kl + rd)..(r + 1) * (kl + rd)];
            let mut lat = row[..kl].to_vec();
            rmsnorm_inplace(&mut lat, &self.kv_a_layernorm, LATENT_NORM_EPS);
            kv.latent.extend_from_slice(&lat);
            let mut k = row[kl..].to_vec();
            rope.apply(&mut k, rope_start + r);
            kv.rope_key.extend_from_slice(&k);
            for hh in 0..heads {
                let off = r * heads * qd + hh * qd + nope;
                rope.apply(&mut q[off..off + rd], rope_start + r);
            }
        }
        Ok(())
    }

    /// q_lat[s, head, kv_lora] = W_UK(head)ᵀ · q_nope(s, head): stream the key rows of kv_b,
    /// one head per task on the pool (each output is summed over d in order whatever the
    /// split or S, so the values do not depend on either).
    #[inline]
    fn absorbed_query(
        &self,
        kvb: &QMatrix<'_>,
        ops: VecOps,
        q: &[f32],
        s: usize,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<f32>> {
        let (heads, nope, vd, kl) = (self.heads, self.nope, self.v_dim, self.kv_lora);
        let qd = nope + self.rope_dim;
        let head_lat = |hh: usize| -> Result<Vec<f32>> {
            let mut lat = vec![0.0f32; s * kl];
            let mut wrow = vec![0.0f32; kl];
            for d in 0..nope {
                kernels::dequantize_row(kvb, hh * (nope + vd) + d, &mut wrow)?;
                for r in 0..s {
                    let qv = q[r * heads * qd + hh * qd + d];
                    ops.axpy(&mut lat[r * kl..(r + 1) * kl], qv, &wrow);
                }
            }
            Ok(lat)
        };
        per_head(heads, s, kl, pool, head_lat)
    }

    /// o[s, head, v] = W_UV(head) · o_lat(s, head), through the kernel on the value rows, one
    /// head per task on the pool, each head's call on its task's thread (a kernel's result
    /// does not depend on its thread count): one fork for all heads instead of one per head.
    #[inline]
    fn absorbed_values(
        &self,
        kvb: &QMatrix<'_>,
        o_lat: &[f32],
        s: usize,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<f32>> {
        let (heads, nope, vd, kl) = (self.heads, self.nope, self.v_dim, self.kv_lora);
        let head_value = |hh: usize| -> Result<Vec<f32>> {
            let wv = kvb.row_range(hh * (nope + vd) + nope, vd)?;
            let mut lat_h = vec![0.0f32; s * kl];
            for r in 0..s {
                lat_h[r * kl..(r + 1) * kl]
                    .copy_from_slice(&o_lat[(r * heads + hh) * kl..(r * heads + hh + 1) * kl]);
            }
            let mut out_h = vec![0.0f32; s * vd];
            kernels::matmul(&wv, &lat_h, s, &mut out_h, None)?;
            Ok(out_h)
        };
        per_head(heads, s, vd, pool, head_value)
    }
}

/// `[s, heads, width]` from `head(h)` = head h's `[s, width]`, one head per task on `pool`
/// (in order on this thread without one); the first error, if any head fails.
fn per_head(
    heads: usize,
    s: usize,
    width: usize,
    pool: Option<&rayon::ThreadPool>,
    head: impl Fn(usize) -> Result<Vec<f32>> + Sync,
) -> Result<Vec<f32>> {
    let parts: Vec<Vec<f32>> = match pool {
        Some(p) => p.install(|| (0..heads).into_par_iter().map(&head).collect::<Result<_>>())?,
        None => (0..heads).map(&head).collect::<Result<_>>()?,
    };
    let mut out = vec![0.0f32; s * heads * width];
    for (h, part) in parts.iter().enumerate() {
        for r in 0..s {
            out[(r * heads + h) * width..(r * heads + h + 1) * width]
                .copy_from_slice(&part[r * width..(r + 1) * width]);
        }
    }
    Ok(out)
}
