//! A second model on the offload library: a small diffusion transformer (DiT) with random weights, a small
//! condition encoder and a decoder, run as a three-component pipeline through one `ComponentsManager`.
//!
//! It depends on the library crates only (`offload-core`, `group-offload`; `memory-sim` in its tests) and gets
//! everything the Z-Image pipeline gets: auto offload, block- and leaf-level group offload with prefetch, the OOM
//! retry, presets planned for the device and the record of every move. What it writes for that is marked
//! between `offload: begin` and `offload: end` below: the three `OffloadModel` declarations (which parts are
//! blocks), the weights views its forwards read, the handles and the preset call. `tests/offload.rs` counts those
//! lines.
//!
//! Shapes: the DiT maps latents `[B, T, P]` (T tokens of P values), a time `[B, 1]` and a condition `[B, C]` to a
//! velocity `[B, T, P]`; the encoder maps token ids `[B, L]` to the condition `[B, C]`; the decoder maps latents
//! to an image `[B, T, P']`.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, silu};
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Device, Int, Tensor, TensorData};
use group_offload::apply::{PipelinePlan, plan_and_apply};
use group_offload::prelude::*;
use offload_core::ComponentsManager;
use offload_core::plan::{DeviceFacts, Settings, Workload};

/// The sizes of the three models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Latent tokens per image.
    pub tokens: usize,
    /// Values per latent token.
    pub patch: usize,
    /// The DiT's width.
    pub dim: usize,
    /// Attention heads (dividing `dim`).
    pub heads: usize,
    /// DiT blocks.
    pub depth: usize,
    /// The condition's width.
    pub cond: usize,
    /// Encoder layers.
    pub encoder_depth: usize,
    /// Token ids the encoder knows.
    pub vocab: usize,
    /// Values per decoded token.
    pub pixels: usize,
}

impl Config {
    /// A DiT of 6 blocks of width 64 (about 1.2 MB of f32 weights), a 3-layer encoder, a small decoder.
    pub fn small() -> Self {
        Self { tokens: 16, patch: 8, dim: 64, heads: 4, depth: 6, cond: 32, encoder_depth: 3, vocab: 100, pixels: 12 }
    }
}

/// One DiT block: adaptive-norm attention and MLP, modulated by the time and condition embedding.
#[derive(Module, Debug)]
pub struct DitBlock {
    /// Shift and scale of both norms from the conditioning: `dim -> 4·dim`.
    pub modulation: Linear,
    /// Norm before attention (no affine of its own use: modulated).
    pub norm1: LayerNorm,
    /// Query, key and value projections: `dim -> 3·dim`.
    pub qkv: Linear,
    /// Attention output projection.
    pub proj: Linear,
    /// Norm before the MLP.
    pub norm2: LayerNorm,
    /// MLP up projection `dim -> 4·dim`.
    pub fc1: Linear,
    /// MLP down projection `4·dim -> dim`.
    pub fc2: Linear,
}

/// The diffusion transformer.
// offload: begin
#[derive(Module, Debug, OffloadModel)]
#[offload(class = "TinyDit")]
// offload: end
pub struct Dit {
    /// Latent patch embedding `patch -> dim`.
    pub patch: Linear,
    /// Time embedding `1 -> dim`.
    pub time: Linear,
    /// Condition embedding `cond -> dim`.
    pub cond: Linear,
    /// The blocks, run in order.
    // offload: begin
    #[offload(blocks, first = modulation)]
    // offload: end
    pub blocks: Vec<DitBlock>,
    /// Output projection `dim -> patch`.
    pub out: Linear,
    /// Attention heads.
    pub heads: usize,
}

/// One encoder layer: a residual MLP.
#[derive(Module, Debug)]
pub struct EncoderLayer {
    /// Norm before the MLP.
    pub norm: LayerNorm,
    /// Up projection `cond -> 2·cond`.
    pub fc1: Linear,
    /// Down projection `2·cond -> cond`.
    pub fc2: Linear,
}

/// The condition encoder: token embeddings, residual MLP layers, mean over the tokens.
// offload: begin
#[derive(Module, Debug, OffloadModel)]
#[offload(class = "TinyEncoder")]
// offload: end
pub struct Encoder {
    /// Token embedding `vocab -> cond`.
    pub embed: Embedding,
    /// The layers, run in order.
    // offload: begin
    #[offload(blocks)]
    // offload: end
    pub layers: Vec<EncoderLayer>,
}

/// The decoder: a two-layer MLP per latent token.
// offload: begin
#[derive(Module, Debug, OffloadModel)]
#[offload(class = "TinyDecoder")]
// offload: end
pub struct Decoder {
    /// `patch -> 4·pixels`.
    pub fc1: Linear,
    /// `4·pixels -> pixels`.
    pub fc2: Linear,
}

/// The three models with random weights (burn's default initialisers).
#[derive(Debug, Clone)]
pub struct Models {
    /// The condition encoder.
    pub encoder: Encoder,
    /// The DiT.
    pub dit: Dit,
    /// The decoder.
    pub decoder: Decoder,
}

impl Models {
    /// Random models of `config`'s sizes on `device`.
    pub fn random(config: &Config, device: &Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).init(device);
        let norm = |d| LayerNormConfig::new(d).init(device);
        let (d, c) = (config.dim, config.cond);
        let block = || DitBlock {
            modulation: linear(d, 4 * d),
            norm1: norm(d),
            qkv: linear(d, 3 * d),
            proj: linear(d, d),
            norm2: norm(d),
            fc1: linear(d, 4 * d),
            fc2: linear(4 * d, d),
        };
        let layer = || EncoderLayer { norm: norm(c), fc1: linear(c, 2 * c), fc2: linear(2 * c, c) };
        Self {
            encoder: Encoder {
                embed: EmbeddingConfig::new(config.vocab, c).init(device),
                layers: (0..config.encoder_depth).map(|_| layer()).collect(),
            },
            dit: Dit {
                patch: linear(config.patch, d),
                time: linear(1, d),
                cond: linear(c, d),
                blocks: (0..config.depth).map(|_| block()).collect(),
                out: linear(d, config.patch),
                heads: config.heads,
            },
            decoder: Decoder {
                fc1: linear(config.patch, 4 * config.pixels),
                fc2: linear(4 * config.pixels, config.pixels),
            },
        }
    }
}

/// One DiT block over a layer's weights, taking each leaf by its field (`leaf!`: the path is the field's) and the
/// norms with the block's own parameters (`own`).
fn dit_block(
    block: Layer<'_, DitBlock>,
    x: Tensor<3>,
    c: &Tensor<2>,
    heads: usize,
) -> group_offload::Result<Tensor<3>> {
    let [b, s, d] = x.dims();
    let m = leaf!(block, modulation).forward(silu(c.clone())).reshape([b, 1, 4 * d]);
    let chunk = |i: usize| m.clone().narrow(2, i * d, d);
    let norms = block.own()?;
    let h = norms.norm1.forward(x.clone()) * (chunk(0) + 1.0) + chunk(1);
    let qkv = leaf!(block, qkv).forward(h).reshape([b, s, 3, heads, d / heads]);
    let head = |i: usize| qkv.clone().narrow(2, i, 1).reshape([b, s, heads, d / heads]).swap_dims(1, 2);
    let options =
        AttentionModuleOptions { scale: Some(1.0 / ((d / heads) as f64).sqrt()), softcap: None, is_causal: false };
    let attended = attention(head(0), head(1), head(2), None, None, options).swap_dims(1, 2).reshape([b, s, d]);
    let x = x + leaf!(block, proj).forward(attended);
    let h = norms.norm2.forward(x.clone()) * (chunk(2) + 1.0) + chunk(3);
    let h = gelu(leaf!(block, fc1).forward(h));
    Ok(x + leaf!(block, fc2).forward(h))
}

/// One encoder layer over a layer's weights.
fn encoder_layer(layer: Layer<'_, EncoderLayer>, x: Tensor<3>) -> group_offload::Result<Tensor<3>> {
    let h = layer.own()?.norm.forward(x.clone());
    let h = gelu(leaf!(layer, fc1).forward(h));
    Ok(x + leaf!(layer, fc2).forward(h))
}

impl Decoder {
    /// Latents `[B, T, P]` to pixels `[B, T, pixels]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.fc2.forward(gelu(self.fc1.forward(x)))
    }
}

impl DitWeights<'_> {
    /// The velocity `[B, T, P]` at latents `x` `[B, T, P]`, time `t` `[B, 1]`, condition `c` `[B, C]`.
    pub fn forward(self, x: Tensor<3>, t: Tensor<2>, c: Tensor<2>) -> group_offload::Result<Tensor<3>> {
        let shell = self.shell.get()?;
        let (h, heads) = (shell.patch.forward(x), shell.heads);
        let c = shell.time.forward(t) + shell.cond.forward(c);
        drop(shell);
        let h = self.blocks.fold(h, |block, h| dit_block(block, h, &c, heads))?;
        Ok(self.shell.get()?.out.forward(h))
    }
}

impl EncoderWeights<'_> {
    /// The condition `[B, C]` of token ids `[B, L]`: the layers' output averaged over the tokens.
    pub fn forward(self, ids: Tensor<2, Int>) -> group_offload::Result<Tensor<2>> {
        let x = self.shell.get()?.embed.forward(ids);
        let x = self.layers.fold(x, encoder_layer)?;
        Ok(x.mean_dim(1).squeeze_dim(1))
    }
}

/// The three models registered with one manager, and the generation flow.
pub struct TinyDitPipeline {
    manager: Arc<ComponentsManager>,
    config: Config,
    placement: OffloadDevice,
    /// The condition encoder.
    pub encoder: ModelHandle<Encoder>,
    /// The DiT.
    pub dit: ModelHandle<Dit>,
    /// The decoder.
    pub decoder: ModelHandle<Decoder>,
}

impl TinyDitPipeline {
    /// Registers `models` (on `placement.host()`) with a new manager.
    pub fn new(models: Models, config: Config, placement: OffloadDevice) -> group_offload::Result<Self> {
        let manager = Arc::new(ComponentsManager::new());
        // offload: begin
        let encoder = ModelHandle::register(&manager, "encoder", models.encoder, placement.clone())?;
        let dit = ModelHandle::register(&manager, "dit", models.dit, placement.clone())?;
        let decoder = ModelHandle::register(&manager, "decoder", models.decoder, placement.clone())?;
        // offload: end
        Ok(Self { manager, config, placement, encoder, dit, decoder })
    }

    /// The manager holding the three models.
    pub fn manager(&self) -> &Arc<ComponentsManager> {
        &self.manager
    }

    // offload: begin
    /// Bytes of activations one call of each model allocates, `[encoder, dit, decoder]`, at batch 1: what a
    /// simulated card charges each call (an estimate: the widest intermediate tensors, f32).
    pub fn activation_estimates(&self, prompt_tokens: usize) -> [u64; 3] {
        let c = &self.config;
        let f32s = |n: usize| (n * 4) as u64;
        let encoder = f32s(prompt_tokens * 4 * c.cond);
        let dit = f32s(c.tokens * (3 * c.dim + 4 * c.dim + c.dim) + c.heads * c.tokens * c.tokens);
        let decoder = f32s(c.tokens * 5 * c.pixels);
        [encoder, dit, decoder]
    }
    // offload: end

    /// Plans the three models for `device` with `settings` (a preset and its overrides) and applies every route:
    /// resident, component offload, or block / leaf group offload with prefetch. The plan's `Display` is the
    /// planner's table, why each route, and what was applied.
    pub fn enable_preset(
        &mut self,
        settings: Settings,
        device: &DeviceFacts,
        prompt_tokens: usize,
    ) -> group_offload::Result<PipelinePlan> {
        let activations = self.activation_estimates(prompt_tokens);
        // offload: begin
        let mut components: [&mut dyn group_offload::handle::Component; 3] =
            [&mut self.encoder, &mut self.dit, &mut self.decoder];
        let mut specs = Vec::new();
        for (component, activation) in components.iter().zip(activations) {
            specs.push(group_offload::apply::component_spec(&self.manager, &**component)?.with_activation(activation));
        }
        let workload = Workload::new().with("model", "tiny-dit");
        plan_and_apply(&self.manager, &mut components, &specs, settings, device, workload, "dit")
        // offload: end
    }

    /// Generates an image `[1, T, pixels]` from `prompt` (token ids below the vocabulary size) with `steps`
    /// Euler steps of the flow from deterministic noise.
    pub fn generate(&self, prompt: &[i64], steps: usize) -> group_offload::Result<Tensor<3>> {
        let c = &self.config;
        let host = self.placement.host();
        // offload: begin (each call goes through its handle, which the manager onloads, charges and retries)
        let [encoder, dit, decoder] = self.activation_estimates(prompt.len());
        // offload: end
        let ids = Tensor::<2, Int>::from_data(TensorData::new(prompt.to_vec(), [1, prompt.len()]), host);
        // offload: begin
        let cond = self.encoder.run(encoder, |weights, device| weights.forward(ids.clone().to_device(device)))?;
        // offload: end
        let values = (0..c.tokens * c.patch).map(|i| ((i as f32) * 0.37).sin()).collect::<Vec<_>>();
        let mut x = Tensor::<3>::from_data(TensorData::new(values, [1, c.tokens, c.patch]), host);
        let dt = 1.0 / steps.max(1) as f32;
        for step in 0..steps {
            let t = Tensor::<2>::from_data(TensorData::new(vec![1.0 - step as f32 * dt], [1, 1]), host);
            // offload: begin
            let velocity = self.dit.run(dit, |weights, device| {
                weights.forward(
                    x.clone().to_device(device),
                    t.clone().to_device(device),
                    cond.clone().to_device(device),
                )
            })?;
            // offload: end
            x = x + velocity.to_device(host) * dt;
        }
        // offload: begin
        let image = self.decoder.run(decoder, |decoder, device| Ok(decoder.forward(x.clone().to_device(device))))?;
        // offload: end
        Ok(image.to_device(host))
    }
}
