//! This host's two limits that decode time rests on, measured briefly for `colibri plan`:
//! random expert-sized reads from disk (O_DIRECT, so the page cache does not flatter it) and
//! the kernels' speed on routed experts at the model's shapes.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use serde::Serialize;

use super::rng::Rng;
use crate::error::{Error, Result};
use crate::quant::kernels;
use crate::quant::pack::quantize;
use crate::quant::QuantFormat;

/// What a disk probe measured.
#[derive(Debug, Clone, Serialize)]
pub struct DiskProbe {
    pub bytes_per_second: f64,
    pub reads: usize,
    pub read_bytes: usize,
    /// Whether the reads bypassed the page cache (O_DIRECT); buffered reads of a file that
    /// is already cached measure memory, not the disk.
    pub direct: bool,
    pub file: PathBuf,
}

const ALIGN: u64 = 4096;

/// Readers in flight at once: the store's demand I/O threads (`StoreOptions::io_threads`'s
/// default), since a forward's misses are read in parallel.
pub const PROBE_READERS: usize = 4;

/// Read `read_len`-byte pieces at random 4 KiB-aligned offsets of the largest of `files`
/// for about `seconds` (at least 4 reads per reader), [`PROBE_READERS`] reads in flight (as
/// a forward's demand loads are), and return the aggregate rate. Nothing is written.
pub fn probe_disk(files: &[PathBuf], read_len: usize, seconds: f64) -> Result<DiskProbe> {
    let (path, size) = files
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok().map(|m| (p.clone(), m.len())))
        .max_by_key(|&(_, n)| n)
        .ok_or_else(|| Error::invalid("disk probe", "no readable file to probe"))?;
    let len = (read_len as u64).div_ceil(ALIGN) * ALIGN;
    if size < len + ALIGN {
        return Err(Error::invalid(
            "disk probe",
            format!(
                "{} holds {size} bytes, too few for {len}-byte reads: give --disk-bw instead",
                path.display()
            ),
        ));
    }
    let start = Instant::now();
    let budget = Duration::from_secs_f64(seconds.max(0.05));
    let results: Vec<Result<(usize, usize, bool)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..PROBE_READERS)
            .map(|r| {
                let path = &path;
                scope.spawn(move || read_randomly(path, size, len, r as u64, start, budget))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Internal("a disk probe reader failed".into())))
            })
            .collect()
    });
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    let (mut reads, mut bytes, mut direct) = (0usize, 0usize, true);
    for r in results {
        let (n, b, d) = r?;
        reads += n;
        bytes += b;
        direct &= d;
    }
    Ok(DiskProbe {
        bytes_per_second: bytes as f64 / secs,
        reads,
        read_bytes: bytes,
        direct,
        file: path,
    })
}

/// One probe reader: (reads, bytes, whether they bypassed the page cache).
fn read_randomly(
    path: &Path,
    size: u64,
    len: u64,
    seed: u64,
    start: Instant,
    budget: Duration,
) -> Result<(usize, usize, bool)> {
    let direct = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    let (file, mut is_direct) = match direct {
        Ok(f) => (f, true),
        Err(_) => (File::open(path).map_err(|e| Error::io(path, e))?, false),
    };
    // An anonymous mapping is page-aligned, as O_DIRECT needs.
    let mut buf = MmapMut::map_anon(len as usize).map_err(|e| Error::io(path, e))?;
    let mut rng = Rng::new(size ^ seed, 0xD15C + seed);
    let slots = (size - len) / ALIGN;
    let (mut reads, mut bytes) = (0usize, 0usize);
    while reads < 4 || start.elapsed() < budget {
        let off = (rng.next_u64() % slots.max(1)) * ALIGN;
        let n = match file.read_at(&mut buf, off) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && is_direct => {
                is_direct = false;
                File::open(path)
                    .and_then(|f| f.read_at(&mut buf, off))
                    .map_err(|e| Error::io(path, e))?
            }
            Err(e) => return Err(Error::io(path, e)),
        };
        reads += 1;
        bytes += n;
        if reads > 100_000 {
            break;
        }
    }
    Ok((reads, bytes, is_direct))
}

/// Probe a disk through a scratch file written in `dir` (then removed): for a known model
/// config, where there is no container to read.
pub fn probe_disk_in(dir: &Path, read_len: usize, seconds: f64) -> Result<DiskProbe> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let path = dir.join(format!(".colibri-disk-probe-{}", std::process::id()));
    let chunk = vec![0x5Au8; 8 << 20];
    let total = (read_len * 24).max(256 << 20);
    let written = (|| -> std::io::Result<()> {
        let f = File::create(&path)?;
        let mut off = 0u64;
        while (off as usize) < total {
            f.write_all_at(&chunk, off)?;
            off += chunk.len() as u64;
        }
        f.sync_all()
    })();
    let out = written
        .map_err(|e| Error::io(&path, e))
        .and_then(|_| probe_disk(std::slice::from_ref(&path), read_len, seconds));
    let _ = std::fs::remove_file(&path);
    out
}

/// The kernels' speed on routed experts: weight bytes processed per second by one token's
/// FFN matmuls (gate, up: [inter, hidden]; down: [hidden, inter]) in int4 with 64-wide
/// groups, on all threads, over enough distinct experts that they come from RAM.
#[derive(Debug, Clone, Serialize)]
pub struct ComputeProbe {
    pub weight_bytes_per_second: f64,
    pub hidden: usize,
    pub moe_inter: usize,
    pub kernel_path: &'static str,
    pub threads: usize,
}

pub fn probe_compute(hidden: usize, moe_inter: usize, seconds: f64) -> Result<ComputeProbe> {
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    let mut rng = Rng::new(7, 0xC0DE);
    let mut make = |rows: usize, cols: usize| -> Result<_> {
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.normal() as f32 * 0.02)
            .collect();
        quantize(format, "probe", &w, rows, cols)
    };
    // Three matrices per expert; enough experts to overflow any L3 (≥ 96 MB of weights).
    let per_expert = 3 * format.data_bytes(moe_inter, hidden).unwrap_or(1);
    let experts = (96usize << 20).div_ceil(per_expert).clamp(2, 64);
    let gate = make(moe_inter, hidden)?;
    let down = make(hidden, moe_inter)?;
    // Distinct copies of the bytes (identical values are fine: only their addresses matter).
    let copies: Vec<_> = (0..experts)
        .map(|_| (gate.clone(), gate.clone(), down.clone()))
        .collect();
    let x: Vec<f32> = (0..hidden).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut mid = vec![0f32; moe_inter];
    let mut out = vec![0f32; hidden];
    let pool = rayon::ThreadPoolBuilder::new()
        .build()
        .map_err(|e| Error::Internal(format!("thread pool: {e}")))?;
    let (mut bytes, mut done) = (0usize, 0usize);
    let start = Instant::now();
    while done < experts || start.elapsed().as_secs_f64() < seconds {
        let (g, u, d) = &copies[done % experts];
        kernels::matmul(&g.view(), &x, 1, &mut mid, Some(&pool))?;
        kernels::matmul(&u.view(), &x, 1, &mut mid, Some(&pool))?;
        kernels::matmul(&d.view(), &mid, 1, &mut out, Some(&pool))?;
        bytes += g.data.len()
            + u.data.len()
            + d.data.len()
            + 4 * (g.scales.len() + u.scales.len() + d.scales.len());
        done += 1;
    }
    Ok(ComputeProbe {
        weight_bytes_per_second: bytes as f64 / start.elapsed().as_secs_f64().max(1e-9),
        hidden,
        moe_inter,
        kernel_path: kernels::selected_path().name(),
        threads: pool.current_num_threads(),
    })
}
