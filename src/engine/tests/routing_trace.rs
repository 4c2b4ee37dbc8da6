use super::*;
use crate::decode::DraftDepth;
use crate::routing::{RowKind, Trace};

fn open_tracing(trace: Option<&Path>, spill: &Path) -> Engine {
    let opts = EngineOptions {
        usage_file: false,
        threads: 2,
        spill_dir: Some(spill.to_path_buf()),
        trace_routing: trace.map(Path::to_path_buf),
        ..EngineOptions::default()
    };
    Engine::open(&model_dir("python/colibri/models/tiny"), &opts).expect("the model opens")
}

/// `trace_routing` writes what the forwards routed, in the format the replay reads: the
/// prompt's rows, one decode row per decode forward, the drafts each verify checked
/// (accepted as the generation's stats count them) and the MTP layer's rows; and it does
/// not change the output.
#[test]
fn the_routing_trace_records_every_forward_and_changes_no_token() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("trace.jsonl");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 200).collect();
    let mut opts = {
        let e = open_tracing(None, tmp.path());
        options(&e, false)
    };
    opts.max_new_tokens = 24;
    opts.depth = DraftDepth::Fixed(2);
    let generate = |e: &Engine| {
        e.generate(None, &prompt, &opts, &mut |_| true, &AtomicBool::new(false))
            .expect("generate")
    };
    let plain = generate(&open_tracing(None, tmp.path()));
    let (traced, cfg) = {
        let e = open_tracing(Some(&path), tmp.path());
        (generate(&e), e.model.config().clone())
        // Dropping the engine writes what is held.
    };
    assert_eq!(traced.tokens, plain.tokens, "tracing changed the output");

    let trace = Trace::load(&path).expect("the trace reads back");
    let moe: Vec<usize> = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect();
    assert_eq!(trace.header.layers, moe);
    assert_eq!(trace.header.experts, cfg.n_routed_experts);
    assert_eq!(trace.header.top_k, cfg.num_experts_per_tok);
    assert_eq!(trace.header.mtp_layer, cfg.mtp_layer_index());
    let count = |kind| trace.rows.iter().filter(|r| r.kind == kind).count();
    assert_eq!(count(RowKind::Prompt), prompt.len());
    let stats = &traced.stats;
    assert_eq!(count(RowKind::Decode) as u64, stats.decode_forwards);
    let proposed: u64 = stats.drafts_proposed.iter().sum();
    let accepted: u64 = stats.drafts_accepted.iter().sum();
    assert!(
        proposed > 0 && accepted > 0,
        "the MTP head drafted: {stats:?}"
    );
    assert_eq!(count(RowKind::Draft) as u64, proposed);
    let accepted_rows = trace.rows.iter().filter(|r| r.accepted == Some(true));
    assert_eq!(accepted_rows.count() as u64, accepted);
    assert!(trace
        .rows
        .iter()
        .filter(|r| r.kind == RowKind::Draft)
        .all(|r| r.accepted.is_some()));
    // The MTP layer absorbed the prompt and drafted: at least one row per prompt token.
    assert!(
        count(RowKind::Mtp) >= prompt.len(),
        "{}",
        count(RowKind::Mtp)
    );
    // The first token comes from the prefill, every other from a decode row or a draft.
    assert_eq!(
        trace.generated_tokens() + 1,
        traced.tokens.len() as u64,
        "decode rows plus accepted drafts"
    );
    for row in &trace.rows {
        for ids in &row.experts {
            let mut distinct = ids.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), cfg.num_experts_per_tok, "{row:?}");
        }
        assert_eq!(row.conv, 0);
    }
    // What the replay reads: every forward's union per layer.
    assert!(!crate::routing::sim::calls(&trace).is_empty());
}

/// Rows of one sequence's second prompt start a new conversation; a trace path that
/// cannot be created fails the open, naming it.
#[test]
fn a_new_prompt_is_a_new_conversation_and_a_bad_path_fails_the_open() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("trace.jsonl");
    {
        let e = open_tracing(Some(&path), tmp.path());
        let mut o = options(&e, false);
        o.draft = crate::decode::DraftSource::Off;
        o.max_new_tokens = 3;
        for prompt in [[5u32, 6, 7], [9, 10, 11]] {
            let s = e.new_session().expect("session");
            e.generate(
                Some(&s),
                &prompt,
                &o,
                &mut |_| true,
                &AtomicBool::new(false),
            )
            .expect("generate");
        }
    }
    let trace = Trace::load(&path).expect("read");
    let convs: Vec<u32> = trace.rows.iter().map(|r| r.conv).collect();
    assert_eq!(convs, [[0u32; 3 + 2], [1; 3 + 2]].concat(), "{convs:?}");
    let bad = tmp.path().join("no/such/dir/trace.jsonl");
    let opts = EngineOptions {
        usage_file: false,
        trace_routing: Some(bad.clone()),
        ..EngineOptions::default()
    };
    let err = Engine::open(&model_dir("python/colibri/models/tiny"), &opts)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("trace.jsonl"), "{err}");
}
