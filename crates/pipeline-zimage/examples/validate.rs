//! Predicted beside measured on the tiny checkpoint: for every preset on three cards sized from the pipeline (one
//! that must stream the transformer, one that holds any one component whole, one that holds everything), the
//! planner's device peak, bytes moved and moves per image next to what one image measured, with the ratios; then,
//! on a real device, each component call's activation pages next to its estimate, at two image sizes.
//!
//! ```text
//! cargo run -p pipeline-zimage --example validate                                   # the simulated card
//! cargo run -p pipeline-zimage --features wgpu --example validate -- --device wgpu  # lavapipe's Vulkan
//! ```
//!
//! `cargo xtask plan --validate [--device wgpu]` runs it. See `pipeline_zimage::validate` for what each figure is.

use anyhow::Context;
use offload_core::DeviceName;
use offload_core::plan::Preset;
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::offload::Placement;
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use pipeline_zimage::validate::{Case, Table, Target, validate, validation_cards};

/// The device's capacity where the runtime reports none (lavapipe): far above every card.
const TOTAL: u64 = 1 << 30;

fn checkpoint() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-z-image-turbo")
}

fn load(placement: Placement) -> pipeline_zimage::Result<ZImagePipeline> {
    ZImagePipeline::load(checkpoint(), placement, &LoadOptions::new())
}

/// The workload: 64x64, 4 steps, 32 prompt tokens (the tiny goldens' shape), a seeded noise.
fn options(size: usize) -> GenerateOptions {
    let mut opts = GenerateOptions::turbo("a red fox in the snow");
    (opts.steps, opts.height, opts.width, opts.max_sequence_length, opts.seed) = (4, size, size, 32, 42);
    opts
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let device = args.windows(2).find(|w| w[0] == "--device").map_or("cpu", |w| w[1].as_str()).to_string();
    let size = args.windows(2).find(|w| w[0] == "--size").map_or(Ok(64), |w| w[1].parse()).context("--size")?;
    let opts = options(size);
    let target = if device == "cpu" {
        Target::Simulated
    } else {
        let name = DeviceName::parse(&device)?;
        let burn = group_offload::open_device_with(&name, group_offload::PagePolicy::Exclusive)?;
        Target::Device { device: burn, name, total: TOTAL }
    };
    let probe = load(Placement::host_only())?;
    let cards = validation_cards(&probe, &opts)?;
    drop(probe);
    println!(
        "tiny Z-Image-Turbo, {size}x{size}, {} steps, {} prompt tokens, on {}; peak in bytes (measured: {}), \
         ratio = predicted / measured",
        opts.steps,
        opts.max_sequence_length,
        if device == "cpu" { "a hard simulated card".to_string() } else { format!("{device} (soft cap)") },
        if device == "cpu" { "the card's peak allocation" } else { "the pool's page high-water above its start" },
    );
    let mut cases = Vec::new();
    for card in cards {
        for preset in Preset::ALL.into_iter().filter(|p| *p != Preset::Off) {
            cases.push(validate(&target, &load, preset, card, &opts));
        }
    }
    print!("{}", Table(&cases));
    let worst = cases
        .iter()
        .filter_map(|c| match c {
            Case::Measured(v) => Some(v.peak_ratio()),
            Case::Refused { .. } => None,
        })
        .fold((f64::INFINITY, 0f64), |(lo, hi), r| (lo.min(r), hi.max(r)));
    println!("peak ratio from {:.3} to {:.3}", worst.0, worst.1);

    if let Target::Device { device: burn, name, total } = &target {
        println!("\nactivation pages per call, every component resident (estimate / measured)");
        for size in [64, 128] {
            let opts = options(size);
            let calls = pipeline_zimage::validate::measure_calls(burn, name, *total, &load, &opts)?;
            for (i, call) in calls.iter().enumerate() {
                let component = match i {
                    0 => "text_encoder",
                    i if i <= opts.steps => "transformer",
                    _ => "vae",
                };
                println!(
                    "{size}x{size} {component:<13} estimate {:>9} measured pages {:>9} (in use {:>9}) ratio {:.3}",
                    call.estimate,
                    call.pages,
                    call.in_use,
                    call.estimate as f64 / call.pages.max(1) as f64
                );
            }
        }
    }
    Ok(())
}
