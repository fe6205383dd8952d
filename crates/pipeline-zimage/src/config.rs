//! The transformer's `config.json` and the checkpoint's `model_index.json`, with the Z-Image-Turbo preset and the
//! sizes derived from them (parameter counts, bytes, activation estimates).
//!
//! Sizes are pure arithmetic on the config: they need no weights and no device, so a memory planner can ask "how
//! big is a block, how much room does a 1024x1024 forward need" before anything is loaded.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::DType;
use serde::Deserialize;

use crate::error::{Error, Result};

/// The width of the timestep embedding that drives adaLN (`ADALN_EMBED_DIM` in diffusers).
pub const ADALN_EMBED_DIM: usize = 256;
/// The hidden width of the timestep embedder's MLP.
pub const T_EMBED_MID_DIM: usize = 1024;
/// The sinusoidal frequency embedding width fed to the timestep MLP.
pub const FREQUENCY_EMBEDDING_SIZE: usize = 256;
/// Image and caption token counts are padded to a multiple of this (`SEQ_MULTI_OF` in diffusers).
pub const SEQ_MULTI_OF: usize = 32;
/// The fixed part of a transformer forward's device pages, beside its sequence terms: the intercept of the fit of
/// [`TransformerConfig::activation_bytes_for_tokens`] to the tiny checkpoint's forwards on wgpu (161,030 bytes:
/// the runtime's per-launch buffers, the timestep and caption embedders' small tensors). Noise at real size.
pub const TRANSFORMER_CALL_OVERHEAD: u64 = 161_030;

/// The longest caption the pipeline feeds (`max_sequence_length`), used for worst-case activation estimates.
pub const MAX_CAPTION_TOKENS: usize = 512;
/// The epsilon of the per-head query/key RMS norms (fixed in diffusers, not read from the config).
pub const QK_NORM_EPS: f64 = 1e-5;
/// The epsilon of the final layer's parameter-free LayerNorm (fixed in diffusers).
pub const FINAL_NORM_EPS: f64 = 1e-6;

/// Limits on what a component config may declare. Every released model sits far below them (Z-Image-Turbo:
/// width 3840, 36 layers, 32 heads, a 151,936-token vocabulary); they keep every size derived from a validated
/// config (parameter counts, bytes, activation estimates) inside 64 bits, and refuse a damaged or hostile
/// `config.json` before anything is allocated for it. The configs' `validate` methods check them first.
pub mod limits {
    /// The largest width: model, feature, hidden, intermediate, channel or head dimension.
    pub const MAX_WIDTH: usize = 1 << 16;
    /// The most layers (or blocks per level) of one kind.
    pub const MAX_LAYERS: usize = 1 << 10;
    /// The most attention heads.
    pub const MAX_HEADS: usize = 1 << 10;
    /// The largest vocabulary.
    pub const MAX_VOCAB: usize = 1 << 20;
    /// The longest position table (an entry of the transformer's `axes_lens`).
    pub const MAX_POSITIONS: usize = 1 << 16;
    /// The largest patch size.
    pub const MAX_PATCH: usize = 16;
    /// The most resolution levels of the VAE (entries of `block_out_channels`).
    pub const MAX_LEVELS: usize = 8;

    /// Checks that every `(field, value, limit)` is within its limit; the `Err` names the first that is not.
    pub fn check(fields: &[(&str, usize, usize)]) -> Result<(), String> {
        match fields.iter().find(|(_, value, limit)| value > limit) {
            Some((name, value, limit)) => Err(format!(
                "{name} is {value}, above the limit of {limit} for any released model; the config is damaged"
            )),
            None => Ok(()),
        }
    }
}

/// `transformer/config.json` of a `ZImageTransformer2DModel`.
///
/// Missing fields take the diffusers class defaults, except `axes_lens`, whose default here is the shipped
/// Z-Image-Turbo value `[1536, 512, 512]` (the diffusers class default `[1024, 512, 512]` only shortens the caption
/// position table). Unknown fields (`_class_name`, `_diffusers_version`, ...) are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct TransformerConfig {
    /// Spatial patch sizes; Z-Image uses `[2]`.
    pub all_patch_size: Vec<usize>,
    /// Frame patch sizes; Z-Image uses `[1]`.
    pub all_f_patch_size: Vec<usize>,
    /// Latent channels.
    pub in_channels: usize,
    /// The model width `D`.
    pub dim: usize,
    /// Number of main (unified-sequence) blocks.
    pub n_layers: usize,
    /// Number of blocks in each refiner (noise and context).
    pub n_refiner_layers: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Key/value heads (equal to `n_heads` in every released config; the model requires it).
    pub n_kv_heads: usize,
    /// Epsilon of the blocks' and caption embedder's RMS norms.
    pub norm_eps: f64,
    /// Whether attention normalises queries and keys per head.
    pub qk_norm: bool,
    /// Width of the text encoder's hidden states.
    pub cap_feat_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// The factor the pipeline's `t` in `[0, 1]` is multiplied by before the sinusoidal embedding.
    pub t_scale: f64,
    /// RoPE dimensions per position axis (frame/caption, height, width); they sum to the head dimension.
    pub axes_dims: Vec<usize>,
    /// RoPE table length per axis (largest position + 1).
    pub axes_lens: Vec<usize>,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        Self::z_image_turbo()
    }
}

impl TransformerConfig {
    /// The configuration shipped with Tongyi-MAI/Z-Image-Turbo.
    pub fn z_image_turbo() -> Self {
        Self {
            all_patch_size: vec![2],
            all_f_patch_size: vec![1],
            in_channels: 16,
            dim: 3840,
            n_layers: 30,
            n_refiner_layers: 2,
            n_heads: 30,
            n_kv_heads: 30,
            norm_eps: 1e-5,
            qk_norm: true,
            cap_feat_dim: 2560,
            rope_theta: 256.0,
            t_scale: 1000.0,
            axes_dims: vec![32, 48, 48],
            axes_lens: vec![1536, 512, 512],
        }
    }

    /// Reads and validates a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::parse(&read_text(path)?, path)
    }

    /// Parses and validates the text of a `config.json`; `path` is only used in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        parse_json(text, path, Self::validate)
    }

    /// Checks the invariants the model code relies on, and the [`limits`]; returns what is wrong.
    pub fn validate(&self) -> std::result::Result<(), String> {
        use limits::{MAX_HEADS, MAX_LAYERS, MAX_PATCH, MAX_POSITIONS, MAX_WIDTH};
        limits::check(&[
            ("dim", self.dim, MAX_WIDTH),
            ("cap_feat_dim", self.cap_feat_dim, MAX_WIDTH),
            ("in_channels", self.in_channels, MAX_WIDTH),
            ("n_heads", self.n_heads, MAX_HEADS),
            ("n_kv_heads", self.n_kv_heads, MAX_HEADS),
            ("n_layers", self.n_layers, MAX_LAYERS),
            ("n_refiner_layers", self.n_refiner_layers, MAX_LAYERS),
            ("patch size", self.patch_size(), MAX_PATCH),
            ("frame patch size", self.f_patch_size(), MAX_PATCH),
        ])?;
        let axes = self.axes_dims.iter().map(|d| ("an axes_dims entry", *d, MAX_WIDTH));
        let lens = self.axes_lens.iter().map(|l| ("an axes_lens entry", *l, MAX_POSITIONS));
        limits::check(&axes.chain(lens).collect::<Vec<_>>())?;
        let positive = [
            ("dim", self.dim),
            ("n_heads", self.n_heads),
            ("in_channels", self.in_channels),
            ("cap_feat_dim", self.cap_feat_dim),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        if self.all_patch_size.is_empty() || self.all_f_patch_size.is_empty() {
            return Err("all_patch_size and all_f_patch_size must not be empty".into());
        }
        if self.patch_size() == 0 || self.f_patch_size() == 0 {
            return Err("patch sizes must be positive".into());
        }
        if !self.dim.is_multiple_of(self.n_heads) {
            return Err(format!("dim {} is not divisible by n_heads {}", self.dim, self.n_heads));
        }
        if self.n_kv_heads != self.n_heads {
            return Err(format!(
                "n_kv_heads {} differs from n_heads {}; grouped-query attention is not implemented",
                self.n_kv_heads, self.n_heads
            ));
        }
        if self.axes_dims.len() != 3 || self.axes_lens.len() != 3 {
            return Err("axes_dims and axes_lens must have three entries".into());
        }
        if self.axes_dims.iter().any(|d| d % 2 != 0) {
            return Err(format!("axes_dims {:?} must all be even", self.axes_dims));
        }
        if self.axes_dims.iter().sum::<usize>() != self.head_dim() {
            return Err(format!(
                "axes_dims {:?} sum to {}, but the head dimension is {}",
                self.axes_dims,
                self.axes_dims.iter().sum::<usize>(),
                self.head_dim()
            ));
        }
        Ok(())
    }

    /// The spatial patch size (first entry of `all_patch_size`).
    pub fn patch_size(&self) -> usize {
        self.all_patch_size.first().copied().unwrap_or(2)
    }

    /// The frame patch size (first entry of `all_f_patch_size`).
    pub fn f_patch_size(&self) -> usize {
        self.all_f_patch_size.first().copied().unwrap_or(1)
    }

    /// The per-head width, `dim / n_heads`.
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }

    /// The SwiGLU hidden width, Python's `int(dim / 3 * 8)` (10240 for Turbo).
    pub fn ffn_hidden_dim(&self) -> usize {
        // Evaluated in f64 like Python so that widths that are not multiples of 3 round the same way.
        (self.dim as f64 / 3.0 * 8.0) as usize
    }

    /// The adaLN conditioning width, `min(dim, 256)`.
    pub fn adaln_dim(&self) -> usize {
        self.dim.min(ADALN_EMBED_DIM)
    }

    /// The width of a patch token, `f_patch * patch² * in_channels` (64 for Turbo).
    pub fn patch_dim(&self) -> usize {
        self.f_patch_size() * self.patch_size() * self.patch_size() * self.in_channels
    }

    /// Parameters of one attention + SwiGLU block without its adaLN projection (a context-refiner block).
    pub fn context_block_params(&self) -> usize {
        let d = self.dim;
        let attention = 4 * d * d + if self.qk_norm { 2 * self.head_dim() } else { 0 };
        let ffn = 3 * d * self.ffn_hidden_dim();
        let norms = 4 * d;
        attention + ffn + norms
    }

    /// Parameters of one modulated block (noise refiner and main layers): a context block plus
    /// `adaLN_modulation.0` (`adaln_dim -> 4·dim`, with bias).
    pub fn modulated_block_params(&self) -> usize {
        self.context_block_params() + self.adaln_dim() * 4 * self.dim + 4 * self.dim
    }

    /// Parameters outside the blocks: embedders, pad tokens and the final layer.
    pub fn non_block_params(&self) -> usize {
        let d = self.dim;
        let p = self.patch_dim();
        let a = self.adaln_dim();
        let x_embedder = p * d + d;
        let final_layer = d * p + p + a * d + d;
        let cap_embedder = self.cap_feat_dim + self.cap_feat_dim * d + d;
        let t_embedder = FREQUENCY_EMBEDDING_SIZE * T_EMBED_MID_DIM + T_EMBED_MID_DIM + T_EMBED_MID_DIM * a + a;
        let pad_tokens = 2 * d;
        x_embedder + final_layer + cap_embedder + t_embedder + pad_tokens
    }

    /// Total parameters: 6,154,908,736 for Turbo.
    pub fn num_params(&self) -> usize {
        (self.n_layers + self.n_refiner_layers) * self.modulated_block_params()
            + self.n_refiner_layers * self.context_block_params()
            + self.non_block_params()
    }

    /// The weights' size in `dtype`: 12,309,817,472 bytes (11.46 GiB) in bf16 for Turbo.
    pub fn bytes(&self, dtype: DType) -> u64 {
        self.num_params() as u64 * dtype.size() as u64
    }

    /// Image tokens for an image of `height x width` pixels under a VAE of `vae_scale_factor` (the FLUX VAE's 8
    /// times patch 2 = 16 pixels a token), padded to a multiple of [`SEQ_MULTI_OF`].
    pub fn image_tokens(&self, height: usize, width: usize, vae_scale_factor: usize) -> usize {
        let per_token = vae_scale_factor.max(1) * self.patch_size();
        let tokens = (height / per_token) * (width / per_token);
        tokens.next_multiple_of(SEQ_MULTI_OF)
    }

    /// Estimated peak activation bytes of one transformer forward at `height x width` (under a VAE of
    /// `vae_scale_factor`) with the longest caption ([`MAX_CAPTION_TOKENS`]), activations in `dtype`: the worst
    /// case over prompts; [`Self::activation_bytes_with_caption`] is the estimate for a known prompt.
    ///
    /// The estimate is [`Self::activation_bytes_for_tokens`] with materialised attention scores, i.e. the upper
    /// bound that holds on every backend (1024x1024 bf16: about 2.7 GiB, of which 2.4 GiB are the scores; 0.36 GiB
    /// with a flash-attention kernel).
    pub fn activation_bytes(&self, height: usize, width: usize, vae_scale_factor: usize, dtype: DType) -> u64 {
        self.activation_bytes_with_caption(height, width, vae_scale_factor, MAX_CAPTION_TOKENS, dtype)
    }

    /// Estimated peak activation bytes of one transformer forward at `height x width` for a caption of
    /// `caption_tokens` real tokens (the prompt's, at most `max_sequence_length`: the transformer sees the
    /// caption's valid rows, padded to [`SEQ_MULTI_OF`], not the text encoder's padded input).
    ///
    /// Measured on wgpu (lavapipe, exclusive pages, `docs/benchmarks.md`): the pages a forward takes follow
    /// [`Self::activation_bytes_for_tokens`] with materialised scores at the real sequence within 4% from 64 to
    /// 608 tokens; one forward with guidance (two items) takes the pages of one, as the items run one after the
    /// other.
    pub fn activation_bytes_with_caption(
        &self,
        height: usize,
        width: usize,
        vae_scale_factor: usize,
        caption_tokens: usize,
        dtype: DType,
    ) -> u64 {
        let tokens = self.image_tokens(height, width, vae_scale_factor) + caption_tokens.next_multiple_of(SEQ_MULTI_OF);
        self.activation_bytes_for_tokens(tokens, dtype, true)
    }

    /// Estimated peak activation bytes of one modulated block over a unified sequence of `tokens` tokens
    /// (batch 1), the largest live set of the forward.
    ///
    /// With `S = tokens`, `D = dim`, `F = ffn_hidden_dim`, `H = n_heads` and `e = dtype` bytes, the peak is the
    /// larger of the two halves of a block, plus the residual stream `S·D·e`:
    /// - attention: the normed input, q, k, v and the attention output (`5·S·D·e`), the f32 RoPE copies of q and
    ///   k (`2·S·D·4`) and, when `materialized_scores` (the fallback attention on CPU backends, or a GPU without
    ///   a flash kernel), the score and probability matrices `2·H·S²·e`;
    /// - feed-forward: the normed input and output (`2·S·D·e`) and the `w1`, `w3` and gated products (`3·S·F·e`).
    ///
    /// plus [`TRANSFORMER_CALL_OVERHEAD`], the fixed part of a forward's pages that no sequence term explains.
    ///
    /// Fitted to the pages of the tiny checkpoint's forwards on wgpu at 64, 96, 192, 288 and 608 tokens (f32):
    /// `c + a·S·D·e + b·H·S²·e` with `a` = 8.06 and `b` = 2.15 against this shape's 8 and 2 (the attention half
    /// is the larger one at every size), within 4% at every size with the intercept `c`. Freed intermediates (norm
    /// statistics, modulation vectors) are ignored; allocator rounding is not modelled.
    pub fn activation_bytes_for_tokens(&self, tokens: usize, dtype: DType, materialized_scores: bool) -> u64 {
        let s = tokens as u64;
        let d = self.dim as u64;
        let f = self.ffn_hidden_dim() as u64;
        let h = self.n_heads as u64;
        let e = dtype.size() as u64;
        let scores = if materialized_scores { 2 * h * s * s * e } else { 0 };
        let attention = 5 * s * d * e + 2 * s * d * 4 + scores;
        let ffn = 2 * s * d * e + 3 * s * f * e;
        s * d * e + attention.max(ffn) + TRANSFORMER_CALL_OVERHEAD
    }
}

/// The pipeline class a Z-Image checkpoint declares.
pub const PIPELINE_CLASS: &str = "ZImagePipeline";

/// The components of a Z-Image checkpoint and the classes this crate accepts for each; an empty list accepts any
/// class. The tokenizer's is any: all this crate reads of it is `tokenizer/tokenizer.json` (required by
/// [`crate::tokenizer::PromptTokenizer::from_dir`]), and transformers 5 names a fast tokenizer it holds as the
/// generic class `TokenizersBackend`, where older versions wrote `Qwen2Tokenizer` or `Qwen2TokenizerFast`.
pub const EXPECTED_COMPONENTS: &[(&str, &[&str])] = &[
    ("scheduler", &["FlowMatchEulerDiscreteScheduler"]),
    ("text_encoder", &["Qwen3Model"]),
    ("tokenizer", &[]),
    ("transformer", &["ZImageTransformer2DModel"]),
    ("vae", &["AutoencoderKL"]),
];

/// `model_index.json`: the pipeline class and, per component, the `(library, class)` pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIndex {
    /// `_class_name`, e.g. `ZImagePipeline`.
    pub class_name: String,
    /// `_diffusers_version`, when present.
    pub diffusers_version: Option<String>,
    /// Component name -> `(library, class)`; either may be `null` in the file for an absent component.
    pub components: BTreeMap<String, (Option<String>, Option<String>)>,
}

impl ModelIndex {
    /// Parses the text of a `model_index.json`; `path` is only used in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
        let not_zimage = |reason: String| Error::NotZImageCheckpoint { path: path.to_path_buf(), reason };
        let object = value.as_object().ok_or_else(|| not_zimage("model_index.json is not a json object".into()))?;
        let class_name = object
            .get("_class_name")
            .and_then(|v| v.as_str())
            .ok_or_else(|| not_zimage("model_index.json has no _class_name".into()))?
            .to_owned();
        let diffusers_version = object.get("_diffusers_version").and_then(|v| v.as_str()).map(str::to_owned);
        let mut components = BTreeMap::new();
        for (name, entry) in object.iter().filter(|(k, _)| !k.starts_with('_')) {
            // Components are `[library, class]`; anything else (e.g. `requires_safety_checker: false`) is a flag.
            if let Some([library, class]) = entry.as_array().map(Vec::as_slice) {
                let library = library.as_str().map(str::to_owned);
                let class = class.as_str().map(str::to_owned);
                components.insert(name.clone(), (library, class));
            }
        }
        Ok(Self { class_name, diffusers_version, components })
    }

    /// Reads and parses `path`; a missing file is [`Error::NotZImageCheckpoint`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::NotZImageCheckpoint { path: path.to_path_buf(), reason: "model_index.json not found".into() }
            } else {
                Error::Io { path: path.to_path_buf(), source }
            }
        })?;
        Self::parse(&text, path)
    }

    /// The class declared for `component`, if any.
    pub fn class_of(&self, component: &str) -> Option<&str> {
        self.components.get(component).and_then(|(_, class)| class.as_deref())
    }

    /// Checks that this is a `ZImagePipeline` whose components have the classes in [`EXPECTED_COMPONENTS`].
    pub fn validate(&self, path: &Path) -> Result<()> {
        if self.class_name != PIPELINE_CLASS {
            return Err(Error::NotZImageCheckpoint {
                path: path.to_path_buf(),
                reason: format!("model_index.json declares {}, expected {PIPELINE_CLASS}", self.class_name),
            });
        }
        for (component, accepted) in EXPECTED_COMPONENTS {
            let found = self.class_of(component).ok_or_else(|| Error::NotZImageCheckpoint {
                path: path.to_path_buf(),
                reason: format!("model_index.json declares no {component}"),
            })?;
            if !accepted.is_empty() && !accepted.contains(&found) {
                return Err(Error::WrongComponentClass {
                    component: (*component).to_owned(),
                    path: path.to_path_buf(),
                    expected: accepted.join(" or "),
                    found: found.to_owned(),
                });
            }
        }
        Ok(())
    }
}

/// Reads a configuration file's text; a read failure names the file.
pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

/// Deserialises a component's `config.json` text and validates it; `path` is only used in errors, which name
/// the file and what is wrong (bad JSON, or a value `validate` refuses).
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    text: &str,
    path: &Path,
    validate: impl FnOnce(&T) -> std::result::Result<(), String>,
) -> Result<T> {
    let config: T = serde_json::from_str(text).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
    validate(&config).map_err(|reason| Error::InvalidConfig { path: path.to_path_buf(), reason })?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turbo_sizes_match_the_published_figures() {
        let c = TransformerConfig::z_image_turbo();
        assert_eq!(c.ffn_hidden_dim(), 10240);
        assert_eq!(c.modulated_block_params(), 180_910_336);
        assert_eq!(c.context_block_params(), 176_962_816);
        assert_eq!(c.non_block_params(), 11_852_352);
        assert_eq!(c.num_params(), 6_154_908_736);
        assert_eq!(c.bytes(DType::BF16), 12_309_817_472);
        assert_eq!(c.bytes(DType::F32), 2 * 12_309_817_472);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn activation_estimate_at_1024() {
        let c = TransformerConfig::z_image_turbo();
        assert_eq!(c.image_tokens(1024, 1024, 8), 4096);
        let s: u64 = 4096 + 512;
        let (d, f, h, e) = (3840u64, 10240u64, 30u64, 2u64);
        let attention = 5 * s * d * e + 8 * s * d + 2 * h * s * s * e;
        let expected = s * d * e + attention.max(2 * s * d * e + 3 * s * f * e) + TRANSFORMER_CALL_OVERHEAD;
        assert_eq!(c.activation_bytes(1024, 1024, 8, DType::BF16), expected);
        assert!(
            c.activation_bytes_for_tokens(4608, DType::BF16, false) < c.activation_bytes(1024, 1024, 8, DType::BF16)
        );
    }

    #[test]
    fn ffn_width_rounds_like_python() {
        let c = TransformerConfig { dim: 64, n_heads: 2, ..TransformerConfig::z_image_turbo() };
        // int(64 / 3 * 8) == 170
        assert_eq!(c.ffn_hidden_dim(), 170);
    }

    #[test]
    fn config_json_defaults_fill_missing_fields() {
        let c: TransformerConfig =
            serde_json::from_str(r#"{"_class_name":"ZImageTransformer2DModel","dim":3840}"#).expect("parses");
        assert_eq!(c, TransformerConfig::z_image_turbo());
    }

    #[test]
    fn model_index_validation() {
        let path = Path::new("model_index.json");
        let good = r#"{"_class_name":"ZImagePipeline","_diffusers_version":"0.36.0",
            "scheduler":["diffusers","FlowMatchEulerDiscreteScheduler"],
            "text_encoder":["transformers","Qwen3Model"],"tokenizer":["transformers","Qwen2Tokenizer"],
            "transformer":["diffusers","ZImageTransformer2DModel"],"vae":["diffusers","AutoencoderKL"]}"#;
        let index = ModelIndex::parse(good, path).expect("parses");
        assert!(index.validate(path).is_ok());
        assert_eq!(index.class_of("vae"), Some("AutoencoderKL"));

        let wrong = good.replace("AutoencoderKL", "AutoencoderTiny");
        let index = ModelIndex::parse(&wrong, path).expect("parses");
        assert!(matches!(
            index.validate(path),
            Err(Error::WrongComponentClass { ref component, .. }) if component == "vae"
        ));

        // Any tokenizer class: transformers 5 writes the generic fast class.
        for class in ["Qwen2TokenizerFast", "TokenizersBackend", "PreTrainedTokenizerFast"] {
            let index = ModelIndex::parse(&good.replace("Qwen2Tokenizer", class), path).expect("parses");
            assert!(index.validate(path).is_ok(), "{class}");
        }

        let other = good.replace("ZImagePipeline", "FluxPipeline");
        let index = ModelIndex::parse(&other, path).expect("parses");
        assert!(matches!(index.validate(path), Err(Error::NotZImageCheckpoint { .. })));
    }
}
