//! Quantized streaming on a real cubecl runtime, burn's wgpu backend (in CI Mesa's lavapipe, on the CPU): a survey
//! of the schemes with the pipeline's host copies on the CPU backend. Each is quantized there, run resident and
//! streamed by blocks; the table prints each outcome. The CPU backend stores every scheme one byte per value, which
//! wgpu cannot hold, so every scheme must be refused up front by name, never fail on the device or panic in burn
//! (`docs/lora-and-quantization.md`).
//!
//! Run it with `cargo test -p pipeline-zimage --features wgpu --test quantized_device -- --nocapture`.

#![cfg(feature = "wgpu")]

mod common;

use std::sync::Arc;

use burn::tensor::quantization::{QuantScheme, QuantStore, QuantValue};
use common::{load_tiny, max_abs_diff, turbo_options, values};
use group_offload::device::{PagePolicy, open_device_with};
use group_offload::{GroupOptions, Placement, whole::Unbounded};
use offload_core::{DeviceName, NoLedger};
use pipeline_zimage::pipeline::ZImagePipeline;
use pipeline_zimage::quantize::quantize_with;

/// The tiny pipeline on the wgpu device, every component resident through the manager.
fn on_device(device: &burn::tensor::Device, name: &DeviceName) -> ZImagePipeline {
    let pipeline = load_tiny(Placement::on_device(device.clone(), name.clone(), Arc::new(NoLedger), None));
    pipeline.enable_auto_offload(Arc::new(Unbounded { device: name.clone() }), 0, true).expect("auto offload");
    pipeline
}

/// Quantizes with `scheme`, runs resident, then streams the transformer by blocks for two images: the resident
/// image, and the largest difference of a streamed image from it. A refusal is returned as its message.
fn run(device: &burn::tensor::Device, name: &DeviceName, scheme: &QuantScheme) -> Result<(Vec<f32>, f32), String> {
    let (opts, _) = turbo_options();
    let mut pipeline = on_device(device, name);
    quantize_with(pipeline.text_encoder_mut(), scheme).map_err(|e| e.to_string())?;
    quantize_with(pipeline.transformer_mut(), scheme).map_err(|e| e.to_string())?;
    let resident = values(pipeline.generate(&opts, &mut |_, _| {}).map_err(|e| e.to_string())?);
    let mut streamed = on_device(device, name);
    quantize_with(streamed.text_encoder_mut(), scheme).map_err(|e| e.to_string())?;
    quantize_with(streamed.transformer_mut(), scheme).map_err(|e| e.to_string())?;
    streamed.enable_group_offload_with("transformer", &GroupOptions::default()).map_err(|e| e.to_string())?;
    let mut difference = 0.0f32;
    for _ in 0..2 {
        let image = values(streamed.generate(&opts, &mut |_, _| {}).map_err(|e| e.to_string())?);
        difference = difference.max(max_abs_diff(&image, &resident));
    }
    Ok((resident, difference))
}

#[test]
fn every_scheme_quantized_on_the_cpu_host_is_refused_by_name_on_wgpu_instead_of_failing_on_the_device() {
    let name = DeviceName::parse("wgpu").expect("a device name");
    let device = open_device_with(&name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (this suite needs a Vulkan driver)"));
    let (opts, _) = turbo_options();
    let float = values(on_device(&device, &name).generate(&opts, &mut |_, _| {}).expect("f32 on wgpu"));
    let schemes = [
        ("q8s native", QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native)),
        ("q8s packed u32", QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::PackedU32(0))),
        ("q4s packed u32", QuantScheme::default().with_value(QuantValue::Q4S).with_store(QuantStore::PackedU32(0))),
        ("e4m3 native", QuantScheme::default().with_value(QuantValue::E4M3).with_store(QuantStore::Native)),
        ("e2m1 packed u32", QuantScheme::default().with_value(QuantValue::E2M1).with_store(QuantStore::PackedU32(0))),
    ];
    let mut outcomes = Vec::new();
    println!("| scheme on {name} | outcome | max abs error vs f32 | streamed vs resident |");
    println!("|---|---|---|---|");
    for (label, scheme) in schemes {
        // A scheme the runtime cannot hold used to panic inside burn's kernels or fail on the device; the survey
        // catches a panic so that it is reported beside the others, and fails on it below.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&device, &name, &scheme)));
        let row = match &outcome {
            Ok(Ok((image, difference))) => {
                format!("computed | {:.3e} | {difference:.1e}", max_abs_diff(image, &float))
            }
            Ok(Err(message)) => format!("refused: {message} | |"),
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                format!("panicked in burn: {} | |", message.lines().next().unwrap_or_default())
            }
        };
        println!("| {label} | {row} |");
        outcomes.push((label, outcome.ok()));
        device.memory_cleanup();
    }
    // The host copies live on the CPU backend, which quantizes every scheme one byte per value; wgpu holds no
    // such tensor, so every scheme is refused up front, typed and by name, rather than failing on the device.
    for (label, outcome) in &outcomes {
        match outcome {
            Some(Err(message)) => assert!(message.contains("cannot quantize text_encoder with"), "{label}: {message}"),
            Some(Ok((_, difference))) => assert_eq!(*difference, 0.0, "{label}: streaming changed the image"),
            None => panic!("{label}: burn panicked instead of a typed refusal"),
        }
    }
}
