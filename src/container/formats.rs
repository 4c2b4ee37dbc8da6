//! Each weight's format, resolved at open from its dtype, byte counts and the config's
//! logical shape, cross-checked with the shard's `__metadata__`.

use super::{expected_len, expected_shape, Container, Dtype, TensorInfo, SCALES_SUFFIX};
use crate::error::{Error, Result};
use crate::quant::format::QuantFormat;

impl Container {
    /// Decide the format of every weight: quantised (U8 + `.qs`) from byte counts against
    /// the logical shape, float 2-D from dtype and shape; check 1-D tensors the config
    /// knows against their length.
    pub(super) fn resolve_formats(&mut self) -> Result<()> {
        let mut resolved = Vec::new();
        for name in &self.order {
            let t = &self.tensors[name];
            if let Some(base) = name.strip_suffix(SCALES_SUFFIX) {
                if !self.tensors.contains_key(base) {
                    return Err(Error::container(
                        &t.file,
                        Some(name),
                        format!("scales tensor without its weight '{base}'"),
                    ));
                }
                continue;
            }
            if let Some((f, shape)) = self.resolve_one(t)? {
                resolved.push((name.clone(), f, shape));
            }
        }
        for (name, f, shape) in resolved {
            if let Some(t) = self.tensors.get_mut(&name) {
                t.format = Some(f);
                t.logical = Some(shape);
            }
        }
        Ok(())
    }

    fn resolve_one(&self, t: &TensorInfo) -> Result<Option<(QuantFormat, (usize, usize))>> {
        let name = t.name.as_str();
        let err = |msg: String| Error::container(&t.file, Some(name), msg);
        let expected = expected_shape(&self.config, name);
        let meta = self.metadata[t.shard].get(name);
        let meta_fmt = meta
            .map(|m| QuantFormat::parse(m))
            .transpose()
            .map_err(|_| {
                err(format!(
                    "__metadata__ names format '{}', which colibri does not know",
                    meta.map(String::as_str).unwrap_or("")
                ))
            })?;
        let scales_name = format!("{name}{SCALES_SUFFIX}");
        if let Some(qs) = self.tensors.get(&scales_name) {
            if t.dtype != Dtype::U8 {
                return Err(err(format!(
                    "has scales '{scales_name}' so it must be U8 packed bytes, but is {}",
                    t.dtype
                )));
            }
            if qs.dtype != Dtype::F32 {
                return Err(Error::container(
                    &qs.file,
                    Some(&scales_name),
                    format!("scales must be F32, found {}", qs.dtype),
                ));
            }
            let (rows, cols) = expected.ok_or_else(|| {
                err(
                    "a quantised tensor whose logical shape the config does not define; \
                     colibri cannot tell its [O, I]"
                        .into(),
                )
            })?;
            let nbytes = t.nbytes();
            let nscales = qs.shape.iter().product::<usize>();
            let inferred = QuantFormat::infer(rows, cols, nbytes, nscales);
            let format = match (meta_fmt, inferred) {
                (Some(m), _)
                    if m.is_quantized()
                        && m.data_bytes(rows, cols) == Some(nbytes)
                        && m.scale_count(rows, cols) == Some(nscales) =>
                {
                    m
                }
                (Some(m), _) => {
                    return Err(err(format!(
                        "__metadata__ says {m}, but {nbytes} bytes and {nscales} scales do not \
                         fit {m} for the logical shape [{rows}, {cols}] from config.json"
                    )))
                }
                (None, Some(f)) => f,
                (None, None) => {
                    return Err(err(format!(
                        "{nbytes} bytes and {nscales} scales match no format (int8, int4, \
                         int4_g{{16..256}}) for the logical shape [{rows}, {cols}] from \
                         config.json; wrong scale count, or a checkpoint for another config"
                    )))
                }
            };
            return Ok(Some((format, (rows, cols))));
        }
        if t.dtype == Dtype::U8 && expected.is_some() {
            return Err(err(format!(
                "U8 weight without its scales tensor '{scales_name}'"
            )));
        }
        let float = match t.dtype {
            Dtype::F32 => Some(QuantFormat::F32),
            Dtype::Bf16 => Some(QuantFormat::Bf16),
            Dtype::F16 => Some(QuantFormat::F16),
            _ => None,
        };
        if t.shape.len() == 2 {
            if let Some(f) = float {
                let shape = (t.shape[0], t.shape[1]);
                if let Some(e) = expected {
                    if e != shape {
                        return Err(err(format!(
                            "shape [{}, {}] disagrees with [{}, {}] from config.json",
                            shape.0, shape.1, e.0, e.1
                        )));
                    }
                }
                if let Some(m) = meta_fmt {
                    if m != f {
                        return Err(err(format!("__metadata__ says {m} but the tensor is {f}")));
                    }
                }
                return Ok(Some((f, shape)));
            }
        }
        if expected.is_some() {
            return Err(err(format!(
                "a weight of shape {:?} and dtype {}; expected a 2-D F32/BF16/F16 tensor or U8 \
                 bytes with F32 '.qs' scales",
                t.shape, t.dtype
            )));
        }
        if let Some(n) = expected_len(&self.config, name) {
            if t.shape.iter().product::<usize>() != n || t.shape.len() != 1 {
                return Err(err(format!(
                    "shape {:?} disagrees with [{n}] from config.json",
                    t.shape
                )));
            }
        }
        Ok(None)
    }
}
