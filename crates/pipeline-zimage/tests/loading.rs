//! Checkpoint validation and weight loading: every way a checkpoint can be wrong ends in its own typed error.
//!
//! Broken checkpoints are made by copying the tiny fixture into a scratch directory under cargo's
//! `CARGO_TARGET_TMPDIR` and damaging the copy.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device};
use pipeline_zimage::Error;
use pipeline_zimage::loading::{Checkpoint, LoadOptions, WeightFiles, load_component};
use pipeline_zimage::transformer::{KEY_REMAP, ZImageTransformer2DModel};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-z-image-turbo")
}

/// A fresh copy of the tiny checkpoint's `model_index.json` and `transformer/` in a directory named `name`.
fn scratch_copy(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pipeline-zimage-loading").join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("old scratch dir removed");
    }
    std::fs::create_dir_all(dir.join("transformer")).expect("scratch dir created");
    std::fs::copy(tiny().join("model_index.json"), dir.join("model_index.json")).expect("model_index copied");
    for entry in std::fs::read_dir(tiny().join("transformer")).expect("fixture readable") {
        let path = entry.expect("dir entry").path();
        let target = dir.join("transformer").join(path.file_name().expect("file name"));
        std::fs::copy(&path, target).expect("fixture file copied");
    }
    dir
}

fn transformer_opts() -> LoadOptions {
    LoadOptions::new().with_key_remap(KEY_REMAP)
}

fn new_model(checkpoint: &Checkpoint) -> ZImageTransformer2DModel {
    let config = checkpoint.transformer_config().expect("config reads");
    ZImageTransformer2DModel::new(&config, &Device::flex())
}

/// The tensors of all transformer shards, as `(dtype, shape, bytes)`.
fn read_all_tensors(dir: &Path) -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let mut tensors = Vec::new();
    for shard in WeightFiles::find(dir).expect("weights found").files() {
        let bytes = std::fs::read(&shard).expect("shard readable");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("shard parses");
        for (name, view) in file.tensors() {
            tensors.push((name, view.dtype(), view.shape().to_vec(), view.data().to_vec()));
        }
    }
    tensors
}

/// Replaces the shards of `dir` by one `diffusion_pytorch_model.safetensors` holding `tensors`.
fn write_single_file(dir: &Path, tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    for entry in std::fs::read_dir(dir).expect("dir readable") {
        let path = entry.expect("dir entry").path();
        if path.to_string_lossy().contains(".safetensors") {
            std::fs::remove_file(path).expect("old weights removed");
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).expect("valid view");
            (name.clone(), view)
        })
        .collect();
    let bytes = safetensors::serialize(views, None::<HashMap<String, String>>).expect("serialises");
    std::fs::write(dir.join("diffusion_pytorch_model.safetensors"), bytes).expect("written");
}

#[test]
fn sharded_load_applies_every_tensor() {
    let checkpoint = Checkpoint::open(tiny()).expect("opens");
    let files = checkpoint.weight_files("transformer").expect("weights found");
    assert!(matches!(files, WeightFiles::Sharded { ref shards, .. } if shards.len() == 3));

    let (model, report) = checkpoint.load_transformer(&Device::flex(), &LoadOptions::new()).expect("loads");
    assert_eq!(report.files.len(), 3);
    assert_eq!(report.applied.len(), 101);
    assert!(report.missing.is_empty() && report.unused.is_empty(), "{report}");
    assert!(report.applied.iter().any(|p| p == "x_embedder.weight"));
    assert_eq!(model.dtype(), DType::F32);
}

#[test]
fn load_can_cast_to_bf16() {
    let checkpoint = Checkpoint::open(tiny()).expect("opens");
    let opts = LoadOptions::new().with_dtype(Some(DType::BF16));
    let (model, _) = checkpoint.load_transformer(&Device::flex(), &opts).expect("loads");
    assert_eq!(model.dtype(), DType::BF16);
    assert_eq!(model.layers[1].feed_forward.w2.weight.val().dtype(), DType::BF16);
}

#[test]
fn missing_directory() {
    let result = Checkpoint::open(tiny().join("does-not-exist"));
    assert!(matches!(result, Err(Error::MissingDirectory { .. })), "{result:?}");
}

#[test]
fn missing_model_index() {
    let dir = scratch_copy("missing-model-index");
    std::fs::remove_file(dir.join("model_index.json")).expect("removed");
    let result = Checkpoint::open(&dir);
    assert!(matches!(result, Err(Error::NotZImageCheckpoint { .. })), "{result:?}");
}

#[test]
fn wrong_component_class() {
    let dir = scratch_copy("wrong-class");
    let path = dir.join("model_index.json");
    let text = std::fs::read_to_string(&path).expect("readable");
    std::fs::write(&path, text.replace("AutoencoderKL", "AutoencoderTiny")).expect("written");
    let result = Checkpoint::open(&dir);
    assert!(
        matches!(result, Err(Error::WrongComponentClass { ref component, ref found, .. })
            if component == "vae" && found == "AutoencoderTiny"),
        "{result:?}"
    );
}

#[test]
fn wrong_pipeline_class() {
    let dir = scratch_copy("wrong-pipeline");
    let path = dir.join("model_index.json");
    let text = std::fs::read_to_string(&path).expect("readable");
    std::fs::write(&path, text.replace("ZImagePipeline", "FluxPipeline")).expect("written");
    let result = Checkpoint::open(&dir);
    assert!(matches!(result, Err(Error::NotZImageCheckpoint { .. })), "{result:?}");
}

#[test]
fn broken_model_index_json() {
    let dir = scratch_copy("broken-json");
    std::fs::write(dir.join("model_index.json"), "{ not json").expect("written");
    let result = Checkpoint::open(&dir);
    assert!(matches!(result, Err(Error::Json { .. })), "{result:?}");
}

#[test]
fn missing_config() {
    let dir = scratch_copy("missing-config");
    std::fs::remove_file(dir.join("transformer/config.json")).expect("removed");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let result = checkpoint.transformer_config();
    assert!(
        matches!(result, Err(Error::MissingFile { ref component, .. }) if component == "transformer"),
        "{result:?}"
    );
}

#[test]
fn missing_component_directory() {
    let dir = scratch_copy("missing-component");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    // The scratch copy has no vae/ directory.
    let result = checkpoint.weight_files("vae");
    assert!(matches!(result, Err(Error::MissingFile { .. })), "{result:?}");
}

#[test]
fn missing_shard() {
    let dir = scratch_copy("missing-shard");
    let shard = dir.join("transformer/diffusion_pytorch_model-00002-of-00003.safetensors");
    std::fs::remove_file(&shard).expect("removed");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &transformer_opts());
    assert!(matches!(result, Err(Error::MissingShard { ref file, .. }) if *file == shard), "{result:?}");
}

#[test]
fn truncated_shard() {
    let dir = scratch_copy("truncated-shard");
    let shard = dir.join("transformer/diffusion_pytorch_model-00001-of-00003.safetensors");
    let bytes = std::fs::read(&shard).expect("readable");
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).expect("truncated");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &transformer_opts());
    assert!(matches!(result, Err(Error::CorruptWeights { ref file, .. }) if *file == shard), "{result:?}");
}

#[test]
fn corrupt_header() {
    let dir = scratch_copy("corrupt-header");
    let shard = dir.join("transformer/diffusion_pytorch_model-00003-of-00003.safetensors");
    let mut bytes = std::fs::read(&shard).expect("readable");
    bytes[8..16].copy_from_slice(b"garbage!");
    std::fs::write(&shard, bytes).expect("written");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &transformer_opts());
    assert!(matches!(result, Err(Error::CorruptWeights { .. })), "{result:?}");
}

#[test]
fn wrong_shape_names_tensor_and_file() {
    let dir = scratch_copy("wrong-shape");
    let component = dir.join("transformer");
    let mut tensors = read_all_tensors(&component);
    let pad = tensors.iter_mut().find(|(name, ..)| name == "x_pad_token").expect("x_pad_token present");
    // [1, 64] -> [2, 32]: same bytes, wrong shape.
    pad.2 = vec![2, 32];
    write_single_file(&component, &tensors);

    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &transformer_opts());
    match result {
        Err(Error::ShapeMismatch { tensor, file, expected, found }) => {
            assert_eq!(tensor, "x_pad_token");
            assert_eq!(file, component.join("diffusion_pytorch_model.safetensors"));
            assert_eq!((expected, found), (vec![1, 64], vec![2, 32]));
        }
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
}

#[test]
fn wrong_dtype_kind() {
    let dir = scratch_copy("wrong-dtype");
    let component = dir.join("transformer");
    let mut tensors = read_all_tensors(&component);
    let norm = tensors.iter_mut().find(|(name, ..)| name == "cap_embedder.0.weight").expect("tensor present");
    // f32 bytes relabelled as i32: an integer tensor for a float parameter.
    norm.1 = safetensors::Dtype::I32;
    write_single_file(&component, &tensors);

    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &transformer_opts());
    assert!(
        matches!(result, Err(Error::DTypeMismatch { ref tensor, .. }) if tensor == "cap_embedder.0.weight"),
        "{result:?}"
    );
}

#[test]
fn partial_load_is_refused_unless_allowed() {
    let dir = scratch_copy("partial");
    let component = dir.join("transformer");
    let mut tensors = read_all_tensors(&component);
    tensors.retain(|(name, ..)| name != "layers.1.ffn_norm2.weight");
    let extra = tensors
        .iter()
        .find(|(name, ..)| name == "cap_pad_token")
        .cloned()
        .map(|(_, dtype, shape, data)| ("extra.tensor".to_owned(), dtype, shape, data))
        .expect("cap_pad_token present");
    tensors.push(extra);
    write_single_file(&component, &tensors);

    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &transformer_opts());
    match result {
        Err(Error::PartialLoad { missing, unused, .. }) => {
            assert_eq!(missing, vec!["layers.1.ffn_norm2.weight".to_owned()]);
            assert_eq!(unused, vec!["extra.tensor".to_owned()]);
        }
        other => panic!("expected a refused partial load, got {other:?}"),
    }

    let mut model = new_model(&checkpoint);
    let report = load_component(&mut model, &component, &transformer_opts().with_allow_partial(true))
        .expect("partial load allowed");
    assert_eq!(report.applied.len(), 100);
    assert_eq!(report.missing, vec!["layers.1.ffn_norm2.weight".to_owned()]);
    assert_eq!(report.unused, vec!["extra.tensor".to_owned()]);
}

#[test]
fn without_the_remap_the_embedders_are_reported() {
    let checkpoint = Checkpoint::open(tiny()).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &LoadOptions::new());
    match result {
        Err(Error::PartialLoad { missing, unused, .. }) => {
            assert!(missing.contains(&"x_embedder.weight".to_owned()));
            assert!(unused.contains(&"all_x_embedder.2-1.weight".to_owned()));
        }
        other => panic!("expected a refused partial load, got {other:?}"),
    }
}

#[test]
fn oversized_header() {
    let dir = scratch_copy("oversized-header");
    let shard = dir.join("transformer/diffusion_pytorch_model-00002-of-00003.safetensors");
    let mut bytes = std::fs::read(&shard).expect("readable");
    // A header length of 1 TiB: safetensors refuses it before allocating (its limit is 100 MB).
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&shard, bytes).expect("written");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let mut model = new_model(&checkpoint);
    let result = checkpoint.load("transformer", &mut model, &transformer_opts());
    match result {
        Err(Error::CorruptWeights { file, reason }) => {
            assert_eq!(file, shard);
            assert!(reason.to_lowercase().contains("header"), "{reason}");
        }
        other => panic!("expected a refused header, got {other:?}"),
    }
}

#[test]
fn index_pointing_outside_the_component() {
    let dir = scratch_copy("index-escapes");
    let index = dir.join("transformer/diffusion_pytorch_model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).expect("readable");
    std::fs::write(
        &index,
        text.replacen("\"diffusion_pytorch_model-00001-of-00003.safetensors\"", "\"../model_index.json\"", 1),
    )
    .expect("written");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let result = checkpoint.weight_files("transformer");
    assert!(
        matches!(result, Err(Error::InvalidConfig { ref path, ref reason }) if *path == index && reason.contains("../model_index.json")),
        "{result:?}"
    );
}

#[test]
fn broken_shard_index() {
    let dir = scratch_copy("broken-index");
    let index = dir.join("transformer/diffusion_pytorch_model.safetensors.index.json");
    std::fs::write(&index, r#"{"metadata": {}, "weight_map": ["#).expect("written");
    let checkpoint = Checkpoint::open(&dir).expect("opens");
    let result = checkpoint.weight_files("transformer");
    assert!(matches!(result, Err(Error::Json { ref path, .. }) if *path == index), "{result:?}");
}
