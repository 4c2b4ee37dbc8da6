//! After a non-finite output: a bounded scan of the stored floats for the tensor to blame.

use std::path::PathBuf;

use super::{decode_floats, finite, names, Container, Dtype};

/// The first NaN/Inf found by [`Container::find_non_finite`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteTensor {
    pub tensor: String,
    pub file: PathBuf,
    /// "NaN", "Inf", or the implausible value ([`finite::BadValue::describe`]).
    pub what: String,
    pub index: usize,
}

impl Container {
    /// Look for a NaN, Inf or implausible magnitude among the float tensors (F32/BF16/F16, quantised weights'
    /// scales included): the resident tensors first, then the routed experts, reading at
    /// most `max_bytes`. `Ok(None)` when none was found within that bound (the second value
    /// says whether every float tensor was read). Only for diagnosing a non-finite output:
    /// loading never scans.
    pub fn find_non_finite(&self, max_bytes: u64) -> (Option<NonFiniteTensor>, bool) {
        let cfg = self.config();
        let is_expert = |n: &str| names::classify(cfg, n).role == names::Role::RoutedExpert;
        let order = self
            .names()
            .filter(|n| !is_expert(n))
            .chain(self.names().filter(|n| is_expert(n)));
        let mut read = 0u64;
        for name in order {
            let Ok(t) = self.info(name) else { continue };
            let width = match t.dtype {
                Dtype::F32 => 4,
                Dtype::Bf16 | Dtype::F16 => 2,
                _ => continue,
            };
            if read + t.nbytes() as u64 > max_bytes {
                return (None, false);
            }
            read += t.nbytes() as u64;
            // In bounded pieces: a tensor may be large.
            const PIECE: usize = 1 << 22;
            let step = PIECE * width;
            let mut start = t.range.start;
            while start < t.range.end {
                let end = (start + step).min(t.range.end);
                let Ok(raw) = self.shards[t.shard].read(start..end, name) else {
                    break;
                };
                if let Some(b) = finite::scan_raw(&raw, t.dtype) {
                    return (
                        Some(NonFiniteTensor {
                            tensor: name.to_owned(),
                            file: t.file.clone(),
                            what: b.describe(),
                            index: (start - t.range.start) / width + b.index,
                        }),
                        true,
                    );
                }
                start = end;
            }
        }
        (None, true)
    }
}

impl Container {
    /// The stored float with the largest magnitude among the float tensors (resident ones
    /// first), reading at most `max_bytes`: (tensor, file, value, flat index).
    pub fn largest_magnitude(&self, max_bytes: u64) -> Option<(String, PathBuf, f32, usize)> {
        let cfg = self.config();
        let is_expert = |n: &str| names::classify(cfg, n).role == names::Role::RoutedExpert;
        let order = self
            .names()
            .filter(|n| !is_expert(n))
            .chain(self.names().filter(|n| is_expert(n)));
        let mut best: Option<(String, PathBuf, f32, usize)> = None;
        let mut read = 0u64;
        for name in order {
            let Ok(t) = self.info(name) else { continue };
            if !matches!(t.dtype, Dtype::F32 | Dtype::Bf16 | Dtype::F16) {
                continue;
            }
            read += t.nbytes() as u64;
            if read > max_bytes {
                break;
            }
            let Ok(v) = self.bytes(name).map(|raw| decode_floats(&raw, t.dtype)) else {
                continue;
            };
            let Some((i, x)) = v.unwrap_or_default().into_iter().enumerate().fold(
                None,
                |m: Option<(usize, f32)>, (i, x)| match m {
                    Some((_, y)) if x.is_nan() || x.abs() <= y.abs() => m,
                    _ => Some((i, x)),
                },
            ) else {
                continue;
            };
            if best.as_ref().is_none_or(|b| x.abs() > b.2.abs()) {
                best = Some((name.to_owned(), t.file.clone(), x, i));
            }
        }
        best
    }

    /// Why the model computed a non-finite value, as far as a bounded scan (`max_bytes` of
    /// float tensors) of the stored weights can tell: the tensor holding NaN/Inf or an
    /// implausible magnitude, else the largest stored value (an overflow's likely source).
    pub fn diagnose_non_finite(&self, max_bytes: u64) -> String {
        let (found, complete) = self.find_non_finite(max_bytes);
        if let Some(t) = found {
            return format!(
                "tensor '{}' in {} contains {} at flat index {}; the checkpoint is damaged or \
                 was saved with non-finite values: download or export it again",
                t.tensor,
                t.file.display(),
                t.what,
                t.index
            );
        }
        let scope = if complete {
            "no stored float is NaN/Inf".to_owned()
        } else {
            format!(
                "the first {} MiB of stored floats are finite",
                max_bytes >> 20
            )
        };
        match self.largest_magnitude(max_bytes) {
            Some((tensor, file, v, i)) => format!(
                "{scope}, so the computation overflows float32; the largest stored value is \
                 {v:e} in tensor '{tensor}' ({}, flat index {i}): weights far outside any \
                 trained range; check the checkpoint against its source",
                file.display()
            ),
            None => format!("{scope}, so the computation overflows float32"),
        }
    }
}
