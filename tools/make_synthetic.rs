//! Write a synthetic GLM-5.2-shaped container for benchmarks: routed experts at the real
//! GLM-5.2 shapes (hidden 6144, moe_intermediate 2048, int4-gs64: 21,233,664 bytes each) with
//! random weights, a `config.json` with GLM-5.2 dimensions but few layers and a small
//! vocabulary, and (unless `--experts-only`) a random dense part so the directory loads as a
//! complete model. Keep it outside the repository: 3 MoE layers × 256 experts ≈ 16.3 GB.
//!
//! ```text
//! cargo run --release --example make_synthetic -- --out /work/synth/glm52 \
//!     [--moe-layers 3] [--experts 256] [--dense-layers 1] [--mtp] [--experts-only] \
//!     [--experts-per-shard 64] [--vocab 1024] [--seed 1] [--index-topk-freq 1] \
//!     [--index-skip-topk-offset 2] [--max-position-embeddings 4096]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use colibri::experts::synth::{self, SynthSpec};

fn main() {
    if let Err(e) = run() {
        eprintln!("make_synthetic: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let mut out: Option<PathBuf> = None;
    let (mut moe, mut experts, mut dense_layers) = (3usize, 256usize, 1usize);
    let mut spec = SynthSpec::glm52(0, 0);
    spec.dense = true;
    let mut args = std::env::args().skip(1);
    let num = |v: Option<String>, flag: &str| -> Result<usize, String> {
        v.ok_or(format!("{flag} needs a value"))?
            .parse()
            .map_err(|e| format!("{flag}: {e}"))
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = args.next().map(PathBuf::from),
            "--moe-layers" => moe = num(args.next(), "--moe-layers")?,
            "--experts" => experts = num(args.next(), "--experts")?,
            "--dense-layers" => dense_layers = num(args.next(), "--dense-layers")?,
            "--experts-per-shard" => {
                spec.experts_per_shard = num(args.next(), "--experts-per-shard")?
            }
            "--vocab" => spec.vocab_size = num(args.next(), "--vocab")?,
            "--seed" => spec.seed = num(args.next(), "--seed")? as u64,
            "--index-topk-freq" => spec.index_topk_freq = num(args.next(), "--index-topk-freq")?,
            "--index-skip-topk-offset" => {
                spec.index_skip_topk_offset = num(args.next(), "--index-skip-topk-offset")?
            }
            "--max-position-embeddings" => {
                spec.max_position_embeddings = num(args.next(), "--max-position-embeddings")?
            }
            "--mtp" => spec.mtp = true,
            "--experts-only" => spec.dense = false,
            "-h" | "--help" => {
                println!("see the header of tools/make_synthetic.rs");
                return Ok(());
            }
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    let out = out.ok_or("--out DIR is required")?;
    spec.n_routed_experts = experts;
    spec.first_k_dense_replace = dense_layers;
    spec.num_hidden_layers = dense_layers + moe;
    let t = Instant::now();
    let src = synth::write(&out, &spec).map_err(|e| e.to_string())?;
    let bytes: u64 = src
        .layers
        .values()
        .flat_map(|l| l.iter().map(|e| e.bytes()))
        .sum();
    println!(
        "wrote {} ({} expert layers × {experts} experts, {:.2} GB of experts{}) in {:.1} s",
        out.display(),
        src.layers.len(),
        bytes as f64 / 1e9,
        if spec.dense { " + dense part" } else { "" },
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
