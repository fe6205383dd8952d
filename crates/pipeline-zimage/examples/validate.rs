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
//! On a device it also prints each phase's predicted peak beside the highest pages one of its calls reached;
//! `--per-call` adds every call's starting pages, pages taken and sampled in-use high-water, and the plan;
//! `--preset NAME` runs one preset; `--calls-only` skips the table.

use anyhow::Context;
use group_offload::OffloadDevice;
use offload_core::DeviceName;
use offload_core::plan::Preset;
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use pipeline_zimage::validate::{Case, Table, Target, validate, validation_cards};

/// The device's capacity where the runtime reports none (lavapipe): far above every card.
const TOTAL: u64 = 1 << 30;

fn checkpoint() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-z-image-turbo")
}

fn load(placement: OffloadDevice) -> pipeline_zimage::Result<ZImagePipeline> {
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
        let burn = group_offload::device::open_device_with(&name, group_offload::device::PagePolicy::Exclusive)?;
        // The one device object of the run: every measurement and case lays its account over it.
        let device = OffloadDevice::on_device(burn, name, std::sync::Arc::new(offload_core::NoLedger), None);
        // The process's first calls compile kernels and take the runtime's first buffers: not what a call needs.
        pipeline_zimage::validate::measure_calls(&device, TOTAL, &load, &opts)?;
        // What each component's weights take in the pool's pages, which the plans count them as.
        let measured = pipeline_zimage::validate::measure_footprints(&device, TOTAL, &load, &opts)?;
        for footprint in &measured.weights {
            println!("footprint: {footprint}");
        }
        for call in &measured.calls {
            println!("call footprint: {call}");
        }
        Target::Device { device, total: TOTAL, footprints: measured.weights, calls: measured.calls }
    };
    let probe = load(OffloadDevice::host_only())?;
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
    let calls_only = args.iter().any(|a| a == "--calls-only");
    let only = args.windows(2).find(|w| w[0] == "--preset").map(|w| Preset::parse(&w[1])).transpose()?;
    for card in cards.into_iter().filter(|_| !calls_only) {
        for preset in Preset::ALL.into_iter().filter(|p| *p != Preset::Off && only.is_none_or(|only| only == *p)) {
            cases.push(validate(&target, &load, preset, card, &opts));
        }
    }
    print!("{}", Table(&cases));
    {
        println!("\nper phase: predicted peak / the highest one of its calls reached, ratio");
        for case in &cases {
            if let Case::Measured(v) = case {
                let phases: Vec<String> = v
                    .phases
                    .iter()
                    .map(|(c, p, m)| format!("{c} {p}/{m} {:.3}", *p as f64 / (*m).max(1) as f64))
                    .collect();
                println!("{:<29} {:>8}  {}", v.preset.name(), offload_core::format_size(v.card), phases.join("  "));
            }
        }
    }
    if args.iter().any(|a| a == "--per-call") {
        for case in &cases {
            if let Case::Measured(v) = case {
                let calls: Vec<String> = v
                    .calls
                    .iter()
                    .map(|c| format!("{}({})+{}/{}", c.start, c.start_in_use, c.pages, c.in_use))
                    .collect();
                println!("{} {} per call, pages/in use: {}\n{}", v.preset, v.card, calls.join(" "), v.plan);
            }
        }
    }
    let worst = cases
        .iter()
        .filter_map(|c| match c {
            Case::Measured(v) => Some(v.peak_ratio()),
            Case::Refused { .. } => None,
        })
        .fold((f64::INFINITY, 0f64), |(lo, hi), r| (lo.min(r), hi.max(r)));
    println!("peak ratio from {:.3} to {:.3}", worst.0, worst.1);

    if let Target::Device { device, total, .. } = &target {
        println!("\nactivation pages per call, every component resident: estimate, measured pages (in use, sampled)");
        let probe = load(OffloadDevice::host_only())?;
        for (size, tokens, guidance) in [
            (64, 32, 0.0),
            (64, 32, 0.0),
            (128, 32, 0.0),
            (192, 32, 0.0),
            (256, 32, 0.0),
            (384, 32, 0.0),
            (64, 64, 0.0),
            (64, 128, 0.0),
            (64, 32, 4.0),
        ] {
            let mut opts = options(size);
            opts.max_sequence_length = tokens;
            opts.guidance = guidance;
            let prompts = vec![opts.prompt.clone()];
            let caption = probe.tokenizer().with_max_sequence_length(tokens).encode(&prompts)?.lengths()[0];
            let image = probe.transformer_config().image_tokens(size, size, probe.vae_scale_factor());
            let calls = pipeline_zimage::validate::measure_calls(device, *total, &load, &opts)?;
            for (i, call) in calls.iter().enumerate() {
                let component = match i {
                    0 => "text_encoder",
                    i if i <= opts.steps => "transformer",
                    _ => "vae",
                };
                println!(
                    "{size}x{size} max_seq {tokens} caption {caption} image_tokens {image} guidance {guidance} {component:<13} \
                     estimate {:>9} measured {:>9} ({:>9}) ratio {:.3}",
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
