//! The prompt tokenizer against the ids and masks diffusers' pipeline produces
//! (`fixtures/golden/tokenizer.json`, made by `tools/make_fixtures.py`).

use std::path::PathBuf;

use pipeline_zimage::Error;
use pipeline_zimage::tokenizer::{ChatTemplate, PromptTokenizer, apply_chat_template};
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

#[test]
fn the_checkpoints_own_template_and_the_fallback_both_give_diffusers_ids() {
    let g = golden();
    let max_len = g["max_sequence_length"].as_u64().expect("max len") as usize;
    let own = tokenizer(max_len);
    // The tiny checkpoint carries Qwen3's template in tokenizer_config.json, as the real one does.
    assert!(matches!(own.template(), ChatTemplate::Checkpoint { .. }), "{:?}", own.template());
    let fallback = own.clone().with_template(ChatTemplate::Qwen3);
    let cases = g["cases"].as_array().expect("cases");
    let prompts: Vec<&str> = cases.iter().map(|c| c["prompt"].as_str().expect("prompt")).collect();
    for (i, case) in cases.iter().enumerate() {
        let templated = case["templated"].as_str().expect("templated");
        assert_eq!(own.template().apply(prompts[i]).expect("renders"), templated, "{:?}", prompts[i]);
        assert_eq!(fallback.template().apply(prompts[i]).expect("renders"), templated, "{:?}", prompts[i]);
    }
    assert_eq!(own.encode(&prompts).expect("encode"), fallback.encode(&prompts).expect("encode"));
}

/// A tokenizer directory with the tiny tokenizer and `files` written beside it.
fn tokenizer_dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tokenizer-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let source = fixtures().join("tiny-z-image-turbo/tokenizer/tokenizer.json");
    std::fs::copy(source, dir.join("tokenizer.json")).expect("copied");
    for (file, text) in files {
        std::fs::write(dir.join(file), text).expect("written");
    }
    dir
}

#[test]
fn a_chat_template_file_wins_and_a_broken_one_is_a_typed_error() {
    let dir = tokenizer_dir(
        "jinja",
        &[
            ("chat_template.jinja", "{% for m in messages %}<{{ m.role }}>{{ m.content.upper() }}{% endfor %}|"),
            ("tokenizer_config.json", r#"{"chat_template": "ignored {{ messages }}"}"#),
        ],
    );
    let tok = PromptTokenizer::from_dir(&dir, 16).expect("tokenizer");
    assert_eq!(tok.template().apply("a cat").expect("renders"), "<user>A CAT|");

    let broken = tokenizer_dir("broken", &[("chat_template.jinja", "{% for m in messages %}{{ m.content }")]);
    let error = PromptTokenizer::from_dir(&broken, 16).expect_err("does not compile");
    assert!(matches!(&error, Error::Tokenizer(message) if message.contains("chat_template.jinja")), "{error}");

    // No template anywhere: the standard Qwen3 one.
    let none = tokenizer_dir("none", &[("tokenizer_config.json", r#"{"pad_token": "<|endoftext|>"}"#)]);
    let tok = PromptTokenizer::from_dir(&none, 16).expect("tokenizer");
    assert!(matches!(tok.template(), ChatTemplate::Qwen3));
    for dir in [dir, broken, none] {
        std::fs::remove_dir_all(dir).ok();
    }
}
