//! The core of absorbed MLA: each query row's scores over its keys in the latent cache, their
//! softmax, and the weighted sum of the keys' latents (`o_lat`), in one pass over the cache.
//!
//! The keys of a row are cut into fixed blocks of [`KEY_BLOCK`]. For a block and a head, the
//! block's scores, their maximum m_b, `p = exp(score − m_b)`, their sum l_b and the unnormalised
//! sum `a_b = Σ p · latent` are computed while the block's latents are in cache; the blocks are
//! then merged in ascending order: `M = max m_b`, `L = Σ_b e^(m_b − M) · l_b`,
//! `o = Σ_b (e^(m_b − M) / L) · a_b`. Every block of every head is computed the same way
//! whichever task computes it, and the merge order is fixed, so the result depends neither on
//! the thread count nor on S (a row is computed by itself).
//!
//! Why one pass: at long contexts the cache, not the arithmetic, is the cost. Scores first and
//! sums after read every latent twice, and splitting the heads across threads made each thread
//! read them all; here a task takes blocks with all their heads, so the cache is read about
//! once per token (docs/benchmarks.md, "Attention in one pass over the cache").

use rayon::prelude::*;

use crate::model::indexer::Selection;
use crate::quant::kernels::vecops::{VecOps, BATCH};

/// Keys per block: 64 latent rows (128 KiB at kv_lora 512, 64 KiB at 256) stay in L2 while
/// every head of the block uses them. A multiple of BATCH.
pub(super) const KEY_BLOCK: usize = 64;

/// Blocks (over all rows) whose partial results are held at once: bounds the memory of a long
/// exact prefill (each holds `heads · (kv_lora + 2)` floats) without changing any value.
const BLOCKS_AT_ONCE: usize = 1024;

/// Merge on the pool only from this many (block, head) partials: below it (a few blocks,
/// short contexts) the fork costs more than the merge's axpys.
const MERGE_FORK_MIN: usize = 128;

/// One forward's attention inputs, in the layouts `attention.rs` builds them.
pub(super) struct Inputs<'a> {
    pub heads: usize,
    /// kv_lora: the latent width.
    pub kl: usize,
    /// qk_rope_head_dim.
    pub rd: usize,
    /// qk_nope_head_dim: the rope part of a query row starts here.
    pub nope: usize,
    /// Roped queries [s, heads, nope + rd] (only their rope parts are read here).
    pub q: &'a [f32],
    /// Absorbed queries [s, heads, kl].
    pub q_lat: &'a [f32],
    pub s: usize,
    /// Position of the first row (row r sees keys `0..=start + r`).
    pub start: usize,
    /// The cache: normed latents [keys, kl] and roped shared keys [keys, rd].
    pub latent: &'a [f32],
    pub rope_key: &'a [f32],
    /// DSA: the keys each row attends to (ascending), instead of all earlier ones.
    pub selection: Option<&'a Selection>,
    pub scale: f32,
}

/// One block's partial result for heads `h0 .. h0 + n` of row `r`.
struct Partial {
    /// Per head: the block's largest score and the sum of `exp(score − max)`.
    max: Vec<f32>,
    sum: Vec<f32>,
    /// Per head, `kl` floats: `Σ exp(score − max) · latent`.
    acc: Vec<f32>,
}

impl Inputs<'_> {
    fn keys(&self, r: usize) -> usize {
        self.selection
            .map_or(self.start + r + 1, |sel| sel[r].len())
    }

    fn key(&self, r: usize, i: usize) -> usize {
        self.selection.map_or(i, |sel| sel[r][i] as usize)
    }

    fn latent(&self, j: usize) -> &[f32] {
        &self.latent[j * self.kl..(j + 1) * self.kl]
    }

    fn rope_key(&self, j: usize) -> &[f32] {
        &self.rope_key[j * self.rd..(j + 1) * self.rd]
    }

    fn q_lat(&self, r: usize, h: usize) -> &[f32] {
        let at = (r * self.heads + h) * self.kl;
        &self.q_lat[at..at + self.kl]
    }

    fn q_rope(&self, r: usize, h: usize) -> &[f32] {
        let qd = self.nope + self.rd;
        let at = r * self.heads * qd + h * qd + self.nope;
        &self.q[at..at + self.rd]
    }

    /// Block `b` of row `r` for heads `h0 .. h0 + n` (`h0` and, unless it ends at `heads`,
    /// `n` multiples of BATCH, so the heads are batched as with all heads at once).
    fn block(&self, ops: &VecOps, r: usize, b: usize, h0: usize, n: usize) -> Partial {
        let kl = self.kl;
        let (i0, i1) = (b * KEY_BLOCK, ((b + 1) * KEY_BLOCK).min(self.keys(r)));
        let len = i1 - i0;
        // scores[h][i] for the block's keys; each key's latent serves every head from L1.
        let mut scores = vec![0.0f32; n * len];
        for i in 0..len {
            let j = self.key(r, i0 + i);
            let (lat, rk) = (self.latent(j), self.rope_key(j));
            for g0 in (h0..h0 + n).step_by(BATCH) {
                if g0 + BATCH <= h0 + n {
                    let c = ops.dots(lat, std::array::from_fn(|k| self.q_lat(r, g0 + k)));
                    let k = ops.dots(rk, std::array::from_fn(|k| self.q_rope(r, g0 + k)));
                    for h in 0..BATCH {
                        scores[(g0 - h0 + h) * len + i] = (c[h] + k[h]) * self.scale;
                    }
                } else {
                    for h in g0..h0 + n {
                        let v = ops.dot(self.q_lat(r, h), lat) + ops.dot(self.q_rope(r, h), rk);
                        scores[(h - h0) * len + i] = v * self.scale;
                    }
                }
            }
        }
        let mut max = vec![f32::NEG_INFINITY; n];
        let mut sum = vec![0.0f32; n];
        for ((sc, m), l) in scores.chunks_exact_mut(len).zip(&mut max).zip(&mut sum) {
            *m = sc.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            for v in sc.iter_mut() {
                *v = (*v - *m).exp();
                *l += *v;
            }
        }
        // acc[h] = Σ p · latent: four keys per call from the block's start, the tail one by one.
        let mut acc = vec![0.0f32; n * kl];
        let whole = len - len % BATCH;
        for i in (0..whole).step_by(BATCH) {
            let rows: [&[f32]; BATCH] =
                std::array::from_fn(|k| self.latent(self.key(r, i0 + i + k)));
            for (a, sc) in acc.chunks_exact_mut(kl).zip(scores.chunks_exact(len)) {
                ops.axpys(a, std::array::from_fn(|k| sc[i + k]), rows);
            }
        }
        for i in whole..len {
            let row = self.latent(self.key(r, i0 + i));
            for (a, sc) in acc.chunks_exact_mut(kl).zip(scores.chunks_exact(len)) {
                ops.axpy(a, sc[i], row);
            }
        }
        Partial { max, sum, acc }
    }
}

/// `o_lat` [s, heads, kl]: every row's attention over its keys (see the module docs).
pub(super) fn attend(x: &Inputs<'_>, ops: VecOps, pool: Option<&rayon::ThreadPool>) -> Vec<f32> {
    let (heads, kl, s) = (x.heads, x.kl, x.s);
    let mut out = vec![0.0f32; s * heads * kl];
    if heads == 0 || kl == 0 {
        return out;
    }
    let threads = pool.map_or(1, |p| p.current_num_threads()).max(1);
    let mut r0 = 0;
    while r0 < s {
        // Rows r0..r1, at most BLOCKS_AT_ONCE blocks (at least one row).
        let mut r1 = r0;
        let mut blocks = 0;
        while r1 < s && (r1 == r0 || blocks + x.keys(r1).div_ceil(KEY_BLOCK) <= BLOCKS_AT_ONCE) {
            blocks += x.keys(r1).div_ceil(KEY_BLOCK);
            r1 += 1;
        }
        // Few blocks (short contexts): cut the heads too, in whole batches, so that every
        // thread has work. The cut changes no value.
        let groups = heads.div_ceil(BATCH);
        let cuts = if blocks >= 2 * threads {
            1
        } else {
            groups.min(threads)
        };
        let per = groups.div_ceil(cuts) * BATCH;
        let items: Vec<(usize, usize, usize)> = (r0..r1)
            .flat_map(|r| {
                (0..x.keys(r).div_ceil(KEY_BLOCK))
                    .flat_map(move |b| (0..heads).step_by(per).map(move |h0| (r, b, h0)))
            })
            .collect();
        let run =
            |&(r, b, h0): &(usize, usize, usize)| x.block(&ops, r, b, h0, per.min(heads - h0));
        let parts: Vec<Partial> = match pool {
            Some(p) => p.install(|| items.par_iter().map(run).collect()),
            None => items.iter().map(run).collect(),
        };
        // Merge each row's blocks per head, in ascending block order; one task per (row, head).
        let merge = |(i, o): (usize, &mut [f32])| {
            let (r, h) = (r0 + i / heads, i % heads);
            let first = items.partition_point(|&(ir, ..)| ir < r);
            let of_head = items[first..]
                .iter()
                .zip(&parts[first..])
                .take_while(|((ir, ..), _)| *ir == r)
                .filter(|((.., h0), _)| (*h0..*h0 + per).contains(&h))
                .map(|((.., h0), p)| (p, h - h0));
            let m = of_head
                .clone()
                .fold(f32::NEG_INFINITY, |a, (p, k)| a.max(p.max[k]));
            let l: f32 = of_head
                .clone()
                .map(|(p, k)| (p.max[k] - m).exp() * p.sum[k])
                .sum();
            for (p, k) in of_head {
                ops.axpy(o, (p.max[k] - m).exp() / l, &p.acc[k * kl..(k + 1) * kl]);
            }
        };
        let dst = &mut out[r0 * heads * kl..r1 * heads * kl];
        // A fork costs more than merging a few blocks (short contexts) on this thread.
        match pool.filter(|_| items.len() * per >= MERGE_FORK_MIN) {
            Some(p) => p.install(|| dst.par_chunks_exact_mut(kl).enumerate().for_each(merge)),
            None => dst.chunks_exact_mut(kl).enumerate().for_each(merge),
        }
        r0 = r1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    fn dot64(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(a, b)| *a as f64 * *b as f64).sum()
    }

    /// Softmax and weighted sum in f64, the textbook two passes.
    fn reference(x: &Inputs<'_>) -> Vec<f64> {
        let (heads, kl) = (x.heads, x.kl);
        let mut out = vec![0.0f64; x.s * heads * kl];
        for r in 0..x.s {
            for h in 0..heads {
                let keys: Vec<usize> = (0..x.keys(r)).map(|i| x.key(r, i)).collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let c = dot64(x.q_lat(r, h), x.latent(j));
                        (c + dot64(x.q_rope(r, h), x.rope_key(j))) * x.scale as f64
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = scores.iter().map(|v| (v - m).exp()).sum();
                let o = &mut out[(r * heads + h) * kl..(r * heads + h + 1) * kl];
                for (&j, v) in keys.iter().zip(&scores) {
                    for (o, lat) in o.iter_mut().zip(x.latent(j)) {
                        *o += (v - m).exp() / l * *lat as f64;
                    }
                }
            }
        }
        out
    }

    /// Against float64 within 1e-5; the same bits with or without a pool, whatever the
    /// thread count, and row by row (S = 1 calls) as in one call; with DSA selections too.
    #[test]
    fn one_pass_equals_the_textbook_softmax_and_depends_on_nothing_else() {
        let ops = VecOps::active().unwrap();
        let (heads, kl, rd, nope) = (6, 40, 8, 4);
        let (start, s) = (150, 5);
        let keys = start + s;
        let latent = values(1, keys * kl);
        let rope_key = values(2, keys * rd);
        let q = values(3, s * heads * (nope + rd));
        let q_lat: Vec<f32> = values(4, s * heads * kl).iter().map(|v| v * 4.0).collect();
        let selection: Selection = (0..s)
            .map(|r| {
                (0..=start + r)
                    .filter(|j| j % 3 != 1)
                    .map(|j| j as u32)
                    .collect()
            })
            .collect();
        let pools: Vec<rayon::ThreadPool> = [1, 2, 3]
            .iter()
            .map(|&t| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .build()
                    .unwrap()
            })
            .collect();
        for sel in [None, Some(&selection)] {
            let x = Inputs {
                heads,
                kl,
                rd,
                nope,
                q: &q,
                q_lat: &q_lat,
                s,
                start,
                latent: &latent,
                rope_key: &rope_key,
                selection: sel,
                scale: 0.3,
            };
            let got = attend(&x, ops, None);
            let want = reference(&x);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() <= 1e-5 * w.abs().max(0.05),
                    "{g} vs {w}"
                );
            }
            for p in &pools {
                assert_eq!(
                    attend(&x, ops, Some(p)),
                    got,
                    "{} threads",
                    p.current_num_threads()
                );
            }
            let qd = nope + rd;
            for r in 0..s {
                let one_sel: Option<Selection> = sel.map(|v| vec![v[r].clone()]);
                let one = Inputs {
                    q: &q[r * heads * qd..(r + 1) * heads * qd],
                    q_lat: &q_lat[r * heads * kl..(r + 1) * heads * kl],
                    s: 1,
                    start: start + r,
                    selection: one_sel.as_ref(),
                    ..x
                };
                let row = attend(&one, ops, Some(&pools[1]));
                assert_eq!(
                    row[..],
                    got[r * heads * kl..(r + 1) * heads * kl],
                    "row {r}"
                );
            }
        }
    }
}
