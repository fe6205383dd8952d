//! The checkpoint readers as fuzz targets, shared by the `fuzz_readers` example (a million inputs each, from
//! `cargo xtask fuzz`) and the smoke test in `tests/fuzz_readers.rs`.
//!
//! Each target takes bytes as they would come from a file of a downloaded checkpoint and runs the reader the
//! crate uses on that file, then what the crate does next with a value it accepted (validation, derived sizes,
//! a schedule, a load into a module). An error is a pass; a panic is a crash.

use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::Module;
use burn::tensor::{DType, Device, Tensor};
use pipeline_zimage::Error;
use pipeline_zimage::config::{EXPECTED_COMPONENTS, ModelIndex, TransformerConfig};
use pipeline_zimage::loading::{LoadOptions, load_bytes, parse_weight_map};
use pipeline_zimage::lora::{ComponentLayers, LoraFile};
use pipeline_zimage::nn::{PtLinear, RmsNorm};
use pipeline_zimage::pipeline::{
    CheckpointConfigs, GenerateOptions, text_encoder_activation_bytes, vae_activation_bytes,
};
use pipeline_zimage::scheduler::SchedulerConfig;
use pipeline_zimage::text_encoder::TextEncoderConfig;
use pipeline_zimage::vae::VaeConfig;

/// A fuzz target: its name (also its seed corpus directory, `fuzz/corpus/<name>`) and the function to call.
pub type Target = (&'static str, fn(&[u8]));

/// Every reader of a checkpoint file.
pub fn targets() -> Vec<Target> {
    vec![
        ("model_index", model_index),
        ("shard_index", shard_index),
        ("transformer_config", transformer_config),
        ("text_encoder_config", text_encoder_config),
        ("vae_config", vae_config),
        ("scheduler_config", scheduler_config),
        ("safetensors", safetensors_file),
        ("options", options),
        ("lora_file", lora_file),
        ("vulkaninfo", vulkaninfo),
    ]
}

/// Inputs each target's reader accepted since the start of the process, by target name: how deep the run
/// went (an input the reader refuses stops at its first check).
pub fn accepted(target: &str) -> u64 {
    let index = targets().iter().position(|(name, _)| *name == target);
    index.map_or(0, |i| ACCEPTED[i].load(Ordering::Relaxed))
}

static ACCEPTED: [AtomicU64; 10] = [const { AtomicU64::new(0) }; 10];

fn accept(index: usize) {
    ACCEPTED[index].fetch_add(1, Ordering::Relaxed);
}

/// A refusal is one of the reader errors, and its message names the file (or component) it is about.
fn typed(error: &Error, names: &str) {
    let expected = matches!(
        error,
        Error::Json { .. }
            | Error::InvalidConfig { .. }
            | Error::NotZImageCheckpoint { .. }
            | Error::WrongComponentClass { .. }
            | Error::CorruptWeights { .. }
            | Error::ShapeMismatch { .. }
            | Error::DTypeMismatch { .. }
            | Error::TensorLoad { .. }
            | Error::PartialLoad { .. }
            | Error::InvalidArgument { .. }
            | Error::InvalidSize { .. }
            | Error::InvalidStrength { .. }
            | Error::ZeroSteps
            | Error::LoraFile { .. }
            | Error::LoraKey { .. }
            | Error::LoraShape { .. }
            | Error::LoraValue { .. }
    );
    assert!(expected, "a reader failed with an unexpected error: {error:?}");
    assert!(error.to_string().contains(names), "the error does not name {names}: {error}");
}

/// The readers take text (`std::fs::read_to_string`); bytes that are not UTF-8 are mapped to text with
/// replacement characters rather than dropped, so every execution reaches the reader.
fn text(input: &[u8]) -> Option<Cow<'_, str>> {
    Some(String::from_utf8_lossy(input))
}

/// Values that break arithmetic, types and ranges.
fn interesting(byte: u8) -> serde_json::Value {
    use serde_json::json;
    match byte % 24 {
        0 => json!(0),
        1 => json!(1),
        2 => json!(-1),
        3 => json!(2),
        4 => json!(3),
        5 => json!(7),
        6 => json!(65_536),
        7 => json!(1_u64 << 31),
        8 => json!(1_u64 << 32),
        9 => json!(1_u64 << 53),
        10 => json!(1_u64 << 62),
        11 => json!(u64::MAX),
        12 => json!(i64::MIN),
        13 => json!(0.5),
        14 => json!(-0.0),
        15 => json!(1e308),
        16 => json!(-1e308),
        17 => json!(5e-324),
        18 => json!(null),
        19 => json!(true),
        20 => json!("silu"),
        21 => json!([]),
        22 => json!({}),
        _ => json!(""),
    }
}

/// One to four edits (more would rarely leave a document a reader accepts), each three bytes: which key,
/// which kind of edit, and its argument. They are drawn from a hash of the whole input, so a mutation anywhere
/// in the input gives other edits: the fuzzer's inputs are mostly seed text, whose first bytes rarely change.
fn edits(input: &[u8]) -> impl Iterator<Item = [u8; 3]> {
    let mut state =
        input.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let count = 1 + next() % 4;
    (0..count).map(move |_| {
        let bytes = next().to_le_bytes();
        [bytes[0], bytes[1], bytes[2]]
    })
}

/// Structure-aware mutation: `input` drives edits of a known-good JSON document (replace a value with an
/// interesting one, drop a key, add a key, grow or shrink an array), so most executions get past the JSON
/// parser and into validation and the derived sizes, where a raw byte mutation rarely arrives.
pub fn structured(seed: &str, input: &[u8]) -> String {
    let mut value: serde_json::Value = serde_json::from_str(seed).unwrap_or_default();
    for [which, kind, arg] in edits(input) {
        let Some(object) = value.as_object_mut() else { break };
        let keys: Vec<String> = object.keys().cloned().collect();
        let Some(key) = keys.get(usize::from(which) % keys.len().max(1)).cloned() else { break };
        match kind % 6 {
            0 | 1 => {
                object.insert(key, interesting(arg));
            }
            2 => {
                object.remove(&key);
            }
            3 => {
                // An element of an array, or the value itself, replaced.
                match object.get_mut(&key).and_then(|v| v.as_array_mut()) {
                    Some(array) if !array.is_empty() => {
                        let i = usize::from(arg) % array.len();
                        array[i] = interesting(arg / 24);
                    }
                    _ => {
                        object.insert(key, interesting(arg));
                    }
                }
            }
            4 => {
                // An array grown by repeating its first element, or shrunk to nothing.
                if let Some(array) = object.get_mut(&key).and_then(|v| v.as_array_mut()) {
                    match array.first().cloned() {
                        Some(first) if arg % 2 == 0 => array.extend(std::iter::repeat_n(first, usize::from(arg))),
                        _ => array.clear(),
                    }
                }
            }
            _ => {
                object.insert(format!("k{arg}"), interesting(which));
            }
        }
    }
    value.to_string()
}

/// Runs `reader` on the raw input as text, then on a structured mutation of each seed driven by the input.
fn both(input: &[u8], seeds: &[&str], mut reader: impl FnMut(&str)) {
    if let Some(text) = text(input) {
        reader(&text);
    }
    let seed = seeds[input.len() % seeds.len()];
    reader(&structured(seed, input));
}

/// The seeds of the structured mutations: the tiny fixture's files and the shipped Z-Image-Turbo values.
const MODEL_INDEX: &[&str] = &[include_str!("../../../../fuzz/corpus/model_index/tiny.json")];
const SHARD_INDEX: &[&str] = &[
    include_str!("../../../../fuzz/corpus/shard_index/text_encoder.json"),
    include_str!("../../../../fuzz/corpus/shard_index/transformer.json"),
];
const TRANSFORMER: &[&str] = &[
    include_str!("../../../../fuzz/corpus/transformer_config/tiny.json"),
    include_str!("../../../../fuzz/corpus/transformer_config/turbo.json"),
];
const TEXT_ENCODER: &[&str] = &[
    include_str!("../../../../fuzz/corpus/text_encoder_config/tiny.json"),
    include_str!("../../../../fuzz/corpus/text_encoder_config/turbo.json"),
];
const VAE: &[&str] = &[
    include_str!("../../../../fuzz/corpus/vae_config/tiny.json"),
    include_str!("../../../../fuzz/corpus/vae_config/turbo.json"),
];
const SCHEDULER: &[&str] = &[
    include_str!("../../../../fuzz/corpus/scheduler_config/tiny.json"),
    include_str!("../../../../fuzz/corpus/scheduler_config/turbo.json"),
    include_str!("../../../../fuzz/corpus/scheduler_config/dynamic.json"),
];

/// `model_index.json`: parse, then check the pipeline and component classes.
pub fn model_index(input: &[u8]) {
    both(input, MODEL_INDEX, |text| {
        let path = Path::new("model_index.json");
        let parsed = ModelIndex::parse(text, path);
        if let Err(error) = &parsed {
            typed(error, "model_index.json");
        }
        if let Ok(index) = parsed {
            accept(0);
            let _ = index.validate(path);
            for (component, _) in EXPECTED_COMPONENTS {
                let _ = index.class_of(component);
            }
        }
    });
}

/// `*.safetensors.index.json`: parse the weight map, then join every shard to the component directory as the
/// loader does; an accepted shard never leaves the directory.
pub fn shard_index(input: &[u8]) {
    both(input, SHARD_INDEX, |text| {
        let parsed = parse_weight_map(text, Path::new("diffusion_pytorch_model.safetensors.index.json"));
        if let Err(error) = &parsed {
            typed(error, "diffusion_pytorch_model.safetensors.index.json");
        }
        if let Ok(map) = parsed {
            accept(1);
            let dir = Path::new("transformer");
            for file in map.values() {
                let joined = dir.join(file);
                assert!(joined.parent() == Some(dir), "an accepted shard {file:?} escapes the component directory");
            }
        }
    });
}

/// `transformer/config.json`: parse and validate, then every size the planner and the pipeline derive.
pub fn transformer_config(input: &[u8]) {
    both(input, TRANSFORMER, |text| {
        let parsed = TransformerConfig::parse(text, Path::new("transformer/config.json"));
        if let Err(error) = &parsed {
            typed(error, "transformer/config.json");
        }
        if let Ok(config) = parsed {
            accept(2);
            let _ = (config.num_params(), config.bytes(DType::BF16), config.head_dim(), config.patch_dim());
            let _ = (config.image_tokens(1024, 1024, 8), config.activation_bytes(1024, 1024, 8, DType::BF16));
            let _ = config.activation_bytes_for_tokens(4608, DType::F32, false);
        }
    });
}

/// `text_encoder/config.json`: parse and validate, then its sizes and activation estimate.
pub fn text_encoder_config(input: &[u8]) {
    both(input, TEXT_ENCODER, |text| {
        let parsed = TextEncoderConfig::parse(text, Path::new("text_encoder/config.json"));
        if let Err(error) = &parsed {
            typed(error, "text_encoder/config.json");
        }
        if let Ok(config) = parsed {
            accept(3);
            let _ = (config.num_params(), config.num_params_used(), config.bytes(2), config.bytes_used(2));
            let _ = (config.head_dim(), config.num_kv_heads(), config.rope_theta());
            let _ = text_encoder_activation_bytes(&config, 512, DType::BF16);
        }
    });
}

/// `vae/config.json`: parse and validate, then its sizes, scale factor and activation estimate.
pub fn vae_config(input: &[u8]) {
    both(input, VAE, |text| {
        let parsed = VaeConfig::parse(text, Path::new("vae/config.json"));
        if let Err(error) = &parsed {
            typed(error, "vae/config.json");
        }
        if let Ok(config) = parsed {
            accept(4);
            let _ = (config.num_params(), config.bytes(2), config.scale_factor(), config.shift());
            let _ = vae_activation_bytes(&config, 1024, 1024, DType::BF16);
        }
    });
}

/// `scheduler/scheduler_config.json`: parse and validate, then a text-to-image and an image-to-image schedule.
pub fn scheduler_config(input: &[u8]) {
    both(input, SCHEDULER, |text| {
        let parsed = SchedulerConfig::parse(text, Path::new("scheduler/scheduler_config.json"));
        if let Err(error) = &parsed {
            typed(error, "scheduler/scheduler_config.json");
        }
        if let Ok(config) = parsed {
            accept(5);
            let _ = config.mu(4096);
            if let Ok(schedule) = config.schedule(8, 4096) {
                let _ = schedule.img2img(0.6);
            }
        }
    });
}

/// The last shard of the tiny text encoder, as a module: the seed loads completely into it.
#[derive(Module, Debug)]
pub struct Probe {
    /// `layers.2.input_layernorm.weight` `[32]`.
    pub input_layernorm: RmsNorm,
    /// `layers.2.post_attention_layernorm.weight` `[32]`.
    pub post_attention_layernorm: RmsNorm,
    /// `layers.2.mlp.*`.
    pub mlp: ProbeMlp,
    /// `norm.weight` `[32]`.
    pub norm: RmsNorm,
}

/// The MLP part of [`Probe`].
#[derive(Module, Debug)]
pub struct ProbeMlp {
    /// `layers.2.mlp.down_proj.weight` `[32, 64]`.
    pub down_proj: PtLinear,
}

impl Probe {
    /// A probe with fresh parameters on the CPU.
    pub fn new() -> Self {
        let device = Device::flex();
        Self {
            input_layernorm: RmsNorm::new(32, 1e-6, &device),
            post_attention_layernorm: RmsNorm::new(32, 1e-6, &device),
            mlp: ProbeMlp { down_proj: PtLinear::new(64, 32, false, &device) },
            norm: RmsNorm::new(32, 1e-6, &device),
        }
    }
}

impl Default for Probe {
    fn default() -> Self {
        Self::new()
    }
}

/// The seed of the structured safetensors edits: the tiny text encoder's last shard.
const SHARD: &[u8] = include_bytes!("../../../../fuzz/corpus/safetensors/text_encoder_shard.safetensors");

/// Structure-aware edits of a safetensors file driven by `input`: a tensor's dtype, shape or data offsets
/// changed, a tensor renamed, dropped or replaced by a value of the wrong type, the header length field
/// changed, or the data truncated. These are the damaged files a checkpoint can hold (wrong shape, wrong dtype,
/// truncated, oversized header), reached far more often than by flipping bytes.
pub fn structured_safetensors(seed: &[u8], input: &[u8]) -> Vec<u8> {
    const DTYPES: &[&str] =
        &["F32", "F16", "BF16", "F64", "I32", "I64", "U8", "I8", "BOOL", "F8_E4M3", "F8_E5M2", "C64", "X"];
    let Some(length) = seed.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default())) else {
        return seed.to_vec();
    };
    let end = 8usize.saturating_add(usize::try_from(length).unwrap_or(usize::MAX)).min(seed.len());
    let mut header: serde_json::Value = serde_json::from_slice(&seed[8.min(end)..end]).unwrap_or_default();
    let mut data = seed[end..].to_vec();
    let mut length_field: Option<u64> = None;
    for [which, kind, arg] in edits(input) {
        let Some(object) = header.as_object_mut() else { break };
        let keys: Vec<String> = object.keys().cloned().collect();
        let Some(key) = keys.get(usize::from(which) % keys.len().max(1)).cloned() else { break };
        let entry = object.get_mut(&key).and_then(|v| v.as_object_mut());
        match (kind % 8, entry) {
            (0, Some(entry)) => {
                entry.insert("dtype".into(), DTYPES[usize::from(arg) % DTYPES.len()].into());
            }
            (1, Some(entry)) => {
                if let Some(shape) = entry.get_mut("shape").and_then(|v| v.as_array_mut()) {
                    match arg % 5 {
                        0 if shape.len() > 1 => shape.swap(0, 1),
                        1 => shape.push(1.into()),
                        2 => {
                            shape.pop();
                        }
                        3 => *shape = vec![0.into()],
                        _ => {
                            let i = usize::from(arg) % shape.len().max(1);
                            if let Some(dim) = shape.get_mut(i) {
                                *dim = interesting(arg / 5);
                            }
                        }
                    }
                }
            }
            (2, Some(entry)) => {
                if let Some(offsets) = entry.get_mut("data_offsets").and_then(|v| v.as_array_mut()) {
                    let i = usize::from(arg) % offsets.len().max(1);
                    match (arg / 2 % 4, offsets.get(i).and_then(|v| v.as_u64())) {
                        (0, Some(v)) => offsets[i] = (v + 1).into(),
                        (1, Some(v)) => offsets[i] = v.saturating_sub(1).into(),
                        (2, _) if offsets.len() == 2 => offsets.swap(0, 1),
                        _ if i < offsets.len() => offsets[i] = interesting(arg),
                        _ => {}
                    }
                }
            }
            (3, _) => {
                if let Some(value) = object.remove(&key)
                    && arg % 2 == 0
                {
                    object.insert(format!("{key}.x"), value);
                }
            }
            (4, _) => {
                object.insert(key, interesting(arg));
            }
            (5, _) => {
                let actual = serde_json::to_vec(&header).map_or(0, |h| h.len() as u64);
                length_field = Some(match arg % 5 {
                    0 => actual + 1,
                    1 => actual.saturating_sub(1),
                    2 => 0,
                    3 => 200_000_000,
                    _ => u64::MAX,
                });
            }
            (6, _) => data.truncate(usize::from(arg) * 64),
            _ => {}
        }
    }
    let header = serde_json::to_vec(&header).unwrap_or_default();
    let mut out = length_field.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    out
}

/// A safetensors file: `safetensors`' bounded header reader, then the crate's loader (store, key remapping,
/// f32 cast, shape and dtype checks, partial-load refusal) into a small module; on the raw input and on a
/// structured edit of the seed.
pub fn safetensors_file(input: &[u8]) {
    let edited = structured_safetensors(SHARD, input);
    for bytes in [input, edited.as_slice()] {
        if let Ok(file) = safetensors::SafeTensors::deserialize(bytes) {
            for (_, view) in file.tensors() {
                let elements: usize = view.shape().iter().product();
                assert_eq!(
                    elements * view.dtype().bitsize() / 8,
                    view.data().len(),
                    "an accepted tensor's bytes do not match its shape"
                );
            }
        }
        let opts = LoadOptions::new().with_key_remap(&[(r"^layers\.2\.", "")]);
        match load_bytes(&mut Probe::new(), "probe", Path::new("probe.safetensors"), bytes.to_vec(), &opts) {
            Ok(_) => accept(6),
            Err(error) => typed(&error, "probe"),
        }
    }
}

/// The seeds of the generation options' edits: Turbo's defaults with latents, and the tiny checkpoint's sizes with an
/// input image.
const OPTIONS: &[&str] = &[
    include_str!("../../../../fuzz/corpus/options/turbo.json"),
    include_str!("../../../../fuzz/corpus/options/tiny.json"),
];

/// The configs options are validated against: Z-Image-Turbo's, read from the corpus the config targets share.
fn turbo_configs() -> Option<CheckpointConfigs> {
    let path = Path::new("config.json");
    Some(CheckpointConfigs {
        text_encoder: TextEncoderConfig::parse(TEXT_ENCODER[1], path).ok()?,
        transformer: TransformerConfig::parse(TRANSFORMER[1], path).ok()?,
        vae: VaeConfig::parse(VAE[1], path).ok()?,
        scheduler: SchedulerConfig::parse(SCHEDULER[1], path).ok()?,
    })
}

/// The library's generation options, as a program sets them (`GenerateOptions`'s public fields): counts, sides
/// and numbers from a mutated JSON document, checked by `check_counts` and against Z-Image-Turbo's configs by
/// `validate`; every accepted option set then derives its latent size and, for a small image, its schedule.
pub fn options(input: &[u8]) {
    let Some(configs) = turbo_configs() else { return };
    let document = structured(OPTIONS[input.len() % OPTIONS.len()], input);
    let Ok(value) = serde_json::from_str::<serde_json::Value>(&document) else { return };
    let count = |key: &str| value.get(key).and_then(serde_json::Value::as_u64).and_then(|n| usize::try_from(n).ok());
    let number = |key: &str| value.get(key).and_then(serde_json::Value::as_f64);
    let shape = |key: &str| -> Option<[usize; 4]> {
        let dims: Vec<usize> =
            value.get(key)?.as_array()?.iter().filter_map(|d| usize::try_from(d.as_u64()?).ok()).collect();
        dims.try_into().ok()
    };
    let mut opts = GenerateOptions::turbo("a fox");
    opts.steps = count("steps").unwrap_or(opts.steps);
    opts.height = count("height").unwrap_or(opts.height);
    opts.width = count("width").unwrap_or(opts.width);
    opts.max_sequence_length = count("max_sequence_length").unwrap_or(opts.max_sequence_length);
    opts.guidance = number("guidance").map_or(opts.guidance, |g| g as f32);
    opts.strength = number("strength").unwrap_or(opts.strength);
    opts.seed = value.get("seed").and_then(serde_json::Value::as_u64).unwrap_or(0);
    let device = Device::flex();
    // Only small tensors are made: a shape the fuzzer made huge is a refusal the shape check gives anyway.
    let small = |dims: [usize; 4]| dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d)).is_some_and(|n| n <= 1 << 20);
    opts.latents = shape("latents").filter(|d| small(*d)).map(|d| Tensor::zeros(d, &device));
    opts.image = shape("image").filter(|d| small(*d)).map(|d| Tensor::zeros(d, &device));
    if let Err(error) = opts.check_counts() {
        typed(&error, "");
        return;
    }
    match opts.validate(&configs) {
        Err(error) => typed(&error, ""),
        Ok(()) => {
            accept(7);
            let [h, w] = opts.latent_size(configs.vae.scale_factor());
            if opts.steps <= 64 {
                let _ = configs.scheduler.schedule(opts.steps, (h / 2) * (w / 2));
            }
        }
    }
}

/// A LoRA file as a user downloads it: the reader (`LoraFile::from_bytes`: safetensors' bounded header, the layout,
/// every key, factor shape, alpha and value) on the raw input and on a structured edit of a small seed; an accepted
/// file then resolves against no layers, which refuses it by name.
pub fn lora_file(input: &[u8]) {
    const SEED: &[u8] = include_bytes!("../../../../fuzz/corpus/lora_file/seed-kohya.safetensors");
    let edited = structured_safetensors(SEED, input);
    for bytes in [input, edited.as_slice()] {
        match LoraFile::from_bytes(Path::new("fuzz.safetensors"), bytes) {
            Ok(file) => {
                accept(8);
                let none = ComponentLayers::none();
                if let Err(error) = pipeline_zimage::lora::resolve(&[(file, 1.0)], &none, &none) {
                    typed(&error, "fuzz.safetensors");
                }
            }
            Err(error) => typed(&error, "fuzz.safetensors"),
        }
    }
}

/// `vulkaninfo --text` as the wgpu runtime reads it when it opens (the heaps' budgets where the driver offers
/// `VK_EXT_memory_budget`): the parser is a pure function of the text, and so is the budget lookup, for the raw
/// input and for the input's lines spliced into lavapipe's real report.
pub fn vulkaninfo(input: &[u8]) {
    const REPORT: &str = include_str!("../../../../fuzz/corpus/vulkaninfo/lavapipe.txt");
    let Some(text) = text(input) else { return };
    let mut lines: Vec<&str> = REPORT.lines().collect();
    let at = input.first().map_or(0, |b| usize::from(*b) * lines.len() / 256);
    lines.splice(at..at, text.lines());
    let spliced = lines.join("\n");
    for report in [text.as_ref(), spliced.as_str()] {
        let gpus = group_offload::vulkaninfo::parse(report);
        if !gpus.is_empty() {
            accept(9);
        }
        let _ = group_offload::vulkaninfo::device_local_budget(report, 0x10005, 0, "llvmpipe");
    }
}
