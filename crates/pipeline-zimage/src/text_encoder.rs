//! The Qwen3 text encoder as Z-Image uses it: `hidden_states[-2]` of transformers' `Qwen3Model`.
//!
//! transformers records `hidden_states[0]` = the token embeddings and `hidden_states[k]` = the raw output of decoder
//! layer `k − 1`; the last entry is the final-normed output of the last layer. Z-Image takes `hidden_states[-2]`:
//! the embeddings run through every decoder layer but the last, with no final norm. So [`TextEncoder`] holds
//! `embed_tokens` and layers `0 ..= num_hidden_layers − 2` only; the checkpoint's last layer and `norm.weight` are
//! never loaded (see [`TextEncoder::unused_checkpoint_prefixes`]).
//!
//! Checkpoint keys (transformers `Qwen3Model.save_pretrained`; the real repository may prefix them with `model.`):
//! `embed_tokens.weight` `[vocab, hidden]`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
//! `layers.{i}.self_attn.{q,k}_norm.weight` `[head_dim]`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
//! `layers.{i}.{input,post_attention}_layernorm.weight` `[hidden]`, `norm.weight`.

use std::path::Path;

use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::silu;
use burn::tensor::module::embedding;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};
use serde::Deserialize;

use group_offload::{Layer, OffloadModel, leaf, narrow, whole};

use crate::loading::{
    BoundComponent, LoadOptions, LoadReport, WeightFiles, bind_files, component_name, load_component,
};
use crate::nn::{PtLinear, RmsNorm};
use crate::{Error, Result};
use group_offload::weights::TensorTransform;
use std::sync::Arc;

/// The RoPE block of transformers 5 configs (`rope_parameters`); older configs use a top-level `rope_theta`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RopeParameters {
    /// The RoPE base.
    pub rope_theta: f64,
    /// Only `"default"` is supported.
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
}

fn default_rope_type() -> String {
    "default".to_owned()
}

/// `text_encoder/config.json` (transformers `Qwen3Config`): the fields this crate uses. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TextEncoderConfig {
    /// Vocabulary size (rows of `embed_tokens`).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers in the checkpoint (Z-Image runs all but the last).
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Epsilon of every RMSNorm.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base of older configs.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE block of transformers 5 configs.
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Must be null or absent: scaled RoPE variants are not supported.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Whether q/k/v/o projections have biases (false for Qwen3).
    #[serde(default)]
    pub attention_bias: bool,
    /// Must be `"silu"`.
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// Longest supported sequence (informational).
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_hidden_act() -> String {
    "silu".to_owned()
}
fn default_max_position_embeddings() -> usize {
    40960
}

impl TextEncoderConfig {
    /// Qwen3-4B as shipped in Tongyi-MAI/Z-Image-Turbo `text_encoder/config.json`.
    pub fn z_image_turbo() -> Self {
        Self {
            vocab_size: 151_936,
            hidden_size: 2560,
            intermediate_size: 9728,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: Some(8),
            head_dim: Some(128),
            rms_norm_eps: 1e-6,
            rope_theta: Some(1_000_000.0),
            rope_parameters: None,
            rope_scaling: None,
            attention_bias: false,
            hidden_act: "silu".to_owned(),
            max_position_embeddings: 40960,
        }
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::parse(&crate::config::read_text(path)?, path)
    }

    /// Parses and validates the text of the file; `path` is only used in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        crate::config::parse_json(text, path, Self::validate)
    }

    /// Checks that the sizes are consistent and within [`limits`](crate::config::limits), and the options
    /// supported; the `Err` says what is wrong.
    pub fn validate(&self) -> std::result::Result<(), String> {
        use crate::config::limits::{self, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH};
        limits::check(&[
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            ("intermediate_size", self.intermediate_size, MAX_WIDTH),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads(), MAX_HEADS),
            ("head_dim", self.head_dim(), MAX_WIDTH),
        ])?;
        if self.hidden_act != "silu" {
            return Err(format!("hidden_act {:?} is not supported (only silu)", self.hidden_act));
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err("rope_scaling is not supported".to_owned());
        }
        if let Some(p) = &self.rope_parameters
            && p.rope_type != "default"
        {
            return Err(format!("rope_type {:?} is not supported (only default)", p.rope_type));
        }
        if self.num_hidden_layers < 2 {
            return Err("num_hidden_layers must be at least 2 (z-image uses hidden_states[-2])".to_owned());
        }
        let (heads, kv) = (self.num_attention_heads, self.num_kv_heads());
        if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
            return Err(format!("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"));
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            return Err(format!("head_dim {} must be positive and even", self.head_dim()));
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.intermediate_size == 0 {
            return Err("vocab_size, hidden_size and intermediate_size must be positive".to_owned());
        }
        Ok(())
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The RoPE base: `rope_parameters.rope_theta`, else `rope_theta`, else transformers' default 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters.as_ref().map(|p| p.rope_theta).or(self.rope_theta).unwrap_or(10_000.0)
    }

    /// Parameters of one decoder layer.
    pub fn layer_params(&self) -> usize {
        let (h, hd) = (self.hidden_size, self.head_dim());
        let (q, kv) = (self.num_attention_heads * hd, self.num_kv_heads() * hd);
        let bias = if self.attention_bias { q + 2 * kv + h } else { 0 };
        h * q + 2 * h * kv + q * h + bias + 2 * hd + 3 * h * self.intermediate_size + 2 * h
    }

    /// Parameters of the token embedding.
    pub fn embedding_params(&self) -> usize {
        self.vocab_size * self.hidden_size
    }

    /// Parameters in the checkpoint (`Qwen3Model`: embedding, every layer, final norm; no `lm_head`).
    /// 4,022,468,096 for Z-Image-Turbo.
    pub fn num_params(&self) -> usize {
        self.embedding_params() + self.num_hidden_layers * self.layer_params() + self.hidden_size
    }

    /// Parameters [`TextEncoder`] holds: the embedding and all layers but the last.
    pub fn num_params_used(&self) -> usize {
        self.embedding_params() + (self.num_hidden_layers - 1) * self.layer_params()
    }

    /// Checkpoint bytes at `bytes_per_param` (2 for bf16, 4 for f32).
    pub fn bytes(&self, bytes_per_param: usize) -> u64 {
        (self.num_params() * bytes_per_param) as u64
    }

    /// Bytes of what [`TextEncoder`] holds at `bytes_per_param`.
    pub fn bytes_used(&self, bytes_per_param: usize) -> u64 {
        (self.num_params_used() * bytes_per_param) as u64
    }
}

/// The token embedding table, `weight` `[vocab, hidden]` (PyTorch `nn.Embedding`).
#[derive(Module, Debug)]
pub struct TokenEmbedding {
    /// One row per token id.
    pub weight: Param<Tensor<2>>,
}

impl TokenEmbedding {
    /// Looks up `ids` `[batch, seq]` -> `[batch, seq, hidden]`.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        embedding(self.weight.val(), ids)
    }
}

/// Grouped-query self-attention with per-head RMSNorm on queries and keys and rotate-half RoPE.
#[derive(Module, Debug)]
pub struct SelfAttention {
    /// `hidden -> heads·head_dim`.
    pub q_proj: PtLinear,
    /// `hidden -> kv_heads·head_dim`.
    pub k_proj: PtLinear,
    /// `hidden -> kv_heads·head_dim`.
    pub v_proj: PtLinear,
    /// `heads·head_dim -> hidden`.
    pub o_proj: PtLinear,
    /// RMSNorm over `head_dim`, applied to every query head before RoPE.
    pub q_norm: RmsNorm,
    /// RMSNorm over `head_dim`, applied to every key head before RoPE.
    pub k_norm: RmsNorm,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
}

impl SelfAttention {
    /// Causal attention over `x` `[batch, seq, hidden]` -> `[batch, seq, hidden]`; `cos`/`sin` are
    /// `[seq, head_dim]` in `x`'s dtype.
    pub fn forward(&self, x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<3> {
        whole(self_attention(&Layer::whole(self), x, cos, sin))
    }
}

/// [`SelfAttention::forward`] over a [`Layer`], taking `q_proj`, `k_proj`, `v_proj`, the attention's own
/// parameters (the query and key norms), then `o_proj`.
fn self_attention(
    attention: &Layer<'_, SelfAttention>,
    x: Tensor<3>,
    cos: Tensor<2>,
    sin: Tensor<2>,
) -> Result<Tensor<3>> {
    let [b, l, _] = x.dims();
    let structure = attention.structure();
    let [nh, nkv, hd] = [structure.num_heads, structure.num_kv_heads, structure.head_dim];
    let q = leaf!(attention, q_proj).forward(x.clone());
    let k = leaf!(attention, k_proj).forward(x.clone());
    let v = leaf!(attention, v_proj).forward(x);
    let (q, k) = {
        let norms = attention.own()?;
        (norms.q_norm.forward(q.reshape([b, l, nh, hd])), norms.k_norm.forward(k.reshape([b, l, nkv, hd])))
    };
    let v = v.reshape([b, l, nkv, hd]);
    let cos = cos.unsqueeze_dims::<4>(&[0, 1]);
    let sin = sin.unsqueeze_dims::<4>(&[0, 1]);
    let q = rope(q.swap_dims(1, 2), cos.clone(), sin.clone());
    let k = repeat_kv(rope(k.swap_dims(1, 2), cos, sin), nh / nkv);
    let v = repeat_kv(v.swap_dims(1, 2), nh / nkv);
    let out = burn::tensor::module::attention(
        q,
        k,
        v,
        None,
        None,
        AttentionModuleOptions { scale: Some(1.0 / (hd as f64).sqrt()), softcap: None, is_causal: true },
    );
    Ok(leaf!(attention, o_proj).forward(out.swap_dims(1, 2).reshape([b, l, nh * hd])))
}

/// `x·cos + rotate_half(x)·sin` with `rotate_half([x1, x2]) = [−x2, x1]` (halves of the last dimension).
/// Shapes: `x` `[batch, heads, seq, head_dim]`, `cos`/`sin` broadcastable to it.
fn rope(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    let half = x.dims()[3] / 2;
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos + rotated * sin
}

/// Repeats each key/value head `n_rep` times (transformers `repeat_kv`: query head `h` uses kv head `h / n_rep`).
/// Shapes: `[batch, kv_heads, seq, head_dim]` -> `[batch, kv_heads·n_rep, seq, head_dim]`.
fn repeat_kv(x: Tensor<4>, n_rep: usize) -> Tensor<4> {
    if n_rep == 1 {
        return x;
    }
    let [b, nkv, l, hd] = x.dims();
    x.unsqueeze_dim::<5>(2).expand([b, nkv, n_rep, l, hd]).reshape([b, nkv * n_rep, l, hd])
}

/// The SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// `hidden -> intermediate`.
    pub gate_proj: PtLinear,
    /// `hidden -> intermediate`.
    pub up_proj: PtLinear,
    /// `intermediate -> hidden`.
    pub down_proj: PtLinear,
}

impl Mlp {
    /// `[..., hidden]` -> `[..., hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        whole(mlp(&Layer::whole(self), x))
    }
}

/// [`Mlp::forward`] over a [`Layer`], taking `gate_proj`, `up_proj`, then `down_proj`.
fn mlp(mlp: &Layer<'_, Mlp>, x: Tensor<3>) -> Result<Tensor<3>> {
    let gate = silu(leaf!(mlp, gate_proj).forward(x.clone()));
    let up = leaf!(mlp, up_proj).forward(x);
    Ok(leaf!(mlp, down_proj).forward(gate * up))
}

/// One pre-norm Qwen3 decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// Attention block.
    pub self_attn: SelfAttention,
    /// MLP block.
    pub mlp: Mlp,
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// `x` `[batch, seq, hidden]` -> same; `cos`/`sin` `[seq, head_dim]`.
    pub fn forward(&self, x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<3> {
        whole(decoder_layer_forward(Layer::whole(self), x, cos, sin))
    }
}

/// [`DecoderLayer::forward`] over a [`Layer`]: the same computation, taking one part at a time in call order
/// (the layer's own norms, `self_attn.q_proj`, `k_proj`, `v_proj`, `self_attn`'s norms, `o_proj`,
/// `mlp.gate_proj`, `up_proj`, `down_proj`). Under leaf-level group offload only the part in use (and the norms)
/// is on the device.
pub fn decoder_layer_forward(
    layer: Layer<'_, DecoderLayer>,
    x: Tensor<3>,
    cos: Tensor<2>,
    sin: Tensor<2>,
) -> Result<Tensor<3>> {
    let norms = layer.own()?;
    let attended = self_attention(&narrow!(layer, self_attn), norms.input_layernorm.forward(x.clone()), cos, sin)?;
    let h = x + attended;
    let mlp_out = mlp(&narrow!(layer, mlp), norms.post_attention_layernorm.forward(h.clone()))?;
    Ok(h + mlp_out)
}

/// The part of `Qwen3Model` that produces `hidden_states[-2]`: embeddings and all decoder layers but the last.
/// Under offload its decoder layers stream; a layer's forward takes its own norms first.
#[derive(Module, Debug, OffloadModel)]
#[offload(class = "Qwen3Model", weights = TextEncoderWeights, parts = TextEncoderParts, leaves = crate::nn::leaf_types)]
pub struct TextEncoder {
    /// Token embedding.
    pub embed_tokens: TokenEmbedding,
    /// Decoder layers `0 ..= num_hidden_layers − 2` of the checkpoint.
    #[offload(blocks)]
    pub layers: Vec<DecoderLayer>,
    /// RoPE base.
    pub rope_theta: f64,
    /// Per-head width (RoPE table width).
    pub head_dim: usize,
}

impl TextEncoder {
    /// Builds the module with lazily initialised parameters on `device` (nothing is allocated until loading
    /// replaces them). `config` must be valid ([`TextEncoderConfig::validate`]).
    pub fn new(config: &TextEncoderConfig, device: &Device) -> Self {
        let (h, hd) = (config.hidden_size, config.head_dim());
        let (nh, nkv) = (config.num_attention_heads, config.num_kv_heads());
        let bias = config.attention_bias;
        let eps = config.rms_norm_eps;
        let layers = (0..config.num_hidden_layers - 1)
            .map(|_| DecoderLayer {
                self_attn: SelfAttention {
                    q_proj: PtLinear::new(h, nh * hd, bias, device),
                    k_proj: PtLinear::new(h, nkv * hd, bias, device),
                    v_proj: PtLinear::new(h, nkv * hd, bias, device),
                    o_proj: PtLinear::new(nh * hd, h, bias, device),
                    q_norm: RmsNorm::new(hd, eps, device),
                    k_norm: RmsNorm::new(hd, eps, device),
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                },
                mlp: Mlp {
                    gate_proj: PtLinear::new(h, config.intermediate_size, false, device),
                    up_proj: PtLinear::new(h, config.intermediate_size, false, device),
                    down_proj: PtLinear::new(config.intermediate_size, h, false, device),
                },
                input_layernorm: RmsNorm::new(h, eps, device),
                post_attention_layernorm: RmsNorm::new(h, eps, device),
            })
            .collect();
        Self {
            embed_tokens: TokenEmbedding {
                weight: Initializer::Normal { mean: 0.0, std: 0.02 }.init([config.vocab_size, h], device),
            },
            layers,
            rope_theta: config.rope_theta(),
            head_dim: hd,
        }
    }

    /// Checkpoint key prefixes this module deliberately does not hold: the last decoder layer and the final norm
    /// (and a tied `lm_head`, should a `Qwen3ForCausalLM` export carry one). Keys are given without the optional
    /// `model.` prefix.
    pub fn unused_checkpoint_prefixes(config: &TextEncoderConfig) -> Vec<String> {
        vec![format!("layers.{}.", config.num_hidden_layers - 1), "norm.".to_owned()]
    }

    /// The RoPE tables for positions `0..seq`: `(cos, sin)`, each `[seq, head_dim]` in f32
    /// (`inv_freq_j = θ^(−2j/head_dim)`, angles duplicated over both halves as transformers does).
    pub fn rope_tables(&self, seq: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let half = self.head_dim / 2;
        let inv_freq: Vec<f32> =
            (0..half).map(|j| (1.0 / self.rope_theta.powf((2 * j) as f64 / self.head_dim as f64)) as f32).collect();
        let mut cos = Vec::with_capacity(seq * self.head_dim);
        let mut sin = Vec::with_capacity(seq * self.head_dim);
        for pos in 0..seq {
            for _ in 0..2 {
                for f in &inv_freq {
                    // transformers multiplies the f32 position by the f32 inverse frequency.
                    let angle = pos as f32 * f;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let shape = [seq, self.head_dim];
        (Tensor::from_data(TensorData::new(cos, shape), device), Tensor::from_data(TensorData::new(sin, shape), device))
    }

    /// `hidden_states[-2]` for a batch of right-padded ids.
    ///
    /// Shapes: `input_ids` `[batch, seq]` -> `[batch, seq, hidden]`. Attention is causal, so with right padding the
    /// rows of real tokens never depend on the pads; pad rows are computed but meaningless.
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Tensor<3> {
        whole(self.weights().forward(input_ids))
    }

    /// The token embeddings of `input_ids` `[batch, seq]` and the RoPE tables for their positions, in the
    /// weights' dtype: what every decoder layer takes.
    pub fn embed(&self, input_ids: Tensor<2, Int>) -> (Tensor<3>, Tensor<2>, Tensor<2>) {
        let device = input_ids.device();
        let seq = input_ids.dims()[1];
        let x = self.embed_tokens.forward(input_ids);
        let (cos, sin) = self.rope_tables(seq, &device);
        let (cos, sin) = (cos.cast(x.dtype()), sin.cast(x.dtype()));
        (x, cos, sin)
    }

    /// The embedding width (`hidden_size`).
    pub fn hidden_size(&self) -> usize {
        self.embed_tokens.weight.shape().dims::<2>()[1]
    }

    /// The prompt embeddings exactly as `ZImagePipeline.encode_prompt` returns them: for each prompt, the rows of
    /// `hidden_states[-2]` where the mask is true, `[len_i, hidden]`.
    ///
    /// Shapes: `input_ids` `[batch, seq]`, `attention_mask` `[batch, seq]` (`true` = real token). Only the first
    /// `max_i len_i` positions are computed (trailing pads cannot influence real tokens under causal attention).
    /// Errors if the shapes differ or a mask row is not right-padded (ones, then zeros).
    pub fn encode(&self, input_ids: Tensor<2, Int>, attention_mask: Tensor<2, Bool>) -> Result<Vec<Tensor<2>>> {
        self.weights().encode(input_ids, attention_mask)
    }

    /// The dtype of the weights (and of the embeddings this module returns).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.weight.val().dtype()
    }
}

impl TextEncoderWeights<'_> {
    /// `hidden_states[-2]` for right-padded ids `[batch, seq]` → `[batch, seq, hidden]`, as
    /// [`TextEncoder::forward`].
    pub fn forward(self, input_ids: Tensor<2, Int>) -> Result<Tensor<3>> {
        let (x, cos, sin) = self.shell.get()?.embed(input_ids);
        self.layers.try_fold(x, |layer, x| decoder_layer_forward(layer, x, cos.clone(), sin.clone()))
    }

    /// Each prompt's valid rows of `hidden_states[-2]`, as [`TextEncoder::encode`].
    pub fn encode(self, input_ids: Tensor<2, Int>, attention_mask: Tensor<2, Bool>) -> Result<Vec<Tensor<2>>> {
        // The width is read from the shell only when no prompt has a token (no forward to read it from).
        encode_valid_rows(input_ids, attention_mask, || Ok(self.shell.get()?.hidden_size()), |ids| self.forward(ids))
    }
}

/// [`TextEncoder::encode`] with the forward given: validates the mask (right-padded rows), runs `forward` over
/// the first `max len` positions and returns each prompt's valid rows `[len_i, hidden]`.
fn encode_valid_rows(
    input_ids: Tensor<2, Int>,
    attention_mask: Tensor<2, Bool>,
    hidden: impl FnOnce() -> Result<usize>,
    forward: impl FnOnce(Tensor<2, Int>) -> Result<Tensor<3>>,
) -> Result<Vec<Tensor<2>>> {
    let [b, seq] = input_ids.dims();
    if attention_mask.dims() != [b, seq] {
        return Err(Error::Shape {
            op: "text encoder".to_owned(),
            reason: format!("attention_mask has shape {:?}, input_ids {:?}", attention_mask.dims(), [b, seq]),
        });
    }
    let mask = attention_mask.int().try_into_data().map_err(|e| Error::Shape {
        op: "text encoder".to_owned(),
        reason: format!("cannot read attention_mask back from the device: {e}"),
    })?;
    let mask: Vec<bool> =
        mask.try_into_vec_as::<i64>().map(|bits| bits.into_iter().map(|bit| bit != 0).collect()).map_err(|e| {
            Error::Shape { op: "text encoder".to_owned(), reason: format!("cannot read attention_mask: {e:?}") }
        })?;
    let mut lengths = Vec::with_capacity(b);
    for (i, row) in mask.chunks(seq.max(1)).take(b).enumerate() {
        let len = row.iter().take_while(|&&on| on).count();
        if row[len..].iter().any(|&on| on) {
            return Err(Error::Shape {
                op: "text encoder".to_owned(),
                reason: format!("attention_mask row {i} is not right-padded"),
            });
        }
        lengths.push(len);
    }
    let longest = lengths.iter().copied().max().unwrap_or(0);
    if longest == 0 {
        let device = input_ids.device();
        let hidden = hidden()?;
        return Ok(lengths.iter().map(|_| Tensor::zeros([0, hidden], &device)).collect());
    }
    let hidden = forward(input_ids.narrow(1, 0, longest))?;
    let hidden_size = hidden.dims()[2];
    Ok(lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            if len == 0 {
                return Tensor::zeros([0, hidden_size], &hidden.device());
            }
            hidden.clone().narrow(0, i, 1).narrow(1, 0, len).reshape([len, hidden_size])
        })
        .collect())
}

/// The checkpoint key renames for transformers exports that keep the `Qwen3ForCausalLM` layout (`model.` prefix).
pub const KEY_REMAP: &[(&str, &str)] = &[(r"^model\.", "")];

/// File tensors transformers' `Qwen3Model` ignores when it loads a checkpoint saved as a causal LM
/// (`Qwen3ForCausalLM`): its output head. Reported in [`LoadReport::ignored`], refused only under
/// [`LoadOptions::strict`](crate::loading::LoadOptions::strict).
pub const REFERENCE_IGNORES: &[&str] = &["lm_head."];

impl TextEncoder {
    /// Reads `dir/config.json` and loads a transformers `Qwen3Model` export in `dir` (the shards of
    /// `model.safetensors.index.json`, or `model.safetensors`; keys with or without `model.`) onto `device` with
    /// [`crate::loading::load_component`] and `opts` (plus [`KEY_REMAP`]).
    ///
    /// The last decoder layer and the final norm are skipped by design ([`TextEncoder::unused_checkpoint_prefixes`],
    /// reported in `skipped`); a causal LM's `lm_head` is reported in `ignored` ([`REFERENCE_IGNORES`]), and refused
    /// only under `opts.strict`; any other missing or unused tensor is an [`Error::PartialLoad`] unless
    /// `opts.allow_partial` is set.
    pub fn load(
        dir: impl AsRef<Path>,
        device: &Device,
        opts: &LoadOptions,
    ) -> Result<(TextEncoderConfig, Self, LoadReport)> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(Error::MissingDirectory { path: dir.to_owned() });
        }
        let config_path = crate::loading::config_file(dir, "text_encoder")?;
        let config = TextEncoderConfig::from_file(&config_path)?;
        let mut module = Self::new(&config, device);
        let load_opts = opts.clone().with_key_remap(KEY_REMAP).with_allow_partial(true);
        let mut report = load_component(&mut module, dir, &load_opts)?;
        Self::sort_report(&mut report, &config, opts)?;
        Ok((config, module, report))
    }

    /// Sorts a loaded or bound text encoder's unused keys by the rules [`TextEncoder::load`] states: the ones skipped
    /// by design into `skipped`, the reference's ignored ones into `ignored` (back into `unused` under
    /// `opts.strict`); an incomplete report is an [`Error::PartialLoad`] unless `opts.allow_partial` is set.
    pub(crate) fn sort_report(report: &mut LoadReport, config: &TextEncoderConfig, opts: &LoadOptions) -> Result<()> {
        let skipped = Self::unused_checkpoint_prefixes(config);
        let (by_design, rest): (Vec<String>, Vec<String>) = std::mem::take(&mut report.unused)
            .into_iter()
            .partition(|key| skipped.iter().any(|prefix| key.starts_with(prefix.as_str())));
        let (ignored, unused): (Vec<String>, Vec<String>) =
            rest.into_iter().partition(|key| REFERENCE_IGNORES.iter().any(|prefix| key.starts_with(prefix)));
        (report.skipped, report.ignored, report.unused) = (by_design, ignored, unused);
        if opts.strict {
            report.unused.append(&mut report.ignored);
            report.unused.sort();
        }
        if !opts.allow_partial && !report.is_complete() {
            return Err(Error::PartialLoad {
                component: report.component.clone(),
                missing: report.missing.clone(),
                unused: report.unused.clone(),
            });
        }
        Ok(())
    }
}

/// The text encoder's binding to its checkpoint files, as a method of the checkpoint (written here, beside the
/// model, so that the loader knows no model of its own).
impl crate::loading::Checkpoint {
    /// Reads `text_encoder/config.json` and binds the text encoder to its files: the file tier's
    /// [`TextEncoder::load`], with its rules (its renames, [`crate::text_encoder::KEY_REMAP`]; the last decoder
    /// layer and the final norm skipped by design and reported in `skipped`; a causal LM's `lm_head` reported in
    /// `ignored`, refused under [`LoadOptions::strict`]; any other missing or unused tensor refused unless
    /// [`LoadOptions::allow_partial`]).
    pub fn bind_text_encoder(
        &self,
        device: &Device,
        opts: &LoadOptions,
        transform: Option<Arc<dyn TensorTransform>>,
    ) -> Result<(TextEncoderConfig, BoundComponent<TextEncoder>)> {
        let dir = self.component_dir("text_encoder")?;
        let config_path = crate::loading::config_file(&dir, "text_encoder")?;
        let config = TextEncoderConfig::from_file(&config_path)?;
        let model = TextEncoder::new(&config, device);
        let bind_opts = opts.clone().with_key_remap(crate::text_encoder::KEY_REMAP).with_allow_partial(true);
        let files = WeightFiles::find(&dir)?.files();
        let mut bound = bind_files(model, &component_name(&dir), &files, &bind_opts, transform)?;
        TextEncoder::sort_report(&mut bound.report, &config, opts)?;
        Ok((config, bound))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn z_image_turbo_sizes() {
        let c = TextEncoderConfig::z_image_turbo();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.layer_params(), 100_930_816);
        assert_eq!(c.num_params(), 4_022_468_096);
        assert_eq!(c.bytes(2), 8_044_936_192);
        assert_eq!(c.num_params_used(), 4_022_468_096 - 100_930_816 - 2560);
    }
}
