//! The Qwen3 text encoder against `ZImagePipeline.encode_prompt` on the tiny checkpoint
//! (`fixtures/golden/text_encoder.safetensors`, made by `tools/make_fixtures.py`). Tolerance: 1e-4 max abs, f32.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use pipeline_zimage::Error;
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::text_encoder::{TextEncoder, TextEncoderConfig};
use pipeline_zimage::tokenizer::PromptTokenizer;
use safetensors::SafeTensors;

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A golden safetensors file, read as (shape, values) pairs.
struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    fn open(name: &str) -> Self {
        Self { bytes: std::fs::read(fixtures().join("golden").join(name)).expect("read golden") }
    }

    fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors");
        let view = st.tensor(name).expect("tensor");
        let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        (view.shape().to_vec(), values)
    }

    fn i64(&self, name: &str) -> (Vec<usize>, Vec<i64>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors");
        let view = st.tensor(name).expect("tensor");
        let values = view.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect();
        (view.shape().to_vec(), values)
    }
}

fn max_abs_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "element count");
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

fn load() -> (TextEncoderConfig, TextEncoder) {
    let (config, encoder, report) =
        TextEncoder::load(fixtures().join("tiny-z-image-turbo/text_encoder"), &Device::flex(), &LoadOptions::default())
            .expect("load text encoder");
    assert!(report.is_complete(), "{report}");
    (config, encoder)
}

#[test]
fn prompt_embeds_match_encode_prompt() {
    let golden = Golden::open("text_encoder.safetensors");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("golden/meta.json")).expect("read meta.json"))
            .expect("meta.json");
    let meta = &meta["text_encoder.safetensors"];
    let prompts: Vec<String> = serde_json::from_value(meta["prompts"].clone()).expect("prompts");
    let max_len = meta["max_sequence_length"].as_u64().expect("max len") as usize;
    let device = Device::flex();

    let tokenizer =
        PromptTokenizer::from_dir(fixtures().join("tiny-z-image-turbo/tokenizer"), max_len).expect("tokenizer");
    let batch = tokenizer.encode(&prompts).expect("encode");
    let (_, ids) = golden.i64("input_ids");
    let flat: Vec<i64> = batch.input_ids.iter().flatten().map(|&id| i64::from(id)).collect();
    assert_eq!(flat, ids, "tokenizer ids differ from the pipeline's");

    let (_, encoder) = load();
    let embeds = encoder.encode(batch.input_ids_tensor(&device), batch.attention_mask_tensor(&device)).expect("encode");
    assert_eq!(embeds.len(), prompts.len());
    let mut worst = 0.0f32;
    for (i, got) in embeds.into_iter().enumerate() {
        let (shape, want) = golden.f32(&format!("prompt_embeds_{i}"));
        assert_eq!(got.dims().to_vec(), shape, "prompt {i} shape");
        let got = got.into_data().try_into_vec::<f32>().expect("f32");
        worst = worst.max(max_abs_error(&got, &want));
    }
    println!("text encoder: max abs error {worst:e}");
    assert!(worst <= TOL, "max abs error {worst} > {TOL}");
}

#[test]
fn padded_forward_matches_hidden_states_on_real_tokens() {
    let golden = Golden::open("text_encoder.safetensors");
    let device = Device::flex();
    let (shape, ids) = golden.i64("input_ids");
    let (_, mask) = golden.i64("attention_mask");
    let (hshape, hidden) = golden.f32("hidden_states_m2");
    let (_, encoder) = load();
    let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [shape[0], shape[1]]), &device);
    let got = encoder.forward(input).into_data().try_into_vec::<f32>().expect("f32");
    let width = hshape[2];
    let mut worst = 0.0f32;
    for (row, _) in mask.iter().enumerate().filter(|(_, m)| **m == 1) {
        let range = row * width..(row + 1) * width;
        worst = worst.max(max_abs_error(&got[range.clone()], &hidden[range]));
    }
    println!("padded forward: max abs error {worst:e}");
    assert!(worst <= TOL, "max abs error {worst} > {TOL}");
}

#[test]
fn checkpoint_holds_what_the_config_counts() {
    let (config, encoder) = load();
    use burn::module::Module;
    assert_eq!(encoder.num_params(), config.num_params_used());
    assert_eq!(encoder.layers.len(), config.num_hidden_layers - 1);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pipeline-zimage-te-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn a_missing_shard_is_reported() {
    let dir = scratch("missing-shard");
    copy_dir(&fixtures().join("tiny-z-image-turbo/text_encoder"), &dir);
    std::fs::remove_file(dir.join("model-00002-of-00004.safetensors")).expect("rm shard");
    let err = TextEncoder::load(&dir, &Device::flex(), &LoadOptions::default()).expect_err("must fail");
    assert!(matches!(err, Error::MissingShard { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_config_that_does_not_match_the_weights_is_reported() {
    let dir = scratch("wrong-config");
    copy_dir(&fixtures().join("tiny-z-image-turbo/text_encoder"), &dir);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    config["intermediate_size"] = serde_json::json!(48);
    std::fs::write(&path, config.to_string()).expect("write");
    let err = TextEncoder::load(&dir, &Device::flex(), &LoadOptions::default()).expect_err("must fail");
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_non_right_padded_mask_is_rejected() {
    let (_, encoder) = load();
    let device = Device::flex();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2, 3], [1, 3]), &device);
    let mask = Tensor::<2, burn::tensor::Bool>::from_data(TensorData::new(vec![true, false, true], [1, 3]), &device);
    let err = encoder.encode(ids, mask).expect_err("must fail");
    assert!(matches!(err, Error::Shape { .. }), "{err}");
}

#[test]
fn z_image_turbo_preset_sizes() {
    let c = TextEncoderConfig::z_image_turbo();
    assert_eq!(c.num_params(), 4_022_468_096);
    assert_eq!(c.bytes(2), 8_044_936_192);
    assert_eq!(c.rope_theta(), 1_000_000.0);
}

/// Rewrites every shard and the index of `dir` with `model.` in front of each tensor name, as a
/// `Qwen3ForCausalLM`-style export names them.
fn prefix_keys_with_model(dir: &Path) {
    use safetensors::tensor::TensorView;
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).expect("read index")).expect("index json");
    let map = index["weight_map"].as_object().expect("weight_map").clone();
    index["weight_map"] = map.iter().map(|(k, v)| (format!("model.{k}"), v.clone())).collect();
    std::fs::write(&index_path, index.to_string()).expect("write index");
    let shards: std::collections::BTreeSet<String> =
        map.values().map(|v| v.as_str().expect("shard").to_owned()).collect();
    for shard in shards {
        let path = dir.join(&shard);
        let bytes = std::fs::read(&path).expect("read shard");
        let st = SafeTensors::deserialize(&bytes).expect("shard");
        let renamed: Vec<(String, TensorView<'_>)> =
            st.tensors().into_iter().map(|(name, view)| (format!("model.{name}"), view)).collect();
        safetensors::serialize_to_file(renamed, None, &path).expect("write shard");
    }
}

#[test]
fn keys_with_a_model_prefix_load_the_same() {
    let dir = scratch("model-prefix");
    copy_dir(&fixtures().join("tiny-z-image-turbo/text_encoder"), &dir);
    prefix_keys_with_model(&dir);
    let (config, encoder, report) =
        TextEncoder::load(&dir, &Device::flex(), &LoadOptions::default()).expect("load prefixed");
    assert!(report.is_complete(), "{report}");
    assert!(report.applied.iter().all(|key| !key.starts_with("model.")));
    use burn::module::Module;
    assert_eq!(encoder.num_params(), config.num_params_used());
    let _ = std::fs::remove_dir_all(&dir);
}
