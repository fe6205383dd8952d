//! The prompt tokenizer against the ids and masks diffusers' pipeline produces
//! (`fixtures/golden/tokenizer.json`, made by `tools/make_fixtures.py`).

use std::path::PathBuf;

use pipeline_zimage::Error;
use pipeline_zimage::tokenizer::{PromptTokenizer, apply_chat_template};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn golden() -> Value {
    let text = std::fs::read_to_string(fixtures().join("golden/tokenizer.json")).expect("read tokenizer.json");
    serde_json::from_str(&text).expect("parse tokenizer.json")
}

fn tokenizer(max_len: usize) -> PromptTokenizer {
    PromptTokenizer::from_dir(fixtures().join("tiny-z-image-turbo/tokenizer"), max_len).expect("tokenizer")
}

#[test]
fn ids_and_masks_match_the_pipeline() {
    let g = golden();
    let max_len = g["max_sequence_length"].as_u64().expect("max len") as usize;
    let tok = tokenizer(max_len);
    assert_eq!(u64::from(tok.pad_id()), g["pad_token_id"].as_u64().expect("pad id"));
    assert_eq!(tok.vocab_size() as u64, g["vocab_size"].as_u64().expect("vocab"));
    let cases = g["cases"].as_array().expect("cases");
    let prompts: Vec<&str> = cases.iter().map(|c| c["prompt"].as_str().expect("prompt")).collect();
    let got = tok.encode(&prompts).expect("encode");
    for (i, case) in cases.iter().enumerate() {
        assert_eq!(apply_chat_template(prompts[i]), case["templated"].as_str().expect("templated"));
        let ids: Vec<u32> =
            case["input_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        let mask: Vec<bool> =
            case["attention_mask"].as_array().expect("mask").iter().map(|v| v.as_u64().expect("bit") == 1).collect();
        assert_eq!(got.input_ids[i], ids, "ids of {:?}", prompts[i]);
        assert_eq!(got.attention_mask[i], mask, "mask of {:?}", prompts[i]);
    }
    // The last case is truncated to the full length.
    assert_eq!(got.lengths().last().copied(), Some(max_len));
}

#[test]
fn tensors_have_batch_by_length_shape() {
    let tok = tokenizer(16);
    let batch = tok.encode(&["a cat", ""]).expect("encode");
    let device = burn::tensor::Device::flex();
    assert_eq!(batch.input_ids_tensor(&device).dims(), [2, 16]);
    assert_eq!(batch.attention_mask_tensor(&device).dims(), [2, 16]);
}

#[test]
fn zero_length_is_rejected() {
    let err = PromptTokenizer::from_dir(fixtures().join("tiny-z-image-turbo/tokenizer"), 0).expect_err("must fail");
    assert!(matches!(err, Error::Tokenizer(_)), "{err}");
}
