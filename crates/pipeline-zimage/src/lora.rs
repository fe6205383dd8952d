//! LoRA adapters for the transformer and the text encoder, under every offload route.
//!
//! A LoRA file adds `scale · alpha / rank · up · down` to the weight of some linear layers. This module reads the
//! layouts Z-Image LoRAs are published in, checks every factor against the model before anything changes, and
//! applies them in one of two [`LoraMode`]s:
//!
//! - [`LoraMode::Fused`]: the update is added to the host copy of each weight, so every route (resident, auto
//!   offload, block and leaf group offload, the disk store) moves exactly the bytes it moves without a LoRA,
//!   and a content-keyed disk store re-keys by itself. Removing it restores the base weights **bit for bit**.
//!   Per layer, the removal keeps the smaller of two records, and so never more than a plain copy of the layer's
//!   original weights: the elements where rounding made `(w + d) - d` differ from `w` (a list, or one signed
//!   byte or 16-bit word per element, with a list for the few that do not fit), or that plain copy. The
//!   factors are kept too: the update is recomputed in the same fixed order and subtracted.
//! - [`LoraMode::Runtime`]: each update stays two small matrices, [`LowRank`] parameters of the layer
//!   ([`PtLinear::lora`]), so group offload moves them with the layer's group and the base weights are never
//!   touched; removing them is dropping them.
//!
//! Layouts read ([`LoraFile::read`]):
//!
//! - diffusers / PEFT (what `save_lora_weights` writes and what most Z-Image-Turbo LoRAs on the Hub use):
//!   `transformer.<module>.lora_A.weight` `[rank, in]` and `.lora_B.weight` `[out, rank]` (also with the prefix
//!   `diffusion_model.`, with no prefix, or with PEFT's adapter name `lora_A.default.weight`),
//!   `text_encoder.<module>...` for the Qwen3 text encoder; alpha from a `.alpha` scalar, else the file's
//!   `lora_adapter_metadata` (`lora_alpha`, `alpha_pattern`, `use_rslora`), else the rank (a scaling of 1, as
//!   diffusers assumes).
//! - ComfyUI's, on the original Z-Image module tree: what its trainer saves, `diffusion_model.<module>`
//!   `.lora_up.weight`, `.lora_down.weight` and `.alpha` (or `lora_A` / `lora_B`), with the original names
//!   `attention.qkv` (the query, key and value as one module: its up factor split by rows among `to_q`, `to_k`,
//!   `to_v`) and `attention.out` (our `attention.to_out.0`); the other original names (`feed_forward.w1`,
//!   `adaLN_modulation.0`, `x_embedder`, `final_layer.linear`, `t_embedder.mlp.0`, `cap_embedder.1`, the
//!   refiners) are ours already.
//! - Kohya / sd-scripts, on the original module tree: `lora_unet_<module, dots as underscores>`
//!   `.lora_down.weight`, `.lora_up.weight` and `.alpha`, with `attention_qkv` and `attention_out` as above;
//!   `lora_te_` for the text encoder. Underscored names are resolved against the model's own layer paths (an
//!   exact table, never a guess from splitting on `_`), with the checkpoint's renames (`all_x_embedder_2-1`).
//!
//! Every problem is found before any weight changes, and each error names the file and the key: a key that
//! names no layer, a factor whose shape does not fit its layer, a down and an up of different ranks, a rank the
//! metadata contradicts, DoRA files ([`Error::LoraKey`], [`Error::LoraShape`], [`Error::LoraFile`]); a factor or
//! an alpha that is not finite, a scale that is not finite or lies past [`MAX_SCALE`] ([`Error::LoraValue`]);
//! a module given a factor or an alpha twice, one layer updated by two modules of one file ([`Error::LoraKey`]).
//! What cannot be known before fusing, finite factors whose sum leaves the weights' range, is checked on every
//! fused weight: [`swap`] then undoes the fuse bit for bit and names the layer and the scale
//! ([`Error::LoraNotFinite`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Tensor, TensorData, bf16, f16};
use group_offload::weights::FileTable;

use crate::error::{Error, Result};
use crate::nn::{LowRank, PtLinear};
use crate::text_encoder::TextEncoder;
use crate::transformer::{KEY_REMAP, ZImageTransformer2DModel};

/// The largest strength a LoRA is applied at, either sign: `|scale| <= 100`.
///
/// ComfyUI's LoRA loaders offer strengths in `[-100, 100]` (`strength_model`), the widest range a published tool
/// gives; diffusers sets no bound. At 100 a trained LoRA, whose update is a thousandth to a tenth of the weights'
/// size, already moves them by 0.1 to 10 times that size; past it the image is the update's noise, and at 1e30
/// the fused weights leave even f32's range.
pub const MAX_SCALE: f32 = 100.0;

/// A number as the messages print it: plainly at everyday sizes, with an exponent when very large or small.
fn number(value: f32) -> String {
    if value != 0.0 && value.is_finite() && !(1e-4..1e6).contains(&value.abs()) {
        format!("{value:e}")
    } else {
        format!("{value}")
    }
}

/// What is wrong with a scale, if anything: not finite, or past [`MAX_SCALE`].
fn scale_problem(scale: f32) -> Option<String> {
    if !scale.is_finite() {
        return Some("is not a finite number; give FILE or FILE:SCALE (0.8, say)".into());
    }
    (scale.abs() > MAX_SCALE).then(|| {
        format!(
            "is outside [-{MAX_SCALE}, {MAX_SCALE}], the strengths ComfyUI's LoRA loaders offer: at {MAX_SCALE} a \
             trained LoRA's update (a thousandth to a tenth of the weights) already moves them by 0.1 to 10 times \
             their size, and past it the image is the update's noise; give a scale in that range (0.8, say)"
        )
    })
}

/// One LoRA file and the scale to apply it at: the CLI's `--lora FILE[:SCALE]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The `.safetensors` file.
    pub path: PathBuf,
    /// The user's strength (diffusers' `adapter_weights`, ComfyUI's `strength_model`); 1 applies the LoRA as
    /// trained, 0 not at all. [`resolve`] refuses one that is not finite or lies past [`MAX_SCALE`].
    pub scale: f32,
}

impl LoraSpec {
    /// `path` at `scale`.
    pub fn new(path: impl Into<PathBuf>, scale: f32) -> Self {
        Self { path: path.into(), scale }
    }

    /// Parses `FILE` (scale 1) or `FILE:SCALE`. A suffix after the last `:` that is not a number is part of the
    /// file name; a scale that is not finite, or lies past [`MAX_SCALE`], is refused.
    pub fn parse(text: &str) -> Result<Self> {
        let (path, scale) = match text.rsplit_once(':') {
            Some((path, scale)) if !path.is_empty() => match scale.trim().parse::<f32>() {
                Ok(scale) => (path, scale),
                Err(_) => (text, 1.0),
            },
            _ => (text, 1.0),
        };
        if let Some(reason) = scale_problem(scale) {
            return Err(Error::InvalidArgument {
                name: "lora",
                reason: format!("{text}: the scale {} {reason}", number(scale)),
            });
        }
        if path.is_empty() {
            return Err(Error::InvalidArgument {
                name: "lora",
                reason: "an empty file name; give FILE or FILE:SCALE".into(),
            });
        }
        Ok(Self::new(path, scale))
    }
}

impl std::str::FromStr for LoraSpec {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        Self::parse(text)
    }
}

/// How a LoRA is applied; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraMode {
    /// Added into the host copies of the weights before anything streams (the default: no cost per step).
    #[default]
    Fused,
    /// Kept as low-rank terms of the layers, computed at every call, moved with their layer's group.
    Runtime,
}

impl std::fmt::Display for LoraMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Fused => "fused",
            Self::Runtime => "runtime",
        })
    }
}

/// The layout a LoRA file was written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraLayout {
    /// diffusers / PEFT factor names: `<module>.lora_A.weight`, `lora_B.weight` (under any prefix).
    Peft,
    /// Kohya / sd-scripts and ComfyUI factor names: `<module>.lora_down.weight`, `lora_up.weight`, `alpha`.
    Kohya,
}

/// The component a LoRA update is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LoraTarget {
    /// The Z-Image transformer.
    Transformer,
    /// The Qwen3 text encoder.
    TextEncoder,
}

impl LoraTarget {
    /// The pipeline's name for it.
    pub fn component(self) -> &'static str {
        match self {
            Self::Transformer => "transformer",
            Self::TextEncoder => "text_encoder",
        }
    }
}

/// How a file names a module.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum ModuleName {
    /// Dots between field names (`layers.0.attention.to_q`), as diffusers' parameter names.
    Dotted(String),
    /// Underscores for dots (`layers_0_attention_to_q`), resolved against the model's layer paths.
    Underscored(String),
}

impl ModuleName {
    fn as_str(&self) -> &str {
        match self {
            Self::Dotted(name) | Self::Underscored(name) => name,
        }
    }
}

/// A down or up factor as read: `[rows, cols]`, its values in f32 (all finite: the reader refuses others).
#[derive(Debug, Clone)]
struct Factor {
    rows: usize,
    cols: usize,
    values: Arc<Vec<f32>>,
}

/// One module's factors as the file stores them, each with its key.
#[derive(Debug, Clone)]
struct FileModule {
    target: LoraTarget,
    name: ModuleName,
    down: Option<(String, Factor)>,
    up: Option<(String, Factor)>,
    alpha: Option<(String, f32)>,
}

impl FileModule {
    /// The key an error about the module names: its down factor's, else its up factor's, else its alpha's.
    fn key(&self) -> &str {
        let keys = [self.down.as_ref().map(|(k, _)| k), self.up.as_ref().map(|(k, _)| k)];
        keys.into_iter().flatten().next().or(self.alpha.as_ref().map(|(k, _)| k)).map_or("", String::as_str)
    }
}

/// The adapter configuration diffusers stores in `lora_adapter_metadata`, for one component.
#[derive(Debug, Clone, Default)]
struct AdapterMetadata {
    rank: Option<usize>,
    alpha: Option<f32>,
    rank_pattern: BTreeMap<String, usize>,
    alpha_pattern: BTreeMap<String, f32>,
    rslora: bool,
}

impl AdapterMetadata {
    /// The entry of `patterns` that names `module` (the whole name or a dotted suffix), as PEFT matches them.
    fn pattern<'a, T>(patterns: &'a BTreeMap<String, T>, module: &str) -> Option<&'a T> {
        patterns.iter().find(|(key, _)| module == key.as_str() || module.ends_with(&format!(".{key}"))).map(|(_, v)| v)
    }
}

/// A LoRA file, read and checked for its own consistency (pairs complete, ranks equal, every value finite, no
/// factor given twice); not yet checked against a model.
#[derive(Debug, Clone)]
pub struct LoraFile {
    path: PathBuf,
    layout: LoraLayout,
    modules: Vec<FileModule>,
    metadata: BTreeMap<LoraTarget, AdapterMetadata>,
}

impl LoraFile {
    /// Reads `path`: a safetensors file in one of the [layouts](self) this module reads.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let bytes = std::fs::read(&path).map_err(|source| Error::LoraFile {
            path: path.clone(),
            reason: format!("it cannot be read ({source})"),
        })?;
        Self::from_bytes(&path, &bytes)
    }

    /// Reads a LoRA file held in memory; `path` names it in errors. This is the reader's one entry point: it
    /// returns an error for any bytes that are not a LoRA file it can use, and never panics (a fuzzer drives it).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
        let file_error = |reason: String| Error::LoraFile { path: path.to_path_buf(), reason };
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| file_error(format!("it is not a safetensors file ({e})")))?;
        let tensors = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| file_error(format!("it is not a safetensors file ({e})")))?;
        let metadata = header.metadata().as_ref().and_then(|m| m.get("lora_adapter_metadata")).map_or_else(
            || Ok(BTreeMap::new()),
            |text| parse_metadata(text).map_err(|reason| file_error(format!("its lora_adapter_metadata {reason}"))),
        )?;
        let mut modules: BTreeMap<(LoraTarget, ModuleName), FileModule> = BTreeMap::new();
        let mut layout = None;
        let mut names: Vec<&str> = tensors.names();
        names.sort_unstable();
        if names.is_empty() {
            return Err(file_error("it holds no tensors".into()));
        }
        for key in names {
            let key_error = |reason: String| Error::LoraKey { path: path.to_path_buf(), key: key.to_string(), reason };
            let shape_error =
                |reason: String| Error::LoraShape { path: path.to_path_buf(), key: key.to_string(), reason };
            let parsed = parse_key(key).ok_or_else(|| {
                key_error(
                    "is not a LoRA factor in a layout this crate reads: diffusers/PEFT \
                     `transformer.<module>.lora_A.weight` / `lora_B.weight`, ComfyUI \
                     `diffusion_model.<module>.lora_down.weight` / `lora_up.weight` / `alpha`, or Kohya \
                     `lora_unet_<module>.lora_down.weight` / `lora_up.weight` / `alpha`"
                        .into(),
                )
            })?;
            if parsed.role == Role::Dora {
                return Err(file_error(format!(
                    "{key} is a DoRA magnitude vector; DoRA is not supported, use a plain LoRA of the model"
                )));
            }
            if parsed.layout.is_some_and(|this| *layout.get_or_insert(this) != this) {
                return Err(key_error(
                    "mixes the Kohya and the diffusers/PEFT layouts in one file; save it in one layout".into(),
                ));
            }
            let view = tensors.tensor(key).map_err(|e| file_error(format!("{key} cannot be read ({e})")))?;
            let values = f32_values(&view).map_err(shape_error)?;
            if let Some(reason) = not_finite(&view, &values) {
                return Err(Error::LoraValue { path: path.to_path_buf(), what: format!("key {key}"), reason });
            }
            let entry = modules.entry((parsed.target, parsed.name.clone())).or_insert_with(|| FileModule {
                target: parsed.target,
                name: parsed.name.clone(),
                down: None,
                up: None,
                alpha: None,
            });
            // A module given a factor twice (PEFT's `lora_A.weight` beside `lora_A.default.weight`, or two
            // prefixes) holds two adapters: which one applies would be a guess, so the file is refused.
            let twice = |what: &str, first: &str| {
                key_error(format!(
                    "gives the {what} of {} a second time (the first is {first}); the file holds two adapters \
                     for one module, and which one applies would be a guess: keep one of them",
                    parsed.name.as_str()
                ))
            };
            match parsed.role {
                Role::Down | Role::Up => {
                    let &[rows, cols] = view.shape() else {
                        return Err(shape_error(
                            if parsed.role == Role::Down {
                                "a down factor must be a matrix [rank, in]"
                            } else {
                                "an up factor must be a matrix [out, rank]"
                            }
                            .into(),
                        ));
                    };
                    let (slot, what) = match parsed.role {
                        Role::Down => (&mut entry.down, "down factor"),
                        _ => (&mut entry.up, "up factor"),
                    };
                    if let Some((first, _)) = slot {
                        return Err(twice(what, first));
                    }
                    *slot = Some((key.to_string(), Factor { rows, cols, values: Arc::new(values) }));
                }
                Role::Alpha => {
                    if values.len() != 1 {
                        return Err(shape_error("an alpha must be one number".into()));
                    }
                    if let Some((first, _)) = &entry.alpha {
                        return Err(twice("alpha", first));
                    }
                    entry.alpha = Some((key.to_string(), values[0]));
                }
                Role::Dora => return Err(file_error(format!("{key} is a DoRA magnitude vector"))),
            }
        }
        let file = Self {
            path: path.to_path_buf(),
            layout: layout.unwrap_or(LoraLayout::Peft),
            modules: modules.into_values().collect(),
            metadata,
        };
        for module in &file.modules {
            file.factors(module)?;
        }
        Ok(file)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The layout it is written in.
    pub fn layout(&self) -> LoraLayout {
        self.layout
    }

    /// How many modules it updates (a fused `qkv` counts once).
    pub fn modules(&self) -> usize {
        self.modules.len()
    }

    /// A module's down and up factors, checked: both present, ranks equal, the rank the metadata gives.
    fn factors<'a>(&self, module: &'a FileModule) -> Result<(&'a Factor, &'a Factor, usize)> {
        let shape_error =
            |reason: String| Error::LoraShape { path: self.path.clone(), key: module.key().to_string(), reason };
        let (Some((_, down)), Some((_, up))) = (&module.down, &module.up) else {
            let missing = if module.down.is_none() { "down (lora_A)" } else { "up (lora_B)" };
            return Err(shape_error(format!("its module has no {missing} factor; the file is incomplete")));
        };
        let rank = down.rows;
        if up.cols != rank || rank == 0 {
            return Err(shape_error(format!(
                "the down factor has rank {rank} and the up factor [{}, {}] has rank {}; the pair does not match",
                up.rows, up.cols, up.cols
            )));
        }
        if let (Some(metadata), ModuleName::Dotted(name)) = (self.metadata.get(&module.target), &module.name) {
            let expected = AdapterMetadata::pattern(&metadata.rank_pattern, name).copied().or(metadata.rank);
            if let Some(expected) = expected.filter(|expected| *expected != rank) {
                return Err(shape_error(format!(
                    "the factors have rank {rank} and the file's lora_adapter_metadata says {expected}; the file is \
                     damaged or its metadata belongs to another adapter"
                )));
            }
        }
        Ok((down, up, rank))
    }

    /// `alpha / rank` (or `alpha / sqrt(rank)` under rsLoRA) for a module of rank `rank`.
    fn scaling(&self, module: &FileModule, rank: usize) -> f32 {
        let metadata = self.metadata.get(&module.target);
        let name = module.name.as_str();
        let alpha = module
            .alpha
            .as_ref()
            .map(|(_, alpha)| *alpha)
            .or_else(|| metadata.and_then(|m| AdapterMetadata::pattern(&m.alpha_pattern, name).copied()))
            .or_else(|| metadata.and_then(|m| m.alpha))
            .unwrap_or(rank as f32);
        if metadata.is_some_and(|m| m.rslora) { alpha / (rank as f32).sqrt() } else { alpha / rank as f32 }
    }
}

/// What a key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Down,
    Up,
    Alpha,
    Dora,
}

struct ParsedKey {
    target: LoraTarget,
    name: ModuleName,
    role: Role,
    /// `None` for a dotted alpha, which both layouts name alike.
    layout: Option<LoraLayout>,
}

/// Splits a key into its component, module and role; `None` for a key in no layout this module reads.
fn parse_key(key: &str) -> Option<ParsedKey> {
    const ROLES: &[(&str, Role)] = &[
        (".lora_A.weight", Role::Down),
        (".lora_A.default.weight", Role::Down),
        (".lora_down.weight", Role::Down),
        (".lora_B.weight", Role::Up),
        (".lora_B.default.weight", Role::Up),
        (".lora_up.weight", Role::Up),
        (".alpha", Role::Alpha),
        (".lora_magnitude_vector", Role::Dora),
        (".lora_magnitude_vector.default.weight", Role::Dora),
        (".dora_scale", Role::Dora),
    ];
    let (module, role) = ROLES.iter().find_map(|(suffix, role)| key.strip_suffix(suffix).map(|m| (m, *role)))?;
    const PREFIXES: &[(&str, LoraTarget, bool)] = &[
        ("transformer.", LoraTarget::Transformer, false),
        ("diffusion_model.", LoraTarget::Transformer, false),
        ("text_encoder.", LoraTarget::TextEncoder, false),
        ("lora_unet_", LoraTarget::Transformer, true),
        ("lora_te_", LoraTarget::TextEncoder, true),
        ("lora_te1_", LoraTarget::TextEncoder, true),
    ];
    // A dotted name without a prefix is the transformer's (the original model's own names, as diffusers and
    // ComfyUI read them); one that names no layer of it is refused when it is resolved.
    let (name, target, underscored) = PREFIXES
        .iter()
        .find_map(|(prefix, target, u)| module.strip_prefix(prefix).map(|n| (n, *target, *u)))
        .unwrap_or((module, LoraTarget::Transformer, false));
    if name.is_empty() {
        return None;
    }
    let kohya_roles = matches!(key.rsplit_once(".lora_").map(|(_, r)| r), Some("down.weight" | "up.weight"));
    let layout = if underscored || kohya_roles {
        Some(LoraLayout::Kohya)
    } else {
        (role != Role::Alpha).then_some(LoraLayout::Peft)
    };
    let name = if underscored { ModuleName::Underscored(name.into()) } else { ModuleName::Dotted(name.into()) };
    Some(ParsedKey { target, name, role, layout })
}

/// diffusers' `lora_adapter_metadata`: a JSON object of `<component>.<field>` entries.
fn parse_metadata(text: &str) -> std::result::Result<BTreeMap<LoraTarget, AdapterMetadata>, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("is not JSON ({e})"))?;
    let object = value.as_object().ok_or("is not a JSON object")?;
    let mut out: BTreeMap<LoraTarget, AdapterMetadata> = BTreeMap::new();
    for (key, value) in object {
        let (target, field) = match key.split_once('.') {
            Some(("transformer", field)) => (LoraTarget::Transformer, field),
            Some(("text_encoder", field)) => (LoraTarget::TextEncoder, field),
            // A file saved for one model (no component prefix) describes the transformer.
            _ => (LoraTarget::Transformer, key.as_str()),
        };
        let entry = out.entry(target).or_default();
        let number = |what: &str| value.as_f64().ok_or(format!("gives {key} = {value}, not a number ({what})"));
        // An alpha is applied in f32: one past its range would make every update of the module infinite.
        let alpha = |name: &str, alpha: f64| {
            let narrowed = alpha as f32;
            narrowed.is_finite().then_some(narrowed).ok_or(format!(
                "gives {name} = {alpha:e}, not a finite number in f32, in which alphas are applied; fix the metadata"
            ))
        };
        match field {
            "r" => entry.rank = Some(number("the rank")? as usize),
            "lora_alpha" => entry.alpha = Some(alpha(key, number("the alpha")?)?),
            "use_rslora" => entry.rslora = value.as_bool().unwrap_or(false),
            "use_dora" if value.as_bool() == Some(true) => return Err("says use_dora; DoRA is not supported".into()),
            "rank_pattern" | "alpha_pattern" => {
                for (pattern, v) in value.as_object().into_iter().flatten() {
                    let v = v.as_f64().ok_or(format!("gives {key}.{pattern} = {v}, not a number"))?;
                    if field == "rank_pattern" {
                        entry.rank_pattern.insert(pattern.clone(), v as usize);
                    } else {
                        entry.alpha_pattern.insert(pattern.clone(), alpha(&format!("{key}.{pattern}"), v)?);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Every value of a safetensors tensor as f32, decoded from its little-endian bytes (a safetensors buffer need
/// not be aligned for a typed view); an error for a dtype LoRA factors do not use.
fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> std::result::Result<Vec<f32>, String> {
    let bytes = view.data();
    Ok(match view.dtype() {
        safetensors::Dtype::F32 => {
            bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        safetensors::Dtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        safetensors::Dtype::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        safetensors::Dtype::F64 => bytes.chunks_exact(8).map(|c| f64_at(c) as f32).collect(),
        other => return Err(format!("has dtype {other:?}; LoRA factors are f32, f16 or bf16")),
    })
}

/// The f64 in the first 8 bytes of `bytes` (little-endian); 0 for fewer, which a safetensors buffer never has.
fn f64_at(bytes: &[u8]) -> f64 {
    bytes.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok()).map_or(0.0, f64::from_le_bytes)
}

/// Why `values` (the tensor `view` decoded to f32) cannot be applied, if any is not finite: how many, the first
/// with its index, and what to do.
fn not_finite(view: &safetensors::tensor::TensorView<'_>, values: &[f32]) -> Option<String> {
    let first = values.iter().position(|v| !v.is_finite())?;
    let count = values.iter().filter(|v| !v.is_finite()).count();
    let shape = view.shape();
    let how_many = if count == 1 { "1 value".to_string() } else { format!("{count} values") };
    // An f64 value past f32's range is finite in the file and infinite once read.
    let in_file = (view.dtype() == safetensors::Dtype::F64)
        .then(|| f64_at(view.data().get(first * 8..).unwrap_or_default()))
        .filter(|v| v.is_finite());
    Some(match in_file {
        Some(value) => format!(
            "holds {how_many} past f32's range, in which factors are applied ({value:e} at index {first} of \
             {shape:?}); save the LoRA in f32, f16 or bf16 with its values in range"
        ),
        None => format!(
            "holds {how_many} that {} not finite ({} at index {first} of {shape:?}); the file is damaged or comes \
             from a training that diverged: export it again, or use another",
            if count == 1 { "is" } else { "are" },
            values[first]
        ),
    })
}

/// A linear layer of a model as LoRA sees it: its path, `[out, in]` and its weight's dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearPlace {
    /// The layer's path in the model (`layers.0.attention.to_q`).
    pub path: String,
    /// `d_out`.
    pub d_out: usize,
    /// `d_in`.
    pub d_in: usize,
    /// The weight's dtype (a quantized one cannot take a fused update).
    pub dtype: DType,
}

/// Every [`PtLinear`] of `module`, by path, read without touching the data.
pub fn linear_places<M: Module>(module: &M) -> Vec<LinearPlace> {
    linear_places_with(module, None)
}

/// [`linear_places`] of a model bound to its checkpoint files: the dtypes of weights nothing read yet come from
/// `files` (asking the weight would read it).
pub fn linear_places_with<M: Module>(module: &M, files: Option<&FileTable>) -> Vec<LinearPlace> {
    struct Places {
        stack: Vec<(String, String)>,
        out: Vec<LinearPlace>,
        files: Option<FileTable>,
    }
    impl ModuleVisitor for Places {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack.push((name.to_string(), container_type.to_string()));
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some((name, container)) = self.stack.last() else { return };
            if D != 2 || name != "weight" || container != "Struct:PtLinear" {
                return;
            }
            let dims = param.lazy_shape();
            let path = self.stack[..self.stack.len() - 1].iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>();
            self.out.push(LinearPlace {
                path: path.join("."),
                d_out: dims[0],
                d_in: dims[1],
                dtype: group_offload::whole::param_dtype(param, self.files.as_ref()),
            });
        }
    }
    let mut places = Places { stack: Vec::new(), out: Vec::new(), files: files.cloned() };
    module.visit(&mut places);
    places.out
}

/// Mutable access to every [`PtLinear`] of a model with its path: how LoRA changes a model's layers (burn's
/// module mappers can change tensors, not add a low-rank term to a layer).
pub trait LinearLayers {
    /// Every linear layer with its path, in the order burn visits them; the paths equal [`linear_places`]'.
    fn linears_mut(&mut self) -> Vec<(String, &mut PtLinear)>;

    /// Path prefixes of checkpoint layers the model leaves out by design: LoRA updates under them are skipped
    /// (and reported), not refused.
    fn skipped_prefixes(&self) -> Vec<String> {
        Vec::new()
    }
}

impl LinearLayers for ZImageTransformer2DModel {
    fn linears_mut(&mut self) -> Vec<(String, &mut PtLinear)> {
        let mut out: Vec<(String, &mut PtLinear)> = vec![
            ("x_embedder".into(), &mut self.x_embedder),
            ("final_layer.linear".into(), &mut self.final_layer.linear),
            ("final_layer.adaLN_modulation.1".into(), &mut self.final_layer.adaLN_modulation.1),
            ("t_embedder.mlp.0".into(), &mut self.t_embedder.mlp.0),
            ("t_embedder.mlp.2".into(), &mut self.t_embedder.mlp.2),
            ("cap_embedder.1".into(), &mut self.cap_embedder.1),
        ];
        for (list, blocks) in [
            ("noise_refiner", &mut self.noise_refiner),
            ("context_refiner", &mut self.context_refiner),
            ("layers", &mut self.layers),
        ] {
            for (i, block) in blocks.iter_mut().enumerate() {
                let prefix = format!("{list}.{i}");
                let attention = &mut block.attention;
                out.push((format!("{prefix}.attention.to_q"), &mut attention.to_q));
                out.push((format!("{prefix}.attention.to_k"), &mut attention.to_k));
                out.push((format!("{prefix}.attention.to_v"), &mut attention.to_v));
                for (j, linear) in attention.to_out.iter_mut().enumerate() {
                    out.push((format!("{prefix}.attention.to_out.{j}"), linear));
                }
                let ff = &mut block.feed_forward;
                out.push((format!("{prefix}.feed_forward.w1"), &mut ff.w1));
                out.push((format!("{prefix}.feed_forward.w2"), &mut ff.w2));
                out.push((format!("{prefix}.feed_forward.w3"), &mut ff.w3));
                for (j, linear) in block.adaLN_modulation.iter_mut().enumerate() {
                    out.push((format!("{prefix}.adaLN_modulation.{j}"), linear));
                }
            }
        }
        out
    }
}

impl LinearLayers for TextEncoder {
    fn linears_mut(&mut self) -> Vec<(String, &mut PtLinear)> {
        let mut out: Vec<(String, &mut PtLinear)> = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let attn = &mut layer.self_attn;
            out.push((format!("layers.{i}.self_attn.q_proj"), &mut attn.q_proj));
            out.push((format!("layers.{i}.self_attn.k_proj"), &mut attn.k_proj));
            out.push((format!("layers.{i}.self_attn.v_proj"), &mut attn.v_proj));
            out.push((format!("layers.{i}.self_attn.o_proj"), &mut attn.o_proj));
            let mlp = &mut layer.mlp;
            out.push((format!("layers.{i}.mlp.gate_proj"), &mut mlp.gate_proj));
            out.push((format!("layers.{i}.mlp.up_proj"), &mut mlp.up_proj));
            out.push((format!("layers.{i}.mlp.down_proj"), &mut mlp.down_proj));
        }
        out
    }

    /// The checkpoint's last decoder layer and final norm, which the pipeline's `hidden_states[-2]` never reads.
    fn skipped_prefixes(&self) -> Vec<String> {
        vec![format!("layers.{}.", self.layers.len()), "norm.".into()]
    }
}

/// One low-rank update of one layer, resolved against the model: `coefficient · up · down` is added to the
/// weight at `path`.
#[derive(Debug, Clone)]
pub struct ResolvedUpdate {
    /// The layer's path in its component.
    pub path: String,
    /// `[rank, d_in]`, f32.
    down: Arc<Vec<f32>>,
    /// `[d_out, rank]`, f32 (a row slice of a fused `qkv` up factor).
    up: Arc<Vec<f32>>,
    /// The rank.
    pub rank: usize,
    /// The user's scale times `alpha / rank`.
    pub coefficient: f32,
    /// The file it comes from, for errors.
    file: Arc<PathBuf>,
    /// The user's scale, for errors.
    scale: f32,
    /// The layer's weight dtype, as measured without reading it (a weight bound to its file is read only when its
    /// group uploads): the dtype of the run-time terms.
    layer_dtype: DType,
}

/// The updates of a set of LoRA files resolved against the pipeline's two models, by component and layer, in
/// the files' order.
#[derive(Debug, Clone, Default)]
pub struct ResolvedLoras {
    /// Updates by component, then by layer path (each layer's updates in the order of the files).
    pub updates: BTreeMap<LoraTarget, BTreeMap<String, Vec<ResolvedUpdate>>>,
    /// File keys skipped because they update a layer the model leaves out by design.
    pub skipped: Vec<String>,
}

impl ResolvedLoras {
    /// How many layer updates there are in all.
    pub fn len(&self) -> usize {
        self.updates.values().flat_map(BTreeMap::values).map(Vec::len).sum()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many layers of `target` are updated.
    pub fn layers(&self, target: LoraTarget) -> usize {
        self.updates.get(&target).map_or(0, BTreeMap::len)
    }
}

/// The layers of one component as resolution sees them.
pub struct ComponentLayers {
    places: BTreeMap<String, LinearPlace>,
    /// Underscored name -> dotted path, `None` where two paths collide.
    underscored: BTreeMap<String, Option<String>>,
    skipped: Vec<String>,
    /// The checkpoint's renames, applied to a file's dotted names as the loader applies them to tensor names.
    remap: burn::store::KeyRemapper,
    /// The same renames with underscores for dots, for Kohya's names (`all_x_embedder_2-1` -> `x_embedder`).
    underscored_remap: burn::store::KeyRemapper,
}

impl ComponentLayers {
    /// The layers of `model`, with the checkpoint renames `remap` (the transformer's [`KEY_REMAP`]).
    pub fn of<M: Module + LinearLayers>(model: &M, remap: &[(&str, &str)]) -> Self {
        Self::of_with(model, remap, None)
    }

    /// [`of`](Self::of) for a model bound to its checkpoint files (`files`, its table): nothing is read.
    pub fn of_with<M: Module + LinearLayers>(model: &M, remap: &[(&str, &str)], files: Option<&FileTable>) -> Self {
        let places: BTreeMap<String, LinearPlace> =
            linear_places_with(model, files).into_iter().map(|place| (place.path.clone(), place)).collect();
        let mut underscored: BTreeMap<String, Option<String>> = BTreeMap::new();
        for path in places.keys() {
            let key = path.replace('.', "_");
            underscored.entry(key).and_modify(|seen| *seen = None).or_insert_with(|| Some(path.clone()));
        }
        // The renames are this crate's own constants, which the loader compiles too (its tests load with them);
        // their underscored forms only replace escaped dots (`\.`) and dots, which keeps a regex a regex.
        let remap =
            burn::store::KeyRemapper::from_patterns(remap.to_vec()).expect("the crate's own key renames compile");
        let underscored_remap = burn::store::KeyRemapper::from_patterns(
            remap
                .to_regex_pairs()
                .iter()
                .map(|(re, to)| (re.as_str().replace(r"\.", "_"), to.replace('.', "_")))
                .collect(),
        )
        .expect("the crate's own key renames compile with underscores");
        Self { places, underscored, skipped: model.skipped_prefixes(), remap, underscored_remap }
    }

    /// No layers: for resolving LoRAs of one component only (every key of the other is then refused).
    pub fn none() -> Self {
        Self {
            places: BTreeMap::new(),
            underscored: BTreeMap::new(),
            skipped: Vec::new(),
            remap: burn::store::KeyRemapper::default(),
            underscored_remap: burn::store::KeyRemapper::default(),
        }
    }

    /// The transformer's layers.
    pub fn transformer(model: &ZImageTransformer2DModel) -> Self {
        Self::of(model, KEY_REMAP)
    }

    /// [`transformer`](Self::transformer) for a transformer bound to its checkpoint files: nothing is read.
    pub fn transformer_with(model: &ZImageTransformer2DModel, files: Option<&FileTable>) -> Self {
        Self::of_with(model, KEY_REMAP, files)
    }

    /// The text encoder's layers (its keys need no rename once `model.` is gone, which LoRA files never carry).
    pub fn text_encoder(model: &TextEncoder) -> Self {
        Self::of(model, &[])
    }

    /// [`text_encoder`](Self::text_encoder) for a text encoder bound to its checkpoint files: nothing is read.
    pub fn text_encoder_with(model: &TextEncoder, files: Option<&FileTable>) -> Self {
        Self::of_with(model, &[], files)
    }

    /// The dotted path a file's module name stands for, in this model (renames applied; a fused `qkv` keeps its
    /// name, which [`resolve`] splits).
    fn dotted(&self, name: &ModuleName) -> std::result::Result<String, &'static str> {
        match name {
            ModuleName::Dotted(name) => {
                let mut key = format!("{name}.");
                for (re, to) in self.remap.to_regex_pairs() {
                    key = re.replace(&key, to.as_str()).into_owned();
                }
                let path = key.trim_end_matches('.');
                // The original module tree's attention output (ComfyUI's and Kohya's `attention.out`) is ours
                // `attention.to_out.0`.
                Ok(match path.strip_suffix(".attention.out") {
                    Some(block) => format!("{block}.attention.to_out.0"),
                    None => path.to_string(),
                })
            }
            ModuleName::Underscored(name) => {
                let mut key = format!("{name}_");
                for (re, to) in self.underscored_remap.to_regex_pairs() {
                    key = re.replace(&key, to.as_str()).into_owned();
                }
                let name = key.trim_end_matches('_');
                // The original module tree's names for the attention (`qkv`, `out`) map onto ours.
                if let Some(block) = name.strip_suffix("_attention_qkv") {
                    return self
                        .lookup_underscored(&format!("{block}_attention_to_q"))
                        .map(|path| format!("{}.qkv", path.trim_end_matches(".to_q")));
                }
                if let Some(block) = name.strip_suffix("_attention_out") {
                    return self.lookup_underscored(&format!("{block}_attention_to_out_0"));
                }
                self.lookup_underscored(name)
            }
        }
    }

    fn lookup_underscored(&self, name: &str) -> std::result::Result<String, &'static str> {
        match self.underscored.get(name) {
            Some(Some(path)) => Ok(path.clone()),
            Some(None) => Err("stands for two layers of the model once underscores become dots"),
            None => Err("names no linear layer of the model"),
        }
    }

    fn is_skipped(&self, path: &str) -> bool {
        let path = format!("{path}.");
        self.skipped.iter().any(|prefix| path.starts_with(prefix.as_str()))
    }
}

/// Resolves `files` (with their scales) against the pipeline's two models: every scale must be finite and within
/// [`MAX_SCALE`], every module must name a linear layer (or one the model leaves out by design: skipped and
/// reported), no layer may be named by two modules of one file, and the factors must fit. Nothing is changed;
/// the first problem is returned, naming its file and key.
pub fn resolve(
    files: &[(LoraFile, f32)],
    transformer: &ComponentLayers,
    text_encoder: &ComponentLayers,
) -> Result<ResolvedLoras> {
    let mut resolved = ResolvedLoras::default();
    for (file, scale) in files {
        if let Some(reason) = scale_problem(*scale) {
            return Err(Error::LoraValue {
                path: file.path.clone(),
                what: format!("the scale {}", number(*scale)),
                reason,
            });
        }
        let source = Arc::new(file.path.clone());
        // The module of this file that updates each layer: a second one is refused.
        let mut claimed: BTreeMap<(LoraTarget, String), &str> = BTreeMap::new();
        for module in &file.modules {
            let layers = match module.target {
                LoraTarget::Transformer => transformer,
                LoraTarget::TextEncoder => text_encoder,
            };
            let key_error =
                |reason: String| Error::LoraKey { path: file.path.clone(), key: module.key().to_string(), reason };
            let shape_error =
                |reason: String| Error::LoraShape { path: file.path.clone(), key: module.key().to_string(), reason };
            let component = module.target.component();
            let path = layers.dotted(&module.name).map_err(|why| {
                key_error(format!("{why} of the {component}; the file is for another model, or misnamed"))
            })?;
            let (down, up, rank) = file.factors(module)?;
            // A fused qkv updates the query, key and value, its up factor split by rows in that order.
            let targets: Vec<String> = match path.strip_suffix(".qkv") {
                Some(attention) => ["to_q", "to_k", "to_v"].iter().map(|p| format!("{attention}.{p}")).collect(),
                None => vec![path.clone()],
            };
            if targets.iter().all(|t| layers.is_skipped(t)) {
                resolved.skipped.push(module.key().to_string());
                continue;
            }
            let places = targets
                .iter()
                .map(|t| {
                    layers
                        .places
                        .get(t)
                        .ok_or_else(|| key_error(format!("names {t}, which is no linear layer of the {component}")))
                })
                .collect::<Result<Vec<_>>>()?;
            for place in &places {
                if let Some(first) = claimed.insert((module.target, place.path.clone()), module.key()) {
                    return Err(key_error(format!(
                        "updates the {component}'s {}, which {first} of the same file updates too; two modules of \
                         one file for one layer (a fused qkv beside its query, say) are two adapters, and which one \
                         is meant would be a guess: keep one of them",
                        place.path
                    )));
                }
            }
            let d_in = down.cols;
            let d_out: usize = places.iter().map(|p| p.d_out).sum();
            if places.iter().any(|p| p.d_in != d_in) || up.rows != d_out {
                return Err(shape_error(format!(
                    "the factors make a [{}, {d_in}] update and the {component}'s {path} is [{d_out}, {}]; the file \
                     is for another model size",
                    up.rows, places[0].d_in
                )));
            }
            let coefficient = scale * file.scaling(module, rank);
            if !coefficient.is_finite() {
                let (key, alpha) = module.alpha.as_ref().map_or((module.key(), rank as f32), |(k, a)| (k.as_str(), *a));
                return Err(Error::LoraValue {
                    path: file.path.clone(),
                    what: format!("key {key}"),
                    reason: format!(
                        "gives alpha {} at rank {rank}, which at scale {} makes an update coefficient that is not a \
                         finite number; the file's alpha is damaged: fix or drop it",
                        number(alpha),
                        number(*scale)
                    ),
                });
            }
            let mut row = 0;
            for place in places {
                let up_rows = Arc::new(up.values[row * rank..(row + place.d_out) * rank].to_vec());
                row += place.d_out;
                resolved.updates.entry(module.target).or_default().entry(place.path.clone()).or_default().push(
                    ResolvedUpdate {
                        path: place.path.clone(),
                        down: down.values.clone(),
                        up: up_rows,
                        rank,
                        coefficient,
                        file: source.clone(),
                        scale: *scale,
                        layer_dtype: place.dtype,
                    },
                );
            }
        }
    }
    Ok(resolved)
}

/// The update of one layer, in f32, row-major `[d_out, d_in]`: `Σ coefficient · up · down` over `updates` in
/// their order. Each element is summed over the rank in one fixed order whatever the thread count, so the same
/// updates give the same bits every time (what makes a fused update removable bit for bit).
fn delta(updates: &[ResolvedUpdate], d_out: usize, d_in: usize) -> Vec<f32> {
    let mut out = vec![0f32; d_out * d_in];
    let threads = std::thread::available_parallelism().map_or(1, usize::from).min(d_out.max(1));
    let rows_per = d_out.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        for (chunk_index, chunk) in out.chunks_mut(rows_per * d_in).enumerate() {
            scope.spawn(move || {
                for (r, row) in chunk.chunks_mut(d_in).enumerate() {
                    let i = chunk_index * rows_per + r;
                    for update in updates {
                        for k in 0..update.rank {
                            let a = update.coefficient * update.up[i * update.rank + k];
                            let down = &update.down[k * d_in..(k + 1) * d_in];
                            for (o, d) in row.iter_mut().zip(down) {
                                *o += a * d;
                            }
                        }
                    }
                }
            });
        }
    });
    out
}

/// What a fused layer keeps so that removing its update gives the original weights bit for bit: whichever of
/// these is smallest, so never more than a plain copy of the original weights.
///
/// Subtracting the update again, `(w + d) - d`, gives `w` back for most elements; the others are off by a few
/// representable values. A code counts that difference in the dtype's ordered values ([`position`]), so a
/// value that rounding moved across zero is still a small code. Where the update is small beside the weight (a
/// trained LoRA) few elements are off and the list is short; where it is as large as the weight, most are off,
/// and one byte per element (with the rare larger code listed apart) or the plain copy is smaller.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Record {
    /// `(index, original bits)` of each element the subtraction gets wrong.
    Sparse(Vec<(u32, u32)>),
    /// For every element, the original's position minus the subtraction's when it fits a byte (else 0, and the
    /// element's `(index, original bits)` is in `escapes`).
    Dense { codes: Vec<i8>, escapes: Vec<(u32, u32)> },
    /// The same with 16-bit codes.
    Wide { codes: Vec<i16>, escapes: Vec<(u32, u32)> },
    /// The original weights' bytes (little-endian, the dtype's width): nothing is subtracted to remove it.
    Copy(Vec<u8>),
}

/// An `(index, original bits)` entry of a record.
const ENTRY: usize = std::mem::size_of::<(u32, u32)>();

impl Record {
    /// Bytes this record holds.
    fn bytes(&self) -> usize {
        match self {
            Self::Sparse(list) => list.len() * ENTRY,
            Self::Dense { codes, escapes } => codes.len() + escapes.len() * ENTRY,
            Self::Wide { codes, escapes } => codes.len() * 2 + escapes.len() * ENTRY,
            Self::Copy(bytes) => bytes.len(),
        }
    }
}

/// A weight's element type, for adding an f32 update in place and rounding once, and for reading and writing
/// its bits.
trait WeightElement: burn::tensor::Element + Copy {
    /// Bytes of one element.
    const BYTES: usize;
    /// The largest finite value, for messages.
    const MAX: f32;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
    fn bits(self) -> u32;
    fn from_bits(bits: u32) -> Self;
    fn is_finite(self) -> bool {
        self.to_f32().is_finite()
    }
}

impl WeightElement for f32 {
    const BYTES: usize = 4;
    const MAX: f32 = f32::MAX;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn from_bits(bits: u32) -> Self {
        f32::from_bits(bits)
    }
}

impl WeightElement for bf16 {
    const BYTES: usize = 2;
    const MAX: f32 = 3.389_531_4e38;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
    fn from_bits(bits: u32) -> Self {
        // Only the low 16 bits are a bf16's; records keep exactly those.
        bf16::from_bits(bits as u16)
    }
}

impl WeightElement for f16 {
    const BYTES: usize = 2;
    const MAX: f32 = 65504.0;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
    fn from_bits(bits: u32) -> Self {
        // Only the low 16 bits are an f16's; records keep exactly those.
        f16::from_bits(bits as u16)
    }
}

/// The position of the value with these bits among all values of `E`, in order: `-0` just below `+0`, each
/// negative value below its smaller magnitudes. Two positions' difference counts the representable values between
/// them, small for two nearby values even across zero.
fn position<E: WeightElement>(bits: u32) -> i64 {
    let sign = 1u32 << (8 * E::BYTES - 1);
    if bits & sign == 0 { i64::from(bits) } else { -i64::from(bits & !sign) - 1 }
}

/// The bits at `position` ([`position`]'s inverse).
fn bits_at<E: WeightElement>(position: i64) -> u32 {
    let sign = 1u32 << (8 * E::BYTES - 1);
    // A position of `E` lies within `E`'s width, so its magnitude fits the bits below the sign.
    if position >= 0 { position as u32 } else { (-(position + 1)) as u32 | sign }
}

/// What a first pass over a layer finds before anything is written: how large each record would be, and how
/// many of the fused weights would not be finite.
#[derive(Debug, Clone, Copy, Default)]
struct Survey {
    /// Elements `(w + d) - d` gets wrong.
    wrong: usize,
    /// Of those, codes that need more than a byte.
    beyond_byte: usize,
    /// And more than 16 bits.
    beyond_word: usize,
    /// Elements finite before and infinite or NaN once fused.
    not_finite: usize,
    /// The update's largest magnitude (infinite where it overflowed f32).
    largest_update: f32,
}

/// `w + d` rounded once to `E`, and what subtracting `d` again gets wrong: the original's position minus the
/// subtraction's.
fn fused_and_code<E: WeightElement>(w: E, d: f32) -> (E, i64) {
    let fused = E::from_f32(w.to_f32() + d);
    let back = E::from_f32(fused.to_f32() - d);
    (fused, position::<E>(w.bits()) - position::<E>(back.bits()))
}

fn survey<E: WeightElement>(weights: &[E], delta: &[f32]) -> Survey {
    let mut survey = Survey::default();
    for (w, d) in weights.iter().zip(delta) {
        survey.largest_update = survey.largest_update.max(d.abs());
        let (fused, code) = fused_and_code(*w, *d);
        if w.is_finite() && !fused.is_finite() {
            survey.not_finite += 1;
        }
        if code != 0 {
            survey.wrong += 1;
            survey.beyond_byte += usize::from(i8::try_from(code).is_err());
            survey.beyond_word += usize::from(i16::try_from(code).is_err());
        }
    }
    survey
}

/// Which [`Record`] a layer keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecordKind {
    Sparse,
    Dense,
    Wide,
    Copy,
}

/// The smallest record for what `survey` found over `n` elements, and its bytes (ties go to the first of the
/// list, byte codes, the plain copy and 16-bit codes).
fn smallest_record<E: WeightElement>(survey: &Survey, n: usize) -> (RecordKind, usize) {
    let copy = (RecordKind::Copy, n * E::BYTES);
    // The other records index elements with a u32; a layer past that (no Z-Image layer: its largest has 39 M
    // elements) keeps the copy.
    if u32::try_from(n).is_err() {
        return copy;
    }
    let sizes = [
        (RecordKind::Sparse, survey.wrong * ENTRY),
        (RecordKind::Dense, n + survey.beyond_byte * ENTRY),
        copy,
        (RecordKind::Wide, 2 * n + survey.beyond_word * ENTRY),
    ];
    sizes.into_iter().min_by_key(|(_, bytes)| *bytes).unwrap_or(copy)
}

/// The second pass: adds `delta` to `weights` in place, each element rounded once, and fills the record of
/// `kind` (from [`smallest_record`]).
fn fuse_in_place<E: WeightElement>(weights: &mut [E], delta: &[f32], kind: RecordKind) -> Record {
    // `smallest_record` chose a copy for a layer whose indices do not fit a u32.
    let entry = |i: usize, w: E| (i as u32, w.bits());
    match kind {
        RecordKind::Copy => {
            let original = weights.iter().flat_map(|w| w.bits().to_le_bytes().into_iter().take(E::BYTES)).collect();
            for (w, d) in weights.iter_mut().zip(delta) {
                *w = E::from_f32(w.to_f32() + d);
            }
            Record::Copy(original)
        }
        RecordKind::Sparse => {
            let mut list = Vec::new();
            for (i, (w, d)) in weights.iter_mut().zip(delta).enumerate() {
                let (fused, code) = fused_and_code(*w, *d);
                if code != 0 {
                    list.push(entry(i, *w));
                }
                *w = fused;
            }
            Record::Sparse(list)
        }
        RecordKind::Dense => {
            let (mut codes, mut escapes) = (vec![0i8; weights.len()], Vec::new());
            for (i, (w, d)) in weights.iter_mut().zip(delta).enumerate() {
                let (fused, code) = fused_and_code(*w, *d);
                match i8::try_from(code) {
                    Ok(code) => codes[i] = code,
                    Err(_) => escapes.push(entry(i, *w)),
                }
                *w = fused;
            }
            Record::Dense { codes, escapes }
        }
        RecordKind::Wide => {
            let (mut codes, mut escapes) = (vec![0i16; weights.len()], Vec::new());
            for (i, (w, d)) in weights.iter_mut().zip(delta).enumerate() {
                let (fused, code) = fused_and_code(*w, *d);
                match i16::try_from(code) {
                    Ok(code) => codes[i] = code,
                    Err(_) => escapes.push(entry(i, *w)),
                }
                *w = fused;
            }
            Record::Wide { codes, escapes }
        }
    }
}

/// Adds `delta` to `weights` with no record: what [`fuse_in_place`] writes, for putting back a fuse that was
/// removed (the same base and the same update give the same bits).
fn add_in_place<E: WeightElement>(weights: &mut [E], delta: &[f32]) {
    for (w, d) in weights.iter_mut().zip(delta) {
        *w = E::from_f32(w.to_f32() + d);
    }
}

/// Gives the original weights back from the fused ones: subtracts `delta` and applies `record`'s corrections, or
/// copies the original bytes (`delta` is then not needed, and `None`).
fn unfuse_in_place<E: WeightElement>(weights: &mut [E], delta: Option<&[f32]>, record: &Record) {
    if let Record::Copy(bytes) = record {
        for (w, original) in weights.iter_mut().zip(bytes.chunks_exact(E::BYTES)) {
            let mut le = [0u8; 4];
            le[..E::BYTES].copy_from_slice(original);
            *w = E::from_bits(u32::from_le_bytes(le));
        }
        return;
    }
    for (w, d) in weights.iter_mut().zip(delta.unwrap_or_default()) {
        *w = E::from_f32(w.to_f32() - d);
    }
    let put = |weights: &mut [E], list: &[(u32, u32)]| {
        for (i, bits) in list {
            weights[*i as usize] = E::from_bits(*bits);
        }
    };
    match record {
        Record::Sparse(list) => put(weights, list),
        Record::Dense { codes, escapes } => {
            apply_codes(weights, codes);
            put(weights, escapes);
        }
        Record::Wide { codes, escapes } => {
            apply_codes(weights, codes);
            put(weights, escapes);
        }
        Record::Copy(_) => {}
    }
}

/// Moves each element by its code (the original's position minus the subtraction's).
fn apply_codes<E: WeightElement, C: Copy + Into<i64>>(weights: &mut [E], codes: &[C]) {
    for (w, code) in weights.iter_mut().zip(codes) {
        let code: i64 = (*code).into();
        if code != 0 {
            *w = E::from_bits(bits_at::<E>(position::<E>(w.bits()) + code));
        }
    }
}

/// A layer's weight as its element type, for the three float dtypes a fused update takes; anything else was
/// refused by [`check_mode`] before a weight was touched.
macro_rules! with_weights {
    ($data:expr, |$weights:ident: $elem:ident| $body:expr) => {
        match $data.dtype() {
            DType::F32 => {
                type $elem = f32;
                let $weights = $data.as_mut_slice::<f32>().expect("an f32 weight is a slice of f32");
                $body
            }
            DType::BF16 => {
                type $elem = bf16;
                let $weights = $data.as_mut_slice::<bf16>().expect("a bf16 weight is a slice of bf16");
                $body
            }
            DType::F16 => {
                type $elem = f16;
                let $weights = $data.as_mut_slice::<f16>().expect("an f16 weight is a slice of f16");
                $body
            }
            other => unreachable!("check_mode refuses a fused update of a {other:?} weight"),
        }
    };
}

/// A layer with a fused update: what removing it needs (the factors and a record, never more than a plain copy
/// of the original weights).
#[derive(Debug, Clone)]
struct FusedLayer {
    target: LoraTarget,
    path: String,
    updates: Vec<ResolvedUpdate>,
    record: Record,
    /// The weight's elements.
    elements: usize,
    /// Bytes of one element of the weight.
    element_bytes: usize,
    /// Elements the subtraction alone gets wrong.
    corrected: usize,
}

/// One fused layer's removal record, as [`AppliedLoras::records`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovalRecord {
    /// The component.
    pub target: LoraTarget,
    /// The layer's path.
    pub layer: String,
    /// The weight's elements.
    pub elements: usize,
    /// Bytes the record keeps.
    pub bytes: usize,
    /// Bytes of a plain copy of the layer's original weights, which `bytes` never exceeds.
    pub copy_bytes: usize,
    /// Whether the record is that plain copy (else it is corrections to the subtraction).
    pub plain_copy: bool,
}

/// A fuse [`apply`] refused: the first layer whose fused weights would not all be finite. Nothing of it was
/// written, and the layers fused before it in the same call were removed again.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraRefusal {
    component: &'static str,
    layer: String,
    /// The files and scales that update the layer.
    files: String,
    not_finite: usize,
    elements: usize,
    dtype: DType,
    largest_update: f32,
    dtype_max: f32,
}

impl LoraRefusal {
    /// The typed error it is ([`Error::LoraNotFinite`]).
    pub fn to_error(&self) -> Error {
        let dtype = format!("{:?}", self.dtype).to_lowercase();
        Error::LoraNotFinite {
            files: self.files.clone(),
            component: self.component,
            layer: self.layer.clone(),
            reason: format!(
                "makes {} of its {} {dtype} weights infinite or NaN (the update reaches {}, and {dtype} holds up to \
                 {})",
                self.not_finite,
                self.elements,
                number(self.largest_update),
                number(self.dtype_max)
            ),
        }
    }
}

/// The files and scales of `updates`, for messages: `a.safetensors at scale 0.8 and b.safetensors at scale 1`.
fn sources(updates: &[ResolvedUpdate]) -> String {
    let mut seen: Vec<(&Path, f32)> = Vec::new();
    for update in updates {
        let source = (update.file.as_path(), update.scale);
        if !seen.contains(&source) {
            seen.push(source);
        }
    }
    let each: Vec<String> =
        seen.iter().map(|(file, scale)| format!("{} at scale {}", file.display(), number(*scale))).collect();
    each.join(" and ")
}

/// What a pipeline has applied: the files, the mode and what undoing it needs.
#[derive(Debug, Clone, Default)]
pub struct AppliedLoras {
    specs: Vec<LoraSpec>,
    mode: LoraMode,
    fused: Vec<FusedLayer>,
    /// Run-time updates by component and layer, kept so that a refused change can put them back.
    runtime: BTreeMap<LoraTarget, BTreeMap<String, Vec<ResolvedUpdate>>>,
    skipped: Vec<String>,
    refused: Option<LoraRefusal>,
    /// Whether [`drop_removal`](Self::drop_removal) gave back what removal needs: the fused LoRAs then stay.
    removal_dropped: bool,
}

impl AppliedLoras {
    /// A record for `specs` applied in `mode`, nothing applied yet.
    pub fn new(specs: Vec<LoraSpec>, mode: LoraMode, skipped: Vec<String>) -> Self {
        Self { specs, mode, skipped, ..Self::default() }
    }

    /// The files applied, with their scales (empty: none).
    pub fn specs(&self) -> &[LoraSpec] {
        &self.specs
    }

    /// How they were applied.
    pub fn mode(&self) -> LoraMode {
        self.mode
    }

    /// Layers updated, per component.
    pub fn layers(&self, target: LoraTarget) -> usize {
        match self.mode {
            LoraMode::Fused => self.fused.iter().filter(|l| l.target == target).count(),
            LoraMode::Runtime => self.runtime.get(&target).map_or(0, BTreeMap::len),
        }
    }

    /// Weight elements whose fused value minus the update is not the original (fused mode), in all: each is
    /// put right from a record when the LoRA is removed.
    pub fn corrections(&self) -> usize {
        self.fused.iter().map(|l| l.corrected).sum()
    }

    /// Bytes kept for a bit-exact removal beside the factors (fused mode): each layer's record, corrections or a
    /// plain copy of its original weights, whichever is smaller.
    pub fn correction_bytes(&self) -> usize {
        self.fused.iter().map(|l| l.record.bytes()).sum()
    }

    /// Gives back what removing the fused LoRAs needs (each layer's removal record and its factors), for a caller
    /// that never changes them again, such as a run that applies its LoRAs once; returns the records' bytes.
    /// Afterwards [`check_removal`] refuses any change of LoRAs, with the fix (load the checkpoint again).
    pub fn drop_removal(&mut self) -> usize {
        let mut freed = 0;
        for layer in &mut self.fused {
            // The factors are shared between the layers a fused `qkv` updates, so only the records are counted.
            freed += layer.record.bytes();
            layer.record = Record::Sparse(Vec::new());
            layer.updates = Vec::new();
        }
        self.removal_dropped = !self.fused.is_empty();
        freed
    }

    /// Each fused layer's removal record.
    pub fn records(&self) -> Vec<RemovalRecord> {
        self.fused
            .iter()
            .map(|l| RemovalRecord {
                target: l.target,
                layer: l.path.clone(),
                elements: l.elements,
                bytes: l.record.bytes(),
                copy_bytes: l.elements * l.element_bytes,
                plain_copy: matches!(l.record, Record::Copy(_)),
            })
            .collect()
    }

    /// Elements of the weights the fused updates changed, in all (fused mode).
    pub fn fused_elements(&self) -> usize {
        self.fused.iter().map(|l| l.elements).sum()
    }

    /// File keys skipped (layers the model leaves out by design).
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// A fuse [`apply`] refused because a fused weight would not be finite: then none of these LoRAs is applied
    /// to the model it refused in, and no further [`apply`] with this record changes anything. [`swap`] turns it
    /// into an error and puts the LoRAs before back.
    pub fn refused(&self) -> Option<&LoraRefusal> {
        self.refused.as_ref()
    }

    /// Whether anything is applied.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

/// Fuses the updates of one component into `model`, each layer surveyed before it is written. At the first layer
/// whose fused weights would not all be finite, that layer is left as it is, the layers fused before it in this
/// call are removed again (bit for bit), and the refusal is returned.
fn fuse_layers<M: LinearLayers>(
    model: &mut M,
    target: LoraTarget,
    updates: &BTreeMap<String, Vec<ResolvedUpdate>>,
) -> std::result::Result<Vec<FusedLayer>, LoraRefusal> {
    let mut linears = model.linears_mut();
    let mut fused: Vec<(usize, FusedLayer)> = Vec::new();
    for index in 0..linears.len() {
        let (path, linear) = &mut linears[index];
        let Some(updates) = updates.get(path.as_str()) else { continue };
        let outcome = rewrite_weight(linear, |data, d_out, d_in| {
            let delta = delta(updates, d_out, d_in);
            let dtype = data.dtype();
            with_weights!(data, |weights: E| {
                let survey = survey(weights, &delta);
                if survey.not_finite > 0 {
                    return Err((survey, dtype, <E as WeightElement>::MAX));
                }
                let (kind, _) = smallest_record::<E>(&survey, weights.len());
                Ok((fuse_in_place(weights, &delta, kind), survey.wrong, <E as WeightElement>::BYTES))
            })
        });
        match outcome {
            Ok((record, corrected, element_bytes)) => {
                let elements = linear.d_out() * linear.d_in();
                let layer = FusedLayer {
                    target,
                    path: path.clone(),
                    updates: updates.clone(),
                    record,
                    elements,
                    element_bytes,
                    corrected,
                };
                fused.push((index, layer));
            }
            Err((survey, dtype, dtype_max)) => {
                let refusal = LoraRefusal {
                    component: target.component(),
                    layer: path.clone(),
                    files: sources(updates),
                    not_finite: survey.not_finite,
                    elements: linear.d_out() * linear.d_in(),
                    dtype,
                    largest_update: survey.largest_update,
                    dtype_max,
                };
                for (index, layer) in fused.iter().rev() {
                    unfuse(linears[*index].1, layer);
                }
                return Err(refusal);
            }
        }
    }
    Ok(fused.into_iter().map(|(_, layer)| layer).collect())
}

/// Removes one layer's fused update: the original weights, bit for bit.
fn unfuse(linear: &mut PtLinear, layer: &FusedLayer) {
    rewrite_weight(linear, |data, d_out, d_in| {
        // A plain copy needs no update to be removed.
        let delta = (!matches!(layer.record, Record::Copy(_))).then(|| delta(&layer.updates, d_out, d_in));
        with_weights!(data, |weights: E| unfuse_in_place::<E>(weights, delta.as_deref(), &layer.record))
    });
}

/// Adds run-time low-rank terms for `updates` to `linear`.
fn push_terms(linear: &mut PtLinear, updates: &[ResolvedUpdate]) {
    // Neither is read from the weight: one bound to its checkpoint file stays unread until its group uploads.
    let device = linear.weight.lazy_device();
    let dtype = match updates.first() {
        Some(update) if !linear.weight.is_initialized() => update.layer_dtype,
        _ => linear.dtype(),
    };
    let (d_out, d_in) = (linear.d_out(), linear.d_in());
    for update in updates {
        let factor = |values: &Vec<f32>, shape: [usize; 2]| {
            Param::from_tensor(
                Tensor::<2>::from_data(TensorData::new(values.clone(), shape), (&device, DType::F32)).cast(dtype),
            )
        };
        linear.lora.push(LowRank {
            down: factor(&update.down, [update.rank, d_in]),
            up: factor(&update.up, [d_out, update.rank]),
            coefficient: f64::from(update.coefficient),
        });
    }
}

/// Reads `linear`'s weight to the host, lets `f` rewrite it in place, and puts it back on its device under the
/// same parameter id.
fn rewrite_weight<T>(linear: &mut PtLinear, f: impl FnOnce(&mut TensorData, usize, usize) -> T) -> T {
    let (d_out, d_in) = (linear.d_out(), linear.d_in());
    let device = linear.weight.val().device();
    let placeholder = Param::from_tensor(Tensor::<2>::empty([0, 0], &device));
    let weight = std::mem::replace(&mut linear.weight, placeholder);
    let id = weight.id;
    let mut data = weight.into_value().into_data();
    let value = f(&mut data, d_out, d_in);
    let dtype = data.dtype();
    linear.weight = Param::initialized(id, Tensor::<2>::from_data(data, (&device, dtype)));
    value
}

/// Applies the updates of `target` in `resolved` to `model` in `applied`'s mode, recording into `applied`: fused
/// into the weights in place (no second copy), or added as run-time terms.
///
/// Prefer [`swap`], which returns a refused fuse as an error. This one cannot fail: when a fused weight would not
/// be finite, it leaves `model` as it found it and records the refusal ([`AppliedLoras::refused`]); a record
/// that holds a refusal applies nothing more.
pub fn apply<M: LinearLayers>(model: &mut M, target: LoraTarget, resolved: &ResolvedLoras, applied: &mut AppliedLoras) {
    if applied.refused.is_some() {
        return;
    }
    let Some(updates) = resolved.updates.get(&target) else { return };
    match applied.mode {
        LoraMode::Fused => match fuse_layers(model, target, updates) {
            Ok(layers) => applied.fused.extend(layers),
            Err(refusal) => applied.refused = Some(refusal),
        },
        LoraMode::Runtime => {
            for (path, linear) in model.linears_mut() {
                if let Some(updates) = updates.get(&path) {
                    push_terms(linear, updates);
                }
            }
            applied.runtime.insert(target, updates.clone());
        }
    }
}

/// Replaces what `old` applied to one model by `resolved`, in `applied`'s mode, recording into `applied`.
///
/// Every fused layer is checked: when one would hold a weight that is not finite (finite factors whose sum
/// leaves the dtype's range, at an absurd scale), nothing of it is written, the layers fused before it are
/// removed again and `old` is put back, so the model holds, bit for bit, what it held before the call; the error
/// names the layer, the files and their scales ([`Error::LoraNotFinite`]).
pub fn swap<M: LinearLayers>(
    model: &mut M,
    target: LoraTarget,
    old: &AppliedLoras,
    resolved: &ResolvedLoras,
    applied: &mut AppliedLoras,
) -> Result<()> {
    remove(model, target, old);
    apply(model, target, resolved, applied);
    match applied.refused.take() {
        None => Ok(()),
        Some(refusal) => {
            restore(model, target, old);
            Err(refusal.to_error())
        }
    }
}

/// Puts `old` back into one model after [`swap`] replaced it by `applied`: for a pipeline whose other model
/// refused its swap. Bit for bit: the same base and the same updates give the same fused weights.
pub fn revert<M: LinearLayers>(model: &mut M, target: LoraTarget, applied: &AppliedLoras, old: &AppliedLoras) {
    remove(model, target, applied);
    restore(model, target, old);
}

/// Applies again to one model what `applied` held for `target`, after it was removed.
fn restore<M: LinearLayers>(model: &mut M, target: LoraTarget, applied: &AppliedLoras) {
    let fused: BTreeMap<&str, &FusedLayer> =
        applied.fused.iter().filter(|l| l.target == target).map(|l| (l.path.as_str(), l)).collect();
    let runtime = applied.runtime.get(&target);
    for (path, linear) in model.linears_mut() {
        if let Some(layer) = fused.get(path.as_str()) {
            rewrite_weight(linear, |data, d_out, d_in| {
                let delta = delta(&layer.updates, d_out, d_in);
                with_weights!(data, |weights: E| add_in_place::<E>(weights, &delta))
            });
        }
        if let Some(updates) = runtime.and_then(|r| r.get(&path)) {
            push_terms(linear, updates);
        }
    }
}

/// Removes from one model what `applied` holds for `target`: fused updates taken out bit for bit, run-time terms
/// dropped.
pub fn remove<M: LinearLayers>(model: &mut M, target: LoraTarget, applied: &AppliedLoras) {
    let fused: BTreeMap<&str, &FusedLayer> =
        applied.fused.iter().filter(|l| l.target == target).map(|l| (l.path.as_str(), l)).collect();
    let runtime = applied.runtime.get(&target);
    for (path, linear) in model.linears_mut() {
        if let Some(layer) = fused.get(path.as_str()) {
            unfuse(linear, layer);
        }
        if runtime.is_some_and(|r| r.contains_key(&path)) {
            linear.lora.clear();
        }
    }
}

/// Whether `value` stays finite once cast to `dtype` (f16 holds up to 65504; other dtypes are not checked here).
fn finite_in(dtype: DType, value: f32) -> bool {
    match dtype {
        DType::F16 => f16::from_f32(value).is_finite(),
        DType::BF16 => bf16::from_f32(value).is_finite(),
        _ => value.is_finite(),
    }
}

/// Checks that `resolved` can be applied in `mode`: a fused update needs a float weight; a run-time term is cast
/// to its layer's dtype, which must hold its factors.
pub fn check_mode(resolved: &ResolvedLoras, mode: LoraMode, layers: &[(LoraTarget, &ComponentLayers)]) -> Result<()> {
    for (target, component) in layers {
        for (path, updates) in resolved.updates.get(target).into_iter().flatten() {
            let Some(place) = component.places.get(path) else { continue };
            if mode == LoraMode::Fused && !matches!(place.dtype, DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::LoraUnsupported {
                    reason: format!(
                        "the {}'s {path} is {:?}, and a fused update needs a float weight; apply the LoRA before \
                         quantizing, or apply it at run time (--lora-mode runtime)",
                        target.component(),
                        place.dtype
                    ),
                });
            }
            if mode != LoraMode::Runtime {
                continue;
            }
            for update in updates {
                let Some(value) = update.down.iter().chain(update.up.iter()).find(|v| !finite_in(place.dtype, **v))
                else {
                    continue;
                };
                return Err(Error::LoraValue {
                    path: update.file.as_ref().clone(),
                    what: format!("the factors of the {}'s {path}", target.component()),
                    reason: format!(
                        "hold {}, which the layer's {:?} weights cannot hold, and run-time terms are cast to them; \
                         apply the LoRA fused (--lora-mode fused), or load the model in a wider dtype",
                        number(*value),
                        place.dtype
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Checks that what `applied` fused can be removed: each of its layers still has a float weight (a model
/// quantized after a LoRA was fused into it keeps that LoRA).
pub fn check_removal(applied: &AppliedLoras, layers: &[(LoraTarget, &ComponentLayers)]) -> Result<()> {
    if applied.removal_dropped {
        return Err(Error::LoraUnsupported {
            reason: "the LoRAs applied cannot be removed or changed: their removal record was given back to save \
                     host memory (AppliedLoras::drop_removal); load the checkpoint again to change its LoRAs"
                .into(),
        });
    }
    for layer in &applied.fused {
        let place = layers.iter().find(|(t, _)| *t == layer.target).and_then(|(_, c)| c.places.get(&layer.path));
        if let Some(place) = place.filter(|p| !matches!(p.dtype, DType::F32 | DType::BF16 | DType::F16)) {
            return Err(Error::LoraUnsupported {
                reason: format!(
                    "the LoRA fused into the {}'s {} cannot be removed: the weight was quantized since ({:?}); \
                     load the checkpoint again to change its LoRAs",
                    layer.target.component(),
                    layer.path,
                    place.dtype
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_reads_a_file_and_an_optional_scale() {
        assert_eq!(LoraSpec::parse("a.safetensors").unwrap(), LoraSpec::new("a.safetensors", 1.0));
        assert_eq!(LoraSpec::parse("a.safetensors:0.5").unwrap(), LoraSpec::new("a.safetensors", 0.5));
        assert_eq!(LoraSpec::parse("dir:x/a.safetensors").unwrap(), LoraSpec::new("dir:x/a.safetensors", 1.0));
        assert_eq!(LoraSpec::parse("a:-1").unwrap(), LoraSpec::new("a", -1.0));
        assert_eq!(LoraSpec::parse("a:100").unwrap(), LoraSpec::new("a", 100.0));
        assert_eq!(LoraSpec::parse("a:-100").unwrap(), LoraSpec::new("a", -100.0));
        for bad in ["a:inf", "a:NaN", "a:1e30", "a:100.5", "a:-1e4", ""] {
            let error = LoraSpec::parse(bad).expect_err(bad).to_string();
            println!("{bad:?}: {error}");
            assert!(error.starts_with("invalid lora: "), "{error}");
        }
        assert!(LoraSpec::parse("a:1e30").unwrap_err().to_string().contains("the scale 1e30 is outside [-100, 100]"));
    }

    #[test]
    fn keys_of_every_layout_parse_and_others_do_not() {
        let peft = parse_key("transformer.layers.0.attention.to_q.lora_A.weight").unwrap();
        assert_eq!(
            (peft.target, peft.role, peft.layout),
            (LoraTarget::Transformer, Role::Down, Some(LoraLayout::Peft))
        );
        assert_eq!(peft.name, ModuleName::Dotted("layers.0.attention.to_q".into()));
        let kohya = parse_key("lora_unet_layers_0_attention_qkv.lora_up.weight").unwrap();
        assert_eq!((kohya.role, kohya.layout), (Role::Up, Some(LoraLayout::Kohya)));
        assert_eq!(kohya.name, ModuleName::Underscored("layers_0_attention_qkv".into()));
        let te = parse_key("text_encoder.layers.1.mlp.up_proj.lora_B.weight").unwrap();
        assert_eq!(te.target, LoraTarget::TextEncoder);
        // ComfyUI's trainer: the original tree's dotted names under `diffusion_model.`, Kohya's factor names.
        let comfy = parse_key("diffusion_model.layers.0.attention.out.lora_down.weight").unwrap();
        let expected = (LoraTarget::Transformer, Role::Down, Some(LoraLayout::Kohya));
        assert_eq!((comfy.target, comfy.role, comfy.layout), expected);
        assert_eq!(comfy.name, ModuleName::Dotted("layers.0.attention.out".into()));
        // No prefix: the transformer's own names.
        let bare = parse_key("layers.1.attention.qkv.alpha").unwrap();
        assert_eq!((bare.target, bare.role, bare.layout), (LoraTarget::Transformer, Role::Alpha, None));
        assert_eq!(bare.name, ModuleName::Dotted("layers.1.attention.qkv".into()));
        assert!(parse_key("transformer.layers.0.attention.to_q.weight").is_none(), "a base weight, no factor");
        assert!(parse_key(".lora_A.weight").is_none(), "no module");
        // A name of another model parses, and resolution refuses it (it names no layer).
        assert_eq!(parse_key("unet.down.lora_A.weight").unwrap().name, ModuleName::Dotted("unet.down".into()));
    }

    /// A transformer of the tiny checkpoint's shape; its parameters are lazy, so nothing is allocated.
    fn tiny_transformer() -> ZImageTransformer2DModel {
        let config = crate::config::TransformerConfig {
            dim: 64,
            n_heads: 2,
            n_kv_heads: 2,
            n_layers: 2,
            n_refiner_layers: 1,
            cap_feat_dim: 32,
            ..crate::config::TransformerConfig::z_image_turbo()
        };
        ZImageTransformer2DModel::new(&config, &burn::tensor::Device::flex())
    }

    #[test]
    fn original_tree_and_checkpoint_names_resolve_to_our_layers() {
        let layers = ComponentLayers::transformer(&tiny_transformer());
        let dotted = |name: &str| layers.dotted(&ModuleName::Dotted(name.into()));
        let underscored = |name: &str| layers.dotted(&ModuleName::Underscored(name.into()));
        for (name, path) in [
            ("layers.1.attention.out", "layers.1.attention.to_out.0"),
            ("noise_refiner.0.attention.out", "noise_refiner.0.attention.to_out.0"),
            ("context_refiner.0.attention.to_out.0", "context_refiner.0.attention.to_out.0"),
            ("layers.0.attention.qkv", "layers.0.attention.qkv"),
            ("layers.0.feed_forward.w2", "layers.0.feed_forward.w2"),
            ("layers.0.adaLN_modulation.0", "layers.0.adaLN_modulation.0"),
            ("all_x_embedder.2-1", "x_embedder"),
            ("all_final_layer.2-1.adaLN_modulation.1", "final_layer.adaLN_modulation.1"),
            ("final_layer.linear", "final_layer.linear"),
            ("t_embedder.mlp.2", "t_embedder.mlp.2"),
            ("cap_embedder.1", "cap_embedder.1"),
        ] {
            assert_eq!(dotted(name).as_deref(), Ok(path), "{name}");
        }
        for (name, path) in [
            ("layers_1_attention_out", "layers.1.attention.to_out.0"),
            ("layers_1_attention_qkv", "layers.1.attention.qkv"),
            ("all_x_embedder_2-1", "x_embedder"),
            ("all_final_layer_2-1_linear", "final_layer.linear"),
            ("x_embedder", "x_embedder"),
            ("context_refiner_0_feed_forward_w3", "context_refiner.0.feed_forward.w3"),
        ] {
            assert_eq!(underscored(name).as_deref(), Ok(path), "{name}");
        }
        assert!(underscored("layers_9_attention_to_q").is_err());
    }

    /// A seeded generator of numbers spread like a normal distribution of deviation 1 (the sum of three uniform
    /// numbers, scaled).
    fn normal(seed: u64) -> impl FnMut() -> f32 {
        let mut state = seed;
        move || {
            let mut uniform = || {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            };
            uniform() + uniform() + uniform()
        }
    }

    /// Fuses `delta` into a copy of `base` through the two passes, removes it again, checks the bits came back,
    /// and returns the record.
    fn fuse_and_remove<E: WeightElement + PartialEq + std::fmt::Debug>(base: &[E], delta: &[f32]) -> Record {
        let survey = survey(base, delta);
        assert_eq!(survey.not_finite, 0);
        let (kind, bytes) = smallest_record::<E>(&survey, base.len());
        let mut weights = base.to_vec();
        let record = fuse_in_place(&mut weights, delta, kind);
        assert_eq!(record.bytes(), bytes, "the survey sized the record it chose");
        assert_ne!(weights, base, "the update changed the weights");
        unfuse_in_place(&mut weights, Some(delta), &record);
        assert!(weights.iter().zip(base).all(|(a, b)| a.bits() == b.bits()), "restored bit for bit");
        record
    }

    #[test]
    fn the_record_never_exceeds_a_plain_copy_and_restores_bit_for_bit_at_every_update_size() {
        // Weights of deviation 0.02 (as the model's), updates of deviation `ratio` times that: from a trained
        // LoRA's (a thousandth) to updates that drown the weights, where only the plain copy is small enough.
        let n = 64 * 1024;
        let mut next = normal(11);
        let base: Vec<f32> = (0..n).map(|_| 0.02 * next() / 3f32.sqrt()).collect();
        let noise: Vec<f32> = (0..n).map(|_| next() / 3f32.sqrt()).collect();
        let mut kinds = std::collections::BTreeSet::new();
        for ratio in [1e-3, 1e-2, 1e-1, 0.5, 1.0, 10.0, 1e3] {
            let delta: Vec<f32> = noise.iter().map(|d| d * 0.02 * ratio).collect();
            let f32_record = fuse_and_remove(&base, &delta);
            let bf16_base: Vec<bf16> = base.iter().map(|v| bf16::from_f32(*v)).collect();
            let bf16_record = fuse_and_remove(&bf16_base, &delta);
            let f16_base: Vec<f16> = base.iter().map(|v| f16::from_f32(*v)).collect();
            let f16_record = fuse_and_remove(&f16_base, &delta);
            for (dtype, record, width) in [("f32", &f32_record, 4), ("bf16", &bf16_record, 2), ("f16", &f16_record, 2)]
            {
                let per_element = record.bytes() as f64 / n as f64;
                let kind = match record {
                    Record::Sparse(_) => "list",
                    Record::Dense { .. } => "bytes",
                    Record::Wide { .. } => "words",
                    Record::Copy(_) => "copy",
                };
                println!("update/weight {ratio}: {dtype} keeps {per_element:.3} bytes an element ({kind})");
                assert!(record.bytes() <= width * n, "{dtype} at {ratio}: never more than a plain copy");
                kinds.insert(kind);
            }
        }
        assert!(kinds.contains("copy") && kinds.len() > 1, "both representations are exercised: {kinds:?}");
    }

    #[test]
    fn a_large_update_beside_small_weights_is_removed_bit_for_bit_in_every_float_dtype() {
        // Values and updates of very different sizes, so rounding loses bits of the sum.
        let (d_out, d_in, rank) = (64, 48, 3);
        let mut next = normal(7);
        let down: Vec<f32> = (0..rank * d_in).map(|_| next()).collect();
        let up: Vec<f32> = (0..d_out * rank).map(|_| next() * 3.0).collect();
        let update = ResolvedUpdate {
            path: "x".into(),
            down: Arc::new(down),
            up: Arc::new(up),
            rank,
            coefficient: 0.37,
            file: Arc::new(PathBuf::from("x.safetensors")),
            scale: 1.0,
            layer_dtype: DType::F32,
        };
        let delta = delta(std::slice::from_ref(&update), d_out, d_in);
        let base: Vec<f32> = (0..d_out * d_in).map(|i| next() * 10f32.powi((i % 7) as i32 - 3)).collect();
        fuse_and_remove(&base, &delta);
        fuse_and_remove(&base.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>(), &delta);
        fuse_and_remove(&base.iter().map(|v| f16::from_f32(*v)).collect::<Vec<_>>(), &delta);
        // A small update beside the weight, as a trained LoRA's: a short list.
        let small: Vec<f32> = delta.iter().map(|d| d * 1e-3).collect();
        let record = fuse_and_remove(&base.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>(), &small);
        assert!(record.bytes() < base.len(), "a small update keeps under half a copy: {}", record.bytes());
    }

    #[test]
    fn a_fuse_that_would_leave_the_range_is_found_before_anything_is_written() {
        let base = [1.0f32, -2.0, 3.0];
        let survey = survey(&base, &[1.0, f32::INFINITY, 3e38]);
        assert_eq!(survey.not_finite, 1, "the infinite update; 3e38 + 3 is still an f32");
        let halves = [f16::from_f32(1.0), f16::from_f32(60000.0)];
        let survey = super::survey(&halves, &[1.0, 10000.0]);
        assert_eq!((survey.not_finite, survey.largest_update), (1, 10000.0), "past f16's 65504");
        // A weight that was not finite before is not the update's doing.
        assert_eq!(super::survey(&[f32::NAN], &[1.0]).not_finite, 0);
    }

    #[test]
    fn positions_order_the_values_and_neighbour_across_zero() {
        let values = [-3.0f32, -1.0, -1e-30, -0.0, 0.0, 1e-30, 2.0];
        let positions: Vec<i64> = values.iter().map(|v| position::<f32>(v.to_bits())).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
        assert_eq!(position::<f32>(0f32.to_bits()) - position::<f32>((-0f32).to_bits()), 1);
        for v in values {
            assert_eq!(bits_at::<f32>(position::<f32>(v.to_bits())), v.to_bits());
            let h = bf16::from_f32(v);
            assert_eq!(bits_at::<bf16>(position::<bf16>(h.bits())), h.bits());
        }
        let tiny = bf16::from_bits(1);
        let minus_tiny = bf16::from_bits(0x8001);
        assert_eq!(position::<bf16>(tiny.bits()) - position::<bf16>(minus_tiny.bits()), 3, "-t, -0, +0, +t");
    }

    #[test]
    fn the_update_is_the_same_bits_whatever_the_threads_and_sums_up_times_down() {
        let update = ResolvedUpdate {
            path: "x".into(),
            down: Arc::new(vec![1.0, 2.0, 3.0, 4.0]),
            up: Arc::new(vec![1.0, 0.0, 0.5, 1.0, 0.0, 2.0]),
            rank: 2,
            coefficient: 2.0,
            file: Arc::new(PathBuf::from("x.safetensors")),
            scale: 1.0,
            layer_dtype: DType::F32,
        };
        // up [3, 2] · down [2, 2] times 2.
        assert_eq!(delta(std::slice::from_ref(&update), 3, 2), vec![2.0, 4.0, 7.0, 10.0, 12.0, 16.0]);
    }
}
