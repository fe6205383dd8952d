//! The checkpoint readers' fuzz harness, briefly, so CI keeps it working: a few thousand mutated inputs into
//! each reader (`cargo xtask fuzz` runs a million), the seeds checked to be valid inputs, and the crashes the
//! fuzzer found kept as regression tests.

#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

#[path = "../examples/fuzz_readers/targets.rs"]
mod targets;

use std::path::{Path, PathBuf};

use pipeline_zimage::Error;
use pipeline_zimage::config::{ModelIndex, TransformerConfig};
use pipeline_zimage::loading::{LoadOptions, load_bytes, parse_weight_map};
use pipeline_zimage::scheduler::SchedulerConfig;
use pipeline_zimage::text_encoder::TextEncoderConfig;
use pipeline_zimage::vae::VaeConfig;
use tests::fuzz::{corpus, fuzz};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target)
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let seeds = corpus(&corpus_dir(target));
    assert!(!seeds.is_empty(), "{target} has no seeds in {}", corpus_dir(target).display());
    seeds
}

#[test]
fn every_reader_survives_a_short_run() {
    for (name, target) in targets::targets() {
        let report = fuzz(name, &seeds(name), 3_000, 7, target);
        assert!(
            report.crashes.is_empty(),
            "{name}: {:?}",
            report.crashes.iter().map(|c| String::from_utf8_lossy(c)).collect::<Vec<_>>()
        );
        // The structured edits reach past the parser: some reads are accepted and go on to the derived values.
        assert!(targets::accepted(name) > 0, "{name}: no read was accepted in a short run");
    }
}

/// The seeds are inputs the readers accept, so mutations start from the paths that matter.
#[test]
fn every_seed_is_accepted() {
    let path = Path::new("seed");
    let text = |seed: &Vec<u8>| String::from_utf8(seed.clone()).unwrap();
    for seed in seeds("model_index") {
        ModelIndex::parse(&text(&seed), path).unwrap().validate(path).unwrap();
    }
    for seed in seeds("shard_index") {
        assert!(!parse_weight_map(&text(&seed), path).unwrap().is_empty());
    }
    for seed in seeds("transformer_config") {
        TransformerConfig::parse(&text(&seed), path).unwrap();
    }
    for seed in seeds("text_encoder_config") {
        TextEncoderConfig::parse(&text(&seed), path).unwrap();
    }
    for seed in seeds("vae_config") {
        VaeConfig::parse(&text(&seed), path).unwrap();
    }
    for seed in seeds("scheduler_config") {
        SchedulerConfig::parse(&text(&seed), path).unwrap();
    }
    let opts = LoadOptions::new().with_key_remap(&[(r"^layers\.2\.", "")]);
    let accepted = seeds("safetensors")
        .into_iter()
        .filter(|seed| load_bytes(&mut targets::Probe::new(), "probe", path, seed.clone(), &opts).is_ok())
        .count();
    assert_eq!(accepted, 1, "the text encoder's last shard loads completely into the probe");
}

#[test]
fn a_shard_outside_the_component_directory_is_refused() {
    let index = Path::new("transformer/diffusion_pytorch_model.safetensors.index.json");
    for file in
        ["../vae/diffusion_pytorch_model.safetensors", "/etc/passwd", "shards/a.safetensors", "..", ".", "", "a\\b"]
    {
        let text = format!(
            r#"{{"metadata": {{}}, "weight_map": {{"x_pad_token": {}}}}}"#,
            serde_json::to_string(file).unwrap()
        );
        let result = parse_weight_map(&text, index);
        assert!(
            matches!(result, Err(Error::InvalidConfig { ref reason, .. }) if reason.contains("not a file name inside the component directory")),
            "{file:?}: {result:?}"
        );
    }
    let text = r#"{"weight_map": {"x_pad_token": "diffusion_pytorch_model-00001-of-00003.safetensors"}}"#;
    assert_eq!(parse_weight_map(text, index).unwrap().len(), 1);
}

#[test]
fn an_oversized_or_overlong_safetensors_header_is_a_typed_error() {
    let opts = LoadOptions::new();
    for seed in ["oversized_header.safetensors", "header_past_end.safetensors"] {
        let bytes = std::fs::read(corpus_dir("safetensors").join(seed)).unwrap();
        let file = Path::new(seed);
        let result = load_bytes(&mut targets::Probe::new(), "probe", file, bytes, &opts);
        assert!(matches!(result, Err(Error::CorruptWeights { file: ref f, .. }) if f == file), "{seed}: {result:?}");
    }
}

/// Crashes the fuzzer found: a config that declares a huge count or width passed validation, and the first
/// derived size overflowed (a panic with overflow checks, a silently wrong size without: the planner would
/// have placed a model of the wrong size, and loading would have tried to allocate it). Each is now refused by
/// the limits in `config::limits`, naming the field.
#[test]
fn regression_huge_sizes_in_a_config_are_refused() {
    let path = Path::new("config.json");
    let refused = |result: Result<(), Error>, field: &str| match result {
        Err(Error::InvalidConfig { reason, .. }) => {
            assert!(reason.contains(field) && reason.contains("limit"), "{reason}")
        }
        other => panic!("{field}: expected a refusal, got {other:?}"),
    };
    let transformer = include_str!("../../../fuzz/corpus/transformer_config/turbo.json");
    for (field, value) in
        [("n_layers", "4611686018427387904"), ("dim", "18446744073709551615"), ("n_refiner_layers", "4294967296")]
    {
        let text = transformer.replacen(&format!("\"{field}\": "), &format!("\"{field}\": {value}, \"_was\": "), 1);
        refused(TransformerConfig::parse(&text, path).map(drop), field);
    }
    let text = transformer.replace("[32, 48, 48]", "[9223372036854775808, 9223372036854775808, 128]");
    refused(TransformerConfig::parse(&text, path).map(drop), "axes_dims");
    let encoder = include_str!("../../../fuzz/corpus/text_encoder_config/turbo.json");
    for (field, value) in [
        ("num_hidden_layers", "4611686018427387904"),
        ("hidden_size", "1099511627776"),
        ("vocab_size", "18446744073709551615"),
    ] {
        let text = encoder.replacen(&format!("\"{field}\": "), &format!("\"{field}\": {value}, \"_was\": "), 1);
        refused(TextEncoderConfig::parse(&text, path).map(drop), field);
    }
    let vae = include_str!("../../../fuzz/corpus/vae_config/turbo.json");
    let text = vae.replace("\"layers_per_block\": 2", "\"layers_per_block\": 4611686018427387904");
    refused(VaeConfig::parse(&text, path).map(drop), "layers_per_block");
    // 70 levels: `scale_factor` would shift a 1 past the width of usize.
    let levels = format!("[{}]", vec!["128"; 70].join(", "));
    let text = vae
        .replace("[128, 256, 512, 512]", &levels)
        .replace("\"down_block_types\"", "\"_down\"")
        .replace("\"up_block_types\"", "\"_up\"");
    refused(VaeConfig::parse(&text, path).map(drop), "block_out_channels");
}

/// The limits are enough: a config at every limit validates, and every size derived from it fits in 64 bits
/// (this test runs with overflow checks).
#[test]
fn regression_sizes_at_the_limits_do_not_overflow() {
    use burn::tensor::DType;
    use pipeline_zimage::config::limits::{MAX_HEADS, MAX_LAYERS, MAX_LEVELS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH};
    use pipeline_zimage::pipeline::{text_encoder_activation_bytes, vae_activation_bytes};

    let transformer = TransformerConfig {
        dim: MAX_WIDTH,
        cap_feat_dim: MAX_WIDTH,
        in_channels: MAX_WIDTH,
        n_heads: MAX_HEADS,
        n_kv_heads: MAX_HEADS,
        n_layers: MAX_LAYERS,
        n_refiner_layers: MAX_LAYERS,
        all_patch_size: vec![1],
        axes_dims: vec![16, 24, 24],
        axes_lens: vec![MAX_POSITIONS; 3],
        ..TransformerConfig::z_image_turbo()
    };
    transformer.validate().unwrap();
    assert!(transformer.bytes(DType::F64) > 0 && transformer.activation_bytes(1024, 1024, 8, DType::F64) > 0);

    let mut encoder = TextEncoderConfig::z_image_turbo();
    (encoder.vocab_size, encoder.hidden_size, encoder.intermediate_size) = (MAX_VOCAB, MAX_WIDTH, MAX_WIDTH);
    (encoder.num_hidden_layers, encoder.num_attention_heads, encoder.num_key_value_heads) =
        (MAX_LAYERS, MAX_HEADS, Some(MAX_HEADS));
    encoder.head_dim = Some(MAX_WIDTH);
    encoder.validate().unwrap();
    assert!(
        encoder.bytes(8) > 0
            && encoder.bytes_used(8) > 0
            && text_encoder_activation_bytes(&encoder, 512, DType::F64) > 0
    );

    let mut vae = VaeConfig::z_image_turbo();
    vae.block_out_channels = vec![MAX_WIDTH; MAX_LEVELS];
    (vae.down_block_types, vae.up_block_types) = (Vec::new(), Vec::new());
    (vae.layers_per_block, vae.norm_num_groups, vae.latent_channels) = (MAX_LAYERS, MAX_WIDTH, MAX_WIDTH);
    (vae.in_channels, vae.out_channels) = (MAX_WIDTH, MAX_WIDTH);
    vae.validate().unwrap();
    assert!(
        vae.bytes(8) > 0
            && vae.scale_factor() == 1 << (MAX_LEVELS - 1)
            && vae_activation_bytes(&vae, 1024, 1024, DType::F64) > 0
    );
}
