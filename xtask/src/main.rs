//! `cargo xtask`: developer commands for the workspace, one `run()` per subcommand.
//!
//! - `integration --card 16GB`: plays Z-Image-Turbo at real sizes on simulated cards through the real
//!   `ComponentsManager`, checks each card's declared expectations and reports time, bytes moved against the
//!   offline optimum, peak and OOM retries. This is the README's main job.
//! - `compare`: bytes moved by each strategy against the optimum, for several prompts in a row.
//! - `bench overlap`: group offload's prefetch against serial transfers, side by side (runs cargo).
//! - `bench offload [--device wgpu]`: a mid-size transformer resident, under `auto` on a cap 30% under its
//!   weights, at block level with and without prefetch and at leaf level, in one process; its last line is
//!   `offload_overhead auto=R block_prefetch=R block_serial=R leaf=R` (runs cargo).
//! - `fuzz`: a million mutated inputs into each parser of user input (sizes, card names, settings) and, through
//!   `pipeline-zimage`'s `fuzz_readers` example, into each checkpoint reader (model index, shard index,
//!   component configs, safetensors files).
//! - `setup-cuda`: installs the LLVM bundle that burn's `cuda` feature needs, from the Python registry.
//! - `gpu-bundle`: builds the GPU check for CUDA in release and packs it with the peer benchmark into
//!   `.gpu/gpu-bundle.tar.xz` (under 60 MB), which `tools/gpu-check.sh` runs on a lent device in one call.
//! - `plan --card 8GB --ram 32GB --preset auto`: the offload plan for Z-Image-Turbo at real sizes: each
//!   component's route, resident and pinned bytes, bytes streamed and predicted time per step, and why.
//!   `plan --validate [--device wgpu]`: every preset's predicted peak, bytes moved and moves beside the measured
//!   ones on the tiny checkpoint, with their ratios (runs `pipeline-zimage`'s `validate` example).
//! - `fixtures`: regenerates the tiny Z-Image checkpoints, their variants, the tiny LoRA files and the golden
//!   outputs with diffusers and peft (runs Python).
//!
//! xtask depends on no burn crate, so the simulation commands build in seconds; commands that need burn or
//! Python run them as child processes.

#![forbid(unsafe_code)]

mod fuzz;
mod integration;
mod plan;
mod tasks;

use clap::{Parser, Subcommand};

/// Developer commands for the offload workspace.
#[derive(Parser)]
#[command(name = "cargo xtask", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Play Z-Image-Turbo at real sizes on simulated cards and check the declared expectations.
    Integration(integration::Args),
    /// Compare strategies' bytes moved with the offline optimum over several prompts.
    Compare(integration::CompareArgs),
    /// Run a benchmark: `overlap` (group offload prefetch versus serial transfers), `offload [--device wgpu]`
    /// (offload overhead against resident), `real-size --weights DIR`.
    Bench(tasks::BenchArgs),
    /// Print the offload plan for Z-Image-Turbo at real sizes on a simulated card and host.
    Plan(plan::Args),
    /// Regenerate the tiny Z-Image fixtures with the reference Python implementation.
    Fixtures(tasks::FixturesArgs),
    /// Fuzz the parsers of user input and the checkpoint readers with a million inputs each.
    Fuzz(fuzz::Args),
    /// Install the LLVM bundle burn's `cuda` feature builds against, from the Python registry.
    SetupCuda(tasks::SetupCudaArgs),
    /// Build the GPU check for CUDA in release and pack it with the peer benchmark for the device tool.
    GpuBundle(tasks::GpuBundleArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Integration(args) => integration::run(&args),
        Command::Compare(args) => integration::compare(&args),
        Command::Bench(args) => tasks::bench(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Fixtures(args) => tasks::fixtures(&args),
        Command::SetupCuda(args) => tasks::setup_cuda(&args),
        Command::GpuBundle(args) => tasks::gpu_bundle(&args),
        Command::Fuzz(args) => fuzz::run(&args),
    }
}
