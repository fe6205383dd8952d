//! The FLUX autoencoder (diffusers `AutoencoderKL` with 16 latent channels, no quant convs) that Z-Image decodes
//! with, and that image-to-image encodes with.
//!
//! The module tree mirrors the checkpoint keys (`encoder.conv_in.weight`, `decoder.up_blocks.0.resnets.1.norm1.bias`,
//! `decoder.mid_block.attentions.0.to_out.0.weight`, ...), so `vae/diffusion_pytorch_model.safetensors` loads with
//! the identity adapter and no remapping.
//!
//! Latent convention: the pipeline's latents are `(z − shift_factor) · scaling_factor`; [`AutoencoderKl::decode`]
//! and [`AutoencoderKl::encode_mean`] work on raw `z`, and [`AutoencoderKl::unscale_latents`] /
//! [`AutoencoderKl::scale_latents`] convert between the two.

use std::path::Path;

use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::silu;
use burn::tensor::module::{attention, conv2d};
use burn::tensor::ops::{AttentionModuleOptions, ConvOptions};
use burn::tensor::{Device, Tensor};
use serde::Deserialize;

use crate::loading::{BoundComponent, LoadOptions, LoadReport, bind_component, load_component};
use crate::nn::{GroupNorm, PtLinear};
use crate::{Error, Result};

/// Epsilon of every GroupNorm in the diffusers VAE blocks.
const NORM_EPS: f64 = 1e-6;

/// `vae/config.json` (diffusers `AutoencoderKL`): the fields this crate uses. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VaeConfig {
    /// Image channels in (3).
    #[serde(default = "three")]
    pub in_channels: usize,
    /// Image channels out (3).
    #[serde(default = "three")]
    pub out_channels: usize,
    /// Channels of each resolution level, highest resolution first.
    pub block_out_channels: Vec<usize>,
    /// Must all be `DownEncoderBlock2D`.
    #[serde(default)]
    pub down_block_types: Vec<String>,
    /// Must all be `UpDecoderBlock2D`.
    #[serde(default)]
    pub up_block_types: Vec<String>,
    /// Resnets per encoder block (decoder blocks have one more).
    #[serde(default = "one")]
    pub layers_per_block: usize,
    /// Must be `"silu"`.
    #[serde(default = "silu_name")]
    pub act_fn: String,
    /// Latent channels (16 for FLUX / Z-Image).
    pub latent_channels: usize,
    /// Groups of every GroupNorm.
    #[serde(default = "thirty_two")]
    pub norm_num_groups: usize,
    /// Pipeline latents are `(z − shift_factor) · scaling_factor`.
    pub scaling_factor: f64,
    /// See `scaling_factor`; absent (0) for VAEs without a shift.
    #[serde(default)]
    pub shift_factor: Option<f64>,
    /// Whether a 1x1 conv follows the encoder (false for FLUX).
    #[serde(default = "yes")]
    pub use_quant_conv: bool,
    /// Whether a 1x1 conv precedes the decoder (false for FLUX).
    #[serde(default = "yes")]
    pub use_post_quant_conv: bool,
    /// Whether the mid blocks have a self-attention layer.
    #[serde(default = "yes")]
    pub mid_block_add_attention: bool,
}

fn three() -> usize {
    3
}
fn one() -> usize {
    1
}
fn thirty_two() -> usize {
    32
}
fn yes() -> bool {
    true
}
fn silu_name() -> String {
    "silu".to_owned()
}

/// Parameters of a `k×k` convolution with bias.
fn conv_params(c_in: usize, c_out: usize, k: usize) -> usize {
    c_out * c_in * k * k + c_out
}

/// Parameters of a `ResnetBlock2D`.
fn resnet_params(c_in: usize, c_out: usize) -> usize {
    let shortcut = if c_in == c_out { 0 } else { conv_params(c_in, c_out, 1) };
    2 * c_in + conv_params(c_in, c_out, 3) + 2 * c_out + conv_params(c_out, c_out, 3) + shortcut
}

impl VaeConfig {
    /// The FLUX.1 VAE config shipped in Tongyi-MAI/Z-Image-Turbo `vae/config.json`.
    pub fn z_image_turbo() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            block_out_channels: vec![128, 256, 512, 512],
            down_block_types: vec!["DownEncoderBlock2D".to_owned(); 4],
            up_block_types: vec!["UpDecoderBlock2D".to_owned(); 4],
            layers_per_block: 2,
            act_fn: "silu".to_owned(),
            latent_channels: 16,
            norm_num_groups: 32,
            scaling_factor: 0.3611,
            shift_factor: Some(0.1159),
            use_quant_conv: false,
            use_post_quant_conv: false,
            mid_block_add_attention: true,
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

    /// Checks that the config describes a VAE this module implements, within
    /// [`limits`](crate::config::limits); the `Err` says what does not fit.
    pub fn validate(&self) -> std::result::Result<(), String> {
        use crate::config::limits::{self, MAX_LAYERS, MAX_LEVELS, MAX_WIDTH};
        limits::check(&[
            ("the number of block_out_channels", self.block_out_channels.len(), MAX_LEVELS),
            ("layers_per_block", self.layers_per_block, MAX_LAYERS),
            ("in_channels", self.in_channels, MAX_WIDTH),
            ("out_channels", self.out_channels, MAX_WIDTH),
            ("latent_channels", self.latent_channels, MAX_WIDTH),
            ("norm_num_groups", self.norm_num_groups, MAX_WIDTH),
        ])?;
        limits::check(
            &self.block_out_channels.iter().map(|c| ("a block_out_channels entry", *c, MAX_WIDTH)).collect::<Vec<_>>(),
        )?;
        if self.block_out_channels.is_empty() {
            return Err("block_out_channels is empty".to_owned());
        }
        if self.act_fn != "silu" {
            return Err(format!("act_fn {:?} is not supported (only silu)", self.act_fn));
        }
        if self.use_quant_conv || self.use_post_quant_conv {
            return Err("quant_conv / post_quant_conv are not supported (the FLUX VAE has none)".to_owned());
        }
        let n = self.block_out_channels.len();
        let down_ok = self.down_block_types.is_empty()
            || (self.down_block_types.len() == n && self.down_block_types.iter().all(|t| t == "DownEncoderBlock2D"));
        let up_ok = self.up_block_types.is_empty()
            || (self.up_block_types.len() == n && self.up_block_types.iter().all(|t| t == "UpDecoderBlock2D"));
        if !down_ok || !up_ok {
            return Err(format!("block types must be {n} DownEncoderBlock2D and {n} UpDecoderBlock2D"));
        }
        let g = self.norm_num_groups;
        if g == 0 || self.block_out_channels.iter().any(|c| *c == 0 || !c.is_multiple_of(g)) {
            return Err(format!(
                "norm_num_groups {g} must divide every block_out_channels entry {:?}",
                self.block_out_channels
            ));
        }
        if self.layers_per_block == 0 || self.latent_channels == 0 || self.in_channels == 0 || self.out_channels == 0 {
            return Err("layers_per_block and channel counts must be positive".to_owned());
        }
        Ok(())
    }

    /// Pixels per latent cell per side: `2^(levels − 1)` (8 for FLUX). The Z-Image pipelines also use this.
    pub fn scale_factor(&self) -> usize {
        1 << (self.block_out_channels.len() - 1)
    }

    /// The shift factor, 0 when the config has none.
    pub fn shift(&self) -> f64 {
        self.shift_factor.unwrap_or(0.0)
    }

    fn mid_params(&self) -> usize {
        let c = self.block_out_channels[self.block_out_channels.len() - 1];
        let attn = if self.mid_block_add_attention { 2 * c + 4 * (c * c + c) } else { 0 };
        2 * resnet_params(c, c) + attn
    }

    /// Parameters of the encoder (`encoder.*`).
    pub fn encoder_params(&self) -> usize {
        let boc = &self.block_out_channels;
        let last = boc[boc.len() - 1];
        let mut n = conv_params(self.in_channels, boc[0], 3);
        let mut prev = boc[0];
        for (i, &c) in boc.iter().enumerate() {
            n += resnet_params(prev, c) + (self.layers_per_block - 1) * resnet_params(c, c);
            if i + 1 < boc.len() {
                n += conv_params(c, c, 3);
            }
            prev = c;
        }
        n + self.mid_params() + 2 * last + conv_params(last, 2 * self.latent_channels, 3)
    }

    /// Parameters of the decoder (`decoder.*`); 49,545,475 for Z-Image-Turbo.
    pub fn decoder_params(&self) -> usize {
        let boc = &self.block_out_channels;
        let mut prev = boc[boc.len() - 1];
        let mut n = conv_params(self.latent_channels, prev, 3) + self.mid_params();
        for (i, &c) in boc.iter().rev().enumerate() {
            n += resnet_params(prev, c) + self.layers_per_block * resnet_params(c, c);
            if i + 1 < boc.len() {
                n += conv_params(c, c, 3);
            }
            prev = c;
        }
        n + 2 * boc[0] + conv_params(boc[0], self.out_channels, 3)
    }

    /// Parameters of the whole checkpoint; 83,819,683 for Z-Image-Turbo.
    pub fn num_params(&self) -> usize {
        self.encoder_params() + self.decoder_params()
    }

    /// Checkpoint bytes at `bytes_per_param` (2 for bf16, 4 for f32).
    pub fn bytes(&self, bytes_per_param: usize) -> u64 {
        (self.num_params() * bytes_per_param) as u64
    }
}

/// A 2-D convolution in PyTorch's layout: `weight` `[c_out, c_in, k, k]`, `bias` `[c_out]`.
#[derive(Module, Debug)]
pub struct Conv2d {
    /// The kernel.
    pub weight: Param<Tensor<4>>,
    /// The bias.
    pub bias: Param<Tensor<1>>,
    /// Stride in both directions.
    pub stride: usize,
    /// Zero padding `[top, bottom, left, right]`.
    pub padding: [usize; 4],
}

impl Conv2d {
    /// A `k×k` convolution, stride `stride`, zero padding `[top, bottom, left, right]` (lazy parameters).
    pub fn new(c_in: usize, c_out: usize, k: usize, stride: usize, padding: [usize; 4], device: &Device) -> Self {
        let fan_in = (c_in * k * k) as f64;
        Self {
            weight: Initializer::Normal { mean: 0.0, std: fan_in.sqrt().recip() }.init([c_out, c_in, k, k], device),
            bias: Initializer::Zeros.init([c_out], device),
            stride,
            padding,
        }
    }

    /// A `k×k` "same" convolution (stride 1, padding `k/2` on every side).
    pub fn same(c_in: usize, c_out: usize, k: usize, device: &Device) -> Self {
        Self::new(c_in, c_out, k, 1, [k / 2; 4], device)
    }

    /// `[batch, c_in, h, w]` -> `[batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let [top, bottom, left, right] = self.padding;
        let options = ConvOptions {
            stride: [self.stride; 2],
            padding: [(top, bottom), (left, right)],
            dilation: [1, 1],
            groups: 1,
        };
        conv2d(x, self.weight.val(), Some(self.bias.val()), options)
    }
}

/// diffusers `ResnetBlock2D` without time embedding: `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))`.
#[derive(Module, Debug)]
pub struct ResnetBlock {
    /// First norm, over the input channels.
    pub norm1: GroupNorm,
    /// `c_in -> c_out`, 3x3.
    pub conv1: Conv2d,
    /// Second norm, over the output channels.
    pub norm2: GroupNorm,
    /// `c_out -> c_out`, 3x3.
    pub conv2: Conv2d,
    /// 1x1 `c_in -> c_out`, only when the channel count changes.
    pub conv_shortcut: Option<Conv2d>,
}

impl ResnetBlock {
    fn new(c_in: usize, c_out: usize, groups: usize, device: &Device) -> Self {
        Self {
            norm1: GroupNorm::new(groups, c_in, NORM_EPS, device),
            conv1: Conv2d::same(c_in, c_out, 3, device),
            norm2: GroupNorm::new(groups, c_out, NORM_EPS, device),
            conv2: Conv2d::same(c_out, c_out, 3, device),
            conv_shortcut: (c_in != c_out).then(|| Conv2d::same(c_in, c_out, 1, device)),
        }
    }

    /// `[b, c_in, h, w]` -> `[b, c_out, h, w]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let h = self.conv1.forward(silu(self.norm1.forward(x.clone())));
        let h = self.conv2.forward(silu(self.norm2.forward(h)));
        let shortcut = match &self.conv_shortcut {
            Some(conv) => conv.forward(x),
            None => x,
        };
        shortcut + h
    }
}

/// The mid-block self-attention: one head over all pixels, GroupNorm first, residual added.
#[derive(Module, Debug)]
pub struct AttentionBlock {
    /// Norm applied before the projections.
    pub group_norm: GroupNorm,
    /// Query projection (with bias).
    pub to_q: PtLinear,
    /// Key projection (with bias).
    pub to_k: PtLinear,
    /// Value projection (with bias).
    pub to_v: PtLinear,
    /// Output projection (with bias); a one-element list because diffusers names it `to_out.0`.
    pub to_out: Vec<PtLinear>,
}

impl AttentionBlock {
    fn new(c: usize, groups: usize, device: &Device) -> Self {
        Self {
            group_norm: GroupNorm::new(groups, c, NORM_EPS, device),
            to_q: PtLinear::new(c, c, true, device),
            to_k: PtLinear::new(c, c, true, device),
            to_v: PtLinear::new(c, c, true, device),
            to_out: vec![PtLinear::new(c, c, true, device)],
        }
    }

    /// `[b, c, h, w]` -> same. The score matrix is `[b, 1, h·w, h·w]` on backends without fused attention.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, c, h, w] = x.dims();
        let tokens = self.group_norm.forward(x.clone()).reshape([b, c, h * w]).swap_dims(1, 2);
        let heads = |lin: &PtLinear| lin.forward(tokens.clone()).unsqueeze_dim::<4>(1);
        let out = attention(
            heads(&self.to_q),
            heads(&self.to_k),
            heads(&self.to_v),
            None,
            None,
            AttentionModuleOptions { scale: Some(1.0 / (c as f64).sqrt()), softcap: None, is_causal: false },
        )
        .reshape([b, h * w, c]);
        let out = self.to_out.iter().fold(out, |acc, lin| lin.forward(acc));
        x + out.swap_dims(1, 2).reshape([b, c, h, w])
    }
}

/// diffusers `UNetMidBlock2D` without time embedding: resnet, (attention), resnet.
#[derive(Module, Debug)]
pub struct MidBlock {
    /// The two resnets.
    pub resnets: Vec<ResnetBlock>,
    /// Zero or one attention block.
    pub attentions: Vec<AttentionBlock>,
}

impl MidBlock {
    fn new(c: usize, groups: usize, add_attention: bool, device: &Device) -> Self {
        Self {
            resnets: (0..2).map(|_| ResnetBlock::new(c, c, groups, device)).collect(),
            attentions: if add_attention { vec![AttentionBlock::new(c, groups, device)] } else { Vec::new() },
        }
    }

    /// `[b, c, h, w]` -> same.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let mut x = self.resnets[0].forward(x);
        for (attn, resnet) in self.attentions.iter().zip(&self.resnets[1..]) {
            x = resnet.forward(attn.forward(x));
        }
        if self.attentions.is_empty() {
            x = self.resnets[1].forward(x);
        }
        x
    }
}

/// diffusers `Downsample2D` with a conv: pad right and bottom by one, then a 3x3 stride-2 convolution.
#[derive(Module, Debug)]
pub struct Downsample {
    /// The stride-2 convolution, padding `(0, 1, 0, 1)`.
    pub conv: Conv2d,
}

/// diffusers `Upsample2D` with a conv: nearest-neighbour x2, then a 3x3 convolution.
#[derive(Module, Debug)]
pub struct Upsample {
    /// The 3x3 convolution after the resize.
    pub conv: Conv2d,
}

impl Upsample {
    /// `[b, c, h, w]` -> `[b, c, 2h, 2w]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, c, h, w] = x.dims();
        // Nearest x2 is an exact copy of each pixel into a 2x2 cell.
        let up = x.reshape([b, c, h, 1, w, 1]).expand([b, c, h, 2, w, 2]).reshape([b, c, 2 * h, 2 * w]);
        self.conv.forward(up)
    }
}

/// diffusers `DownEncoderBlock2D`.
#[derive(Module, Debug)]
pub struct DownBlock {
    /// `layers_per_block` resnets.
    pub resnets: Vec<ResnetBlock>,
    /// One downsampler, none on the last level.
    pub downsamplers: Vec<Downsample>,
}

/// diffusers `UpDecoderBlock2D`.
#[derive(Module, Debug)]
pub struct UpBlock {
    /// `layers_per_block + 1` resnets.
    pub resnets: Vec<ResnetBlock>,
    /// One upsampler, none on the last level.
    pub upsamplers: Vec<Upsample>,
}

/// diffusers `Encoder` (double_z): image -> latent moments (mean, logvar).
#[derive(Module, Debug)]
pub struct Encoder {
    /// `in_channels -> block_out_channels[0]`.
    pub conv_in: Conv2d,
    /// One block per level, highest resolution first.
    pub down_blocks: Vec<DownBlock>,
    /// At the lowest resolution.
    pub mid_block: MidBlock,
    /// Final norm.
    pub conv_norm_out: GroupNorm,
    /// `-> 2·latent_channels`.
    pub conv_out: Conv2d,
}

impl Encoder {
    fn new(config: &VaeConfig, device: &Device) -> Self {
        let boc = &config.block_out_channels;
        let g = config.norm_num_groups;
        let last = boc[boc.len() - 1];
        let mut prev = boc[0];
        let down_blocks = boc
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let resnets = (0..config.layers_per_block)
                    .map(|j| ResnetBlock::new(if j == 0 { prev } else { c }, c, g, device))
                    .collect();
                prev = c;
                let downsamplers = if i + 1 < boc.len() {
                    vec![Downsample { conv: Conv2d::new(c, c, 3, 2, [0, 1, 0, 1], device) }]
                } else {
                    Vec::new()
                };
                DownBlock { resnets, downsamplers }
            })
            .collect();
        Self {
            conv_in: Conv2d::same(config.in_channels, boc[0], 3, device),
            down_blocks,
            mid_block: MidBlock::new(last, g, config.mid_block_add_attention, device),
            conv_norm_out: GroupNorm::new(g, last, NORM_EPS, device),
            conv_out: Conv2d::same(last, 2 * config.latent_channels, 3, device),
        }
    }

    /// `[b, in_channels, H, W]` -> moments `[b, 2·latent_channels, H/f, W/f]` (`f` = the scale factor).
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let mut x = self.conv_in.forward(x);
        for block in &self.down_blocks {
            for resnet in &block.resnets {
                x = resnet.forward(x);
            }
            for down in &block.downsamplers {
                x = down.conv.forward(x);
            }
        }
        let x = self.mid_block.forward(x);
        self.conv_out.forward(silu(self.conv_norm_out.forward(x)))
    }
}

/// diffusers `Decoder`: latent `z` -> image in about `[-1, 1]`.
#[derive(Module, Debug)]
pub struct Decoder {
    /// `latent_channels -> block_out_channels[-1]`.
    pub conv_in: Conv2d,
    /// At the lowest resolution.
    pub mid_block: MidBlock,
    /// One block per level, lowest resolution first.
    pub up_blocks: Vec<UpBlock>,
    /// Final norm.
    pub conv_norm_out: GroupNorm,
    /// `block_out_channels[0] -> out_channels`.
    pub conv_out: Conv2d,
}

impl Decoder {
    fn new(config: &VaeConfig, device: &Device) -> Self {
        let boc = &config.block_out_channels;
        let g = config.norm_num_groups;
        let last = boc[boc.len() - 1];
        let mut prev = last;
        let up_blocks = boc
            .iter()
            .rev()
            .enumerate()
            .map(|(i, &c)| {
                let resnets = (0..=config.layers_per_block)
                    .map(|j| ResnetBlock::new(if j == 0 { prev } else { c }, c, g, device))
                    .collect();
                prev = c;
                let upsamplers =
                    if i + 1 < boc.len() { vec![Upsample { conv: Conv2d::same(c, c, 3, device) }] } else { Vec::new() };
                UpBlock { resnets, upsamplers }
            })
            .collect();
        Self {
            conv_in: Conv2d::same(config.latent_channels, last, 3, device),
            mid_block: MidBlock::new(last, g, config.mid_block_add_attention, device),
            up_blocks,
            conv_norm_out: GroupNorm::new(g, boc[0], NORM_EPS, device),
            conv_out: Conv2d::same(boc[0], config.out_channels, 3, device),
        }
    }

    /// `z` `[b, latent_channels, h, w]` -> `[b, out_channels, h·f, w·f]`.
    pub fn forward(&self, z: Tensor<4>) -> Tensor<4> {
        let mut x = self.mid_block.forward(self.conv_in.forward(z));
        for block in &self.up_blocks {
            for resnet in &block.resnets {
                x = resnet.forward(x);
            }
            for up in &block.upsamplers {
                x = up.forward(x);
            }
        }
        self.conv_out.forward(silu(self.conv_norm_out.forward(x)))
    }
}

/// diffusers `AutoencoderKL` without quant convs (the FLUX VAE). It declares no parts that stream: it moves only
/// whole (component offload), and its forward reads the module.
#[derive(Module, Debug, group_offload::OffloadModel)]
#[offload(class = "AutoencoderKL")]
pub struct AutoencoderKl {
    /// Image -> moments.
    pub encoder: Encoder,
    /// Latent -> image.
    pub decoder: Decoder,
    /// Latent channels (the mean is the first half of the encoder's moments).
    pub latent_channels: usize,
    /// Pipeline latents are `(z − shift_factor) · scaling_factor`.
    pub scaling_factor: f64,
    /// See `scaling_factor`.
    pub shift_factor: f64,
}

impl AutoencoderKl {
    /// Builds the module with lazily initialised parameters on `device`. `config` must be valid
    /// ([`VaeConfig::validate`]).
    pub fn new(config: &VaeConfig, device: &Device) -> Self {
        Self {
            encoder: Encoder::new(config, device),
            decoder: Decoder::new(config, device),
            latent_channels: config.latent_channels,
            scaling_factor: config.scaling_factor,
            shift_factor: config.shift(),
        }
    }

    /// Decodes raw latents: `z` `[b, 16, h, w]` -> image `[b, 3, 8h, 8w]`, roughly in `[-1, 1]` (not clamped).
    pub fn decode(&self, z: Tensor<4>) -> Tensor<4> {
        self.decoder.forward(z)
    }

    /// The mean (= mode) of the latent distribution: image `[b, 3, H, W]` in `[-1, 1]` -> `z` `[b, 16, H/8, W/8]`.
    /// `H` and `W` should be multiples of 8.
    pub fn encode_mean(&self, image: Tensor<4>) -> Tensor<4> {
        self.encoder.forward(image).narrow(1, 0, self.latent_channels)
    }

    /// Pipeline latents -> raw `z`: `latents / scaling_factor + shift_factor` (before [`AutoencoderKl::decode`]).
    pub fn unscale_latents<const D: usize>(&self, latents: Tensor<D>) -> Tensor<D> {
        latents / self.scaling_factor + self.shift_factor
    }

    /// Raw `z` -> pipeline latents: `(z − shift_factor) · scaling_factor` (after [`AutoencoderKl::encode_mean`]).
    pub fn scale_latents<const D: usize>(&self, z: Tensor<D>) -> Tensor<D> {
        (z - self.shift_factor) * self.scaling_factor
    }

    /// Decoder output -> the `output_type="pt"` image: `clamp(x / 2 + 0.5, 0, 1)`.
    pub fn postprocess<const D: usize>(image: Tensor<D>) -> Tensor<D> {
        (image / 2.0 + 0.5).clamp(0.0, 1.0)
    }
}

impl AutoencoderKl {
    /// Reads `dir/config.json` and loads `dir/diffusion_pytorch_model.safetensors` (or its sharded form) onto
    /// `device` with [`crate::loading::load_component`] and `opts`. Any missing or unused tensor is an
    /// [`Error::PartialLoad`] unless `opts.allow_partial` is set.
    pub fn load(dir: impl AsRef<Path>, device: &Device, opts: &LoadOptions) -> Result<(VaeConfig, Self, LoadReport)> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(Error::MissingDirectory { path: dir.to_owned() });
        }
        let config_path = crate::loading::config_file(dir, "vae")?;
        let config = VaeConfig::from_file(&config_path)?;
        let mut module = Self::new(&config, device);
        let report = load_component(&mut module, dir, opts)?;
        Ok((config, module, report))
    }
}

/// The VAE's binding to its checkpoint files, as a method of the checkpoint (written here, beside the model, so
/// that the loader knows no model of its own).
impl crate::loading::Checkpoint {
    /// Reads `vae/config.json` and binds the VAE to its files: the file tier's [`AutoencoderKl::load`]. A VAE
    /// declares no blocks, so registered from its files it moves whole (one group read from the file at each
    /// onload).
    pub fn bind_vae(&self, device: &Device, opts: &LoadOptions) -> Result<(VaeConfig, BoundComponent<AutoencoderKl>)> {
        let dir = self.component_dir("vae")?;
        let config_path = crate::loading::config_file(&dir, "vae")?;
        let config = VaeConfig::from_file(&config_path)?;
        let model = AutoencoderKl::new(&config, device);
        Ok((config, bind_component(model, &dir, opts)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn z_image_turbo_sizes() {
        let c = VaeConfig::z_image_turbo();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.scale_factor(), 8);
        assert_eq!(c.decoder_params(), 49_545_475);
        assert_eq!(c.num_params(), 83_819_683);
        assert_eq!(c.bytes(2), 167_639_366);
    }

    #[test]
    fn module_param_count_matches_config() {
        let c = VaeConfig {
            block_out_channels: vec![16, 16, 32, 32],
            layers_per_block: 1,
            norm_num_groups: 8,
            ..VaeConfig::z_image_turbo()
        };
        let vae = AutoencoderKl::new(&c, &Device::flex());
        assert_eq!(vae.num_params(), c.num_params());
        assert_eq!(vae.decoder.num_params(), c.decoder_params());
    }
}
