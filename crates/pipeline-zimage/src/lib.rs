//! The reference Z-Image(-Turbo) pipeline on burn: diffusers-layout checkpoints, the Z-Image transformer, the Qwen3
//! text encoder, the FLUX VAE and the flow-match scheduler.
//!
//! Module map:
//! - [`config`]: the components' `config.json` and `model_index.json`, with the Z-Image-Turbo preset and derived
//!   sizes (parameter counts, bytes, activation estimates).
//! - [`nn`]: layers named and laid out like the PyTorch checkpoints (`PtLinear`, `RmsNorm`, `GroupNorm`).
//! - [`transformer`]: `ZImageTransformer2DModel`, exposed block by block so an offloader can drive the main loop.
//! - [`loading`]: opening a checkpoint directory and loading (sharded) safetensors into any module, loudly.
//! - [`lora`]: LoRA files (diffusers/PEFT and Kohya layouts) fused into the host weights or applied at run time,
//!   removable bit for bit, under every offload route.
//! - [`text_encoder`], [`vae`], [`scheduler`], [`tokenizer`]: the other pipeline components.
//! - [`pipeline`]: `ZImagePipeline`, text-to-image and image-to-image with every component a
//!   `group_offload::ModelHandle` run through one `ComponentsManager`. The transformer and the text encoder are
//!   `group_offload::OffloadModel`s (their block lists declared once, their forward written once over their
//!   weights, resident or streamed); the offload machinery itself lives in `group-offload` and `offload-core`.
//! - [`presets`]: `offload-core`'s planner applied to the pipeline (presets, budgets, staged phases, capacity
//!   profiles and calibration).
//! - [`plot`]: the device memory plot of a run's timeline (`--memory-plot`).
//! - [`schedule`]: the uses a run captured: a lookahead from the first image for the images after it, and a
//!   run's bytes moved beside `auto`'s and the optimum on the same schedule.
//! - [`output`]: the files a run writes, checked before it starts and written atomically.
//! - [`host`]: the process's host memory (peak resident set), for capacity profiles and the real-size benchmark.
//! - [`error`]: the crate's one error type.
//!
//! Validation lives at the edge: [`loading`] checks directories, configs and tensors, and the pipeline checks
//! generation arguments; model `forward`s trust their (documented) input shapes.

#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod host;
pub mod loading;
pub mod lora;
pub mod nn;
pub mod output;
pub mod pipeline;
pub mod plot;
pub mod presets;
pub mod quantize;
pub mod schedule;
pub mod scheduler;
pub mod text_encoder;
pub mod tokenizer;
pub mod transformer;
pub mod vae;
pub mod validate;

pub use error::{Error, Result};

/// The Rust examples of the README and `docs/`, compiled and run as doctests (`cargo test -p pipeline-zimage
/// --doc`): what a user is shown, CI runs. `docs/model-guide.md` is group-offload's own doctest.
#[cfg(doctest)]
mod shown {
    #[doc = include_str!("../../../README.md")]
    struct Readme;
    #[doc = include_str!("../../../docs/presets.md")]
    struct Presets;
    #[doc = include_str!("../../../docs/trace.md")]
    struct Trace;
}
