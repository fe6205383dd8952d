//! A Stable-Diffusion-style UNet on the offload library: a time MLP and `conv_in`, two down stages of two ResNet
//! blocks (the first with a downsample), a mid block with self-attention between two ResNets, two up stages of
//! three ResNets fed by skip connections (the first with an upsample), then `norm_out` and `conv_out`; beside it
//! a small condition encoder. Random weights; the UNet 0.92 MB in f32, the encoder 0.27 MB.
//!
//! The UNet's lists are nested (`down_blocks[i].resnets[j]`), so it is declared in the shape it has:
//! `#[offload(nested)]` on the stage lists and the mid block, `#[offload(blocks)]` on each stage's `resnets` and
//! `attentions`. Block level then streams one ResNet (or attention) per group, each stage's resampler a group of
//! its own; leaf level streams one convolution or linear layer at a time. One ResNet forward and one attention
//! forward serve the down, mid and up stages. The skip connections are plain tensors the forward keeps across
//! streamed blocks: a block's group is released when its forward returns, its output is not.
//!
//! Lines that exist only for offloading are marked `offload: begin` / `offload: end`, or hold an accessor
//! (`leaf!`, `.own()`, `.shell.`, `#[offload(..)]`); `tests/offload.rs` counts them against the README.
//!
//! Shapes: latents `[B, 4, 16, 16]`, time `[B, 1]` and a condition `[B, 64]` to a prediction `[B, 4, 16, 16]`.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Embedding, EmbeddingConfig, GroupNorm, GroupNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use group_offload::prelude::*;
use offload_core::ComponentsManager;

/// Latent channels.
pub const LATENT: usize = 4;
/// Latent height and width.
pub const SIZE: usize = 16;
/// The time and condition embedding's width.
pub const EMBED: usize = 64;
/// Channels of the two resolutions.
pub const CHANNELS: [usize; 2] = [16, 32];
/// Groups of every group norm.
const GROUPS: usize = 8;

/// A ResNet block: `x + conv2(silu(norm2(conv1(silu(norm1(x))) + time_emb_proj(temb))))`, with a 1×1 shortcut
/// where the channels change.
#[derive(Module, Debug)]
pub struct ResnetBlock {
    /// Norm before the first convolution.
    pub norm1: GroupNorm,
    /// 3×3, `in -> out`.
    pub conv1: Conv2d,
    /// The embedding's shift per channel: `EMBED -> out`.
    pub time_emb_proj: Linear,
    /// Norm before the second convolution.
    pub norm2: GroupNorm,
    /// 3×3, `out -> out`.
    pub conv2: Conv2d,
    /// 1×1 `in -> out` where the channels change.
    pub conv_shortcut: Option<Conv2d>,
}

/// Single-head self-attention over the pixels, with a residual.
#[derive(Module, Debug)]
pub struct AttentionBlock {
    /// Norm before the projections.
    pub group_norm: GroupNorm,
    /// Query projection.
    pub to_q: Linear,
    /// Key projection.
    pub to_k: Linear,
    /// Value projection.
    pub to_v: Linear,
    /// Output projection.
    pub to_out: Linear,
}

/// A stage: ResNets (each followed by an attention where the stage has one) and an optional resampler (a
/// stride-2 convolution going down, a convolution after a nearest 2× upsampling going up).
// offload: begin
#[derive(Module, Debug, OffloadModel)]
// offload: end
pub struct Stage {
    /// The ResNet blocks, run in order.
    #[offload(blocks)]
    pub resnets: Vec<ResnetBlock>,
    /// The attentions, `attentions[i]` after `resnets[i]` (the mid block's; empty elsewhere).
    #[offload(blocks)]
    pub attentions: Vec<AttentionBlock>,
    /// The resampler, after the blocks.
    pub resample: Option<Conv2d>,
}

/// The UNet.
// offload: begin
#[derive(Module, Debug, OffloadModel)]
#[offload(class = "UNet2DModel")]
// offload: end
pub struct UNet {
    /// Time embedding, first layer: `1 -> EMBED`.
    pub time_1: Linear,
    /// Time embedding, second layer.
    pub time_2: Linear,
    /// 3×3, `LATENT -> CHANNELS[0]`.
    pub conv_in: Conv2d,
    /// The down stages, full then half resolution.
    #[offload(nested)]
    pub down_blocks: Vec<Stage>,
    /// The mid block: ResNet, attention, ResNet.
    #[offload(nested)]
    pub mid_block: Stage,
    /// The up stages, half then full resolution, fed by the skips.
    #[offload(nested)]
    pub up_blocks: Vec<Stage>,
    /// Norm before the output.
    pub norm_out: GroupNorm,
    /// 3×3, `CHANNELS[0] -> LATENT`.
    pub conv_out: Conv2d,
}

/// The condition encoder: a class embedding and a projection.
// offload: begin
#[derive(Module, Debug, OffloadModel)]
// offload: end
pub struct Encoder {
    /// Class embedding `classes -> EMBED`.
    pub embed: Embedding,
    /// Projection.
    pub proj: Linear,
}

fn conv(device: &Device, channels: [usize; 2], kernel: usize, stride: usize) -> Conv2d {
    let pad = kernel / 2;
    Conv2dConfig::new(channels, [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
        .init(device)
}

fn resnet(device: &Device, input: usize, output: usize) -> ResnetBlock {
    ResnetBlock {
        norm1: GroupNormConfig::new(GROUPS, input).init(device),
        conv1: conv(device, [input, output], 3, 1),
        time_emb_proj: LinearConfig::new(EMBED, output).init(device),
        norm2: GroupNormConfig::new(GROUPS, output).init(device),
        conv2: conv(device, [output, output], 3, 1),
        conv_shortcut: (input != output).then(|| conv(device, [input, output], 1, 1)),
    }
}

fn attention(device: &Device, channels: usize) -> AttentionBlock {
    let linear = || LinearConfig::new(channels, channels).init(device);
    AttentionBlock {
        group_norm: GroupNormConfig::new(GROUPS, channels).init(device),
        to_q: linear(),
        to_k: linear(),
        to_v: linear(),
        to_out: linear(),
    }
}

impl UNet {
    /// A UNet with random weights (burn's default initialisers).
    pub fn random(device: &Device) -> Self {
        let [c0, c1] = CHANNELS;
        let stage = |resnets, attentions, resample| Stage { resnets, attentions, resample };
        Self {
            time_1: LinearConfig::new(1, EMBED).init(device),
            time_2: LinearConfig::new(EMBED, EMBED).init(device),
            conv_in: conv(device, [LATENT, c0], 3, 1),
            down_blocks: vec![
                stage(vec![resnet(device, c0, c0), resnet(device, c0, c0)], vec![], Some(conv(device, [c0, c0], 3, 2))),
                stage(vec![resnet(device, c0, c1), resnet(device, c1, c1)], vec![], None),
            ],
            mid_block: stage(vec![resnet(device, c1, c1), resnet(device, c1, c1)], vec![attention(device, c1)], None),
            up_blocks: vec![
                stage(
                    vec![resnet(device, c1 + c1, c1), resnet(device, c1 + c1, c1), resnet(device, c1 + c0, c1)],
                    vec![],
                    Some(conv(device, [c1, c1], 3, 1)),
                ),
                stage(
                    vec![resnet(device, c1 + c0, c0), resnet(device, c0 + c0, c0), resnet(device, c0 + c0, c0)],
                    vec![],
                    None,
                ),
            ],
            norm_out: GroupNormConfig::new(GROUPS, c0).init(device),
            conv_out: conv(device, [c0, LATENT], 3, 1),
        }
    }
}

impl Encoder {
    /// An encoder of `classes` classes with random weights.
    pub fn random(classes: usize, device: &Device) -> Self {
        Self {
            embed: EmbeddingConfig::new(classes, EMBED).init(device),
            proj: LinearConfig::new(EMBED, EMBED).init(device),
        }
    }

    /// The condition `[B, EMBED]` of class ids `[B, 1]`.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<2> {
        self.proj.forward(self.embed.forward(ids)).squeeze_dim(1)
    }
}

/// One ResNet block over its layer: `x` `[B, in, H, W]`, `temb` `[B, EMBED]` -> `[B, out, H, W]`.
fn resnet_forward(block: &Layer<'_, ResnetBlock>, x: Tensor<4>, temb: &Tensor<2>) -> Result<Tensor<4>> {
    let norms = block.own()?;
    let h = leaf!(block, conv1).forward(silu(norms.norm1.forward(x.clone())));
    let [b, c, _, _] = h.dims();
    let h = h + leaf!(block, time_emb_proj).forward(silu(temb.clone())).reshape([b, c, 1, 1]);
    let h = leaf!(block, conv2).forward(silu(norms.norm2.forward(h)));
    let shortcut = match block.structure().conv_shortcut.is_some() {
        true => leaf!(block, conv_shortcut).as_ref().map_or(x.clone(), |c| c.forward(x)),
        false => x,
    };
    Ok(shortcut + h)
}

/// Self-attention over the pixels of `x` `[B, C, H, W]`, with a residual.
fn attention_forward(block: &Layer<'_, AttentionBlock>, x: Tensor<4>) -> Result<Tensor<4>> {
    let [b, c, h, w] = x.dims();
    let tokens = block.own()?.group_norm.forward(x.clone()).reshape([b, c, h * w]).swap_dims(1, 2);
    let q = leaf!(block, to_q).forward(tokens.clone());
    let k = leaf!(block, to_k).forward(tokens.clone());
    let v = leaf!(block, to_v).forward(tokens);
    let weights = softmax(q.matmul(k.swap_dims(1, 2)) / (c as f64).sqrt(), 2);
    let out = leaf!(block, to_out).forward(weights.matmul(v));
    Ok(x + out.swap_dims(1, 2).reshape([b, c, h, w]))
}

/// Where a stage sits, which decides what it does with the skips.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Down,
    Mid,
    Up,
}

/// One stage: each ResNet (taking a skip on the way up, leaving one on the way down), its attention where it
/// has one, then the resampler.
fn stage_forward(
    stage: StageWeights<'_>,
    mut h: Tensor<4>,
    temb: &Tensor<2>,
    skips: &mut Vec<Tensor<4>>,
    path: Path,
) -> Result<Tensor<4>> {
    for (i, resnet) in stage.resnets.iter().enumerate() {
        if path == Path::Up {
            let skip = skips.pop().unwrap_or_else(|| h.clone());
            h = Tensor::cat(vec![h, skip], 1);
        }
        h = resnet_forward(&resnet?, h, temb)?;
        if let Some(attention) = stage.attentions.get(i) {
            h = attention_forward(&attention?, h)?;
        }
        if path == Path::Down {
            skips.push(h.clone());
        }
    }
    if let Some(resample) = &stage.shell.get()?.resample {
        h = match path {
            Path::Up => resample.forward(upsample(h)),
            _ => resample.forward(h),
        };
        if path == Path::Down {
            skips.push(h.clone());
        }
    }
    Ok(h)
}

/// Nearest 2× upsampling `[B, C, H, W] -> [B, C, 2H, 2W]`.
fn upsample(x: Tensor<4>) -> Tensor<4> {
    let [b, c, h, w] = x.dims();
    x.reshape([b, c, h, 1, w, 1]).expand([b, c, h, 2, w, 2]).reshape([b, c, 2 * h, 2 * w])
}

impl UNetWeights<'_> {
    /// The prediction `[B, LATENT, SIZE, SIZE]` at latents `x`, time `t` `[B, 1]` and condition `cond`
    /// `[B, EMBED]`: the one forward, resident or streamed.
    pub fn forward(self, x: Tensor<4>, t: Tensor<2>, cond: Tensor<2>) -> Result<Tensor<4>> {
        let shell = self.shell.get()?;
        let temb = shell.time_2.forward(silu(shell.time_1.forward(t))) + cond;
        let mut h = shell.conv_in.forward(x);
        drop(shell);
        let mut skips = vec![h.clone()];
        for stage in self.down_blocks.iter() {
            h = stage_forward(stage, h, &temb, &mut skips, Path::Down)?;
        }
        h = stage_forward(self.mid_block, h, &temb, &mut skips, Path::Mid)?;
        for stage in self.up_blocks.iter() {
            h = stage_forward(stage, h, &temb, &mut skips, Path::Up)?;
        }
        let shell = self.shell.get()?;
        Ok(shell.conv_out.forward(silu(shell.norm_out.forward(h))))
    }
}

/// The encoder and the UNet registered with one manager, and the sampling loop.
pub struct TinyUnetPipeline {
    manager: Arc<ComponentsManager>,
    host: Device,
    /// The condition encoder (moved whole).
    pub encoder: ModelHandle<Encoder>,
    /// The UNet.
    pub unet: ModelHandle<UNet>,
}

impl TinyUnetPipeline {
    /// Registers `encoder` and `unet` (on `placement.host()`) with a new manager.
    pub fn new(encoder: Encoder, unet: UNet, placement: OffloadDevice) -> Result<Self> {
        let manager = Arc::new(ComponentsManager::new());
        let host = placement.host().clone();
        // offload: begin
        let encoder = ModelHandle::register(&manager, "encoder", encoder, placement.clone())?;
        let unet = ModelHandle::register(&manager, "unet", unet, placement)?;
        // offload: end
        Ok(Self { manager, host, encoder, unet })
    }

    /// The manager holding both models.
    pub fn manager(&self) -> &Arc<ComponentsManager> {
        &self.manager
    }

    /// Bytes of activations one UNet call allocates at batch 1 (an estimate: the skips and the widest
    /// intermediate feature maps, f32), what a simulated card charges each call and the planner sizes the
    /// reserve from.
    pub fn unet_activations() -> u64 {
        let full = (CHANNELS[1] * SIZE * SIZE * 4) as u64;
        8 * full + ((SIZE * SIZE / 4) * (SIZE * SIZE / 4) * 4) as u64
    }

    /// Samples latents `[1, LATENT, SIZE, SIZE]` for class `class` with `steps` Euler steps from deterministic
    /// noise.
    pub fn generate(&self, class: i64, steps: usize) -> Result<Tensor<4>> {
        let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![class], [1, 1]), &self.host);
        // offload: begin
        let cond = self.encoder.run(0, |encoder, device| Ok(encoder.forward(ids.clone().to_device(device))))?;
        // offload: end
        let values = (0..LATENT * SIZE * SIZE).map(|i| ((i as f32) * 0.37).sin()).collect::<Vec<_>>();
        let mut x = Tensor::<4>::from_data(TensorData::new(values, [1, LATENT, SIZE, SIZE]), &self.host);
        let dt = 1.0 / steps.max(1) as f32;
        for step in 0..steps {
            let t = Tensor::<2>::from_data(TensorData::new(vec![1.0 - step as f32 * dt], [1, 1]), &self.host);
            // offload: begin
            let v = self.unet.run(Self::unet_activations(), |unet, d| {
                unet.forward(x.clone().to_device(d), t.clone().to_device(d), cond.clone().to_device(d))
            })?;
            // offload: end
            x = x - v.to_device(&self.host) * dt;
        }
        Ok(x)
    }
}

/// The README's example, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct Readme;

/// The offload record's page, whose program that prints each image's refused prefetches runs on this pipeline.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/offload-record.md")]
struct OffloadRecordPage;
