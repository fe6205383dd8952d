//! LoRA adapters for the transformer and the text encoder, under every offload route.
//!
//! A LoRA file adds `scale · alpha / rank · up · down` to the weight of some linear layers. This module reads the
//! two layouts Z-Image LoRAs are published in, checks every factor against the model before anything changes,
//! and applies them in one of two [`LoraMode`]s:
//!
//! - [`LoraMode::Fused`]: the update is added to the host copy of each weight, so every route (resident, auto
//!   offload, block and leaf group offload, the disk store) moves exactly the bytes it moves without a LoRA,
//!   and a content-keyed disk store re-keys by itself. Removing it restores the base weights **bit for bit**
//!   without keeping a second copy of them: the factors are kept, the update is recomputed in the same fixed
//!   order and subtracted, and the few elements where rounding made `(w + d) - d` differ from `w` are kept as
//!   `(index, original bits)` corrections, found when the update was added.
//! - [`LoraMode::Runtime`]: each update stays two small matrices, [`LowRank`] parameters of the layer
//!   ([`PtLinear::lora`]), so group offload moves them with the layer's group and the base weights are never
//!   touched; removing them is dropping them.
//!
//! Layouts read ([`LoraFile::read`]):
//!
//! - diffusers / PEFT (what `save_lora_weights` writes and what most Z-Image-Turbo LoRAs on the Hub use):
//!   `transformer.<module>.lora_A.weight` `[rank, in]` and `.lora_B.weight` `[out, rank]` (also with the prefix
//!   `diffusion_model.`, or with PEFT's adapter name `lora_A.default.weight`), `text_encoder.<module>...` for the
//!   Qwen3 text encoder; alpha from a `.alpha` scalar, else the file's `lora_adapter_metadata` (`lora_alpha`,
//!   `alpha_pattern`, `use_rslora`), else the rank (a scaling of 1, as diffusers assumes).
//! - Kohya / sd-scripts, on the original Z-Image module tree: `lora_unet_<module, dots as underscores>`
//!   `.lora_down.weight`, `.lora_up.weight` and `.alpha`, the attention's query, key and value as one fused
//!   `attention_qkv` module (its up matrix split by rows among `to_q`, `to_k`, `to_v`) and its output as
//!   `attention_out`; `lora_te_` for the text encoder. Underscored names are resolved against the model's own
//!   layer paths (an exact table, never a guess from splitting on `_`).
//!
//! Every problem is found before any weight changes: a key that names no layer, a factor whose shape does not
//! fit its layer, a down and an up of different ranks, a rank the metadata contradicts, DoRA files. Each error
//! names the file and the key ([`Error::LoraKey`], [`Error::LoraShape`], [`Error::LoraFile`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Tensor, TensorData, bf16, f16};

use crate::error::{Error, Result};
use crate::nn::{LowRank, PtLinear};
use crate::text_encoder::TextEncoder;
use crate::transformer::{KEY_REMAP, ZImageTransformer2DModel};

/// One LoRA file and the scale to apply it at: the CLI's `--lora FILE[:SCALE]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// The `.safetensors` file.
    pub path: PathBuf,
    /// The user's strength (diffusers' `adapter_weights`, ComfyUI's `strength_model`); 1 applies the LoRA as
    /// trained, 0 not at all.
    pub scale: f32,
}

impl LoraSpec {
    /// `path` at `scale`.
    pub fn new(path: impl Into<PathBuf>, scale: f32) -> Self {
        Self { path: path.into(), scale }
    }

    /// Parses `FILE` (scale 1) or `FILE:SCALE`. A suffix after the last `:` that is not a number is part of the
    /// file name; a scale that is not finite is refused.
    pub fn parse(text: &str) -> Result<Self> {
        let (path, scale) = match text.rsplit_once(':') {
            Some((path, scale)) if !path.is_empty() => match scale.trim().parse::<f32>() {
                Ok(scale) => (path, scale),
                Err(_) => (text, 1.0),
            },
            _ => (text, 1.0),
        };
        if !scale.is_finite() {
            return Err(Error::InvalidArgument {
                name: "lora",
                reason: format!("{text}: the scale {scale} is not a finite number; give FILE or FILE:SCALE (0.8, say)"),
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
    /// diffusers / PEFT: `<component>.<module>.lora_A.weight`, `lora_B.weight`.
    Peft,
    /// Kohya / sd-scripts: `lora_unet_<module>.lora_down.weight`, `lora_up.weight`, `alpha`.
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

/// One module's factors as the file stores them.
#[derive(Debug, Clone)]
struct FileModule {
    target: LoraTarget,
    name: ModuleName,
    /// The key of the down factor, for errors.
    down_key: String,
    down: Option<TensorData>,
    up: Option<TensorData>,
    alpha: Option<f32>,
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

/// A LoRA file, read and checked for its own consistency (pairs complete, ranks equal); not yet checked against
/// a model.
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

    /// Reads a LoRA file held in memory; `path` names it in errors.
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
            let parsed = parse_key(key).ok_or_else(|| Error::LoraKey {
                path: path.to_path_buf(),
                key: key.to_string(),
                reason: "is not a LoRA factor in a layout this crate reads: diffusers/PEFT \
                         `transformer.<module>.lora_A.weight` / `lora_B.weight`, or Kohya \
                         `lora_unet_<module>.lora_down.weight` / `lora_up.weight` / `alpha`"
                    .into(),
            })?;
            if parsed.role == Role::Dora {
                return Err(file_error(format!(
                    "{key} is a DoRA magnitude vector; DoRA is not supported, use a plain LoRA of the model"
                )));
            }
            if *layout.get_or_insert(parsed.layout) != parsed.layout {
                return Err(Error::LoraKey {
                    path: path.to_path_buf(),
                    key: key.to_string(),
                    reason: "mixes the Kohya and the diffusers/PEFT layouts in one file; save it in one layout".into(),
                });
            }
            let view = tensors.tensor(key).map_err(|e| file_error(format!("{key} cannot be read ({e})")))?;
            let data = tensor_data(&view).map_err(|reason| Error::LoraShape {
                path: path.to_path_buf(),
                key: key.to_string(),
                reason,
            })?;
            let entry = modules.entry((parsed.target, parsed.name.clone())).or_insert_with(|| FileModule {
                target: parsed.target,
                name: parsed.name.clone(),
                down_key: key.to_string(),
                down: None,
                up: None,
                alpha: None,
            });
            let shape_error = |reason: &str| Error::LoraShape {
                path: path.to_path_buf(),
                key: key.to_string(),
                reason: reason.into(),
            };
            match parsed.role {
                Role::Down => {
                    if data.shape().len() != 2 {
                        return Err(shape_error("a down factor must be a matrix [rank, in]"));
                    }
                    entry.down_key = key.to_string();
                    entry.down = Some(data);
                }
                Role::Up => {
                    if data.shape().len() != 2 {
                        return Err(shape_error("an up factor must be a matrix [out, rank]"));
                    }
                    entry.up = Some(data);
                }
                Role::Alpha => {
                    let values = f32_values(&data);
                    if values.len() != 1 || !values[0].is_finite() {
                        return Err(shape_error("an alpha must be one finite number"));
                    }
                    entry.alpha = Some(values[0]);
                }
                Role::Dora => unreachable!("refused above"),
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

    /// How many modules it updates (a Kohya fused `qkv` counts once).
    pub fn modules(&self) -> usize {
        self.modules.len()
    }

    /// A module's down and up factors, checked: both present, ranks equal, the rank the metadata gives.
    fn factors<'a>(&self, module: &'a FileModule) -> Result<(&'a TensorData, &'a TensorData, usize)> {
        let shape_error =
            |reason: String| Error::LoraShape { path: self.path.clone(), key: module.down_key.clone(), reason };
        let (Some(down), Some(up)) = (&module.down, &module.up) else {
            let missing = if module.down.is_none() { "down (lora_A)" } else { "up (lora_B)" };
            return Err(shape_error(format!("its module has no {missing} factor; the file is incomplete")));
        };
        let rank = down.shape()[0];
        if up.shape()[1] != rank || rank == 0 {
            return Err(shape_error(format!(
                "the down factor has rank {rank} and the up factor {:?} has rank {}; the pair does not match",
                up.shape().as_slice(),
                up.shape()[1]
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
        let name = match &module.name {
            ModuleName::Dotted(name) | ModuleName::Underscored(name) => name.as_str(),
        };
        let alpha = module
            .alpha
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
    layout: LoraLayout,
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
    let (name, target, underscored) =
        PREFIXES.iter().find_map(|(prefix, target, u)| module.strip_prefix(prefix).map(|n| (n, *target, *u)))?;
    if name.is_empty() {
        return None;
    }
    let kohya_roles = matches!(key.rsplit_once(".lora_").map(|(_, r)| r), Some("down.weight" | "up.weight"));
    let layout = if underscored || kohya_roles { LoraLayout::Kohya } else { LoraLayout::Peft };
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
        match field {
            "r" => entry.rank = Some(number("the rank")? as usize),
            "lora_alpha" => entry.alpha = Some(number("the alpha")? as f32),
            "use_rslora" => entry.rslora = value.as_bool().unwrap_or(false),
            "use_dora" if value.as_bool() == Some(true) => return Err("says use_dora; DoRA is not supported".into()),
            "rank_pattern" | "alpha_pattern" => {
                for (pattern, v) in value.as_object().into_iter().flatten() {
                    let v = v.as_f64().ok_or(format!("gives {key}.{pattern} = {v}, not a number"))?;
                    if field == "rank_pattern" {
                        entry.rank_pattern.insert(pattern.clone(), v as usize);
                    } else {
                        entry.alpha_pattern.insert(pattern.clone(), v as f32);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// A safetensors tensor as burn data, for the float dtypes LoRA files use.
fn tensor_data(view: &safetensors::tensor::TensorView<'_>) -> std::result::Result<TensorData, String> {
    let dtype = match view.dtype() {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F64 => DType::F64,
        other => return Err(format!("has dtype {other:?}; LoRA factors are f32, f16 or bf16")),
    };
    Ok(TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype))
}

/// Every value of `data` as f32, decoded from its little-endian bytes (a safetensors buffer need not be aligned
/// for a typed view). Only the float dtypes [`tensor_data`] admits reach here.
fn f32_values(data: &TensorData) -> Vec<f32> {
    let bytes = data.as_bytes();
    match data.dtype() {
        DType::F64 => {
            bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect()
        }
        DType::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    }
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
    struct Places {
        stack: Vec<(String, String)>,
        out: Vec<LinearPlace>,
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
            let dims = param.shape();
            let path = self.stack[..self.stack.len() - 1].iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>();
            self.out.push(LinearPlace {
                path: path.join("."),
                d_out: dims[0],
                d_in: dims[1],
                dtype: param.val().dtype(),
            });
        }
    }
    let mut places = Places { stack: Vec::new(), out: Vec::new() };
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
}

impl ComponentLayers {
    /// The layers of `model`, with the checkpoint renames `remap` (the transformer's [`KEY_REMAP`]).
    pub fn of<M: Module + LinearLayers>(model: &M, remap: &[(&str, &str)]) -> Self {
        let places: BTreeMap<String, LinearPlace> =
            linear_places(model).into_iter().map(|place| (place.path.clone(), place)).collect();
        let mut underscored: BTreeMap<String, Option<String>> = BTreeMap::new();
        for path in places.keys() {
            let key = path.replace('.', "_");
            underscored.entry(key).and_modify(|seen| *seen = None).or_insert_with(|| Some(path.clone()));
        }
        // The renames are this crate's own constants, which the loader compiles too (its tests load with them).
        let remap =
            burn::store::KeyRemapper::from_patterns(remap.to_vec()).expect("the crate's own key renames compile");
        Self { places, underscored, skipped: model.skipped_prefixes(), remap }
    }

    /// No layers: for resolving LoRAs of one component only (every key of the other is then refused).
    pub fn none() -> Self {
        Self {
            places: BTreeMap::new(),
            underscored: BTreeMap::new(),
            skipped: Vec::new(),
            remap: burn::store::KeyRemapper::default(),
        }
    }

    /// The transformer's layers.
    pub fn transformer(model: &ZImageTransformer2DModel) -> Self {
        Self::of(model, KEY_REMAP)
    }

    /// The text encoder's layers (its keys need no rename once `model.` is gone, which LoRA files never carry).
    pub fn text_encoder(model: &TextEncoder) -> Self {
        Self::of(model, &[])
    }

    /// The dotted path a file's module name stands for, in this model (renames applied).
    fn dotted(&self, name: &ModuleName) -> std::result::Result<String, &'static str> {
        match name {
            ModuleName::Dotted(name) => {
                let mut key = format!("{name}.");
                for (re, to) in self.remap.to_regex_pairs() {
                    key = re.replace(&key, to.as_str()).into_owned();
                }
                Ok(key.trim_end_matches('.').to_string())
            }
            ModuleName::Underscored(name) => {
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

/// Resolves `files` (with their scales) against the pipeline's two models: every module must name a linear
/// layer (or one the model leaves out by design: skipped and reported) and its factors must fit it. Nothing is
/// changed; the first problem is returned, naming its file and key.
pub fn resolve(
    files: &[(LoraFile, f32)],
    transformer: &ComponentLayers,
    text_encoder: &ComponentLayers,
) -> Result<ResolvedLoras> {
    let mut resolved = ResolvedLoras::default();
    for (file, scale) in files {
        for module in &file.modules {
            let layers = match module.target {
                LoraTarget::Transformer => transformer,
                LoraTarget::TextEncoder => text_encoder,
            };
            let key_error =
                |reason: String| Error::LoraKey { path: file.path.clone(), key: module.down_key.clone(), reason };
            let shape_error =
                |reason: String| Error::LoraShape { path: file.path.clone(), key: module.down_key.clone(), reason };
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
                resolved.skipped.push(module.down_key.clone());
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
            let d_in = down.shape()[1];
            let d_out: usize = places.iter().map(|p| p.d_out).sum();
            if d_in != places[0].d_in || up.shape()[0] != d_out {
                return Err(shape_error(format!(
                    "the factors make a [{}, {d_in}] update and the {component}'s {path} is [{d_out}, {}]; the file \
                     is for another model size",
                    up.shape()[0],
                    places[0].d_in
                )));
            }
            let coefficient = scale * file.scaling(module, rank);
            let down = Arc::new(f32_values(down));
            let up_values = f32_values(up);
            let mut row = 0;
            for place in places {
                let up_rows = Arc::new(up_values[row * rank..(row + place.d_out) * rank].to_vec());
                row += place.d_out;
                resolved.updates.entry(module.target).or_default().entry(place.path.clone()).or_default().push(
                    ResolvedUpdate { path: place.path.clone(), down: down.clone(), up: up_rows, rank, coefficient },
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

/// What `(w + d) - d` gets wrong in a fused weight, for a bit-exact removal: the cheapest of a list of
/// `(index, original bits)` and one signed byte or one signed 16-bit word per element (the original's bits minus
/// the subtraction's, in units in the last place). Where the update is small beside the weight (a trained LoRA)
/// few elements are wrong and the list is short; where it is as large as the weight, the weight's low bits are
/// what the sum lost, and the record holds about as many bits as were lost.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Corrections {
    /// `(index, the original bits)` of each element the subtraction gets wrong.
    Sparse(Vec<(u32, u32)>),
    /// For every element, the original's bits minus the subtraction's, when each fits a byte.
    Dense(Vec<i8>),
    /// For every element, the original's bits minus the subtraction's, when each fits 16 bits.
    Wide(Vec<i16>),
}

impl Corrections {
    /// Bytes this record holds.
    fn bytes(&self) -> usize {
        match self {
            Self::Sparse(list) => list.len() * std::mem::size_of::<(u32, u32)>(),
            Self::Dense(codes) => codes.len(),
            Self::Wide(codes) => codes.len() * 2,
        }
    }

    /// Elements the subtraction gets wrong.
    fn count(&self) -> usize {
        match self {
            Self::Sparse(list) => list.len(),
            Self::Dense(codes) => codes.iter().filter(|c| **c != 0).count(),
            Self::Wide(codes) => codes.iter().filter(|c| **c != 0).count(),
        }
    }
}

/// A weight's element type, for adding an f32 update in place and rounding once.
trait WeightElement: burn::tensor::Element + Copy {
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
    fn bits(self) -> u32;
}

impl WeightElement for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl WeightElement for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

impl WeightElement for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

/// Adds `delta` to `weights` in place, each element rounded once, and returns what subtracting it again would
/// get wrong.
fn add_in_place<E: WeightElement>(weights: &mut [E], delta: &[f32]) -> Corrections {
    // Only the elements that need a correction are kept while adding (index, original bits, code), so the
    // record never costs a pass over a full-size buffer; the dense forms are built from them at the end.
    let mut wrong: Vec<(u32, u32, i32)> = Vec::new();
    for (i, (w, d)) in weights.iter_mut().zip(delta).enumerate() {
        let fused = E::from_f32(w.to_f32() + d);
        let back = E::from_f32(fused.to_f32() - d).bits();
        if back != w.bits() {
            // Bits are at most 32 wide, so their difference fits an i64; an i32 holds every code a dense form
            // can take, and a wider one only ever goes to the sparse list.
            let code = i32::try_from(i64::from(w.bits()) - i64::from(back)).unwrap_or(i32::MAX);
            wrong.push((i as u32, w.bits(), code));
        }
        *w = fused;
    }
    let n = weights.len();
    let sparse_bytes = wrong.len() * std::mem::size_of::<(u32, u32)>();
    let fits = |bits: u32| wrong.iter().all(|(_, _, c)| *c != i32::MAX && c.unsigned_abs() < (1 << (bits - 1)));
    if n < sparse_bytes && fits(8) {
        let mut codes = vec![0i8; n];
        wrong.iter().for_each(|(i, _, c)| codes[*i as usize] = *c as i8);
        Corrections::Dense(codes)
    } else if 2 * n < sparse_bytes && fits(16) {
        let mut codes = vec![0i16; n];
        wrong.iter().for_each(|(i, _, c)| codes[*i as usize] = *c as i16);
        Corrections::Wide(codes)
    } else {
        Corrections::Sparse(wrong.into_iter().map(|(i, bits, _)| (i, bits)).collect())
    }
}

/// Subtracts `delta` from `weights` in place and applies `corrections`, which gives the original bits back.
fn subtract_in_place<E: WeightElement>(
    weights: &mut [E],
    delta: &[f32],
    corrections: &Corrections,
    from_bits: fn(u32) -> E,
) {
    for (w, d) in weights.iter_mut().zip(delta) {
        *w = E::from_f32(w.to_f32() - d);
    }
    match corrections {
        Corrections::Sparse(list) => {
            for (i, bits) in list {
                weights[*i as usize] = from_bits(*bits);
            }
        }
        Corrections::Dense(codes) => apply_codes(weights, codes, from_bits),
        Corrections::Wide(codes) => apply_codes(weights, codes, from_bits),
    }
}

/// Adds each element's code (the original's bits minus the subtraction's) back to its bits.
fn apply_codes<E: WeightElement, C: Copy + Into<i64>>(weights: &mut [E], codes: &[C], from_bits: fn(u32) -> E) {
    for (w, code) in weights.iter_mut().zip(codes) {
        let code: i64 = (*code).into();
        if code != 0 {
            *w = from_bits((i64::from(w.bits()) + code) as u32);
        }
    }
}

/// A layer with a fused update: what removing it needs (the factors and the corrections, never the weight).
#[derive(Debug, Clone)]
struct FusedLayer {
    target: LoraTarget,
    path: String,
    updates: Vec<ResolvedUpdate>,
    corrections: Corrections,
    /// The weight's elements.
    elements: usize,
}

/// What a pipeline has applied: the files, the mode and what undoing it needs.
#[derive(Debug, Clone, Default)]
pub struct AppliedLoras {
    specs: Vec<LoraSpec>,
    mode: LoraMode,
    fused: Vec<FusedLayer>,
    runtime_layers: BTreeMap<LoraTarget, Vec<String>>,
    skipped: Vec<String>,
}

impl AppliedLoras {
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
            LoraMode::Runtime => self.runtime_layers.get(&target).map_or(0, Vec::len),
        }
    }

    /// Weight elements whose fused value minus the update is not the original (fused mode), in all: each is
    /// corrected from a record when the LoRA is removed.
    pub fn corrections(&self) -> usize {
        self.fused.iter().map(|l| l.corrections.count()).sum()
    }

    /// Bytes kept for a bit-exact removal beside the factors (fused mode): the corrections' records.
    pub fn correction_bytes(&self) -> usize {
        self.fused.iter().map(|l| l.corrections.bytes()).sum()
    }

    /// Elements of the weights the fused updates changed, in all (fused mode).
    pub fn fused_elements(&self) -> usize {
        self.fused.iter().map(|l| l.elements).sum()
    }

    /// File keys skipped (layers the model leaves out by design).
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// Whether anything is applied.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

/// Applies the updates of `target` in `resolved` to `model` in `mode`; returns the fused layers' undo records
/// (fused) or the updated paths (runtime). The model's weights are rewritten in place (no second copy).
fn apply_to<M: LinearLayers>(
    model: &mut M,
    target: LoraTarget,
    resolved: &ResolvedLoras,
    mode: LoraMode,
) -> (Vec<FusedLayer>, Vec<String>) {
    let Some(updates) = resolved.updates.get(&target) else { return (Vec::new(), Vec::new()) };
    let mut fused = Vec::new();
    let mut paths = Vec::new();
    for (path, linear) in model.linears_mut() {
        let Some(updates) = updates.get(&path) else { continue };
        match mode {
            LoraMode::Fused => {
                let corrections = rewrite_weight(linear, |data, d_out, d_in| {
                    let delta = delta(updates, d_out, d_in);
                    match data.dtype() {
                        DType::F32 => add_in_place(data.as_mut_slice::<f32>().expect("an f32 weight"), &delta),
                        DType::BF16 => add_in_place(data.as_mut_slice::<bf16>().expect("a bf16 weight"), &delta),
                        DType::F16 => add_in_place(data.as_mut_slice::<f16>().expect("an f16 weight"), &delta),
                        other => unreachable!("resolution refuses a fused update of a {other:?} weight"),
                    }
                });
                let elements = linear.d_out() * linear.d_in();
                fused.push(FusedLayer { target, path, updates: updates.clone(), corrections, elements });
            }
            LoraMode::Runtime => {
                let device = linear.weight.val().device();
                let dtype = linear.dtype();
                let (d_out, d_in) = (linear.d_out(), linear.d_in());
                for update in updates {
                    let factor = |values: &Vec<f32>, shape: [usize; 2]| {
                        Param::from_tensor(
                            Tensor::<2>::from_data(TensorData::new(values.clone(), shape), (&device, DType::F32))
                                .cast(dtype),
                        )
                    };
                    linear.lora.push(LowRank {
                        down: factor(&update.down, [update.rank, d_in]),
                        up: factor(&update.up, [d_out, update.rank]),
                        coefficient: f64::from(update.coefficient),
                    });
                }
                paths.push(path);
            }
        }
    }
    (fused, paths)
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

/// Removes from one model what `applied` holds for `target`: fused updates subtracted and corrected bit for bit,
/// run-time terms dropped.
pub fn remove<M: LinearLayers>(model: &mut M, target: LoraTarget, applied: &AppliedLoras) {
    let fused: BTreeMap<&str, &FusedLayer> =
        applied.fused.iter().filter(|l| l.target == target).map(|l| (l.path.as_str(), l)).collect();
    let runtime: Vec<&String> = applied.runtime_layers.get(&target).into_iter().flatten().collect();
    for (path, linear) in model.linears_mut() {
        if let Some(layer) = fused.get(path.as_str()) {
            rewrite_weight(linear, |data, d_out, d_in| {
                let delta = delta(&layer.updates, d_out, d_in);
                let corrections = &layer.corrections;
                match data.dtype() {
                    DType::F32 => {
                        subtract_in_place(
                            data.as_mut_slice::<f32>().expect("f32"),
                            &delta,
                            corrections,
                            f32::from_bits,
                        );
                    }
                    DType::BF16 => {
                        subtract_in_place(data.as_mut_slice::<bf16>().expect("bf16"), &delta, corrections, |bits| {
                            bf16::from_bits(bits as u16)
                        })
                    }
                    DType::F16 => {
                        subtract_in_place(data.as_mut_slice::<f16>().expect("f16"), &delta, corrections, |bits| {
                            f16::from_bits(bits as u16)
                        })
                    }
                    other => unreachable!("a fused update was applied to a {other:?} weight"),
                }
            });
        }
        if runtime.iter().any(|p| **p == path) {
            linear.lora.clear();
        }
    }
}

/// Checks that `resolved` can be applied in `mode`: a fused update needs a float weight.
pub fn check_mode(resolved: &ResolvedLoras, mode: LoraMode, layers: &[(LoraTarget, &ComponentLayers)]) -> Result<()> {
    if mode != LoraMode::Fused {
        return Ok(());
    }
    for (target, component) in layers {
        for path in resolved.updates.get(target).into_iter().flat_map(BTreeMap::keys) {
            let Some(place) = component.places.get(path) else { continue };
            if !matches!(place.dtype, DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::LoraUnsupported {
                    reason: format!(
                        "the {}'s {path} is {:?}, and a fused update needs a float weight; apply the LoRA before \
                         quantizing, or apply it at run time (--lora-mode runtime)",
                        target.component(),
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

/// Applies `resolved` to one model in `mode`, recording into `applied`.
pub fn apply<M: LinearLayers>(model: &mut M, target: LoraTarget, resolved: &ResolvedLoras, applied: &mut AppliedLoras) {
    let (fused, paths) = apply_to(model, target, resolved, applied.mode);
    applied.fused.extend(fused);
    if !paths.is_empty() {
        applied.runtime_layers.insert(target, paths);
    }
}

impl AppliedLoras {
    /// A record for `specs` applied in `mode`, nothing applied yet.
    pub fn new(specs: Vec<LoraSpec>, mode: LoraMode, skipped: Vec<String>) -> Self {
        Self { specs, mode, skipped, ..Self::default() }
    }
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
        assert!(LoraSpec::parse("a:inf").is_err());
        assert!(LoraSpec::parse("").is_err());
    }

    #[test]
    fn keys_of_both_layouts_parse_and_others_do_not() {
        let peft = parse_key("transformer.layers.0.attention.to_q.lora_A.weight").unwrap();
        assert_eq!((peft.target, peft.role, peft.layout), (LoraTarget::Transformer, Role::Down, LoraLayout::Peft));
        assert_eq!(peft.name, ModuleName::Dotted("layers.0.attention.to_q".into()));
        let kohya = parse_key("lora_unet_layers_0_attention_qkv.lora_up.weight").unwrap();
        assert_eq!((kohya.role, kohya.layout), (Role::Up, LoraLayout::Kohya));
        assert_eq!(kohya.name, ModuleName::Underscored("layers_0_attention_qkv".into()));
        let te = parse_key("text_encoder.layers.1.mlp.up_proj.lora_B.weight").unwrap();
        assert_eq!(te.target, LoraTarget::TextEncoder);
        assert!(parse_key("transformer.layers.0.attention.to_q.weight").is_none());
        assert!(parse_key("unet.down.lora_A.weight").is_none());
    }

    #[test]
    fn a_fused_update_is_removed_bit_for_bit_in_every_float_dtype() {
        // Values and updates of very different sizes, so rounding loses bits of the sum.
        let d_out = 64;
        let d_in = 48;
        let rank = 3;
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let down: Vec<f32> = (0..rank * d_in).map(|_| next()).collect();
        let up: Vec<f32> = (0..d_out * rank).map(|_| next() * 3.0).collect();
        let update =
            ResolvedUpdate { path: "x".into(), down: Arc::new(down), up: Arc::new(up), rank, coefficient: 0.37 };
        let delta = delta(std::slice::from_ref(&update), d_out, d_in);
        let base: Vec<f32> = (0..d_out * d_in).map(|i| next() * 10f32.powi((i % 7) as i32 - 3)).collect();

        let mut w = base.clone();
        let corrections = add_in_place(&mut w, &delta);
        assert_ne!(w, base, "the update changed the weight");
        subtract_in_place(&mut w, &delta, &corrections, f32::from_bits);
        assert!(w.iter().zip(&base).all(|(a, b)| a.to_bits() == b.to_bits()), "f32 restored bit for bit");
        assert!(corrections.count() > 0, "some f32 elements needed a correction (else this checks nothing)");
        println!(
            "large f32 update: {} of {} corrected in {} bytes",
            corrections.count(),
            base.len(),
            corrections.bytes()
        );
        assert!(corrections.bytes() < 4 * base.len(), "less than a copy of the weight");

        let base16: Vec<bf16> = base.iter().map(|v| bf16::from_f32(*v)).collect();
        let mut w = base16.clone();
        let corrections = add_in_place(&mut w, &delta);
        subtract_in_place(&mut w, &delta, &corrections, |b| bf16::from_bits(b as u16));
        assert!(w.iter().zip(&base16).all(|(a, b)| a.to_bits() == b.to_bits()), "bf16 restored bit for bit");
        println!(
            "large bf16 update: {} of {} corrected in {} bytes",
            corrections.count(),
            base16.len(),
            corrections.bytes()
        );
        // A small update beside the weight, as a trained LoRA's: next to nothing to keep.
        let small: Vec<f32> = delta.iter().map(|d| d * 1e-3).collect();
        let mut w = base16.clone();
        let corrections = add_in_place(&mut w, &small);
        assert_ne!(w, base16);
        subtract_in_place(&mut w, &small, &corrections, |b| bf16::from_bits(b as u16));
        assert!(w.iter().zip(&base16).all(|(a, b)| a.to_bits() == b.to_bits()), "small bf16 update restored");
        println!("small bf16 update: {} of {} elements corrected", corrections.count(), base16.len());
        assert!(corrections.bytes() < base16.len(), "a small update keeps under half a copy (2 bytes an element)");
    }

    #[test]
    fn the_update_is_the_same_bits_whatever_the_threads_and_sums_up_times_down() {
        let update = ResolvedUpdate {
            path: "x".into(),
            down: Arc::new(vec![1.0, 2.0, 3.0, 4.0]),
            up: Arc::new(vec![1.0, 0.0, 0.5, 1.0, 0.0, 2.0]),
            rank: 2,
            coefficient: 2.0,
        };
        // up [3, 2] · down [2, 2] times 2.
        assert_eq!(delta(std::slice::from_ref(&update), 3, 2), vec![2.0, 4.0, 7.0, 10.0, 12.0, 16.0]);
    }
}
