//! The remote-experts hook on the embedded trained model: experts computed by a stand-in
//! worker (the same kernels on the same rows, as `ExpertShard` runs them) give the local
//! model's logits bit for bit, and so do a remote that answers nothing or answers wrongly.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;
use crate::container::Container;
use crate::model::moe::ResidentExperts;
use crate::model::{Model, ModelOptions, Sequence};
use crate::quant::kernels;

/// How a stand-in worker answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    /// Computes the odd experts it takes.
    Right,
    /// Computes every expert (the shared ones then run while it does).
    All,
    /// Takes the odd experts and answers none (a dead worker).
    Nothing,
    /// Answers every taken expert with one value too few (a broken worker).
    Short,
}

struct Worker {
    experts: ResidentExperts,
    answer: Answer,
    submitted: AtomicUsize,
}

struct Done {
    taken: Vec<usize>,
    out: RemoteOutputs,
}

impl RemotePending for Done {
    fn taken(&self) -> &[usize] {
        &self.taken
    }
    fn collect(self: Box<Self>) -> RemoteOutputs {
        self.out
    }
}

impl RemoteExperts for Worker {
    fn submit(
        &self,
        layer: usize,
        arith: Arithmetic,
        h: &[f32],
        s: usize,
        want: &[ExpertRows],
    ) -> Option<Box<dyn RemotePending>> {
        self.submitted.fetch_add(1, Ordering::Relaxed);
        let hidden = h.len() / s;
        let mine: Vec<&ExpertRows> = want
            .iter()
            .filter(|w| self.answer == Answer::All || w.expert % 2 == 1)
            .collect();
        if mine.is_empty() {
            return None;
        }
        let taken: Vec<usize> = mine.iter().map(|w| w.expert).collect();
        let mut done = Vec::new();
        if self.answer != Answer::Nothing {
            let xs: Vec<Vec<f32>> = mine
                .iter()
                .map(|w| {
                    w.rows
                        .iter()
                        .flat_map(|&r| h[r * hidden..(r + 1) * hidden].iter().copied())
                        .collect()
                })
                .collect();
            self.experts
                .with_expert_batches(layer, &taken, &mut |batch| {
                    let calls: Vec<kernels::ExpertCall<'_>> = batch
                        .iter()
                        .zip(&xs)
                        .zip(&mine)
                        .map(|(((_, v), x), w)| {
                            kernels::ExpertCall::new(&v.gate, &v.up, &v.down, x, w.rows.len())
                        })
                        .collect();
                    let mut ys: Vec<Vec<f32>> =
                        calls.iter().map(|c| vec![0.0; c.s * hidden]).collect();
                    let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
                    kernels::experts_ffn_in(arith, &calls, &mut outs, None)?;
                    for ((id, _), mut y) in batch.iter().zip(ys) {
                        if self.answer == Answer::Short {
                            y.pop();
                        }
                        done.push((*id, y));
                    }
                    Ok(())
                })
                .expect("the stand-in worker computes");
        }
        Some(Box::new(Done {
            taken,
            out: RemoteOutputs { done },
        }))
    }
}

fn tiny(decode: Arithmetic) -> (Model, ResidentExperts) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/colibri/models/tiny");
    let c = Arc::new(Container::open(&dir).expect("the embedded model opens"));
    let cfg = c.config().clone();
    let layers: Vec<usize> = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .chain(cfg.mtp_layer_index())
        .collect();
    let experts = ResidentExperts::load(&c, &cfg, &layers).expect("experts load");
    let opts = ModelOptions {
        decode_arithmetic: decode,
        prefill_arithmetic: decode,
        ..ModelOptions::default()
    };
    (Model::load(c, &opts).expect("the model loads"), experts)
}

const PROMPT: [u32; 7] = [1, 200, 31, 417, 90, 12, 77];

/// Logits of the prompt's rows and of two decode steps after it, one row then three.
fn logits(model: &Model) -> Vec<f32> {
    let mut seq = Sequence::owned(model);
    let n = PROMPT.len();
    let mut all = seq.step(&PROMPT, 0, true).expect("prefill").logits;
    all.extend(seq.step(&[5], n, true).expect("one row").logits);
    all.extend(
        seq.step(&[6, 7, 8], n + 1, true)
            .expect("three rows")
            .logits,
    );
    all
}

#[test]
fn experts_computed_remotely_give_the_local_logits_bit_for_bit() {
    for arith in [Arithmetic::Exact, Arithmetic::Int8] {
        for answer in [Answer::Right, Answer::All, Answer::Nothing, Answer::Short] {
            let (model, experts) = tiny(arith);
            let want = logits(&model);
            let worker = Arc::new(Worker {
                experts,
                answer,
                submitted: AtomicUsize::new(0),
            });
            model.set_remote_experts(Some(worker.clone()));
            let got = logits(&model);
            assert!(worker.submitted.load(Ordering::Relaxed) > 0);
            let same = got.len() == want.len()
                && got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{} arithmetic, a worker answering {answer:?}",
                arith.name()
            );
            model.set_remote_experts(None);
        }
    }
}
