//! Z-Image-Turbo at real sizes as plan input, and machines of given card and RAM sizes.
//!
//! offload-core cannot depend on memory-sim (memory-sim depends on it), so the numbers are repeated here from
//! `memory_sim::PipelineProfile::z_image_turbo` (weights, activations, FLOPs) and `shared/reference/zimage-burn.md`
//! A.2 (block structure). `cargo xtask plan` builds the same input from memory-sim itself.

#![allow(dead_code)] // Each test file uses a different part.

use offload_core::plan::{BlockLayout, ComponentSpec, HostMemory, Machine, TimeModel};

const GIB: f64 = (1u64 << 30) as f64;

fn gib(x: f64) -> u64 {
    (x * GIB).round() as u64
}

/// memory-sim's CUDA context overhead (0.606 GiB).
pub const CUDA_CONTEXT_OVERHEAD: u64 = 650_692_591;

/// Denoising steps of Z-Image-Turbo (8 transformer calls per image).
pub const STEPS: u32 = 8;

/// The three components in pipeline order, file-backed: the real checkpoint is a file of the bf16 weights they
/// upload, so each file can be its component's host copy.
pub fn z_image_turbo() -> Vec<ComponentSpec> {
    let transformer_tokens = 4096.0 + 32.0;
    let transformer_flops =
        2.0 * 6_154_908_736.0 * transformer_tokens + 34.0 * 4.0 * transformer_tokens * transformer_tokens * 3840.0;
    let text_flops = 2.0 * 4_022_468_096.0 * 512.0 + 36.0 * 4.0 * 512.0 * 512.0 * 4096.0;
    let conv = |pixels: f64, channels: f64| 2.0 * 9.0 * channels * channels * pixels;
    let vae_flops = 6.0
        * (conv(1024.0 * 1024.0, 128.0)
            + conv(512.0 * 512.0, 256.0)
            + conv(256.0 * 256.0, 512.0)
            + conv(128.0 * 128.0, 512.0))
        + conv(1024.0 * 1024.0, 256.0)
        + conv(512.0 * 512.0, 512.0)
        + conv(256.0 * 256.0, 512.0);

    let text_layers = BlockLayout::uniform(36, 100_930_816 * 2);
    let text_weight = 8_044_936_192;
    let text_outside = text_weight - text_layers.iter().sum::<u64>();
    let text_encoder = ComponentSpec::new("text_encoder", text_weight)
        .with_layout(BlockLayout {
            block_bytes: text_layers,
            outside_bytes: text_outside,
            // The largest leaf inside a layer: mlp.gate_proj (9728 x 2560); 7 linear layers per layer.
            largest_leaf_bytes: 9728 * 2560 * 2,
            leaf_count: 36 * 7,
            // q_proj (4096 x 2560), the first part a layer's forward takes after its norms.
            first_leaf_bytes: 4096 * 2560 * 2,
            leaf_bytes: Vec::new(),
        })
        .with_activation(gib(0.28) + gib(0.15))
        .with_cost(text_flops, 1)
        .with_file_backed(true);

    let modulated = 180_910_336 * 2;
    let context = 176_962_816 * 2;
    let blocks: Vec<u64> = [vec![modulated; 2], vec![context; 2], vec![modulated; 30]].concat();
    let transformer_weight = 12_309_817_472;
    let transformer_outside = transformer_weight - blocks.iter().sum::<u64>();
    let transformer = ComponentSpec::new("transformer", transformer_weight)
        .with_layout(BlockLayout {
            block_bytes: blocks,
            outside_bytes: transformer_outside,
            // feed_forward.w1 (10240 x 3840); 8 linear layers per modulated block, 7 per context block.
            largest_leaf_bytes: 10_240 * 3840 * 2,
            leaf_count: 32 * 8 + 2 * 7,
            // adaLN_modulation.0 (256 -> 4 x 3840, with bias) of the first noise_refiner block.
            first_leaf_bytes: (256 * 15_360 + 15_360) * 2,
            leaf_bytes: Vec::new(),
        })
        .with_activation(gib(0.46) + gib(0.05))
        .with_cost(transformer_flops, STEPS)
        .with_file_backed(true);

    let vae = ComponentSpec::new("vae", 167_639_366)
        .with_activation(gib(2.33) + 1024 * 1024 * 3 * 2)
        .with_cost(vae_flops, 1)
        .with_file_backed(true);
    vec![text_encoder, transformer, vae]
}

/// A machine with a card of `card_gb` decimal GB (less a CUDA context) and `ram_gb` of RAM, 90% available,
/// with memory-sim's generic timing (PCIe 4.0 x16, 100 TFLOP/s).
pub fn machine(card_gb: u64, ram_gb: u64) -> Machine {
    let card = card_gb * 1_000_000_000;
    let ram = ram_gb * 1_000_000_000;
    Machine::new(card, card - CUDA_CONTEXT_OVERHEAD, HostMemory::new(ram, ram / 10 * 9)).with_time(TimeModel::generic())
}
