//! The float32 forward against transformers' goldens: prefill and token-by-token logits,
//! greedy continuation, chunked prefill, KV accounting, rollback, the MTP head (depth 1 and
//! chained), and every source of experts giving the same logits.

use std::sync::Arc;

use colibri::container::Container;
use colibri::model::{Model, ModelOptions, Sequence};

use crate::common::{argmax, fixture_dir, load, rel_err, Golden, FIXTURES};

#[test]
fn prefill_logits_match_transformers() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let prompt = g.ids("prompt_ids");
        let (_, want) = g.f32("logits");
        let (_, want_hidden) = g.f32("hidden");
        let model = load(name);
        let mut m = Sequence::owned(&model);
        let f = m.step(&prompt, 0, true).unwrap();
        let err = rel_err(&f.logits, &want);
        eprintln!(
            "{name}: prefill logits rel err {err:.2e}, hidden rel err {:.2e}",
            rel_err(&f.pre_norm_hidden, &want_hidden)
        );
        assert!(err <= 1e-3, "{name}: prefill logits rel err {err}");
    }
}

#[test]
fn token_by_token_logits_match_transformers() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let prompt = g.ids("prompt_ids");
        let (shape, want) = g.f32("logits");
        let v = shape[1];
        let model = load(name);
        let mut m = Sequence::owned(&model);
        for (p, &t) in prompt.iter().enumerate() {
            let f = m.step(&[t], p, true).unwrap();
            let err = rel_err(&f.logits, &want[p * v..(p + 1) * v]);
            assert!(err <= 1e-3, "{name}: position {p} rel err {err}");
        }
    }
}

#[test]
fn greedy_continuation_is_token_identical() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let prompt = g.ids("prompt_ids");
        let want = g.ids("greedy_ids");
        let (_, want_logits) = g.f32("greedy_logits");
        let v = want_logits.len() / want.len();
        let model = load(name);
        let mut m = Sequence::owned(&model);
        let mut f = m.step(&prompt, 0, false).unwrap();
        let mut got = Vec::new();
        for i in 0..want.len() {
            let err = rel_err(&f.logits, &want_logits[i * v..(i + 1) * v]);
            assert!(err <= 1e-3, "{name}: greedy step {i} rel err {err}");
            let t = argmax(&f.logits);
            got.push(t);
            if i + 1 < want.len() {
                f = m.step(&[t], prompt.len() + i, false).unwrap();
            }
        }
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let prompt = g.ids("prompt_ids");
        let model = load(name);
        let mut m = Sequence::owned(&model);
        let one = m.step(&prompt, 0, true).unwrap().logits;
        m.reset();
        let mut chunked = Vec::new();
        let mut pos = 0;
        for chunk in prompt.chunks(5) {
            chunked.extend(m.step(chunk, pos, true).unwrap().logits);
            pos += chunk.len();
        }
        let err = rel_err(&chunked, &one);
        assert!(err <= 1e-5, "{name}: chunked vs one-shot rel err {err}");
    }
}

/// Per token: an f32 latent and roped key per layer, plus an f32 indexer key per GLM DSA
/// full layer (nothing else: no expanded K/V).
#[test]
fn kv_cache_holds_latent_rope_key_and_indexer_key_only() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let prompt = g.ids("prompt_ids");
        let model = load(name);
        let mut m = Sequence::owned(&model);
        m.step(&prompt, 0, false).unwrap();
        let cfg = model.config().clone();
        let per = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4;
        assert_eq!(cfg.kv_bytes_per_token_per_layer(), per);
        let full_layers = cfg.indexer_full.iter().filter(|f| **f).count();
        assert_eq!(model.uses_dsa(), name.starts_with("glm"), "{name}");
        let token = per * cfg.num_hidden_layers + full_layers * cfg.index_head_dim * 4;
        assert_eq!(
            cfg.kv_bytes_per_token(model.uses_dsa(), false),
            token,
            "{name}"
        );
        let mtp_row = per
            + if model.uses_dsa() {
                cfg.index_head_dim * 4
            } else {
                0
            };
        assert_eq!(model.kv_bytes_per_token(), token + mtp_row, "{name}");
        assert_eq!(m.caches().main_bytes(), token * prompt.len(), "{name}");
        m.truncate(5);
        assert_eq!(m.kv_len(), 5);
        assert_eq!(m.caches().main_bytes(), token * 5, "{name}");
    }
}

#[test]
fn rollback_then_recompute_matches() {
    let g = Golden::load("dsv3_a");
    let prompt = g.ids("prompt_ids");
    let model = load("dsv3_a");
    let mut m = Sequence::owned(&model);
    let want = m.step(&prompt, 0, true).unwrap().logits;
    // Feed garbage after position 6, roll back, and recompute the rest.
    m.truncate(6);
    m.step(&[3, 4, 5], 6, false).unwrap();
    m.truncate(6);
    let tail = m.step(&prompt[6..], 6, true).unwrap().logits;
    let v = model.config().vocab_size;
    assert!(rel_err(&tail, &want[6 * v..]) <= 1e-5);
}

#[test]
fn mtp_head_matches_transformers() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let prompt = g.ids("prompt_ids");
        let (_, want) = g.f32("mtp_logits");
        let model = load(name);
        let mut m = Sequence::owned(&model);
        assert!(model.has_mtp(), "{name}");
        let f = m.step(&prompt, 0, true).unwrap();
        let h = model.config().hidden_size;
        let t = prompt.len();
        let carried = model.final_norm(&f.pre_norm_hidden[..(t - 1) * h]);
        let d = m.mtp_step(&prompt[1..], &carried, 0, true).unwrap();
        let err = rel_err(&d.logits, &want);
        eprintln!("{name}: mtp logits rel err {err:.2e}");
        assert!(err <= 1e-3, "{name}: mtp logits rel err {err}");
    }
}

#[test]
fn chained_mtp_drafts_match_transformers_convention() {
    for name in FIXTURES {
        let g = Golden::load(name);
        let prompt = g.ids("prompt_ids");
        let greedy = g.ids("greedy_ids");
        let want_ids = g.ids("mtp_chain_ids");
        let (_, want_logits) = g.f32("mtp_chain_logits");
        let model = load(name);
        let mut m = Sequence::owned(&model);
        let v = model.config().vocab_size;
        let t = prompt.len();
        let f = m.step(&prompt, 0, true).unwrap();
        let carried = model.final_norm(&f.pre_norm_hidden);
        // Absorb the prompt and draft from the last position in one batch.
        let mut tokens = prompt[1..].to_vec();
        tokens.push(greedy[0]);
        let d = m.mtp_step(&tokens, &carried, 0, true).unwrap();
        let mut logits = d.logits[(t - 1) * v..].to_vec();
        let mut state = d.post_norm_hidden.slice(t - 1..t);
        for k in 0..want_ids.len() {
            let err = rel_err(&logits, &want_logits[k * v..(k + 1) * v]);
            assert!(err <= 1e-3, "{name}: chain depth {} rel err {err}", k + 1);
            let id = argmax(&logits);
            assert_eq!(id, want_ids[k], "{name}: depth {}", k + 1);
            if k + 1 < want_ids.len() {
                let d = m.mtp_step(&[id], &state, t + k, true).unwrap();
                logits = d.logits;
                state = d.post_norm_hidden;
            }
        }
    }
}

/// Every way of getting experts — all resident, or the streaming store in each I/O mode, with
/// prefetch off / hint / real and a budget too small to hold a layer — gives bit-identical
/// logits.
#[test]
fn output_is_identical_across_expert_sources_and_prefetch_modes() {
    use colibri::experts::{ExpertStore, IoMode, PinPolicy, PrefetchMode, StoreOptions};
    for name in ["dsv3_a", "glm_b"] {
        let g = Golden::load(name);
        let mut tokens = g.ids("prompt_ids");
        tokens.extend(g.ids("greedy_ids"));
        let c = Arc::new(Container::open(&fixture_dir(name)).unwrap());
        let reference_model = Model::load(c.clone(), &ModelOptions::default()).unwrap();
        let reference = Sequence::owned(&reference_model)
            .step(&tokens, 0, true)
            .unwrap()
            .logits;
        for io in [IoMode::Mmap, IoMode::Pread] {
            for prefetch in [PrefetchMode::Off, PrefetchMode::Hint, PrefetchMode::Real] {
                for budget in [Some(1u64), None] {
                    let store = ExpertStore::open(
                        c.clone(),
                        StoreOptions {
                            io,
                            prefetch,
                            ram_budget_bytes: budget,
                            pin: PinPolicy::Off,
                            usage_file: false,
                            ..StoreOptions::default()
                        },
                    )
                    .unwrap();
                    let opts = ModelOptions {
                        prefetch_top_k: if prefetch == PrefetchMode::Off { 0 } else { 4 },
                        ..ModelOptions::default()
                    };
                    let model =
                        Model::load_with_experts(c.clone(), &opts, Arc::new(store)).unwrap();
                    let mut m = Sequence::owned(&model);
                    // Token by token, so the lookahead runs many times.
                    let mut logits = Vec::new();
                    for (p, &t) in tokens.iter().enumerate() {
                        logits.extend(m.step(&[t], p, true).unwrap().logits);
                    }
                    let v = model.config().vocab_size;
                    for p in 0..tokens.len() {
                        assert!(
                            logits[p * v..(p + 1) * v]
                                .iter()
                                .zip(&reference[p * v..(p + 1) * v])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{name} {io:?} {prefetch:?} {budget:?}: position {p} differs"
                        );
                    }
                }
            }
        }
    }
}
