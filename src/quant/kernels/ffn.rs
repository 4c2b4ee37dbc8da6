//! The expert feed-forward `down · (silu(gate · x) ⊙ (up · x))`, for one expert or for a
//! batch of them (the experts of one MoE layer in one forward).
//!
//! A batch runs as two parallel passes, every expert's gate and up rows and then every
//! expert's down rows, where experts run one by one take two passes each. At decode a MoE
//! layer of 8 routed experts and a shared one is 18 fork-joins one by one and 2 as a batch;
//! each fork-join costs its wake-up and the tail of its last chunk (docs/benchmarks.md,
//! "Fewer fork-joins per MoE layer"). Every output is still computed by the same kernel call
//! on the same activations, so a batch equals its experts run one by one bit for bit.

use rayon::prelude::*;

use super::{
    active_path, check_shapes, int8_kernel, int8act, rows, rows_pair, s_blocks, silu, transpose,
    Arithmetic, KernelPath, XBuf, XLayout, S_BLOCK,
};
use crate::error::{Error, Result};
use crate::quant::format::{QMatrix, QuantFormat};

/// One expert's part of a batch: its matrices (gate and up [F, H], down [H, F]) and its `s`
/// activation rows `x` ([s, H], row-major).
#[derive(Debug, Clone, Copy)]
pub struct ExpertCall<'a> {
    pub gate: QMatrix<'a>,
    pub up: QMatrix<'a>,
    pub down: QMatrix<'a>,
    pub x: &'a [f32],
    pub s: usize,
}

impl<'a> ExpertCall<'a> {
    pub fn new(
        gate: &QMatrix<'a>,
        up: &QMatrix<'a>,
        down: &QMatrix<'a>,
        x: &'a [f32],
        s: usize,
    ) -> Self {
        ExpertCall {
            gate: *gate,
            up: *up,
            down: *down,
            x,
            s,
        }
    }
}

/// Fused expert: `out[S×H] = down · (silu(gate · x) ⊙ (up · x))` for S rows of `x` ([S, H]),
/// gate and up [F, H], down [H, F]. Gate and up rows are computed together, sharing each
/// loaded activation vector. Equals `matmul(gate)`, `matmul(up)`, silu, product and
/// `matmul(down)` on the same path bit for bit, and so is S-invariant like them.
pub fn expert_ffn(
    gate: &QMatrix<'_>,
    up: &QMatrix<'_>,
    down: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    out: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    expert_ffn_with(active_path()?, gate, up, down, x, s, out, pool)
}

/// [`expert_ffn`] on an explicit path.
#[allow(clippy::too_many_arguments)]
pub fn expert_ffn_with(
    path: KernelPath,
    gate: &QMatrix<'_>,
    up: &QMatrix<'_>,
    down: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    out: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    let call = ExpertCall::new(gate, up, down, x, s);
    experts_ffn_with(path, &[call], &mut [out], pool)
}

/// [`expert_ffn`] for each call of a batch, `outs[i]` ([s_i, H]) receiving call i's result,
/// in two parallel passes over the whole batch. Equals [`expert_ffn`] of each call bit for
/// bit (and so does not depend on the batch either).
pub fn experts_ffn(
    calls: &[ExpertCall<'_>],
    outs: &mut [&mut [f32]],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    experts_ffn_with(active_path()?, calls, outs, pool)
}

/// [`experts_ffn`] on an explicit path.
pub fn experts_ffn_with(
    path: KernelPath,
    calls: &[ExpertCall<'_>],
    outs: &mut [&mut [f32]],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    check_lengths(calls, outs)?;
    for (c, out) in calls.iter().zip(outs.iter()) {
        check_expert(c, out.len())?;
    }
    path.require()?;
    if calls.iter().all(|c| c.s <= S_BLOCK) {
        two_passes(path, calls, outs, pool);
        return Ok(());
    }
    // Row t of any call is the S=1 call, so blocks of rows give the same values.
    for (c, out) in calls.iter().zip(outs.iter_mut()) {
        let h = c.gate.cols();
        for b in s_blocks(c.s) {
            let block = ExpertCall {
                x: &c.x[b.start * h..b.end * h],
                s: b.len(),
                ..*c
            };
            two_passes(
                path,
                &[block],
                &mut [&mut out[b.start * h..b.end * h]],
                pool,
            );
        }
    }
    Ok(())
}

/// [`experts_ffn`] in `arith` (see [`super::matmul_in`]). Exact calls run as one batch; in
/// int8 each expert runs by itself, its gate and up sharing one quantisation of `x` and its
/// hidden rows quantised again for down (prefill: a few large calls, where the fork-joins
/// cost nothing).
pub fn experts_ffn_in(
    arith: Arithmetic,
    calls: &[ExpertCall<'_>],
    outs: &mut [&mut [f32]],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    let int8 = |c: &ExpertCall<'_>| {
        arith == Arithmetic::Int8
            && [c.gate, c.up, c.down]
                .iter()
                .all(|w| int8act::supports(w.format()))
            && c.gate.rows() == c.up.rows()
            && c.gate.cols() == c.up.cols()
    };
    if !calls.iter().any(int8) {
        return experts_ffn(calls, outs, pool);
    }
    check_lengths(calls, outs)?;
    #[cfg(target_arch = "x86_64")]
    if calls.iter().all(|c| int8(c) && decode_sized(c))
        && super::uses_decode_kernel(int8_kernel()?, 1)
    {
        return experts_int8_decode(calls, outs, pool);
    }
    for (c, out) in calls.iter().zip(outs.iter_mut()) {
        if int8(c) {
            expert_ffn_int8(c, out, pool)?;
        } else {
            experts_ffn(std::slice::from_ref(c), &mut [&mut **out], pool)?;
        }
    }
    Ok(())
}

/// [`experts_ffn_in`] for one call (as [`expert_ffn`] is [`experts_ffn`] for one).
#[allow(clippy::too_many_arguments)]
pub fn expert_ffn_in(
    arith: Arithmetic,
    gate: &QMatrix<'_>,
    up: &QMatrix<'_>,
    down: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    out: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    let call = ExpertCall::new(gate, up, down, x, s);
    experts_ffn_in(arith, &[call], &mut [out], pool)
}

/// Whether a call's rows are few enough for the decode kernel, and its gate and up take the
/// same activation layout.
#[cfg(target_arch = "x86_64")]
fn decode_sized(c: &ExpertCall<'_>) -> bool {
    c.s <= int8act::DECODE_MAX_ROWS
        && (c.gate.format() == QuantFormat::Int8PerRow)
            == (c.up.format() == QuantFormat::Int8PerRow)
}

/// A batch of decode-sized experts in int8 activations on a decode kernel (VNNI or AVX2), in two
/// parallel passes as the exact batch runs (every gate and up, then every down): the same
/// values as [`expert_ffn_int8`] per expert, bit for bit.
#[cfg(target_arch = "x86_64")]
fn experts_int8_decode(
    calls: &[ExpertCall<'_>],
    outs: &mut [&mut [f32]],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    use int8act::{DecodeActs, DecodeJob};
    for (c, out) in calls.iter().zip(outs.iter()) {
        check_expert(c, out.len())?;
    }
    DECODE_SCRATCH.with(|cell| {
        // A call made while this thread's scratch is in use (none today) gets its own.
        let mut own = None;
        let mut held = cell.try_borrow_mut();
        let scratch = match held.as_deref_mut() {
            Ok(s) => s,
            Err(_) => own.get_or_insert_with(DecodeScratch::default),
        };
        let DecodeScratch { xs, hs, gu } = scratch;
        // At a decode step every routed expert and the shared one see the same row: quantise
        // each distinct input once (quantisation is per row, so sharing changes no value).
        let mut x_of: Vec<usize> = Vec::with_capacity(calls.len());
        let mut distinct = 0;
        for (i, c) in calls.iter().enumerate() {
            let same = calls[..i].iter().zip(&x_of).find(|(d, _)| {
                d.s == c.s
                    && d.gate.format() == c.gate.format()
                    && d.gate.cols() == c.gate.cols()
                    && d.x == c.x
            });
            match same {
                Some((_, &k)) => x_of.push(k),
                None => {
                    if xs.len() == distinct {
                        xs.push(DecodeActs::empty());
                    }
                    xs[distinct].fill(c.x, c.s, c.gate.cols(), c.gate.format())?;
                    x_of.push(distinct);
                    distinct += 1;
                }
            }
        }
        // Every call's gate then up outputs, end to end in one buffer.
        let total: usize = calls.iter().map(|c| 2 * c.s * c.gate.rows()).sum();
        gu.clear();
        gu.resize(total, 0.0);
        let mut halves: Vec<(&mut [f32], &mut [f32])> = Vec::with_capacity(calls.len());
        let mut rest = &mut gu[..];
        for c in calls {
            let (this, tail) = rest.split_at_mut(2 * c.s * c.gate.rows());
            halves.push(this.split_at_mut(c.s * c.gate.rows()));
            rest = tail;
        }
        {
            let mut jobs: Vec<DecodeJob<'_>> = Vec::with_capacity(2 * calls.len());
            for ((c, &k), (g, u)) in calls.iter().zip(&x_of).zip(&mut halves) {
                let x = &xs[k];
                jobs.push(DecodeJob { w: c.gate, x, y: g });
                jobs.push(DecodeJob { w: c.up, x, y: u });
            }
            int8act::matmuls_decode(&mut jobs, pool)?;
        }
        for (g, u) in &mut halves {
            for (g, u) in g.iter_mut().zip(u.iter()) {
                *g = silu(*g) * u;
            }
        }
        while hs.len() < calls.len() {
            hs.push(DecodeActs::empty());
        }
        for ((c, (g, _)), h) in calls.iter().zip(&halves).zip(hs.iter_mut()) {
            h.fill(g, c.s, c.down.cols(), c.down.format())?;
        }
        let mut jobs: Vec<DecodeJob<'_>> = calls
            .iter()
            .zip(hs.iter())
            .zip(outs.iter_mut())
            .map(|((c, x), out)| DecodeJob {
                w: c.down,
                x,
                y: out,
            })
            .collect();
        int8act::matmuls_decode(&mut jobs, pool)
    })
}

/// Buffers of [`experts_int8_decode`], kept per thread between calls (a decode step makes
/// one call per MoE layer, each with a few rows per expert).
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct DecodeScratch {
    /// The distinct inputs' quantised rows.
    xs: Vec<int8act::DecodeActs>,
    /// Each call's hidden rows quantised for down.
    hs: Vec<int8act::DecodeActs>,
    /// Each call's gate and up outputs.
    gu: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static DECODE_SCRATCH: std::cell::RefCell<DecodeScratch> = Default::default();
}

/// One expert in int8 activations (the formats were checked to have that form).
fn expert_ffn_int8(
    c: &ExpertCall<'_>,
    out: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    check_expert(c, out.len())?;
    let (f, h, s) = (c.gate.rows(), c.gate.cols(), c.s);
    let kernel = int8_kernel()?;
    let q = int8act::QuantizedActs::new(c.x, s, h, pool);
    let mut g = vec![0.0f32; s * f];
    let mut u = vec![0.0f32; s * f];
    int8act::matmul_quantized(&c.gate, &q, &mut g, kernel, pool)?;
    int8act::matmul_quantized(&c.up, &q, &mut u, kernel, pool)?;
    for (g, u) in g.iter_mut().zip(&u) {
        *g = silu(*g) * u;
    }
    let qh = int8act::QuantizedActs::new(&g, s, f, pool);
    int8act::matmul_quantized(&c.down, &qh, out, kernel, pool)
}

/// One output buffer per call.
fn check_lengths(calls: &[ExpertCall<'_>], outs: &[&mut [f32]]) -> Result<()> {
    if calls.len() == outs.len() {
        return Ok(());
    }
    Err(Error::invalid(
        "expert_ffn",
        format!(
            "{} expert calls but {} output buffers",
            calls.len(),
            outs.len()
        ),
    ))
}

/// The shapes of one call: gate = up = [F, H], down = [H, F], `x` [s, H], `out` [s, H].
fn check_expert(c: &ExpertCall<'_>, out_len: usize) -> Result<()> {
    let (gate, up, down) = (&c.gate, &c.up, &c.down);
    let (f, h) = (gate.rows(), gate.cols());
    if up.rows() != f || up.cols() != h || down.rows() != h || down.cols() != f {
        return Err(Error::invalid(
            "expert_ffn",
            format!(
                "gate [{}, {}], up [{}, {}] and down [{}, {}] do not form an expert \
                 (need gate = up = [F, H] and down = [H, F])",
                gate.rows(),
                gate.cols(),
                up.rows(),
                up.cols(),
                down.rows(),
                down.cols()
            ),
        ));
    }
    let hidden_len = c.s.saturating_mul(f);
    check_shapes(gate, c.x.len(), c.s, hidden_len)?;
    check_shapes(down, hidden_len, c.s, out_len)
}

/// The batch's two passes, every call of at most [`S_BLOCK`] rows and checked.
fn two_passes(
    path: KernelPath,
    calls: &[ExpertCall<'_>],
    outs: &mut [&mut [f32]],
    pool: Option<&rayon::ThreadPool>,
) {
    // Pass 1, every expert's rows: hT[f, s] = silu(gate_f · x_s) · (up_f · x_s).
    let xs: Vec<(XBuf<'_>, Option<XBuf<'_>>)> = calls
        .iter()
        .map(|c| {
            let h = c.gate.cols();
            let (lg, lu) = (
                XLayout::of(path, c.gate.format()),
                XLayout::of(path, c.up.format()),
            );
            // Layouts differ only when the formats do: then each matrix gets its own.
            let xu = (lu != lg).then(|| lu.arrange(c.x, c.s, h));
            (lg.arrange(c.x, c.s, h), xu)
        })
        .collect();
    let mut ht: Vec<Vec<f32>> = calls
        .iter()
        .map(|c| vec![0.0f32; c.gate.rows() * c.s])
        .collect();
    let shapes: Vec<ChunkShape> = calls
        .iter()
        .map(|c| ChunkShape {
            rows: c.gate.rows(),
            s: c.s,
            row_bytes: c.gate.format().row_bytes(c.gate.cols())
                + c.up.format().row_bytes(c.up.cols()),
        })
        .collect();
    let targets = ht.iter_mut().map(|v| &mut v[..]).collect();
    for_chunks(&shapes, targets, pool, |e, o0, out_h| {
        let (c, (xg, xu)) = (&calls[e], &xs[e]);
        let mut u = vec![0.0f32; out_h.len()];
        match xu {
            None => rows_pair(path, &c.gate, &c.up, o0, xg, c.s, out_h, &mut u),
            Some(xu) => {
                rows(path, &c.gate, o0, xg, c.s, out_h);
                rows(path, &c.up, o0, xu, c.s, &mut u);
            }
        }
        for (g, u) in out_h.iter_mut().zip(&u) {
            *g = silu(*g) * u;
        }
    });
    drop(xs);

    // Pass 2, every expert's down rows, from hidden = hT transposed ([s, F]).
    let hidden: Vec<Vec<f32>> = calls
        .iter()
        .zip(&ht)
        .map(|(c, ht)| {
            let mut hidden = vec![0.0f32; ht.len()];
            transpose(ht, c.gate.rows(), c.s, &mut hidden);
            hidden
        })
        .collect();
    let xd: Vec<XBuf<'_>> = calls
        .iter()
        .zip(&hidden)
        .map(|(c, hid)| XLayout::of(path, c.down.format()).arrange(hid, c.s, c.down.cols()))
        .collect();
    // S = 1: Yᵀ is Y, written straight into the output; otherwise [H, s], transposed after.
    let mut yt: Vec<Vec<f32>> = calls
        .iter()
        .map(|c| {
            if c.s == 1 {
                Vec::new()
            } else {
                vec![0.0f32; c.down.rows() * c.s]
            }
        })
        .collect();
    let shapes: Vec<ChunkShape> = calls
        .iter()
        .map(|c| ChunkShape {
            rows: c.down.rows(),
            s: c.s,
            row_bytes: c.down.format().row_bytes(c.down.cols()),
        })
        .collect();
    let targets = calls
        .iter()
        .zip(outs.iter_mut())
        .zip(yt.iter_mut())
        .map(|((c, out), yt)| if c.s == 1 { &mut **out } else { &mut yt[..] })
        .collect();
    for_chunks(&shapes, targets, pool, |e, o0, out| {
        rows(path, &calls[e].down, o0, &xd[e], calls[e].s, out)
    });
    for ((c, out), yt) in calls.iter().zip(outs.iter_mut()).zip(&yt) {
        if c.s > 1 {
            transpose(yt, c.down.rows(), c.s, out);
        }
    }
}

/// One matrix's (or matrix pair's) share of a pass: `rows` output rows of `row_bytes` weight
/// bytes each, for `s` activation rows.
pub(super) struct ChunkShape {
    pub rows: usize,
    pub s: usize,
    pub row_bytes: usize,
}

/// Weight bytes per chunk: a pass's bytes over ~8 chunks per thread for balance, within
/// 32 KiB (a chunk's start-up next to its streaming) and 256 KiB (the tail a thread may wait
/// for at the join: ~10 µs of DRAM streaming on one core).
const CHUNK_BYTES: std::ops::RangeInclusive<usize> = (32 << 10)..=(256 << 10);

/// Split each target (`[rows, s]` transposed results, one per shape) into chunks of whole
/// rows and run `work(target, first row, chunk)` on every chunk, in parallel on `pool` when
/// given. Chunks are disjoint; how rows are split does not change any value (each output is
/// computed by itself).
pub(super) fn for_chunks(
    shapes: &[ChunkShape],
    targets: Vec<&mut [f32]>,
    pool: Option<&rayon::ThreadPool>,
    work: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    debug_assert_eq!(shapes.len(), targets.len());
    let threads = pool.map_or(1, |p| p.current_num_threads().max(1));
    let total: usize = shapes.iter().map(|c| c.rows * c.row_bytes).sum();
    let chunk_bytes = total
        .div_ceil(threads * 8)
        .clamp(*CHUNK_BYTES.start(), *CHUNK_BYTES.end());
    let mut chunks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (e, (shape, target)) in shapes.iter().zip(targets).enumerate() {
        debug_assert_eq!(target.len(), shape.rows * shape.s);
        if shape.rows == 0 || shape.s == 0 {
            continue;
        }
        let per = (chunk_bytes / shape.row_bytes.max(1)).clamp(1, shape.rows);
        for (i, chunk) in target.chunks_mut(per * shape.s).enumerate() {
            chunks.push((e, i * per, chunk));
        }
    }
    match pool {
        None => chunks
            .into_iter()
            .for_each(|(e, o0, chunk)| work(e, o0, chunk)),
        Some(pool) => pool.install(|| {
            chunks
                .into_par_iter()
                .for_each(|(e, o0, chunk)| work(e, o0, chunk))
        }),
    }
}
