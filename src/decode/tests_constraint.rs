//! Structured output on the mock target: the grammar's mask holds in every picked row, and
//! speculative decoding under it emits exactly the plain-decoding tokens (greedy and seeded
//! sampling), with a negative control that leaves the verify rows unmasked.

use std::sync::atomic::AtomicBool;

use super::constraint::{Grammar, GrammarSpec, Vocabulary};
use super::mock::{MockConfig, MockTarget};
use super::*;
use crate::Error;

/// The stop token of these tests: a special token (0xFF-marked) no grammar text matches.
const STOP: u32 = 12;

/// Bytes of the mock's 16 tokens: digits, brackets and commas, some merged (so a text has
/// several tokenisations), letters and a space the grammar never allows.
fn mock_vocabulary() -> Vocabulary {
    let words: [&[u8]; 16] = [
        b"0",
        b"1",
        b"2",
        b"3",
        b"[",
        b"]",
        b",",
        b"12",
        b"3]",
        b",1",
        b"a",
        b"b",
        b"\xFF<|end|>",
        b"x",
        b" ",
        b"00",
    ];
    Vocabulary::new(words.iter().map(|w| w.to_vec()).collect(), 16).unwrap()
}

/// Lists of 4 to 6 numbers of one or two digits 0-3.
const LIST: &str = r"\[[0-3]{1,2}(,[0-3]{1,2}){3,5}\]";

fn list_grammar() -> Grammar {
    mock_vocabulary()
        .compile(&GrammarSpec::Regex(LIST.into()))
        .unwrap()
}

/// An independent check of `LIST` (not the grammar engine's).
fn is_list(text: &str) -> bool {
    let Some(inner) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')) else {
        return false;
    };
    let items: Vec<&str> = inner.split(',').collect();
    (4..=6).contains(&items.len())
        && items
            .iter()
            .all(|i| (1..=2).contains(&i.len()) && i.bytes().all(|b| (b'0'..=b'3').contains(&b)))
}

fn text(tokens: &[u32]) -> String {
    let words = [
        "0", "1", "2", "3", "[", "]", ",", "12", "3]", ",1", "a", "b", "", "x", " ", "00",
    ];
    tokens.iter().map(|&t| words[t as usize]).collect()
}

fn options(
    grammar: &Grammar,
    draft: DraftSource,
    depth: DraftDepth,
    seed: Option<u64>,
) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: 40,
        sampling: SamplingParams {
            temperature: if seed.is_some() { 1.0 } else { 0.0 },
            seed,
            constraint: Some(grammar.clone()),
            ..SamplingParams::default()
        },
        stop_tokens: vec![STOP],
        draft,
        depth,
        guard: GuardConfig {
            enabled: false,
            ..GuardConfig::default()
        },
        ..GenerateOptions::default()
    }
}

fn generate_on(t: &mut MockTarget, prompt: &[u32], o: &GenerateOptions) -> Result<Generation> {
    generate(t, prompt, o, &mut |_| true, &AtomicBool::new(false))
}

const DRAFTERS: [(DraftSource, DraftDepth); 5] = [
    (DraftSource::Mtp, DraftDepth::Fixed(1)),
    (DraftSource::Mtp, DraftDepth::Fixed(4)),
    (DraftSource::Mtp, DraftDepth::Auto),
    (DraftSource::Ngram, DraftDepth::Fixed(3)),
    (DraftSource::Ngram, DraftDepth::Auto),
];

fn prompts() -> Vec<Vec<u32>> {
    let mut rng = rng::Rng::from_seed(7);
    (0..16)
        .map(|i| (0..1 + i % 6).map(|_| rng.below(16) as u32).collect())
        .collect()
}

/// Plain constrained decoding of every prompt, checked against the pattern.
fn plain_outputs(t: &mut MockTarget, grammar: &Grammar, seed: Option<u64>) -> Vec<Vec<u32>> {
    prompts()
        .iter()
        .map(|p| {
            let o = options(grammar, DraftSource::Off, DraftDepth::Auto, seed);
            let g = generate_on(t, p, &o).unwrap();
            assert_eq!(g.finish, FinishReason::Stop, "prompt {p:?}: {:?}", g.tokens);
            assert_eq!(g.tokens.last(), Some(&STOP));
            let body = text(&g.tokens);
            assert!(
                is_list(&body),
                "prompt {p:?}: {body:?} does not match {LIST}"
            );
            g.tokens
        })
        .collect()
}

#[test]
fn constrained_output_matches_the_pattern_and_unconstrained_does_not() {
    let mut t = MockTarget::new(MockConfig::default());
    plain_outputs(&mut t, &list_grammar(), None);
    plain_outputs(&mut t, &list_grammar(), Some(3));
    // The mock's own greedy text is no list: the mask is what makes it one.
    let free = GenerateOptions {
        sampling: SamplingParams::default(),
        ..options(&list_grammar(), DraftSource::Off, DraftDepth::Auto, None)
    };
    let raw = generate_on(&mut t, &prompts()[0], &free).unwrap();
    assert!(!is_list(&text(&raw.tokens)));
}

#[test]
fn drafting_under_a_grammar_is_lossless_greedy_and_seeded() {
    let mut t = MockTarget::new(MockConfig::default());
    let grammar = list_grammar();
    for seed in [None, Some(1), Some(2), Some(3)] {
        let plain = plain_outputs(&mut t, &grammar, seed);
        let mut accepted = 0;
        for (p, want) in prompts().iter().zip(&plain) {
            for (draft, depth) in DRAFTERS {
                let g = generate_on(&mut t, p, &options(&grammar, draft, depth, seed)).unwrap();
                assert_eq!(
                    &g.tokens, want,
                    "{draft:?} {depth:?} seed {seed:?} prompt {p:?}"
                );
                accepted += g.stats.accepted;
            }
        }
        assert!(
            accepted > 0,
            "no draft was ever accepted: the test shows nothing"
        );
    }
}

/// The negative control: with the verify rows unmasked, drafting no longer reproduces plain
/// constrained decoding (it emits drafts the grammar forbids, or fails on them).
#[test]
fn unmasked_verify_rows_break_the_lossless_test() {
    let mut t = MockTarget::new(MockConfig::default());
    let grammar = list_grammar();
    let control = grammar.without_verify_masks();
    let plain = plain_outputs(&mut t, &grammar, None);
    let mut broken = 0;
    for (p, want) in prompts().iter().zip(&plain) {
        let o = options(&control, DraftSource::Mtp, DraftDepth::Fixed(4), None);
        match generate_on(&mut t, p, &o) {
            Ok(g) if &g.tokens == want => {}
            _ => broken += 1,
        }
    }
    assert!(
        broken > plain.len() / 2,
        "only {broken} of {} broke",
        plain.len()
    );
}

#[test]
fn a_complete_grammar_ends_the_output_even_before_min_tokens() {
    let mut t = MockTarget::new(MockConfig::default());
    let grammar = mock_vocabulary()
        .compile(&GrammarSpec::Regex("12".into()))
        .unwrap();
    let mut o = options(&grammar, DraftSource::Mtp, DraftDepth::Fixed(2), None);
    o.sampling.min_tokens = 10;
    let g = generate_on(&mut t, &[1, 2], &o).unwrap();
    assert_eq!(text(&g.tokens), "12");
    assert_eq!(g.tokens.last(), Some(&STOP));
    // Without a stop token to end it, a complete grammar leaves no token: a clear error.
    o.stop_tokens.clear();
    let err = generate_on(&mut t, &[1, 2], &o).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { param, .. } if param == "sampling_params"),
        "{err}"
    );
}

#[test]
fn bad_grammars_are_invalid_arguments_naming_their_keyword() {
    let v = mock_vocabulary();
    for (spec, param) in [
        (GrammarSpec::JsonSchema("{not json".into()), "guided_json"),
        (
            GrammarSpec::JsonSchema(r#"{"type": "frobnicate"}"#.into()),
            "guided_json",
        ),
        (GrammarSpec::Regex("[0-".into()), "guided_regex"),
        (
            GrammarSpec::Lark("start: undefined_rule".into()),
            "guided_grammar",
        ),
    ] {
        let err = v.compile(&spec).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { param: p, .. } if p == param),
            "{spec:?}: {err}"
        );
    }
    assert!(GrammarSpec::parse("regex", "  ").is_err());
    assert!(GrammarSpec::parse("yaml", "a").is_err());
    // A grammar compiled for another vocabulary size is refused before any forward.
    let mut t = MockTarget::new(MockConfig {
        vocab: 20,
        ..MockConfig::default()
    });
    let o = options(&list_grammar(), DraftSource::Off, DraftDepth::Auto, None);
    let err = generate_on(&mut t, &[1], &o).unwrap_err();
    assert!(err.to_string().contains("compiled for 16 tokens"), "{err}");
}

/// The tiny model's tokenizer.json (byte-level BPE): a JSON schema compiles against it, and
/// its special tokens and padding rows are never allowed.
#[test]
fn tokenizer_json_vocabulary_masks_special_tokens() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/python/colibri/models/tiny/tokenizer.json"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let v = Vocabulary::from_tokenizer_json(&text, 4100).unwrap();
    let schema =
        r#"{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}"#;
    let g = v.compile(&GrammarSpec::JsonSchema(schema.into())).unwrap();
    let sp = SamplingParams {
        constraint: Some(g),
        ..SamplingParams::default()
    };
    let history = History::new(&[0], &sp, &[1]);
    let row = vec![0.0f32; 4100];
    let x = history.process(&row, &sp, &[]);
    let allowed: Vec<usize> = (0..x.len()).filter(|&i| x[i] > f32::NEG_INFINITY).collect();
    assert!(!allowed.is_empty());
    // Ids 0-5 are <|bos|>, <|endoftext|>, ...; 4096.. are rows the tokenizer does not fill.
    assert!(allowed.iter().all(|&i| i > 5 && i < 4096), "{allowed:?}");
    assert!(Vocabulary::from_tokenizer_json("{}", 10).is_err());
    assert!(Vocabulary::from_tokenizer_json("[", 10).is_err());
}
