//! `ZImageTransformer2DModel`, the Z-Image diffusion transformer, exposed block by block for offloading.
//!
//! The forward pass (diffusers `transformer_z_image.py`):
//! 1. the timestep `t·t_scale` is embedded (sinusoid, cos first) into the adaLN conditioning `[B, 256]`;
//! 2. the latent is cut into 2x2 patches (`[B, N, 64]`), embedded, and padded to a multiple of 32 tokens with the
//!    learned `x_pad_token`; the caption features are RMS-normed, embedded and padded with `cap_pad_token`;
//! 3. the image tokens pass through `noise_refiner` (modulated blocks), the caption tokens through
//!    `context_refiner` (unmodulated blocks), each with its own 3-axis RoPE;
//! 4. the unified sequence `[image, caption]` passes through the `layers` (modulated blocks);
//! 5. the final layer (parameter-free LayerNorm, adaLN scale, linear) maps image tokens back to patches, which
//!    are reassembled into the latent.
//!
//! For an offloader the pass is split into [`ZImageTransformer2DModel::prepare`] (steps 1-3 and the unified
//! sequence, or [`ZImageTransformer2DModel::embed`] + the refiner blocks + [`Embedded::unify`] for finer
//! control), [`block_forward`] once per entry of `layers`, and [`ZImageTransformer2DModel::finish`];
//! [`ZImageTransformer2DModel::forward`] is exactly that sequence.
//!
//! Field names mirror the diffusers checkpoint keys (hence `adaLN_modulation`), with two exceptions:
//! `all_x_embedder.2-1.*` and `all_final_layer.2-1.*` live in PyTorch `ModuleDict`s keyed by `"2-1"` (patch 2,
//! frame patch 1), which is not a Rust field name; they are the fields `x_embedder` and `final_layer`, and the
//! loader renames the keys with [`KEY_REMAP`].
//!
//! Batching: every item of a batch must have the same latent size and caption length (the pipeline's case), so
//! no attention mask is needed; pad tokens are not masked, they carry the learned pad embeddings (as in
//! diffusers). Dtype: the model computes in its weights' dtype (f32 or bf16); the timestep embedding, norms,
//! RoPE and attention statistics run in f32.

// The `adaLN_modulation` fields keep the checkpoint's spelling so the field tree matches the safetensors keys;
// `#[derive(Module)]` expands them into local variables, so the lint has to be silenced for the whole file.
#![allow(non_snake_case)]

use burn::module::{Initializer, Module, Param};
use burn::nn::activation::SiLU;
use burn::tensor::activation::silu;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::config::{
    FINAL_NORM_EPS, FREQUENCY_EMBEDDING_SIZE, QK_NORM_EPS, SEQ_MULTI_OF, T_EMBED_MID_DIM, TransformerConfig,
};
use crate::error::{Error, Result};
use group_offload::{Layer, OffloadModel, leaf, narrow, whole};

use crate::nn::{PtLinear, RmsNorm, layer_norm_no_affine};

/// Checkpoint key renames applied when loading a diffusers transformer: `(regex, replacement)`.
///
/// `all_x_embedder.2-1.` becomes `x_embedder.` and `all_final_layer.2-1.` becomes `final_layer.`; every other
/// key matches the module's field tree as is.
pub const KEY_REMAP: &[(&str, &str)] =
    &[(r"^all_x_embedder\.2-1\.", "x_embedder."), (r"^all_final_layer\.2-1\.", "final_layer.")];

/// The sinusoidal timestep embedding followed by `Linear -> SiLU -> Linear` (`t_embedder`).
///
/// Keys: `mlp.0.{weight,bias}`, `mlp.2.{weight,bias}` (index 1 is the parameter-free SiLU).
#[derive(Module, Debug)]
pub struct TimestepEmbedder {
    /// `(Linear(256 -> 1024), SiLU, Linear(1024 -> adaln_dim))`.
    pub mlp: (PtLinear, SiLU, PtLinear),
}

impl TimestepEmbedder {
    fn new(out_dim: usize, device: &Device) -> Self {
        Self {
            mlp: (
                PtLinear::new(FREQUENCY_EMBEDDING_SIZE, T_EMBED_MID_DIM, true, device),
                SiLU,
                PtLinear::new(T_EMBED_MID_DIM, out_dim, true, device),
            ),
        }
    }

    /// Embeds already-scaled timesteps `t` `[B]` (any float dtype) into `[B, out_dim]` in the weights' dtype.
    ///
    /// The sinusoid is `cat(cos(t·f), sin(t·f))` with `f_i = exp(-ln(10000)·i/128)`, computed in f32.
    pub fn forward(&self, t: Tensor<1>) -> Tensor<2> {
        let half = FREQUENCY_EMBEDDING_SIZE / 2;
        let device = t.device();
        let ln_period = -(10000f64.ln()) as f32;
        let freqs: Vec<f32> = (0..half).map(|i| (ln_period * i as f32 / half as f32).exp()).collect();
        let freqs = Tensor::<1>::from_data(TensorData::new(freqs, [half]), (&device, DType::F32));
        let args = t.cast(DType::F32).unsqueeze_dim::<2>(1) * freqs.unsqueeze_dim::<2>(0);
        let embedding = Tensor::cat(vec![args.clone().cos(), args.sin()], 1);
        let (first, _, second) = &self.mlp;
        let dtype = first.dtype();
        second.forward(silu(first.forward(embedding.cast(dtype))))
    }
}

/// Self-attention with per-head RMS-normed queries and keys and 3-axis RoPE (`attention`).
///
/// Keys: `to_q.weight`, `to_k.weight`, `to_v.weight`, `to_out.0.weight` (no biases), `norm_q.weight`,
/// `norm_k.weight` `[head_dim]`.
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection `dim -> dim`.
    pub to_q: PtLinear,
    /// Key projection `dim -> dim`.
    pub to_k: PtLinear,
    /// Value projection `dim -> dim`.
    pub to_v: PtLinear,
    /// Output projection, one element (`to_out.0`; PyTorch's `to_out.1` is a parameter-free dropout).
    pub to_out: Vec<PtLinear>,
    /// Per-head query norm (absent when the config has `qk_norm: false`).
    pub norm_q: Option<RmsNorm>,
    /// Per-head key norm (absent when the config has `qk_norm: false`).
    pub norm_k: Option<RmsNorm>,
    /// Number of heads.
    pub n_heads: usize,
}

impl Attention {
    fn new(config: &TransformerConfig, device: &Device) -> Self {
        let d = config.dim;
        let head_dim = config.head_dim();
        let norm = || config.qk_norm.then(|| RmsNorm::new(head_dim, QK_NORM_EPS, device));
        Self {
            to_q: PtLinear::new(d, d, false, device),
            to_k: PtLinear::new(d, d, false, device),
            to_v: PtLinear::new(d, d, false, device),
            to_out: vec![PtLinear::new(d, d, false, device)],
            norm_q: norm(),
            norm_k: norm(),
            n_heads: config.n_heads,
        }
    }

    /// Attends over `x` `[B, S, dim]` with `rope` for its `S` positions; returns `[B, S, dim]`.
    pub fn forward(&self, x: Tensor<3>, rope: &Rope) -> Tensor<3> {
        whole(attention_forward(&Layer::whole(self), x, rope))
    }
}

/// [`Attention::forward`] over a [`Layer`], taking each part in turn: `to_q`, `to_k`, `to_v`, the attention's own
/// parameters (the query and key norms, when the config has them) and `to_out.0`.
fn attention_forward(attention: &Layer<'_, Attention>, x: Tensor<3>, rope: &Rope) -> Result<Tensor<3>> {
    let [b, s, d] = x.dims();
    let (h, outs) = (attention.structure().n_heads, attention.structure().to_out.len());
    let q = leaf!(attention, to_q).forward(x.clone());
    let k = leaf!(attention, to_k).forward(x.clone());
    let v = leaf!(attention, to_v).forward(x);
    let head_dim = d / h;
    let heads = |t: Tensor<3>| t.reshape([b, s, h, head_dim]);
    let (mut q, mut k, v) = (heads(q), heads(k), heads(v));
    let structure = attention.structure();
    if structure.norm_q.is_some() || structure.norm_k.is_some() {
        let norms = attention.own()?;
        if let Some(norm) = &norms.norm_q {
            q = norm.forward(q);
        }
        if let Some(norm) = &norms.norm_k {
            k = norm.forward(k);
        }
    }
    let q = rope.apply(q).swap_dims(1, 2);
    let k = rope.apply(k).swap_dims(1, 2);
    let v = v.swap_dims(1, 2);
    let options =
        AttentionModuleOptions { scale: Some(1.0 / (head_dim as f64).sqrt()), softcap: None, is_causal: false };
    let mut out = burn::tensor::module::attention(q, k, v, None, None, options).swap_dims(1, 2).reshape([b, s, d]);
    for i in 0..outs {
        out = leaf!(attention, to_out[i]).forward(out);
    }
    Ok(out)
}

/// The SwiGLU feed-forward `w2(silu(w1 x) · w3 x)` (`feed_forward`), no biases.
#[derive(Module, Debug)]
pub struct FeedForward {
    /// Gate projection `dim -> hidden`.
    pub w1: PtLinear,
    /// Down projection `hidden -> dim`.
    pub w2: PtLinear,
    /// Up projection `dim -> hidden`.
    pub w3: PtLinear,
}

impl FeedForward {
    fn new(dim: usize, hidden: usize, device: &Device) -> Self {
        Self {
            w1: PtLinear::new(dim, hidden, false, device),
            w2: PtLinear::new(hidden, dim, false, device),
            w3: PtLinear::new(dim, hidden, false, device),
        }
    }

    /// `[..., dim] -> [..., dim]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        whole(feed_forward(&Layer::whole(self), x))
    }
}

/// [`FeedForward::forward`] over a [`Layer`], taking `w1`, `w3`, then `w2`.
fn feed_forward(feed_forward: &Layer<'_, FeedForward>, x: Tensor<3>) -> Result<Tensor<3>> {
    let gate = silu(leaf!(feed_forward, w1).forward(x.clone()));
    let up = leaf!(feed_forward, w3).forward(x);
    Ok(leaf!(feed_forward, w2).forward(gate * up))
}

/// One `ZImageTransformerBlock`: sandwich-normed attention and SwiGLU, modulated by the timestep when it has an
/// `adaLN_modulation` projection (noise refiner and main layers) and plain otherwise (context refiner).
///
/// A block is the unit an offloader moves: 180.9 M parameters modulated, 177.0 M plain, for Turbo.
#[derive(Module, Debug)]
pub struct ZImageBlock {
    /// The attention (`attention.*`).
    pub attention: Attention,
    /// The feed-forward (`feed_forward.*`).
    pub feed_forward: FeedForward,
    /// Norm before attention.
    pub attention_norm1: RmsNorm,
    /// Norm after attention.
    pub attention_norm2: RmsNorm,
    /// Norm before the feed-forward.
    pub ffn_norm1: RmsNorm,
    /// Norm after the feed-forward.
    pub ffn_norm2: RmsNorm,
    /// `adaLN_modulation.0`: `Linear(adaln_dim -> 4·dim)` with bias; empty for an unmodulated block.
    pub adaLN_modulation: Vec<PtLinear>,
}

impl ZImageBlock {
    /// Creates a block with lazily initialised parameters.
    pub fn new(config: &TransformerConfig, modulated: bool, device: &Device) -> Self {
        let d = config.dim;
        let norm = || RmsNorm::new(d, config.norm_eps, device);
        Self {
            attention: Attention::new(config, device),
            feed_forward: FeedForward::new(d, config.ffn_hidden_dim(), device),
            attention_norm1: norm(),
            attention_norm2: norm(),
            ffn_norm1: norm(),
            ffn_norm2: norm(),
            adaLN_modulation: if modulated {
                vec![PtLinear::new(config.adaln_dim(), 4 * d, true, device)]
            } else {
                Vec::new()
            },
        }
    }

    /// Whether the block is modulated by the timestep.
    pub fn is_modulated(&self) -> bool {
        !self.adaLN_modulation.is_empty()
    }

    /// Runs the block over `x` `[B, S, dim]`, with `rope` for its `S` positions and, for a modulated block, the
    /// conditioning `adaln` `[B, adaln_dim]` (ignored by an unmodulated block). Returns `[B, S, dim]`.
    ///
    /// Modulated: `x += tanh(g_msa)·norm2(attn(norm1(x)·(1+s_msa)))`, then the same with the feed-forward,
    /// where `(s_msa, g_msa, s_mlp, g_mlp)` are the four chunks of `adaLN_modulation(adaln)`.
    pub fn forward(&self, x: Tensor<3>, rope: &Rope, adaln: Option<&Tensor<2>>) -> Tensor<3> {
        whole(block_layer_forward(Layer::whole(self), x, rope, adaln))
    }
}

/// [`ZImageBlock::forward`] over a [`Layer`]: the same computation, taking one part at a time in call order
/// (`adaLN_modulation.0`, the block's own norms, the attention's projections and norms, `feed_forward.w1`,
/// `w3`, `w2`). Under leaf-level group offload only the part in use (and the norms) is on the device.
pub fn block_layer_forward(
    block: Layer<'_, ZImageBlock>,
    x: Tensor<3>,
    rope: &Rope,
    adaln: Option<&Tensor<2>>,
) -> Result<Tensor<3>> {
    let [b, _, d] = x.dims();
    let modulation = match adaln {
        Some(adaln) if block.structure().is_modulated() => {
            Some(leaf!(block, adaLN_modulation[0]).forward(adaln.clone()).reshape([b, 1, 4 * d]))
        }
        _ => None,
    };
    let chunk = |m: &Tensor<3>, i: usize| m.clone().narrow(2, i * d, d);
    let norms = block.own()?;
    let h = norms.attention_norm1.forward(x.clone());
    let h = match &modulation {
        Some(m) => h * (chunk(m, 0) + 1.0),
        None => h,
    };
    let attn = norms.attention_norm2.forward(attention_forward(&narrow!(block, attention), h, rope)?);
    let x = match &modulation {
        Some(m) => x + chunk(m, 1).tanh() * attn,
        None => x + attn,
    };
    let h = norms.ffn_norm1.forward(x.clone());
    let h = match &modulation {
        Some(m) => h * (chunk(m, 2) + 1.0),
        None => h,
    };
    let ffn = norms.ffn_norm2.forward(feed_forward(&narrow!(block, feed_forward), h)?);
    Ok(match &modulation {
        Some(m) => x + chunk(m, 3).tanh() * ffn,
        None => x + ffn,
    })
}

/// The output head (`all_final_layer.2-1`, field `final_layer`): `linear(LayerNorm(x)·(1 + scale(adaln)))`.
#[derive(Module, Debug)]
pub struct FinalLayer {
    /// `linear`: `dim -> patch_dim` with bias.
    pub linear: PtLinear,
    /// `adaLN_modulation`: `(SiLU, Linear(adaln_dim -> dim))`, keys `adaLN_modulation.1.*`.
    pub adaLN_modulation: (SiLU, PtLinear),
}

impl FinalLayer {
    /// Maps `x` `[B, S, dim]` to patches `[B, S, patch_dim]` under the conditioning `adaln` `[B, adaln_dim]`.
    pub fn forward(&self, x: Tensor<3>, adaln: &Tensor<2>) -> Tensor<3> {
        let [b, _, d] = x.dims();
        let scale = self.adaLN_modulation.1.forward(silu(adaln.clone())).reshape([b, 1, d]) + 1.0;
        self.linear.forward(layer_norm_no_affine(x, FINAL_NORM_EPS) * scale)
    }
}

/// Rotary embedding angles for a sequence: `cos` and `sin`, each `[S, head_dim/2]` in f32.
///
/// Pair `j` of a head vector (`x[2j]`, `x[2j+1]`, interleaved) is rotated by the angle in column `j`.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Cosines, `[S, head_dim/2]`, f32.
    pub cos: Tensor<2>,
    /// Sines, `[S, head_dim/2]`, f32.
    pub sin: Tensor<2>,
}

impl Rope {
    /// Builds the angles for positions `ids` (`(axis0, axis1, axis2)` per token), as diffusers' `RopeEmbedder`:
    /// per axis `k` with dimension `d_k`, `freq_j = 1 / theta^(2j/d_k)` in f64, angle `pos·freq_j` rounded to f32,
    /// then `cos`/`sin` of that f32 angle.
    pub fn new(ids: &[[usize; 3]], config: &TransformerConfig, device: &Device) -> Self {
        let half: usize = config.axes_dims.iter().sum::<usize>() / 2;
        let freqs: Vec<Vec<f64>> = config
            .axes_dims
            .iter()
            .map(|&d| (0..d / 2).map(|j| 1.0 / config.rope_theta.powf((2 * j) as f64 / d as f64)).collect())
            .collect();
        let mut cos = Vec::with_capacity(ids.len() * half);
        let mut sin = Vec::with_capacity(ids.len() * half);
        for id in ids {
            for (axis, axis_freqs) in freqs.iter().enumerate() {
                for f in axis_freqs {
                    // torch computes the table in f64, then `.float()`s it before `polar`.
                    let angle = (id[axis] as f64 * f) as f32 as f64;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        let upload = |v: Vec<f32>| Tensor::<2>::from_data(TensorData::new(v, [ids.len(), half]), (device, DType::F32));
        Self { cos: upload(cos), sin: upload(sin) }
    }

    /// The angles of `self`'s positions followed by `other`'s.
    pub fn cat(&self, other: &Rope) -> Rope {
        Rope {
            cos: Tensor::cat(vec![self.cos.clone(), other.cos.clone()], 0),
            sin: Tensor::cat(vec![self.sin.clone(), other.sin.clone()], 0),
        }
    }

    /// The number of positions.
    pub fn len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Whether there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rotates `x` `[B, S, heads, head_dim]` (computed in f32, returned in `x`'s dtype).
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, s, h, d] = x.dims();
        let dtype = x.dtype();
        let pairs = x.cast(DType::F32).reshape([b, s, h, d / 2, 2]);
        let re = pairs.clone().narrow(4, 0, 1);
        let im = pairs.narrow(4, 1, 1);
        let cos = self.cos.clone().reshape([1, s, 1, d / 2, 1]);
        let sin = self.sin.clone().reshape([1, s, 1, d / 2, 1]);
        let out_re = re.clone() * cos.clone() - im.clone() * sin.clone();
        let out_im = re * sin + im * cos;
        Tensor::cat(vec![out_re, out_im], 4).reshape([b, s, h, d]).cast(dtype)
    }
}

/// The embedded inputs before the unified sequence is formed (see [`ZImageTransformer2DModel::embed`]).
#[derive(Debug, Clone)]
pub struct Embedded {
    /// Image tokens `[B, N_pad, dim]` (patch embeddings, then `x_pad_token` rows).
    pub image: Tensor<3>,
    /// Caption tokens `[B, L_pad, dim]` (caption embeddings, then `cap_pad_token` rows).
    pub caption: Tensor<3>,
    /// RoPE for the image tokens.
    pub image_rope: Rope,
    /// RoPE for the caption tokens.
    pub caption_rope: Rope,
    /// The timestep conditioning `[B, adaln_dim]`, in the model dtype.
    pub adaln: Tensor<2>,
    /// The latent layout needed to reassemble the output.
    pub layout: LatentLayout,
}

impl Embedded {
    /// Forms the unified sequence `[image, caption]` for the main layers.
    pub fn unify(self) -> ZImageState {
        ZImageState {
            hidden: Tensor::cat(vec![self.image, self.caption], 1),
            rope: self.image_rope.cat(&self.caption_rope),
            adaln: self.adaln,
            layout: self.layout,
        }
    }
}

/// Where the image tokens are and how to fold them back into a latent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentLayout {
    /// Batch size.
    pub batch: usize,
    /// Latent channels.
    pub channels: usize,
    /// Latent `(frames, height, width)`.
    pub size: [usize; 3],
    /// Tokens per axis `(frames, height, width)` after patching.
    pub tokens: [usize; 3],
    /// Image tokens before padding (they come first in the unified sequence).
    pub image_tokens: usize,
    /// Image tokens after padding to a multiple of 32.
    pub padded_image_tokens: usize,
}

/// The state carried through the main layers: the unified sequence and what every block needs.
#[derive(Debug, Clone)]
pub struct ZImageState {
    /// The unified sequence `[B, N_pad + L_pad, dim]` (image tokens first).
    pub hidden: Tensor<3>,
    /// RoPE for every position of `hidden`.
    pub rope: Rope,
    /// The timestep conditioning `[B, adaln_dim]`.
    pub adaln: Tensor<2>,
    /// The latent layout, for [`ZImageTransformer2DModel::finish`].
    pub layout: LatentLayout,
}

/// Runs `forward` once per item, as a batch of one (`xs[i]` `[C, F, H, W]` with `t[i]` and `caps[i]`
/// `[L_i, cap_feat_dim]`), and returns each output `[C, F, H, W]`: the loop behind
/// [`ZImageTransformer2DModel::forward_items`] and [`TransformerWeights::forward_items`].
pub fn forward_each(
    xs: Vec<Tensor<4>>,
    t: Tensor<1>,
    caps: Vec<Tensor<2>>,
    mut forward: impl FnMut(Tensor<5>, Tensor<1>, Tensor<3>) -> Result<Tensor<5>>,
) -> Result<Vec<Tensor<4>>> {
    xs.into_iter()
        .zip(caps)
        .enumerate()
        .map(|(i, (x, cap))| {
            let out = forward(x.unsqueeze_dim(0), t.clone().narrow(0, i, 1), cap.unsqueeze_dim(0))?;
            let [_, c, f, h, w] = out.dims();
            Ok(out.reshape([c, f, h, w]))
        })
        .collect()
}

/// Runs one main-loop block over the state. The block's weights must be on the state's device.
pub fn block_forward(block: &ZImageBlock, state: ZImageState) -> ZImageState {
    let hidden = block.forward(state.hidden, &state.rope, Some(&state.adaln));
    ZImageState { hidden, ..state }
}

/// The Z-Image transformer (diffusers `ZImageTransformer2DModel`). Under offload its three block lists stream, in
/// the order the forward runs them; a modulated block's forward takes `adaLN_modulation.0` first (the noise
/// refiner's and the main layers' blocks).
#[derive(Module, Debug, OffloadModel)]
#[offload(
    class = "ZImageTransformer2DModel",
    weights = TransformerWeights,
    parts = TransformerParts,
    leaves = crate::nn::leaf_types
)]
pub struct ZImageTransformer2DModel {
    /// `all_x_embedder.2-1`: patch embedding `patch_dim -> dim` with bias (renamed by [`KEY_REMAP`]).
    pub x_embedder: PtLinear,
    /// `all_final_layer.2-1`: the output head (renamed by [`KEY_REMAP`]).
    pub final_layer: FinalLayer,
    /// `t_embedder`: the timestep embedder.
    pub t_embedder: TimestepEmbedder,
    /// `cap_embedder`: `(RMSNorm(cap_feat_dim), Linear(cap_feat_dim -> dim))`.
    pub cap_embedder: (RmsNorm, PtLinear),
    /// `x_pad_token` `[1, dim]`: the embedding of image padding tokens.
    pub x_pad_token: Param<Tensor<2>>,
    /// `cap_pad_token` `[1, dim]`: the embedding of caption padding tokens.
    pub cap_pad_token: Param<Tensor<2>>,
    /// `noise_refiner`: modulated blocks over the image tokens.
    #[offload(blocks, first = adaLN_modulation[0])]
    pub noise_refiner: Vec<ZImageBlock>,
    /// `context_refiner`: unmodulated blocks over the caption tokens.
    #[offload(blocks)]
    pub context_refiner: Vec<ZImageBlock>,
    /// `layers`: modulated blocks over the unified sequence, the main loop.
    #[offload(blocks, first = adaLN_modulation[0])]
    pub layers: Vec<ZImageBlock>,
    /// The configuration the model was built from.
    #[module(skip)]
    pub config: TransformerConfig,
}

impl ZImageTransformer2DModel {
    /// Builds the model on `device` with lazily initialised parameters (nothing is allocated until loaded).
    ///
    /// `config` must pass [`TransformerConfig::validate`] (as [`TransformerConfig::from_file`] ensures).
    pub fn new(config: &TransformerConfig, device: &Device) -> Self {
        let d = config.dim;
        let blocks = |n: usize, modulated: bool| (0..n).map(|_| ZImageBlock::new(config, modulated, device)).collect();
        let pad_token = || Initializer::Zeros.init([1, d], device);
        Self {
            x_embedder: PtLinear::new(config.patch_dim(), d, true, device),
            final_layer: FinalLayer {
                linear: PtLinear::new(d, config.patch_dim(), true, device),
                adaLN_modulation: (SiLU, PtLinear::new(config.adaln_dim(), d, true, device)),
            },
            t_embedder: TimestepEmbedder::new(config.adaln_dim(), device),
            cap_embedder: (
                RmsNorm::new(config.cap_feat_dim, config.norm_eps, device),
                PtLinear::new(config.cap_feat_dim, d, true, device),
            ),
            x_pad_token: pad_token(),
            cap_pad_token: pad_token(),
            noise_refiner: blocks(config.n_refiner_layers, true),
            context_refiner: blocks(config.n_refiner_layers, false),
            layers: blocks(config.n_layers, true),
            config: config.clone(),
        }
    }

    /// The dtype the model computes in (its float weights'; the pad token is never quantized).
    pub fn dtype(&self) -> DType {
        self.x_pad_token.val().dtype()
    }

    /// Checks a latent shape `[B, C, F, H, W]` and caption length against the config; the pipeline calls this
    /// once at its edge so that [`Self::forward`] can trust its inputs.
    pub fn check_inputs(&self, latent: [usize; 5], caption_len: usize) -> Result<()> {
        let c = &self.config;
        let [b, ch, f, h, w] = latent;
        let shape_error = |reason: String| Error::Shape { op: "z-image transformer".into(), reason };
        if b == 0 || caption_len == 0 {
            return Err(shape_error("batch and caption length must be positive".into()));
        }
        if ch != c.in_channels {
            return Err(shape_error(format!("latent has {ch} channels, the model expects {}", c.in_channels)));
        }
        let (p, pf) = (c.patch_size(), c.f_patch_size());
        if f % pf != 0 || h % p != 0 || w % p != 0 || f == 0 || h == 0 || w == 0 {
            return Err(shape_error(format!(
                "latent frames x height x width {f}x{h}x{w} must be positive multiples of {pf}x{p}x{p}"
            )));
        }
        let lp = caption_len.next_multiple_of(SEQ_MULTI_OF);
        let limits = [lp + 1 + f / pf, h / p, w / p];
        for (axis, (&needed, &len)) in limits.iter().zip(&c.axes_lens).enumerate() {
            if needed > len {
                return Err(shape_error(format!(
                    "rope axis {axis} needs {needed} positions, the config has {len}; use a shorter caption or a smaller image"
                )));
            }
        }
        Ok(())
    }

    /// Embeds the inputs (steps 1-2 of the forward) without running any block.
    ///
    /// Shapes: `x` `[B, C, F, H, W]` latents, `t` `[B]` in `[0, 1]` (the pipeline's `1 - sigma`), `cap_feats`
    /// `[B, L, cap_feat_dim]`. Inputs are cast to the model dtype.
    pub fn embed(&self, x: Tensor<5>, t: Tensor<1>, cap_feats: Tensor<3>) -> Embedded {
        let c = &self.config;
        let device = x.device();
        let dtype = self.dtype();
        let [b, ch, f, h, w] = x.dims();
        let (p, pf) = (c.patch_size(), c.f_patch_size());
        let tokens = [f / pf, h / p, w / p];
        let n = tokens.iter().product::<usize>();
        let n_pad = n.next_multiple_of(SEQ_MULTI_OF);
        let [_, l, _] = cap_feats.dims();
        let l_pad = l.next_multiple_of(SEQ_MULTI_OF);
        let d = c.dim;

        let adaln = self.t_embedder.forward(t.cast(DType::F32) * c.t_scale).cast(dtype);

        // Patches in token order (f, h, w), features ordered (pf, ph, pw, c).
        let patches = x
            .cast(dtype)
            .reshape([b, ch, tokens[0], pf, tokens[1], p, tokens[2], p])
            .permute([0, 2, 4, 6, 3, 5, 7, 1])
            .reshape([b, n, c.patch_dim()]);
        // Pad rows would be overwritten by the pad token, so they are never embedded.
        let image = pad_rows(self.x_embedder.forward(patches), &self.x_pad_token, n_pad);

        let (norm, linear) = &self.cap_embedder;
        let caption = linear.forward(norm.forward(cap_feats.cast(dtype)));
        let caption = pad_rows(caption, &self.cap_pad_token, l_pad);
        debug_assert_eq!(image.dims()[2], d);

        // Caption token i (pads included) sits at (1 + i, 0, 0); image tokens at (L_pad + 1 + f, h, w); image
        // pads at the origin.
        let caption_ids: Vec<[usize; 3]> = (0..l_pad).map(|i| [1 + i, 0, 0]).collect();
        let mut image_ids = Vec::with_capacity(n_pad);
        for fi in 0..tokens[0] {
            for hi in 0..tokens[1] {
                for wi in 0..tokens[2] {
                    image_ids.push([l_pad + 1 + fi, hi, wi]);
                }
            }
        }
        image_ids.resize(n_pad, [0, 0, 0]);

        Embedded {
            image,
            caption,
            image_rope: Rope::new(&image_ids, c, &device),
            caption_rope: Rope::new(&caption_ids, c, &device),
            adaln,
            layout: LatentLayout {
                batch: b,
                channels: ch,
                size: [f, h, w],
                tokens,
                image_tokens: n,
                padded_image_tokens: n_pad,
            },
        }
    }

    /// Embeds the inputs, runs both refiners and forms the unified sequence: everything before the main loop.
    ///
    /// Shapes as in [`Self::embed`].
    pub fn prepare(&self, x: Tensor<5>, t: Tensor<1>, cap_feats: Tensor<3>) -> ZImageState {
        let mut embedded = self.embed(x, t, cap_feats);
        for block in &self.noise_refiner {
            embedded.image = block.forward(embedded.image, &embedded.image_rope, Some(&embedded.adaln));
        }
        for block in &self.context_refiner {
            embedded.caption = block.forward(embedded.caption, &embedded.caption_rope, None);
        }
        embedded.unify()
    }

    /// Applies the final layer to the image tokens and reassembles the latent `[B, C, F, H, W]` (model dtype).
    pub fn finish(&self, state: ZImageState) -> Tensor<5> {
        let c = &self.config;
        let layout = state.layout;
        let (p, pf) = (c.patch_size(), c.f_patch_size());
        let [tf, th, tw] = layout.tokens;
        let [f, h, w] = layout.size;
        let image = state.hidden.narrow(1, 0, layout.image_tokens);
        self.final_layer
            .forward(image, &state.adaln)
            .reshape([layout.batch, tf, th, tw, pf, p, p, layout.channels])
            .permute([0, 7, 1, 4, 2, 5, 3, 6])
            .reshape([layout.batch, layout.channels, f, h, w])
    }

    /// Runs items of different latent sizes or caption lengths, one forward each.
    ///
    /// diffusers batches such items with padding and an attention mask that hides the padding completely, so
    /// each item's result equals a batch-1 forward; running them one by one gives the same numbers without a
    /// mask. Shapes: `xs[i]` `[C, F, H, W]`, `t` `[B]`, `caps[i]` `[L_i, cap_feat_dim]` -> `[C, F, H, W]` each.
    pub fn forward_items(&self, xs: Vec<Tensor<4>>, t: Tensor<1>, caps: Vec<Tensor<2>>) -> Vec<Tensor<4>> {
        whole(forward_each(xs, t, caps, |x, t, cap| Ok(self.forward(x, t, cap))))
    }

    /// The whole forward: [`Self::prepare`], every block of `layers`, [`Self::finish`] (the forward of
    /// [`TransformerWeights`], over the resident weights).
    ///
    /// Shapes: `x` `[B, C, F, H, W]`, `t` `[B]` in `[0, 1]`, `cap_feats` `[B, L, cap_feat_dim]` ->
    /// `[B, C, F, H, W]` in the model dtype (the model's prediction; the pipeline negates it into the velocity).
    pub fn forward(&self, x: Tensor<5>, t: Tensor<1>, cap_feats: Tensor<3>) -> Tensor<5> {
        whole(self.weights().forward(x, t, cap_feats))
    }
}

impl TransformerWeights<'_> {
    /// The forward over items of possibly different sizes, one at a time (as
    /// [`ZImageTransformer2DModel::forward_items`]): `xs[i]` `[C, F, H, W]`, `t` `[n]`, `caps[i]` `[L_i, D_cap]`.
    pub fn forward_items(self, xs: Vec<Tensor<4>>, t: Tensor<1>, caps: Vec<Tensor<2>>) -> Result<Vec<Tensor<4>>> {
        forward_each(xs, t, caps, |x, t, cap| self.forward(x, t, cap))
    }

    /// One forward: `x` `[B, C, F, H, W]`, `t` `[B]`, `cap_feats` `[B, L, D_cap]` → `[B, C, F, H, W]`: embed,
    /// the noise refiner over the image tokens, the context refiner over the caption, the main layers over the
    /// unified sequence, the final layer.
    pub fn forward(self, x: Tensor<5>, t: Tensor<1>, cap_feats: Tensor<3>) -> Result<Tensor<5>> {
        let mut embedded = self.shell.get()?.embed(x, t, cap_feats);
        let (rope, adaln) = (embedded.image_rope.clone(), embedded.adaln.clone());
        embedded.image = self
            .noise_refiner
            .try_fold(embedded.image, |block, image| block_layer_forward(block, image, &rope, Some(&adaln)))?;
        let rope = embedded.caption_rope.clone();
        embedded.caption = self
            .context_refiner
            .try_fold(embedded.caption, |block, caption| block_layer_forward(block, caption, &rope, None))?;
        let ZImageState { hidden, rope, adaln, layout } = embedded.unify();
        let hidden =
            self.layers.try_fold(hidden, |block, hidden| block_layer_forward(block, hidden, &rope, Some(&adaln)))?;
        Ok(self.shell.get()?.finish(ZImageState { hidden, rope, adaln, layout }))
    }
}

/// Appends `padded - rows` copies of `token` `[1, dim]` to `x` `[B, rows, dim]`.
fn pad_rows(x: Tensor<3>, token: &Param<Tensor<2>>, padded: usize) -> Tensor<3> {
    let [b, rows, d] = x.dims();
    if padded == rows {
        return x;
    }
    let pad = token.val().cast(x.dtype()).reshape([1, 1, d]).expand([b, padded - rows, d]);
    Tensor::cat(vec![x, pad], 1)
}
