//! Quantised containers against transformers running the same dequantised weights: the
//! default `colibri convert` container, and the int8 prefill arithmetic (docs/architecture.md,
//! "Prefill arithmetic").

use std::path::Path;
use std::sync::Arc;

use colibri::container::Container;
use colibri::model::{Model, ModelOptions, Sequence};

use crate::common::{
    fixture_dir, mean_kl, rel_err, top1_agreement, worst_row_rel_err, Golden, FIXTURES,
};

/// Fixture `name` converted with `colibri convert`'s defaults (int4-g64 and int8 weights).
fn default_container(name: &str) -> (tempfile::TempDir, Arc<Container>) {
    use colibri::convert::{convert, ConvertOptions};
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    std::fs::create_dir(&src).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir(name).join(f), src.join(f)).unwrap();
    }
    convert(&src, &dst, &ConvertOptions::default()).unwrap();
    let c = Arc::new(Container::open(&dst).unwrap());
    (tmp, c)
}

/// The default `colibri convert` container (int4-g64 experts/attention/MLPs, int8 embed,
/// LM head, MTP and indexer) against transformers running the same dequantised weights
/// (`golden_int4.safetensors`), teacher-forced over prompt + greedy continuation.
#[test]
fn default_quantized_container_matches_transformers_on_dequantized_weights() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let q = Golden::load_file(name, "golden_int4.safetensors");
        let ids = q.ids("int4_ids");
        let (shape, want) = q.f32("int4_logits");
        let prompt = g.ids("prompt_ids");
        let greedy = g.ids("greedy_ids");
        let mut forced = prompt.clone();
        forced.extend(&greedy[..greedy.len() - 1]);
        assert_eq!(ids, forced, "{name}: golden_int4 ids");
        assert_eq!(shape, [ids.len(), shape[1]]);

        let (_tmp, c) = default_container(name);
        let model = Model::load(c, &ModelOptions::default()).unwrap();
        let mut m = Sequence::owned(&model);
        let got = m.step(&ids, 0, true).unwrap().logits;
        let v = model.config().vocab_size;
        assert_eq!(v, shape[1]);

        let agree = top1_agreement(&got, &want, v);
        let err = rel_err(&got, &want);
        let kl = mean_kl(&want, &got, v);
        // The quantisation effect itself: the same container against the float32 goldens.
        let (_, f32_prompt) = g.f32("logits");
        let (_, f32_greedy) = g.f32("greedy_logits");
        let mut f32_want = f32_prompt;
        f32_want.extend(&f32_greedy[v..]);
        eprintln!(
            "{name}: int4 container vs transformers on dequantised weights: top-1 {:.1}% over \
             {} positions, max rel err {err:.2e}, mean KL {kl:.2e} nats; vs float32 goldens: \
             top-1 {:.1}%, mean KL {:.3} nats",
            100.0 * agree,
            ids.len(),
            100.0 * top1_agreement(&got, &f32_want, v),
            mean_kl(&f32_want, &got, v),
        );
        assert!(agree >= 0.95, "{name}: top-1 agreement {agree}");
        assert!(err <= 1e-3, "{name}: logits rel err {err}");
    }
}

/// The default container prefilled with int8 activations, against transformers on the same
/// dequantised weights, teacher-forced over prompt + greedy continuation (one prefill forward
/// of every row). These random-weight fixtures are hypersensitive by design (near-tied router
/// scores and DSA selections, so a small change flips an expert or a key): the stated
/// tolerance is relative to what the default int4 weights already cost against the float32
/// model — the int8 activations' mean KL is at most a fifth of it (measured 0.3–12%) — and the
/// top-1 of at least 75% of positions (measured 79–93%). The realistic check is the trained
/// tiny model below. The exact prefill of the same container must be much closer (int8 ran).
#[test]
fn int8_prefill_stays_within_tolerance_of_transformers() {
    use colibri::quant::kernels::Arithmetic;
    for name in FIXTURES {
        let g = Golden::load(name);
        let q = Golden::load_file(name, "golden_int4.safetensors");
        let ids = q.ids("int4_ids");
        let (shape, want) = q.f32("int4_logits");
        assert!(ids.len() >= colibri::quant::kernels::int8act::PREFILL_MIN_ROWS);
        let (_tmp, c) = default_container(name);
        let run = |arith: Arithmetic| {
            let opts = ModelOptions {
                prefill_arithmetic: arith,
                ..ModelOptions::default()
            };
            let model = Model::load(c.clone(), &opts).unwrap();
            let mut m = Sequence::owned(&model);
            m.prefill(&ids, 0, true).unwrap().logits
        };
        let (int8, exact) = (run(Arithmetic::Int8), run(Arithmetic::Exact));
        let v = shape[1];
        // What the int4 weights cost: the exact container against the float32 goldens.
        let (_, f32_prompt) = g.f32("logits");
        let (_, f32_greedy) = g.f32("greedy_logits");
        let mut f32_want = f32_prompt;
        f32_want.extend(&f32_greedy[v..]);
        let weights_kl = mean_kl(&f32_want, &exact, v);
        let (agree, err, kl) = (
            top1_agreement(&int8, &want, v),
            worst_row_rel_err(&int8, &want, v),
            mean_kl(&want, &int8, v),
        );
        let (exact_err, exact_kl) = (
            worst_row_rel_err(&exact, &want, v),
            mean_kl(&want, &exact, v),
        );
        eprintln!(
            "{name}: int8 prefill vs transformers on dequantised weights over {} rows: top-1 \
             {:.1}%, worst row rel err {err:.2e}, mean KL {kl:.2e} nats = {:.1}% of the int4 \
             weights' {weights_kl:.3} (exact prefill: {exact_err:.2e}, {exact_kl:.2e})",
            ids.len(),
            100.0 * agree,
            100.0 * kl / weights_kl,
        );
        assert!(agree >= 0.75, "{name}: top-1 agreement {agree}");
        assert!(
            kl <= 0.2 * weights_kl,
            "{name}: mean KL {kl} vs {weights_kl}"
        );
        assert!(
            exact_err <= 1e-3 && exact_kl < kl / 100.0,
            "{name}: exact {exact_err} {exact_kl} vs int8 {err} {kl}"
        );
    }
}

/// The trained tiny model (python/colibri/models/tiny, the shipped int4 container) on its
/// held-out code goldens (transformers, tools/make_tiny_golden.py): prefilled with int8
/// activations it keeps the exact prefill's bar — top-1 agreement ≥ 95% and the held-out
/// loss within 0.05 nats of transformers' — and agrees with the exact prefill's top-1 at
/// ≥ 97% of positions.
#[test]
fn int8_prefill_keeps_the_tiny_models_held_out_top1() {
    use colibri::quant::kernels::Arithmetic;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/colibri/models/tiny");
    let bytes = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_golden.safetensors"),
    )
    .unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let tensor = |k: &str| {
        let off = header[k]["data_offsets"].as_array().unwrap();
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        let shape: Vec<usize> = header[k]["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        (shape, &bytes[8 + n + a..8 + n + b])
    };
    let (ids_shape, ids_bytes) = tensor("ids");
    assert_eq!(header["logits"]["dtype"], "F16");
    let (_, logit_bytes) = tensor("logits");
    let (_, loss_bytes) = tensor("loss");
    let want_loss: Vec<f32> = loss_bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let (seqs, len) = (ids_shape[0], ids_shape[1]);
    let c = Arc::new(Container::open(&dir).unwrap());
    let v = c.config().vocab_size;
    let load = |arith: Arithmetic| {
        let opts = ModelOptions {
            prefill_arithmetic: arith,
            ..ModelOptions::default()
        };
        Model::load(c.clone(), &opts).unwrap()
    };
    let (int8_model, exact_model) = (load(Arithmetic::Int8), load(Arithmetic::Exact));
    let mut int8 = Sequence::owned(&int8_model);
    let mut exact = Sequence::owned(&exact_model);
    let (mut agree, mut agree_exact, mut same, mut loss, mut kl) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for k in 0..seqs {
        let ids: Vec<u32> = ids_bytes[k * len * 8..(k + 1) * len * 8]
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        let want: Vec<f32> = logit_bytes[k * len * v * 2..(k + 1) * len * v * 2]
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        int8.reset();
        exact.reset();
        let got = int8.prefill(&ids, 0, true).unwrap().logits;
        let reference = exact.prefill(&ids, 0, true).unwrap().logits;
        agree += top1_agreement(&got, &want, v) / seqs as f64;
        agree_exact += top1_agreement(&reference, &want, v) / seqs as f64;
        same += top1_agreement(&got, &reference, v) / seqs as f64;
        kl += mean_kl(&reference, &got, v) / seqs as f64;
        // Held-out loss: the mean NLL of each next token.
        let mut nll = 0.0f64;
        for r in 0..len - 1 {
            let row = &got[r * v..(r + 1) * v];
            let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let z = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
            nll += z - row[ids[r + 1] as usize] as f64;
        }
        loss += nll / (len - 1) as f64 / seqs as f64;
    }
    let want_loss = want_loss.iter().map(|&l| l as f64).sum::<f64>() / seqs as f64;
    eprintln!(
        "tiny model, held-out code, int8 prefill: top-1 vs transformers {:.1}% (exact prefill \
         {:.1}%), top-1 vs exact prefill {:.1}%, mean KL to the exact prefill {kl:.2e} nats, \
         loss {loss:.4} vs transformers {want_loss:.4}",
        100.0 * agree,
        100.0 * agree_exact,
        100.0 * same
    );
    assert!(agree >= 0.95, "top-1 agreement {agree}");
    assert!(
        same >= 0.97,
        "top-1 agreement with the exact prefill {same}"
    );
    assert!(
        (loss - want_loss).abs() <= 0.05,
        "loss {loss} vs {want_loss}"
    );
}

/// Chunks of fewer than PREFILL_MIN_ROWS rows, and `step` (decode and verify), stay exact
/// under the int8 option: bit-identical to a model without it (while a long prefill differs).
#[test]
fn short_prefills_and_steps_stay_exact_under_int8() {
    use colibri::quant::kernels::Arithmetic;
    let name = "dsv3_a";
    let q = Golden::load_file(name, "golden_int4.safetensors");
    let prompt = q.ids("int4_ids");
    let (_tmp, c) = default_container(name);
    let opts = ModelOptions {
        prefill_arithmetic: Arithmetic::Int8,
        ..ModelOptions::default()
    };
    let int8_model = Model::load(c.clone(), &opts).unwrap();
    let exact_model = Model::load(c, &ModelOptions::default()).unwrap();
    let mut int8 = Sequence::owned(&int8_model);
    let mut exact = Sequence::owned(&exact_model);
    let short = &prompt[..colibri::quant::kernels::int8act::PREFILL_MIN_ROWS - 1];
    let a = int8.prefill(short, 0, true).unwrap().logits;
    let b = exact.prefill(short, 0, true).unwrap().logits;
    assert_eq!(a, b);
    let a = int8
        .step(&prompt[short.len()..], short.len(), true)
        .unwrap()
        .logits;
    let b = exact
        .step(&prompt[short.len()..], short.len(), true)
        .unwrap()
        .logits;
    assert_eq!(a, b);
    int8.reset();
    exact.reset();
    let a = int8.prefill(&prompt, 0, true).unwrap().logits;
    let b = exact.prefill(&prompt, 0, true).unwrap().logits;
    assert_ne!(a, b, "a {}-row prefill must run int8", prompt.len());
}
