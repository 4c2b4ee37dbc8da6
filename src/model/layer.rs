//! A decoder layer (attention half, feed-forward half, the router lookahead's pieces) and the
//! MTP head's own weights around its layer.

use crate::config::ModelConfig;
use crate::container::{Container, Weight};
use crate::error::Result;
use crate::model::attention::{Attention, Form, LayerKv};
use crate::model::indexer::Selection;
use crate::model::linear;
use crate::model::moe::{ExpertProvider, Mlp, Moe, Routing};
use crate::model::norm::rmsnorm;
use crate::model::rope::Rope;

/// The feed-forward half of a decoder layer.
enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

/// One decoder layer (main model or the MTP block).
pub(super) struct Layer {
    input_layernorm: Vec<f32>,
    pub(super) self_attn: Attention,
    post_attention_layernorm: Vec<f32>,
    ffn: Ffn,
}

impl Layer {
    /// Layer `index`; a MoE layer routes each row to `top_k` experts.
    pub(super) fn load(
        c: &Container,
        cfg: &ModelConfig,
        index: usize,
        dsa: bool,
        top_k: usize,
    ) -> Result<Self> {
        let p = format!("model.layers.{index}");
        let h = cfg.hidden_size;
        let ffn = if cfg.is_moe_layer(index) {
            Ffn::Moe(Moe::load(c, cfg, index, top_k)?)
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
    pub(super) fn attend(
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
    pub(super) fn new_kv(&self, cfg: &ModelConfig) -> LayerKv {
        LayerKv::new(
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            self.self_attn.index_key_dim(),
        )
    }

    /// Feed-forward half: `x += FFN(post_attention_layernorm(x))`. `resident` is
    /// [`Layer::resident_ffn`]'s output when the router lookahead already computed it.
    /// Returns each row's routing on a MoE layer.
    pub(super) fn feed_forward(
        &self,
        x: &mut [f32],
        s: usize,
        eps: f32,
        experts: &dyn ExpertProvider,
        pool: Option<&rayon::ThreadPool>,
        resident: Option<Vec<f32>>,
    ) -> Result<Option<Vec<Routing>>> {
        let h = rmsnorm(x, &self.post_attention_layernorm, eps);
        let (y, routing) = match (&self.ffn, resident) {
            (Ffn::Dense(_), Some(y)) => (y, None),
            (Ffn::Dense(mlp), None) => (mlp.forward(&h, s, pool)?, None),
            (Ffn::Moe(moe), resident) => {
                let (y, routing) = moe.forward(&h, s, experts, pool, resident)?;
                (y, Some(routing))
            }
        };
        for (v, d) in x.iter_mut().zip(&y) {
            *v += d;
        }
        Ok(routing)
    }

    /// The resident part of this layer's feed-forward on `x` (after attention): the whole
    /// output of a dense layer, or the shared experts' output of a MoE layer. The router
    /// lookahead adds it to the residual: it is what the next layer will see, minus the
    /// routed experts.
    pub(super) fn resident_ffn(
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
    pub(super) fn predict(
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
pub(super) struct MtpHead {
    pub(super) enorm: Vec<f32>,
    pub(super) hnorm: Vec<f32>,
    /// [hidden, 2·hidden]: applied to [enorm(embed(t)) ; hnorm(norm(h))].
    pub(super) eh_proj: Weight,
    pub(super) layer: Layer,
    pub(super) shared_head_norm: Vec<f32>,
}

impl MtpHead {
    /// The head at layer `index`, its MoE routing each row to `top_k` experts (the main
    /// layers' k: a draft routes as the model it drafts for).
    pub(super) fn load(
        c: &Container,
        cfg: &ModelConfig,
        index: usize,
        dsa: bool,
        top_k: usize,
    ) -> Result<Self> {
        let p = format!("model.layers.{index}");
        let h = cfg.hidden_size;
        Ok(MtpHead {
            enorm: linear::load_vector(c, &format!("{p}.enorm.weight"), h)?,
            hnorm: linear::load_vector(c, &format!("{p}.hnorm.weight"), h)?,
            eh_proj: linear::load(c, &format!("{p}.eh_proj.weight"), h, 2 * h)?,
            layer: Layer::load(c, cfg, index, dsa, top_k)?,
            shared_head_norm: linear::load_vector(c, &format!("{p}.shared_head.norm.weight"), h)?,
        })
    }

    /// Whether every tensor the head needs is present (a checkpoint may ship without it).
    pub(super) fn present(c: &Container, index: usize) -> bool {
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
