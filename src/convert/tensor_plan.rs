//! One source tensor's output: refused layouts, its FP8 block scales, its kind and format.

use super::plan::{OutKind, PlannedTensor};
use super::source::{is_float, is_fp8, Source, SrcTensor};
use super::{ConvertOptions, SCALE_INV_SUFFIX};
use crate::config::ModelConfig;
use crate::container::names::{classify, expected_len, expected_shape, Role};
use crate::container::safetensors::Dtype;
use crate::error::{Error, Result};
use crate::quant::format::QuantFormat;

/// Whether `name` is the block scales of an FP8 weight (an error when it names no FP8
/// weight).
pub(super) fn is_block_scales(source: &Source, name: &str) -> Result<bool> {
    let Some(weight) = name.strip_suffix(SCALE_INV_SUFFIX) else {
        return Ok(false);
    };
    match source.tensors.get(weight) {
        Some(w) if is_fp8(w.dtype) => Ok(true),
        _ => Err(Error::container(
            source.path(&source.tensors[name]),
            Some(name),
            format!("block scales without an FP8 weight '{weight}'"),
        )),
    }
}

/// One source tensor's output: refused layouts, its FP8 block scales, its kind and format.
pub(super) fn plan_tensor(
    source: &Source,
    config: &ModelConfig,
    options: &ConvertOptions,
    name: &str,
) -> Result<PlannedTensor> {
    let t = &source.tensors[name];
    let path = source.path(t);
    let err = |msg: String| Error::container(path, Some(name), msg);
    if name.contains(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj") {
        return Err(Error::Unsupported(format!(
            "{}: tensor '{name}' stores all experts fused; convert a checkpoint with \
             per-expert tensors (transformers' save_pretrained writes those)",
            path.display()
        )));
    }
    if t.dtype == Dtype::F8E5M2 {
        return Err(Error::Unsupported(format!(
            "{}: tensor '{name}' is F8_E5M2; only F8_E4M3 with block scales is supported",
            path.display()
        )));
    }
    let scale_inv = if t.dtype == Dtype::F8E4M3 {
        Some(fp8_block_scales(source, name, t)?)
    } else {
        None
    };
    let role = classify(config, name);
    let mtp = role.layer.is_some_and(|l| config.is_mtp_layer(l));
    let kind = if let Some((rows, cols)) = expected_shape(config, name) {
        if t.shape != [rows, cols] || !(is_float(t.dtype) || t.dtype == Dtype::F8E4M3) {
            return Err(err(format!(
                "expected a float or FP8 weight of shape [{rows}, {cols}] from config.json, \
                 found {} {:?}",
                t.dtype, t.shape
            )));
        }
        let format = weight_format(options, role.role, mtp)?;
        if format.is_quantized() {
            OutKind::Quant { format, rows, cols }
        } else {
            OutKind::Float {
                format,
                shape: t.shape.clone(),
            }
        }
    } else if let Some(n) = expected_len(config, name) {
        if t.shape != [n] || !is_float(t.dtype) {
            return Err(err(format!(
                "expected a float vector of length {n} from config.json, found {} {:?}",
                t.dtype, t.shape
            )));
        }
        OutKind::Float {
            format: QuantFormat::F32,
            shape: t.shape.clone(),
        }
    } else if t.dtype == Dtype::F8E4M3 {
        // Unrecognised FP8 weight: keep it exact, dequantised to BF16.
        OutKind::Float {
            format: QuantFormat::Bf16,
            shape: t.shape.clone(),
        }
    } else {
        // Unrecognised tensor: copied unchanged.
        OutKind::Copy {
            dtype: t.dtype,
            shape: t.shape.clone(),
        }
    };
    Ok(PlannedTensor {
        name: name.to_owned(),
        kind,
        scale_inv,
    })
}

/// The recipe, role → output format of a 2-D weight, in one place: which option sets each
/// role's bits. Routers stay F32 everywhere; every other weight of the MTP layer(s) takes
/// `mtp_bits`. The match is exhaustive so that a new role has to be given a line here.
fn weight_format(options: &ConvertOptions, role: Role, mtp: bool) -> Result<QuantFormat> {
    let (param, bits) = match (role, mtp) {
        (Role::Router, _) => return Ok(QuantFormat::F32),
        (_, true) => ("mtp_bits", options.mtp_bits),
        (Role::Embed, false) => ("embed_bits", options.embed_bits),
        (Role::LmHead, false) => ("lm_head_bits", options.lm_head_bits),
        (Role::RoutedExpert, false) => ("expert_bits", options.expert_bits),
        (Role::Indexer, false) => ("indexer_bits", options.indexer_bits),
        (
            Role::Attention
            | Role::DenseMlp
            | Role::SharedExpert
            | Role::MtpProj
            | Role::RouterBias
            | Role::Norm
            | Role::Unknown,
            false,
        ) => ("dense_bits", options.dense_bits),
    };
    options.format(param, bits)
}

/// The name of an FP8 weight's block scales, checked: present, float, and of the shape the
/// checkpoint's block size gives.
fn fp8_block_scales(source: &Source, name: &str, t: &SrcTensor) -> Result<String> {
    let err = |msg: String| Error::container(source.path(t), Some(name), msg);
    let s = format!("{name}{SCALE_INV_SUFFIX}");
    let st = source
        .tensors
        .get(&s)
        .ok_or_else(|| err(format!("FP8 weight without its block scales '{s}'")))?;
    let (bo, bi) = source.block;
    let want = match t.shape.as_slice() {
        [o, i] => vec![o.div_ceil(bo), i.div_ceil(bi)],
        _ => return Err(err(format!("FP8 weight must be 2-D, found {:?}", t.shape))),
    };
    if st.shape != want || !is_float(st.dtype) {
        return Err(Error::container(
            source.path(st),
            Some(&s),
            format!(
                "block scales must be a float tensor of shape {want:?} for a {:?} weight \
                 with {bo}×{bi} blocks, found {} {:?}",
                t.shape, st.dtype, st.shape
            ),
        ));
    }
    Ok(s)
}
