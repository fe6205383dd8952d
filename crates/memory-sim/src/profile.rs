//! Pipeline profiles: the components of a pipeline at real sizes, and the order it uses them in.
//!
//! # How the Z-Image-Turbo numbers were obtained
//!
//! Weight bytes are bf16 parameter counts × 2, computed from the architecture in
//! `shared/reference/zimage-burn.md` (A.2) and checked in `pipeline-zimage`'s tests against its own config code:
//! transformer 6,154,908,736 parameters, text encoder 4,022,468,096, VAE 83,819,683.
//!
//! The activation profile is calibrated on the one published record of the anchor (diffusers PR #14304's docs,
//! a 20GB card with the default 3GB reserve), whose readings are binary GiB:
//!
//! | reading | value | what it pins |
//! |---|---|---|
//! | available before the first load | 18.02 | context overhead 18.626 − 18.02 = 0.606 GiB ([`CUDA_CONTEXT_OVERHEAD`]) |
//! | peak when the transformer arrives | 7.77 | text encoder working set 7.77 − 7.49 = 0.28 GiB |
//! | available when the transformer arrives | 10.38 | text encoder outputs 18.02 − 7.49 − 10.38 = 0.15 GiB |
//! | available when the VAE arrives | 6.36 | transformer outputs 10.38 + 7.49 − 11.46 − 6.36 = 0.05 GiB |
//! | peak when the VAE arrives | 12.07 | transformer working set 12.07 − 11.46 − 0.15 = 0.46 GiB |
//! | peak of the whole run (`max_memory_allocated`) | 14.15 | VAE working set 14.15 − 0.15 − 0.05 − 11.46 − 0.16 = 2.33 GiB |
//!
//! The text encoder's and the transformer's working sets are made in one allocation per layer or block, so a
//! hard card's out-of-memory strikes part-way through a call (see [`ActivationProfile`]).
//!
//! The VAE decoder's working set rises and falls, calibrated on the anchor's second record (the same docs: a
//! 13.5GB card, `memory_reserve=0`), whose decode fails part-way and is retried:
//!
//! | reading | value | what it pins |
//! |---|---|---|
//! | available when the VAE arrives | 1.29 | free for the decode once its 159.87 MB are on: 1.29 − 0.156 = 1.134 GiB |
//! | available at the `oom_retry` row | 693.77 MB | held by the failed decode: 1.134 − 0.678 = 0.456 GiB |
//! | peak at the `oom_retry` row | 12.65 | made by the decode before it failed: 12.65 − (12.90 − 1.134) = 0.884 GiB |
//!
//! So the decoder reaches 0.884 GiB, falls back to 0.456 GiB (its early maps freed), and then asks for more than
//! the 0.678 GiB left; on a card with room it goes on to the 2.33 GiB the first record pins. The record does not
//! say how large the failing request was, only that it was over 0.678 GiB: the profile takes 1 GiB (a 1024² map
//! of 256 channels in f32), a modelling choice. The readings are taken after the failure, when torch has
//! released its cache (an out-of-memory frees the cached blocks before it is raised), so the available
//! reading is the card less what is allocated. On the simulated card this run reads 0.05 GiB lower and peaks
//! 0.05 GiB higher than the anchor: the 0.05 GiB the transformer's calls leave, which the first record shows
//! held and this one does not (the allocator's cache, which the card does not model).
//!
//! The VAE leaves its image behind (1024 × 1024 × 3 bf16 = 6 MiB). The other two profiles' outputs are what the
//! record shows the allocator did not give back, not the size of the tensors alone; they reproduce the
//! record's readings within 0.01 GiB and the four declared card expectations exactly (see the tests).
//!
//! FLOPs per call are estimates for the time model only: 2 × parameters × tokens for the linear layers plus
//! 4 × sequence² × width per attention layer (transformer: 4,096 image + 32 caption tokens; text encoder: 512
//! padded tokens), and for the VAE decoder the 3×3 convolutions of its four resolutions at 1024².
//!
//! [`CUDA_CONTEXT_OVERHEAD`]: crate::card::CUDA_CONTEXT_OVERHEAD

use crate::component::{ActivationProfile, ComponentProfile};

const GIB: f64 = (1u64 << 30) as f64;

/// Z-Image-Turbo's real-size facts in bf16, written once: [`PipelineProfile::z_image_turbo`], `cargo xtask plan`
/// (the block structure) and the pipeline crate's tests (which check them against its configs) read them here.
pub mod z_image_turbo {
    /// The transformer's parameters (`ZImageTransformer2DModel`).
    pub const TRANSFORMER_PARAMETERS: u64 = 6_154_908_736;
    /// The text encoder's parameters (Qwen3, without the causal LM's head).
    pub const TEXT_ENCODER_PARAMETERS: u64 = 4_022_468_096;
    /// The VAE's parameters (FLUX's `AutoencoderKL`).
    pub const VAE_PARAMETERS: u64 = 83_819_683;
    /// The transformer's weights in bf16.
    pub const TRANSFORMER_BYTES: u64 = TRANSFORMER_PARAMETERS * 2;
    /// The text encoder's weights in bf16.
    pub const TEXT_ENCODER_BYTES: u64 = TEXT_ENCODER_PARAMETERS * 2;
    /// The VAE's weights in bf16.
    pub const VAE_BYTES: u64 = VAE_PARAMETERS * 2;
    /// Bytes of one modulated transformer block (a noise refiner or a main layer, with `adaLN_modulation`).
    pub const MODULATED_BLOCK_BYTES: u64 = 180_910_336 * 2;
    /// Bytes of one context-refiner block.
    pub const CONTEXT_BLOCK_BYTES: u64 = 176_962_816 * 2;
    /// Noise-refiner blocks, run first.
    pub const NOISE_REFINER_BLOCKS: usize = 2;
    /// Context-refiner blocks, run second.
    pub const CONTEXT_REFINER_BLOCKS: usize = 2;
    /// Main transformer layers, run last.
    pub const MAIN_BLOCKS: usize = 30;
    /// Bytes of one Qwen3 decoder layer of the text encoder.
    pub const TEXT_LAYER_BYTES: u64 = 100_930_816 * 2;
    /// The text encoder's decoder layers.
    pub const TEXT_LAYERS: usize = 36;
    /// The text encoder's largest leaf: a layer's `mlp.gate_proj` (9728 × 2560).
    pub const TEXT_GATE_PROJ_BYTES: u64 = 9728 * 2560 * 2;
    /// The transformer's largest leaf: a block's feed-forward `w1` (10240 × 3840).
    pub const TRANSFORMER_W1_BYTES: u64 = 10_240 * 3840 * 2;
    /// Leaf groups inside the text encoder's layers, as leaf-level group offload forms them: per Qwen3 layer its
    /// 7 linear layers, its norms and its attention's q/k norms.
    pub const TEXT_LEAVES: usize = TEXT_LAYERS * 9;
    /// Leaf groups inside the transformer's blocks: per modulated block 8 linear layers (with `adaLN_modulation`)
    /// and the same two norm groups, per context-refiner block 7 and two.
    pub const TRANSFORMER_LEAVES: usize = (NOISE_REFINER_BLOCKS + MAIN_BLOCKS) * 10 + CONTEXT_REFINER_BLOCKS * 9;
    /// The first leaf group the text encoder's forward takes: its first layer's norms (two RMSNorm weights).
    pub const TEXT_FIRST_LEAF_BYTES: u64 = 2560 * 2 * 2;
    /// The first leaf group the transformer's forward takes: the first noise refiner's `adaLN_modulation.0`
    /// (256 -> 4 x 3840, with bias).
    pub const TRANSFORMER_FIRST_LEAF_BYTES: u64 = (256 * 15_360 + 15_360) * 2;

    /// The transformer's block sizes in execution order: noise refiners, context refiners, main layers.
    pub fn transformer_blocks() -> Vec<u64> {
        [
            vec![MODULATED_BLOCK_BYTES; NOISE_REFINER_BLOCKS],
            vec![CONTEXT_BLOCK_BYTES; CONTEXT_REFINER_BLOCKS],
            vec![MODULATED_BLOCK_BYTES; MAIN_BLOCKS],
        ]
        .concat()
    }

    /// The text encoder's layer sizes in execution order.
    pub fn text_layers() -> Vec<u64> {
        vec![TEXT_LAYER_BYTES; TEXT_LAYERS]
    }

    /// The leaf groups of one Qwen3 layer in bf16 bytes, as leaf-level group offload forms them: its two norms
    /// (2 × 2560), `q_proj` (4096 × 2560), `k_proj` and `v_proj` (1024 × 2560), the attention's q/k norms
    /// (2 × 128), `o_proj` (2560 × 4096), `gate_proj`, `up_proj` (9728 × 2560) and `down_proj` (2560 × 9728).
    /// They add up to [`TEXT_LAYER_BYTES`].
    pub fn text_layer_leaves() -> [u64; 9] {
        [2 * 2560, 4096 * 2560, 1024 * 2560, 1024 * 2560, 2 * 128, 2560 * 4096, 9728 * 2560, 9728 * 2560, 2560 * 9728]
            .map(|params| params * 2)
    }

    /// The text encoder's leaf groups in execution order, [`TEXT_LEAVES`] of them.
    pub fn text_leaves() -> Vec<u64> {
        (0..TEXT_LAYERS).flat_map(|_| text_layer_leaves()).collect()
    }

    /// The leaf groups of one transformer block in bf16 bytes (`modulated`: with its `adaLN_modulation.0`, 256 →
    /// 4 × 3840 with bias, first): `to_q`, `to_k`, `to_v`, `to_out.0` (3840 × 3840 each), the attention's q/k norms
    /// (2 × 128), `w1`, `w2`, `w3` (3840 × 10240 each) and the block's four norms (4 × 3840). They add up to
    /// [`MODULATED_BLOCK_BYTES`] or [`CONTEXT_BLOCK_BYTES`].
    pub fn transformer_block_leaves(modulated: bool) -> Vec<u64> {
        let ada = modulated.then_some(256 * 15_360 + 15_360);
        let rest = [3840 * 3840; 4].into_iter().chain([2 * 128]).chain([3840 * 10_240; 3]).chain([4 * 3840]);
        ada.into_iter().chain(rest).map(|params| params * 2).collect()
    }

    /// The transformer's leaf groups in execution order, [`TRANSFORMER_LEAVES`] of them.
    pub fn transformer_leaves() -> Vec<u64> {
        let blocks = [(true, NOISE_REFINER_BLOCKS), (false, CONTEXT_REFINER_BLOCKS), (true, MAIN_BLOCKS)];
        blocks
            .into_iter()
            .flat_map(|(modulated, count)| (0..count).flat_map(move |_| transformer_block_leaves(modulated)))
            .collect()
    }
}

/// The allocations a call's working set is made in: one per layer or block that runs (Qwen3's 36 layers; the
/// transformer's 2 noise-refiner, 2 context-refiner and 30 main blocks). A modelling choice, not a measurement:
/// it sets how far into a call an out-of-memory can strike, and how much the failed call holds when it does.
const TEXT_ALLOCATIONS: u32 = z_image_turbo::TEXT_LAYERS as u32;
const TRANSFORMER_ALLOCATIONS: u32 =
    (z_image_turbo::NOISE_REFINER_BLOCKS + z_image_turbo::CONTEXT_REFINER_BLOCKS + z_image_turbo::MAIN_BLOCKS) as u32;

/// The VAE decoder's working set after each of its allocations and frees, GiB, from the anchor's two records
/// (module docs): up to 0.884, down to 0.456, a 1 GiB request, up to its 2.33 peak.
pub const VAE_DECODE_LEVELS_GIB: [f64; 5] = [0.456, 0.884, 0.456, 1.456, 2.33];

fn gib(x: f64) -> u64 {
    (x * GIB).round() as u64
}

/// A pipeline: its components, and the components one prompt uses, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineProfile {
    /// The pipeline's name.
    pub name: String,
    /// Components in registration order.
    pub components: Vec<ComponentProfile>,
    /// Components that run once per prompt before denoising (prompt encoding), by name.
    pub encode: Vec<String>,
    /// Components that run once per denoising step, by name.
    pub denoise: Vec<String>,
    /// Components that run once per prompt after denoising (decoding), by name.
    pub decode: Vec<String>,
    /// Denoising steps per prompt.
    pub steps: usize,
}

impl PipelineProfile {
    /// The Z-Image-Turbo pipeline at 1024×1024 in bf16 with `steps` denoising steps (the anchor tests 4).
    pub fn z_image_turbo(steps: usize) -> Self {
        let transformer_tokens = 4096.0 + 32.0;
        let transformer_flops = 2.0 * z_image_turbo::TRANSFORMER_PARAMETERS as f64 * transformer_tokens
            + 34.0 * 4.0 * transformer_tokens * transformer_tokens * 3840.0;
        let text_tokens = 512.0;
        let text_flops = 2.0 * z_image_turbo::TEXT_ENCODER_PARAMETERS as f64 * text_tokens
            + 36.0 * 4.0 * text_tokens * text_tokens * 4096.0;
        // 3x3 convolutions: about six per resolution at (1024², 128 ch), (512², 256), (256², 512), (128², 512),
        // each 2 × 9 × channels² × pixels, plus the three upsampling convolutions.
        let conv = |pixels: f64, channels: f64| 2.0 * 9.0 * channels * channels * pixels;
        let vae_flops = 6.0
            * (conv(1024.0 * 1024.0, 128.0)
                + conv(512.0 * 512.0, 256.0)
                + conv(256.0 * 256.0, 512.0)
                + conv(128.0 * 128.0, 512.0))
            + conv(1024.0 * 1024.0, 256.0)
            + conv(512.0 * 512.0, 512.0)
            + conv(256.0 * 256.0, 512.0);
        Self {
            name: "z-image-turbo".into(),
            components: vec![
                ComponentProfile {
                    name: "text_encoder".into(),
                    bytes: z_image_turbo::TEXT_ENCODER_BYTES,
                    activations: ActivationProfile::new(gib(0.28), gib(0.15)).in_allocations(TEXT_ALLOCATIONS),
                    flops: text_flops,
                },
                ComponentProfile {
                    name: "transformer".into(),
                    bytes: z_image_turbo::TRANSFORMER_BYTES,
                    activations: ActivationProfile::new(gib(0.46), gib(0.05)).in_allocations(TRANSFORMER_ALLOCATIONS),
                    flops: transformer_flops,
                },
                ComponentProfile {
                    name: "vae".into(),
                    bytes: z_image_turbo::VAE_BYTES,
                    activations: ActivationProfile::through_levels(
                        VAE_DECODE_LEVELS_GIB.iter().map(|&level| gib(level)).collect(),
                        1024 * 1024 * 3 * 2,
                    ),
                    flops: vae_flops,
                },
            ],
            encode: vec!["text_encoder".into()],
            denoise: vec!["transformer".into()],
            decode: vec!["vae".into()],
            steps,
        }
    }

    /// The names of the components one prompt uses, in order: encode, `steps` × denoise, decode.
    pub fn uses_per_prompt(&self) -> Vec<String> {
        let mut uses = self.encode.clone();
        for _ in 0..self.steps {
            uses.extend(self.denoise.iter().cloned());
        }
        uses.extend(self.decode.iter().cloned());
        uses
    }

    /// The uses of `prompts` prompts in a row.
    pub fn uses(&self, prompts: usize) -> Vec<String> {
        let one = self.uses_per_prompt();
        (0..prompts).flat_map(|_| one.iter().cloned()).collect()
    }

    /// A component's profile by name.
    pub fn component(&self, name: &str) -> Option<&ComponentProfile> {
        self.components.iter().find(|c| c.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::z_image_turbo::*;

    #[test]
    fn the_leaves_add_up_to_their_blocks_and_agree_with_the_leaf_facts() {
        let text = text_leaves();
        assert_eq!(text.len(), TEXT_LEAVES);
        assert_eq!(text.iter().sum::<u64>(), text_layers().iter().sum::<u64>());
        assert_eq!(text_layer_leaves().iter().sum::<u64>(), TEXT_LAYER_BYTES);
        assert_eq!(text[0], TEXT_FIRST_LEAF_BYTES);
        assert_eq!(text.iter().max(), Some(&TEXT_GATE_PROJ_BYTES));
        let transformer = transformer_leaves();
        assert_eq!(transformer.len(), TRANSFORMER_LEAVES);
        assert_eq!(transformer.iter().sum::<u64>(), transformer_blocks().iter().sum::<u64>());
        assert_eq!(transformer_block_leaves(true).iter().sum::<u64>(), MODULATED_BLOCK_BYTES);
        assert_eq!(transformer_block_leaves(false).iter().sum::<u64>(), CONTEXT_BLOCK_BYTES);
        assert_eq!(transformer[0], TRANSFORMER_FIRST_LEAF_BYTES);
        assert_eq!(transformer.iter().max(), Some(&TRANSFORMER_W1_BYTES));
    }
}
