//! The feed-forward blocks: dense MLP, the noaux_tc router, and the MoE that runs the union of
//! the experts chosen by S rows (each expert fetched once per forward) plus the shared expert.

use crate::config::ModelConfig;
use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::experts::{ExpertBatch, ExpertView, ReadPrice};
use crate::model::linear;
use crate::model::remote::{ExpertRows, RemoteExperts};
use crate::quant::kernels;
use crate::quant::QMatrix;

/// `down(silu(gate·x) ⊙ up·x)` over `s` rows of `x`, in this thread's arithmetic
/// (`linear::arithmetic`).
pub fn ffn(
    gate: &QMatrix<'_>,
    up: &QMatrix<'_>,
    down: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    pool: Option<&rayon::ThreadPool>,
) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; s * down.rows()];
    kernels::expert_ffn_in(linear::arithmetic(), gate, up, down, x, s, &mut out, pool)?;
    Ok(out)
}

/// A dense gated MLP (dense-first layers and the shared experts).
pub struct Mlp {
    gate_proj: Weight,
    up_proj: Weight,
    down_proj: Weight,
}

impl Mlp {
    pub fn load(c: &Container, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        Ok(Mlp {
            gate_proj: linear::load(c, &format!("{prefix}.gate_proj.weight"), inter, hidden)?,
            up_proj: linear::load(c, &format!("{prefix}.up_proj.weight"), inter, hidden)?,
            down_proj: linear::load(c, &format!("{prefix}.down_proj.weight"), hidden, inter)?,
        })
    }

    /// Gate, up and down as the kernels take them.
    fn views(&self) -> [QMatrix<'_>; 3] {
        [
            self.gate_proj.view(),
            self.up_proj.view(),
            self.down_proj.view(),
        ]
    }

    pub fn forward(
        &self,
        x: &[f32],
        s: usize,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<f32>> {
        ffn(
            &self.gate_proj.view(),
            &self.up_proj.view(),
            &self.down_proj.view(),
            x,
            s,
            pool,
        )
    }
}

/// Where routed experts come from: all resident (tiny models, tests) or the streaming store.
pub trait ExpertProvider: Send + Sync {
    /// Make experts `ids` of `layer` available and call `f` with them in batches of
    /// `(id, view)`, each id once, in any order: those available at once as one batch (run as
    /// one by the kernels: fewer fork-joins), the others as they arrive.
    fn with_expert_batches(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(&ExpertBatch<'_>) -> Result<()>,
    ) -> Result<()>;

    /// Predicted experts of `layer` (router lookahead): bring them in early if possible.
    fn prefetch(&self, _layer: usize, _ids: &[usize]) {}

    /// `layer` is about to run (a chance to hint the experts the previous token used there).
    fn begin_layer(&self, _layer: usize) {}

    /// What the reads of a draft cost, for `k` routed experts per token with the MTP layer at
    /// `mtp_layer` (`experts::read_costs`); `None` when nothing is read (all resident).
    fn read_price(&self, _k: usize, _mtp_layer: Option<usize>) -> Option<ReadPrice> {
        None
    }

    /// Where experts may also be computed (`model::remote`); none by default.
    fn remote(&self) -> Option<&dyn RemoteExperts> {
        None
    }
}

/// Every expert loaded at start-up (owned copies read from the container).
pub struct ResidentExperts {
    /// [layer][expert] → (gate, up, down); empty for dense layers.
    layers: Vec<Vec<[Weight; 3]>>,
}

impl ResidentExperts {
    pub fn load(c: &Container, cfg: &ModelConfig, layers: &[usize]) -> Result<Self> {
        let mut out: Vec<Vec<[Weight; 3]>> = Vec::new();
        let h = cfg.hidden_size;
        for &l in layers {
            let mi = cfg.moe_intermediate(l);
            if out.len() <= l {
                out.resize_with(l + 1, Vec::new);
            }
            let mut experts = Vec::with_capacity(cfg.n_routed_experts);
            for e in 0..cfg.n_routed_experts {
                let p = format!("model.layers.{l}.mlp.experts.{e}");
                experts.push([
                    linear::load(c, &format!("{p}.gate_proj.weight"), mi, h)?,
                    linear::load(c, &format!("{p}.up_proj.weight"), mi, h)?,
                    linear::load(c, &format!("{p}.down_proj.weight"), h, mi)?,
                ]);
            }
            out[l] = experts;
        }
        Ok(ResidentExperts { layers: out })
    }
}

impl ExpertProvider for ResidentExperts {
    fn with_expert_batches(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(&ExpertBatch<'_>) -> Result<()>,
    ) -> Result<()> {
        let experts = self
            .layers
            .get(layer)
            .ok_or_else(|| Error::Internal(format!("layer {layer} has no experts")))?;
        let batch = ids
            .iter()
            .map(|&id| {
                let [g, u, d] = experts
                    .get(id)
                    .ok_or_else(|| Error::Internal(format!("expert {id} of layer {layer}")))?;
                Ok((
                    id,
                    ExpertView {
                        gate: g.view(),
                        up: u.view(),
                        down: d.view(),
                    },
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        f(&batch)
    }
}

/// The routed experts per token in effect: `requested` (the `experts_per_token` option) when
/// it is in `1..=k`, the model's own `k` (`num_experts_per_tok`) when it is `None`.
pub fn experts_per_token(requested: Option<usize>, k: usize) -> Result<usize> {
    match requested {
        None => Ok(k),
        Some(n) if (1..=k).contains(&n) => Ok(n),
        Some(n) => Err(Error::invalid(
            "experts_per_token",
            format!(
                "{n}; this model routes each token to {k} experts (num_experts_per_tok), so \
                 the allowed range is 1..={k}"
            ),
        )),
    }
}

/// The noaux_tc router: sigmoid scores, bias-corrected choice, optional group limit.
///
/// `top_k` is the routed experts per token in effect: the config's `num_experts_per_tok`, or
/// fewer with the `experts_per_token` option. The fewer are the best of the same choice
/// (after the group limit, which does not depend on k), and their weights are normalised as
/// the model normalises its own k: over the chosen experts when `norm_topk_prob`, then
/// times `routed_scaling_factor`.
pub struct Router {
    /// [n_routed_experts, hidden], kept in f32 as the checkpoints ship it.
    weight: Weight,
    e_score_correction_bias: Vec<f32>,
    top_k: usize,
    n_group: usize,
    topk_group: usize,
    norm_topk_prob: bool,
    routed_scaling_factor: f32,
}

/// The chosen experts of one row and their weights (top_k entries each).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub ids: Vec<usize>,
    pub weights: Vec<f32>,
}

impl Router {
    /// The router at `prefix`, choosing `top_k` experts per row (at most the config's
    /// `num_experts_per_tok`: see [`experts_per_token`]).
    pub fn load(c: &Container, cfg: &ModelConfig, prefix: &str, top_k: usize) -> Result<Self> {
        let e = cfg.n_routed_experts;
        Ok(Router {
            weight: linear::load(c, &format!("{prefix}.gate.weight"), e, cfg.hidden_size)?,
            e_score_correction_bias: linear::load_vector(
                c,
                &format!("{prefix}.gate.e_score_correction_bias"),
                e,
            )?,
            top_k,
            n_group: cfg.n_group.max(1),
            topk_group: cfg.topk_group.max(1),
            norm_topk_prob: cfg.norm_topk_prob,
            routed_scaling_factor: cfg.routed_scaling_factor,
        })
    }

    /// Experts chosen per token (`num_experts_per_tok`, or the `experts_per_token` option).
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Route `s` rows of `h` ([s, hidden]); `top_k` overrides the config's k (prefetch uses
    /// a wider prediction).
    pub fn route(
        &self,
        h: &[f32],
        s: usize,
        top_k: usize,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Vec<Routing>> {
        let logits = linear::apply(&self.weight, h, s, pool)?;
        let e = self.e_score_correction_bias.len();
        Ok(logits
            .chunks_exact(e)
            .map(|row| self.route_row(row, top_k))
            .collect())
    }

    fn route_row(&self, logits: &[f32], top_k: usize) -> Routing {
        let e = logits.len();
        let scores: Vec<f32> = logits.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
        let mut choice: Vec<f32> = scores
            .iter()
            .zip(&self.e_score_correction_bias)
            .map(|(s, b)| s + b)
            .collect();
        if self.n_group > 1 {
            let per = e / self.n_group;
            // A group's score is the sum of its best two choice scores.
            let group_scores: Vec<f32> = choice
                .chunks_exact(per)
                .map(|g| {
                    let best = top_indices(g, 2.min(per));
                    best.iter().map(|&i| g[i]).sum()
                })
                .collect();
            let keep = top_indices(&group_scores, self.topk_group);
            for (g, chunk) in choice.chunks_exact_mut(per).enumerate() {
                if !keep.contains(&g) {
                    chunk.fill(f32::NEG_INFINITY);
                }
            }
        }
        let ids = top_indices(&choice, top_k.min(e));
        let mut weights: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
        if self.norm_topk_prob {
            let denom: f32 = weights.iter().sum::<f32>() + 1e-20;
            for w in &mut weights {
                *w /= denom;
            }
        }
        for w in &mut weights {
            *w *= self.routed_scaling_factor;
        }
        Routing { ids, weights }
    }
}

/// Indices of the `k` largest values, best first; ties go to the lowest index.
pub fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// A MoE block: router, routed experts (from an [`ExpertProvider`]) and shared experts.
pub struct Moe {
    pub router: Router,
    shared: Option<Mlp>,
    layer: usize,
}

impl Moe {
    /// The MoE block of `layer`, its router choosing `top_k` experts per row.
    pub fn load(c: &Container, cfg: &ModelConfig, layer: usize, top_k: usize) -> Result<Self> {
        let prefix = format!("model.layers.{layer}.mlp");
        let shared = if cfg.n_shared_experts > 0 {
            Some(Mlp::load(
                c,
                &format!("{prefix}.shared_experts"),
                cfg.hidden_size,
                cfg.moe_intermediate(layer) * cfg.n_shared_experts,
            )?)
        } else {
            None
        };
        Ok(Moe {
            router: Router::load(c, cfg, &prefix, top_k)?,
            shared,
            layer,
        })
    }

    /// MoE over `s` rows of normed `h`: route every row, fetch the union of chosen experts once,
    /// run each on the rows that chose it, and sum per row in ascending expert order (so the
    /// result does not depend on the order experts arrive in).
    ///
    /// `shared_out` is the shared experts' output for `h` when the caller already computed it
    /// (the router lookahead uses it); it is computed here otherwise. Returns the output and
    /// each row's routing.
    pub fn forward(
        &self,
        h: &[f32],
        s: usize,
        experts: &dyn ExpertProvider,
        pool: Option<&rayon::ThreadPool>,
        shared_out: Option<Vec<f32>>,
    ) -> Result<(Vec<f32>, Vec<Routing>)> {
        let hidden = h.len() / s.max(1);
        let routing = self.router.route(h, s, self.router.top_k, pool)?;
        let mut union: Vec<usize> = routing.iter().flat_map(|r| r.ids.iter().copied()).collect();
        union.sort_unstable();
        union.dedup();
        // per_row[r] = (expert id, weighted output) for each of row r's choices.
        let mut per_row: Vec<Vec<(usize, Vec<f32>)>> = vec![Vec::new(); s];
        // The shared experts join the first batch unless the caller computed them.
        let mut shared_out = shared_out;
        let mut shared = self.shared.as_ref().filter(|_| shared_out.is_none());
        // The rows (and their weights) that chose expert `id`, in row order.
        let rows_of = |id: usize| -> Vec<(usize, f32)> {
            routing
                .iter()
                .enumerate()
                .filter_map(|(r, rt)| {
                    rt.ids
                        .iter()
                        .position(|&x| x == id)
                        .map(|k| (r, rt.weights[k]))
                })
                .collect()
        };
        // Experts a remote worker holds go out first and run there meanwhile.
        let pending = experts.remote().and_then(|remote| {
            let want: Vec<ExpertRows> = union
                .iter()
                .map(|&expert| ExpertRows {
                    expert,
                    rows: rows_of(expert).into_iter().map(|(r, _)| r).collect(),
                })
                .collect();
            remote.submit(self.layer, linear::arithmetic(), h, s, &want)
        });
        let local: Vec<usize> = match &pending {
            Some(p) => union
                .iter()
                .copied()
                .filter(|id| !p.taken().contains(id))
                .collect(),
            None => union.clone(),
        };
        let mut run_batch = |batch: &ExpertBatch<'_>| -> Result<()> {
            if batch.is_empty() && shared.is_none() {
                return Ok(());
            }
            // rows[i] = (row, weight) of each row that chose batch[i]'s expert.
            let rows: Vec<Vec<(usize, f32)>> = batch.iter().map(|(id, _)| rows_of(*id)).collect();
            let xs: Vec<Vec<f32>> = rows
                .iter()
                .map(|rows| {
                    let mut xs = Vec::with_capacity(rows.len() * hidden);
                    for &(r, _) in rows {
                        xs.extend_from_slice(&h[r * hidden..(r + 1) * hidden]);
                    }
                    xs
                })
                .collect();
            let mut calls: Vec<kernels::ExpertCall<'_>> = batch
                .iter()
                .zip(&rows)
                .zip(&xs)
                .map(|(((_, w), rows), xs)| {
                    kernels::ExpertCall::new(&w.gate, &w.up, &w.down, xs, rows.len())
                })
                .collect();
            let shared_views = shared.take().map(Mlp::views);
            if let Some([gate, up, down]) = &shared_views {
                calls.push(kernels::ExpertCall::new(gate, up, down, h, s));
            }
            let mut ys: Vec<Vec<f32>> = calls.iter().map(|c| vec![0.0f32; c.s * hidden]).collect();
            let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
            kernels::experts_ffn_in(linear::arithmetic(), &calls, &mut outs, pool)?;
            if shared_views.is_some() {
                shared_out = ys.pop();
            }
            for (((id, _), rows), y) in batch.iter().zip(&rows).zip(&ys) {
                for (k, &(r, weight)) in rows.iter().enumerate() {
                    let out = y[k * hidden..(k + 1) * hidden]
                        .iter()
                        .map(|v| v * weight)
                        .collect();
                    per_row[r].push((*id, out));
                }
            }
            Ok(())
        };
        experts.with_expert_batches(self.layer, &local, &mut run_batch)?;
        let mut remote_rows = Vec::new();
        if let Some(p) = pending {
            // Every routed expert is remote: the shared ones (in a batch of their own) still
            // run while the workers do.
            if local.is_empty() {
                run_batch(&[])?;
            }
            let taken: Vec<usize> = p
                .taken()
                .iter()
                .copied()
                .filter(|id| union.contains(id))
                .collect();
            let answered = p.collect().done;
            // An answer of the wrong size counts as none: that expert runs here.
            let mut missing: Vec<usize> = taken
                .iter()
                .copied()
                .filter(|&id| {
                    !answered
                        .iter()
                        .any(|(e, y)| *e == id && y.len() == rows_of(id).len() * hidden)
                })
                .collect();
            missing.sort_unstable();
            missing.dedup();
            if !missing.is_empty() {
                experts.with_expert_batches(self.layer, &missing, &mut run_batch)?;
            }
            for (id, y) in answered {
                let fresh = !remote_rows
                    .iter()
                    .any(|(e, _): &(usize, Vec<f32>)| *e == id);
                if fresh && taken.contains(&id) && !missing.contains(&id) {
                    remote_rows.push((id, y));
                }
            }
        }
        for (id, y) in remote_rows {
            for (k, (r, weight)) in rows_of(id).into_iter().enumerate() {
                let out = y[k * hidden..(k + 1) * hidden]
                    .iter()
                    .map(|v| v * weight)
                    .collect();
                per_row[r].push((id, out));
            }
        }
        let mut out = vec![0.0f32; s * hidden];
        for (r, mut contributions) in per_row.into_iter().enumerate() {
            contributions.sort_by_key(|(id, _)| *id);
            let dst = &mut out[r * hidden..(r + 1) * hidden];
            for (_, y) in contributions {
                for (a, b) in dst.iter_mut().zip(&y) {
                    *a += b;
                }
            }
        }
        // Without routed experts to run (no batch came), the shared ones run here.
        let shared_out = match (shared_out, shared) {
            (Some(y), _) => Some(y),
            (None, Some(mlp)) => Some(mlp.forward(h, s, pool)?),
            (None, None) => None,
        };
        if let Some(y) = shared_out {
            for (a, b) in out.iter_mut().zip(&y) {
                *a += b;
            }
        }
        Ok((out, routing))
    }

    /// The shared experts' output for `h` ([s, hidden]); `None` without shared experts.
    pub fn shared_output(
        &self,
        h: &[f32],
        s: usize,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Option<Vec<f32>>> {
        self.shared
            .as_ref()
            .map(|m| m.forward(h, s, pool))
            .transpose()
    }
}

#[cfg(test)]
#[path = "moe_tests.rs"]
mod tests;
