//! Predicted beside measured on a real cubecl runtime (burn's wgpu backend; lavapipe in CI), for every preset on
//! three cards sized from the tiny pipeline: the bytes moved and the moves per image are the planner's exactly;
//! the predicted device peak is at most 10% above the pool's page high-water (the cache released before each
//! call) and below it by no more than the measured misses that `docs/benchmarks.md` explains (small tensors'
//! pages, which the pool keeps; a streamed group's pages, kept for the rest of its call): the goal of 10% is not
//! met on this runtime, and the bounds say by how much.
//! Each call's pages are also checked against the activation estimate they were fitted to.
//!
//! `cargo test -p pipeline-zimage --features wgpu --test validate_device -- --nocapture` prints the table.

#![cfg(feature = "wgpu")]

mod common;

use common::fixtures;
use group_offload::Placement;
use group_offload::{device::PagePolicy, device::open_device_with};
use offload_core::DeviceName;
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use pipeline_zimage::validate::{Case, Table, Target, measure_calls, validate_presets, validation_cards};

/// The size given as the lavapipe device's total: it reports none.
const TOTAL: u64 = 1 << 30;

fn load(placement: Placement) -> pipeline_zimage::Result<ZImagePipeline> {
    ZImagePipeline::load(fixtures().join("tiny-z-image-turbo"), placement, &LoadOptions::new())
}

fn options(size: usize) -> GenerateOptions {
    let mut opts = GenerateOptions::turbo("a red fox in the snow");
    (opts.steps, opts.height, opts.width, opts.max_sequence_length, opts.seed) = (4, size, size, 32, 42);
    opts
}

#[test]
fn every_preset_on_the_real_device_moves_what_the_plan_predicts_and_peaks_near_it() {
    let name = DeviceName::parse("wgpu").expect("a device name");
    let device = open_device_with(&name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (this suite needs a Vulkan driver)"));
    let opts = options(64);
    // The process's first calls compile kernels and take the runtime's first buffers.
    measure_calls(&device, &name, TOTAL, &load, &opts).expect("a warm-up run");

    // Each call's pages against its estimate, at two image sizes: the text encoder's are within the runtime's
    // per-call buffers at this size, and a pipeline's first step takes its first buffers (up to 16% off), so the
    // later steps and the decode are held.
    for size in [64, 128] {
        let calls = measure_calls(&device, &name, TOTAL, &load, &options(size)).expect("a resident run");
        assert_eq!(calls.len(), 6, "the text encoder, four steps, the decode");
        for (i, call) in calls.iter().enumerate().skip(2) {
            let ratio = call.estimate as f64 / call.pages as f64;
            println!(
                "{size}x{size} call {i}: estimate {} B, measured pages {} B, ratio {ratio:.3}",
                call.estimate, call.pages
            );
            assert!((0.9..=1.1).contains(&ratio), "{size}x{size} call {i}: {call:?}");
        }
    }

    let probe = load(Placement::host_only()).expect("loads");
    let cards = validation_cards(&probe, &opts).expect("cards");
    let target = Target::Device { device: device.clone(), name: name.clone(), total: TOTAL };
    let cases = validate_presets(&target, &load, &cards, &opts);
    let table = Table(&cases).to_string();
    println!("{table}");
    for case in &cases {
        let Case::Measured(v) = case else { panic!("every preset runs on every card: {table}") };
        assert_eq!(v.predicted.bytes, v.measured.bytes, "{} on {}: bytes\n{table}", v.preset, v.card);
        assert_eq!(v.predicted.moves, v.measured.moves, "{} on {}: moves\n{table}", v.preset, v.card);
        let streams = v.routes.contains("block") || v.routes.contains("leaf");
        // Measured (docs/benchmarks.md): 0.90 to 0.94 where nothing streams, 0.815 to 0.843 where something does
        // (small tensors' pages, which the planner does not model).
        let floor = if streams { 0.75 } else { 0.85 };
        let ratio = v.peak_ratio();
        assert!((floor..=1.10).contains(&ratio), "{} on {}: peak ratio {ratio:.3}\n{table}", v.preset, v.card);
    }
}
