//! What a trace's routing looks like, in the terms GLM-5.2's public figures use: how many
//! experts consecutive tokens share, how well the router lookahead recalls the next layer,
//! how skewed each layer is, how strongly experts co-fire by topic, and how many drafts the
//! verifies accepted.

use std::collections::HashMap;

use serde::Serialize;

use super::histogram::{median, Skew};
use super::trace::{RowKind, Trace};

/// A trace's routing statistics (medians over layers where per-layer).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceStats {
    pub rows: usize,
    pub forwards: usize,
    pub conversations: usize,
    pub generated_tokens: u64,
    /// Mean share of a token's experts that the previous generated token of its conversation
    /// also routed to, per layer (GLM-5.2: 0.413; uniform: k/n).
    pub consecutive_overlap: f64,
    /// Mean share of a row's experts the router lookahead predicted (GLM-5.2: 0.716).
    pub lookahead_recall: f64,
    /// Median over layers of the share of experts that hold half the selections (0.19).
    pub half_share: f64,
    /// Median share of the selections held by the top 10% of experts (0.34).
    pub top10_share: f64,
    pub gini: f64,
    /// Median rate of each layer's hottest expert (0.21).
    pub hottest_rate: f64,
    /// Median lift of the 300 most co-activated pairs per layer, counted per conversation as
    /// the public file counted per topic (2.94), and their median topic support (2).
    pub pair_lift: f64,
    pub pair_support: f64,
    /// P(the first d drafts were accepted) for d = 1..depth.
    pub acceptance: Vec<f64>,
    /// Generated tokens per decode forward.
    pub tokens_per_forward: f64,
}

/// The generated tokens' rows in order: decode rows and accepted drafts, by conversation.
fn real_rows(t: &Trace) -> Vec<Vec<usize>> {
    let mut by_conv: Vec<(u32, Vec<usize>)> = Vec::new();
    for (i, r) in t.rows.iter().enumerate() {
        if r.kind == RowKind::Decode || r.accepted == Some(true) {
            match by_conv.last_mut() {
                Some((c, v)) if *c == r.conv => v.push(i),
                _ => by_conv.push((r.conv, vec![i])),
            }
        }
    }
    by_conv.into_iter().map(|(_, v)| v).collect()
}

fn shared(a: &[u16], b: &[u16]) -> usize {
    a.iter().filter(|x| b.contains(x)).count()
}

impl TraceStats {
    pub fn of(t: &Trace) -> TraceStats {
        let nl = t.header.layers.len();
        let n = t.header.experts;
        let convs = real_rows(t);
        let (mut ov, mut ov_n) = (0.0, 0usize);
        for rows in &convs {
            for w in rows.windows(2) {
                let (a, b) = (&t.rows[w[0]].experts, &t.rows[w[1]].experts);
                for l in 0..nl {
                    ov += shared(&a[l], &b[l]) as f64 / b[l].len().max(1) as f64;
                    ov_n += 1;
                }
            }
        }
        let (mut rec, mut rec_n) = (0.0, 0usize);
        for r in &t.rows {
            if let Some(p) = &r.lookahead {
                for (pred, got) in p.iter().zip(&r.experts).take(nl) {
                    rec += shared(pred, got) as f64 / got.len().max(1) as f64;
                    rec_n += 1;
                }
            }
        }
        let all: Vec<usize> = convs.iter().flatten().copied().collect();
        let skews: Vec<Skew> = (0..nl)
            .map(|l| {
                let mut c = vec![0u64; n];
                for &i in &all {
                    for &e in &t.rows[i].experts[l] {
                        c[e as usize] += 1;
                    }
                }
                Skew::of(&c, all.len() as u64)
            })
            .collect();
        let med = |f: fn(&Skew) -> f64| median(skews.iter().map(f).collect());
        let (pair_lift, pair_support) = pair_figures(t, &convs);
        let forwards = t.forwards();
        let decode_forwards: Vec<_> = forwards
            .iter()
            .filter(|f| {
                t.rows[f.start..f.end]
                    .iter()
                    .any(|r| r.kind == RowKind::Decode)
            })
            .collect();
        let depth = decode_forwards
            .iter()
            .map(|f| {
                t.rows[f.start..f.end]
                    .iter()
                    .filter(|r| r.kind == RowKind::Draft)
                    .count()
            })
            .max()
            .unwrap_or(0);
        let acceptance = (1..=depth)
            .map(|d| {
                let (mut yes, mut of) = (0usize, 0usize);
                for f in &decode_forwards {
                    let drafts: Vec<_> = t.rows[f.start..f.end]
                        .iter()
                        .filter(|r| r.kind == RowKind::Draft)
                        .collect();
                    if drafts.len() >= d {
                        of += 1;
                        yes += drafts[..d].iter().all(|r| r.accepted == Some(true)) as usize;
                    }
                }
                yes as f64 / of.max(1) as f64
            })
            .collect();
        TraceStats {
            rows: t.rows.len(),
            forwards: forwards.len(),
            conversations: convs.len(),
            generated_tokens: t.generated_tokens(),
            consecutive_overlap: ov / ov_n.max(1) as f64,
            lookahead_recall: rec / rec_n.max(1) as f64,
            half_share: med(|s| s.half_share),
            top10_share: med(|s| s.top10_share),
            gini: med(|s| s.gini),
            hottest_rate: med(|s| s.hottest_rate),
            pair_lift,
            pair_support,
            acceptance,
            tokens_per_forward: t.generated_tokens() as f64 / decode_forwards.len().max(1) as f64,
        }
    }
}

/// Median lift and topic support of each layer's 300 most co-activated pairs (of those that
/// co-fired at least 5 times), as the public file selected and computed them: count = rows
/// where both fired, lift = count / expected if independent,
/// support = conversations (topics) in which the pair co-fired at least twice.
fn pair_figures(t: &Trace, convs: &[Vec<usize>]) -> (f64, f64) {
    let nl = t.header.layers.len();
    let n = t.header.experts;
    let rows: f64 = convs.iter().map(Vec::len).sum::<usize>() as f64;
    let mut lifts = Vec::new();
    let mut supports = Vec::new();
    for l in 0..nl {
        let mut heat = vec![0u64; n];
        let mut pairs: HashMap<(u16, u16), (u64, Vec<u32>)> = HashMap::new();
        for (ci, conv) in convs.iter().enumerate() {
            for &i in conv {
                let ids = &t.rows[i].experts[l];
                for &e in ids {
                    heat[e as usize] += 1;
                }
                for (a, &x) in ids.iter().enumerate() {
                    for &y in &ids[a + 1..] {
                        let p = pairs.entry((x.min(y), x.max(y))).or_default();
                        p.0 += 1;
                        if p.1.len() <= ci {
                            p.1.resize(ci + 1, 0);
                        }
                        p.1[ci] += 1;
                    }
                }
            }
        }
        let mut top: Vec<_> = pairs.into_iter().collect();
        top.sort_unstable_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
        // The file kept pairs that co-fired at least 5 times, then the 300 most frequent.
        for ((x, y), (count, per_conv)) in top.into_iter().filter(|p| p.1 .0 >= 5).take(300) {
            let expect = heat[x as usize] as f64 * heat[y as usize] as f64 / rows.max(1.0);
            lifts.push(count as f64 / expect.max(1e-9));
            supports.push(per_conv.iter().filter(|&&c| c >= 2).count() as f64);
        }
    }
    (median(lifts), median(supports))
}

impl std::fmt::Display for TraceStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "rows {}  forwards {}  conversations {}  generated tokens {}  tokens/forward {:.2}",
            self.rows,
            self.forwards,
            self.conversations,
            self.generated_tokens,
            self.tokens_per_forward
        )?;
        writeln!(
            f,
            "consecutive-token overlap   {:.3}   (GLM-5.2 0.413)",
            self.consecutive_overlap
        )?;
        writeln!(
            f,
            "router lookahead recall     {:.3}   (GLM-5.2 0.716)",
            self.lookahead_recall
        )?;
        writeln!(
            f,
            "skew: half the selections on {:.1}% of experts (19%), top 10% hold {:.1}% (34%), Gini {:.2} (0.47), hottest {:.1}% of rows (21%)",
            100.0 * self.half_share,
            100.0 * self.top10_share,
            self.gini,
            100.0 * self.hottest_rate
        )?;
        writeln!(
            f,
            "co-activated pairs: median lift {:.2} (2.94), topic support {:.1} (2)",
            self.pair_lift, self.pair_support
        )?;
        if !self.acceptance.is_empty() {
            let acc: Vec<String> = self.acceptance.iter().map(|a| format!("{a:.3}")).collect();
            writeln!(
                f,
                "drafts accepted per depth   {}   (GLM-5.2 0.834 / 0.653 / 0.494)",
                acc.join(" / ")
            )?;
        }
        Ok(())
    }
}
