//! Quantized weights on a real cubecl runtime, burn's wgpu backend (in CI Mesa's lavapipe, on the CPU), with the
//! pipeline's host copies on the CPU backend `flex`, which stores every scheme one byte a value. wgpu holds 8-bit
//! values only packed four to a `u32`, the same bytes in the same order: every move, whole or by group, relabels
//! them (`group_offload::quant::repack`), and a weight whose rows are not a whole number of words stays float. Here:
//!
//! - a survey of the schemes: each is quantized, run resident through the manager (whole moves), and streamed by
//!   blocks and by leaves for two images; the table prints each outcome. 8-bit computes, streams the resident
//!   image bit for bit and stays near f32; 4-bit is refused by name (the device would hold fewer bytes than the
//!   host copy every size is counted from), and the float values by name (flex has none);
//! - every preset on three cards, the quantized pipeline's bytes and moves per image equal the plan's.
//!
//! Run it with `cargo test -p pipeline-zimage --features wgpu --test quantized_device -- --nocapture`
//! (`docs/lora-and-quantization.md` has the figures).

#![cfg(feature = "wgpu")]

mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::quantization::{QuantScheme, QuantStore, QuantValue};
use burn::tensor::{DType, Tensor};
use common::{component_bytes, fixtures, load_tiny, max_abs_diff, turbo_options, values};
use group_offload::device::{PagePolicy, open_device_with};
use group_offload::{GroupLevel, GroupOptions, OffloadDevice};
use offload_core::{DeviceName, NoLedger};
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::pipeline::ZImagePipeline;
use pipeline_zimage::presets::exact_reserve;
use pipeline_zimage::quantize::{int8_scheme, quantize_with};
use pipeline_zimage::validate::{Case, Table, Target, validate_presets, validation_cards};

/// The size given as the lavapipe device's total: it reports none.
const TOTAL: u64 = 1 << 30;

/// One test at a time on the device: each reads the pool's pages, which another's run would move.
static TURNS: Mutex<()> = Mutex::new(());

/// The wgpu device and this test's turn on it.
fn wgpu() -> (burn::tensor::Device, DeviceName, MutexGuard<'static, ()>) {
    let turn = TURNS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let name = DeviceName::parse("wgpu").expect("a device name");
    let device = open_device_with(&name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (this suite needs a Vulkan driver)"));
    (device, name, turn)
}

/// The tiny pipeline on the wgpu device, every component resident through the manager.
fn on_device(device: &burn::tensor::Device, name: &DeviceName) -> ZImagePipeline {
    let pipeline = load_tiny(OffloadDevice::on_device(device.clone(), name.clone(), Arc::new(NoLedger), None));
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    pipeline
}

/// What a scheme must do on the device.
#[derive(Clone, Copy)]
enum Expect {
    /// Compute, its image at most this far from f32's.
    Computes(f32),
    /// Be refused before anything changes, the refusal saying this.
    Refused(&'static str),
    /// Compute with a finite image, or be refused saying this (the device's kernels decide).
    Either(&'static str),
}

/// What one scheme gave: the resident image, how many weights stayed float, and the largest difference of an image
/// streamed by blocks and by leaves from the resident one.
struct Outcome {
    image: Vec<f32>,
    /// The quantized transformer's bytes as the device holds it.
    transformer: u64,
    left_float: usize,
    block: f32,
    leaf: f32,
}

/// Quantizes with `scheme`, runs resident (the manager moves each component whole), then streams the transformer
/// at each level for two images. A refusal is returned as its message.
fn run(device: &burn::tensor::Device, name: &DeviceName, scheme: &QuantScheme) -> Result<Outcome, String> {
    let (opts, _) = turbo_options();
    let quantized = |pipeline: &mut ZImagePipeline| -> Result<usize, String> {
        let text = quantize_with(pipeline.text_encoder_mut(), scheme).map_err(|e| e.to_string())?;
        let transformer = quantize_with(pipeline.transformer_mut(), scheme).map_err(|e| e.to_string())?;
        assert!(text.weights > 0 && transformer.weights > 0, "something is quantized");
        Ok(text.left_float.len() + transformer.left_float.len())
    };
    let mut pipeline = on_device(device, name);
    let left_float = quantized(&mut pipeline)?;
    let transformer = component_bytes(&pipeline, "transformer");
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).map_err(|e| e.to_string())?);
    let mut differences = [0.0f32; 2];
    for (level, difference) in
        [GroupLevel::Block { blocks_per_group: 1 }, GroupLevel::Leaf].into_iter().zip(&mut differences)
    {
        let mut streamed = on_device(device, name);
        quantized(&mut streamed)?;
        let options = GroupOptions { level, ..GroupOptions::default() };
        streamed.enable_group_offload_with("transformer", &options).map_err(|e| e.to_string())?;
        for _ in 0..2 {
            let streamed = values(streamed.generate(&opts, &mut |_, _| {}).map_err(|e| e.to_string())?);
            *difference = difference.max(max_abs_diff(&streamed, &image));
        }
    }
    Ok(Outcome { image, transformer, left_float, block: differences[0], leaf: differences[1] })
}

#[test]
fn eight_bit_weights_quantized_on_the_cpu_host_run_and_stream_on_wgpu_and_the_rest_are_refused_by_name() {
    let (device, name, _turn) = wgpu();
    let (opts, _) = turbo_options();
    let float = values(on_device(&device, &name).generate(&opts, &mut |_, _| {}).expect("f32 on wgpu"));
    let flex_q8s = {
        let mut pipeline = load_tiny(OffloadDevice::host_only());
        quantize_with(pipeline.text_encoder_mut(), &int8_scheme()).expect("q8s on flex");
        quantize_with(pipeline.transformer_mut(), &int8_scheme()).expect("q8s on flex");
        values(pipeline.generate(&opts, &mut |_, _| {}).expect("q8s on flex"))
    };
    // For a scheme that computes, the most its image may differ from f32's (on flex: 8-bit 2.96e-2; 4-bit 0.517
    // with one scale per tensor on this checkpoint, which is not usable, so only its streaming and a finite image
    // are held). 2-bit weights depend on the device's kernels: lavapipe's shared memory is too small for burn's
    // 2-bit matmul, and the probe before quantizing must refuse it by name there.
    let q = |value: QuantValue, store: QuantStore| QuantScheme::default().with_value(value).with_store(store);
    let schemes = [
        ("q8s native", q(QuantValue::Q8S, QuantStore::Native), Expect::Computes(0.1)),
        ("q8s packed u32", q(QuantValue::Q8S, QuantStore::PackedU32(0)), Expect::Computes(0.1)),
        ("q4s packed u32", q(QuantValue::Q4S, QuantStore::PackedU32(0)), Expect::Computes(f32::INFINITY)),
        (
            "q2s packed u32",
            q(QuantValue::Q2S, QuantStore::PackedU32(0)),
            Expect::Either("burn cannot compute a linear layer"),
        ),
        (
            "e4m3 native",
            q(QuantValue::E4M3, QuantStore::Native),
            Expect::Refused("flex quantizes every scheme to integers"),
        ),
        (
            "e2m1 packed u32",
            q(QuantValue::E2M1, QuantStore::PackedU32(0)),
            Expect::Refused("flex quantizes every scheme to integers"),
        ),
    ];
    println!(
        "| scheme on {name} | outcome | transformer bytes | weights left float | max abs error vs f32 | vs q8s on \
         flex | block vs resident | leaf vs resident |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut failures = Vec::new();
    let mut sizes = Vec::new();
    for (label, scheme, expect) in schemes {
        // A scheme the runtime cannot hold used to panic inside burn's kernels or fail on the device; the survey
        // catches a panic so that it is reported beside the others, and fails on it below.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&device, &name, &scheme)));
        device.memory_cleanup();
        match outcome {
            Ok(Ok(outcome)) => {
                let (error, vs_flex) = (max_abs_diff(&outcome.image, &float), max_abs_diff(&outcome.image, &flex_q8s));
                println!(
                    "| {label} | computed | {} | {} | {error:.3e} | {vs_flex:.1e} | {:.1e} | {:.1e} |",
                    outcome.transformer, outcome.left_float, outcome.block, outcome.leaf
                );
                sizes.push((scheme.value, outcome.transformer));
                match expect {
                    Expect::Refused(_) => failures.push(format!("{label}: computed, but it should be refused")),
                    // The weights left float are those of the 8-bit case too, and the kernels are wgpu's; the
                    // weights themselves are checked bit for bit below.
                    Expect::Computes(bound) if error.is_nan() || error > bound => {
                        failures.push(format!("{label}: {error} from f32 ({vs_flex} from flex's 8-bit image)"))
                    }
                    Expect::Either(_) if !error.is_finite() => failures.push(format!("{label}: {error} from f32")),
                    _ => {}
                }
                if outcome.block != 0.0 || outcome.leaf != 0.0 {
                    failures.push(format!("{label}: streaming changed the image ({} {})", outcome.block, outcome.leaf));
                }
            }
            Ok(Err(message)) => {
                println!("| {label} | refused: {message} | | | | | | |");
                let named = match expect {
                    Expect::Computes(_) => false,
                    Expect::Refused(reason) | Expect::Either(reason) => message.contains(reason),
                };
                if !named || !message.contains("cannot quantize text_encoder with") {
                    failures.push(format!("{label}: {message}"));
                }
            }
            Err(panic) => {
                let message = group_offload::device::panic_text(panic.as_ref());
                println!("| {label} | panicked in burn: {} | | | | | | |", message.lines().next().unwrap_or_default());
                failures.push(format!("{label}: burn panicked instead of a typed refusal: {message}"));
            }
        }
    }
    // Packed on the device, fewer bits a value are fewer bytes: the transformer's size is counted as wgpu holds it.
    let size = |value| sizes.iter().find(|(v, _)| *v == value).map(|(_, bytes)| *bytes);
    if let (Some(q8), Some(q4), Some(q2)) = (size(QuantValue::Q8S), size(QuantValue::Q4S), size(QuantValue::Q2S))
        && !(q2 < q4 && q4 < q8)
    {
        failures.push(format!("packed sizes do not shrink with the bits: q8s {q8}, q4s {q4}, q2s {q2}"));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Each quantized parameter's bytes (`into_data`) and its values dequantized, in visiting order.
fn quantized_params<M: Module>(module: &M) -> Vec<(Vec<u8>, Vec<u32>)> {
    struct Collect(Vec<(Vec<u8>, Vec<u32>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            if !matches!(tensor.dtype(), DType::QFloat(_)) {
                return;
            }
            let bytes = tensor.clone().into_data().as_bytes().to_vec();
            let values: Vec<f32> = tensor.dequantize().into_data().convert::<f32>().try_to_vec().expect("f32 values");
            self.0.push((bytes, values.iter().map(|v| v.to_bits()).collect()));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

#[test]
fn quantized_weights_reach_wgpu_repacked_and_dequantize_there_bit_for_bit_as_on_the_host() {
    let (device, name, _turn) = wgpu();
    // 2-bit weights pack too (`group_offload::quant`'s unit tests), but lavapipe cannot compute their product.
    for value in [QuantValue::Q8S, QuantValue::Q4S] {
        let mut pipeline = on_device(&device, &name);
        let scheme = QuantScheme::default().with_value(value).with_store(QuantStore::Native);
        quantize_with(pipeline.transformer_mut(), &scheme).expect("quantizes");
        let (on_host, on_device) = pipeline
            .transformer()
            .inspect(|module| {
                let moved = group_offload::quant::module_to_device(module.clone(), &device).expect("moves to wgpu");
                (quantized_params(module), quantized_params(&moved))
            })
            .expect("a whole transformer");
        assert!(!on_host.is_empty(), "the transformer has quantized weights");
        assert_eq!(on_host.len(), on_device.len(), "every quantized weight moved quantized");
        let (host_bytes, device_bytes): (usize, usize) = on_host
            .iter()
            .zip(&on_device)
            .map(|(h, d)| (h.0.len(), d.0.len()))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        for (i, (host, moved)) in on_host.iter().zip(&on_device).enumerate() {
            if value == QuantValue::Q8S {
                assert_eq!(host.0, moved.0, "weight {i}: 8-bit values are the same bytes on the device");
            }
            assert_eq!(host.1, moved.1, "{value:?} weight {i}: dequantized on wgpu, it differs from the host's");
        }
        assert_eq!(
            device_bytes as u64,
            pipeline.transformer().inspect(|m| quantized_bytes_on(m, &device)).expect("whole"),
            "{value:?}: the bytes on the device are the sizes counted for it"
        );
        println!(
            "{value:?}: {} quantized weights, {host_bytes} bytes on the host, {device_bytes} on wgpu, the same \
             dequantized values",
            on_host.len()
        );
    }
}

/// The bytes `exec` holds `module`'s quantized parameters in, as the sizes count them.
fn quantized_bytes_on<M: Module>(module: &M, exec: &burn::tensor::Device) -> u64 {
    struct Sum<'a>(u64, &'a burn::tensor::Device);
    impl ModuleVisitor for Sum<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            if matches!(tensor.dtype(), DType::QFloat(_)) {
                self.0 += group_offload::whole::tensor_bytes_on(&tensor, Some(self.1));
            }
        }
    }
    let mut sum = Sum(0, exec);
    module.visit(&mut sum);
    sum.0
}

#[test]
fn every_preset_predicts_a_quantized_pipelines_bytes_and_moves_exactly_on_wgpu() {
    let (device, name, _turn) = wgpu();
    let opts = {
        let (mut opts, _) = turbo_options();
        opts.steps = 2;
        opts
    };
    // 8-bit weights are the host's bytes relabelled; 4-bit ones are packed smaller than the host copy, so their
    // sizes hold only if every count is in the device's store.
    for value in [QuantValue::Q8S, QuantValue::Q4S] {
        let scheme = QuantScheme::default().with_value(value).with_store(QuantStore::Native);
        let load = |placement: OffloadDevice| -> pipeline_zimage::Result<ZImagePipeline> {
            let mut pipeline =
                ZImagePipeline::load(fixtures().join("tiny-z-image-turbo"), placement, &LoadOptions::new())?;
            quantize_with(pipeline.text_encoder_mut(), &scheme)?;
            quantize_with(pipeline.transformer_mut(), &scheme)?;
            Ok(pipeline)
        };
        // The cards are sized on the host (4-bit weights there are a byte a value: larger cards than wgpu needs).
        let probe = load(OffloadDevice::host_only()).expect("loads");
        // As on the simulated card (`tests/quantized.rs`): the float VAE is larger than the quantized transformer
        // and decodes on every card beside its activations.
        // On the device the cap also holds the pool's pages left from earlier runs and the rounding of each
        // tensor to pages, which a card of exactly the VAE and its activations has no room for: a sixteenth more.
        let decode = component_bytes(&probe, "vae") + exact_reserve(&probe, &opts);
        let decode = decode + decode / 16;
        let mut cards = validation_cards(&probe, &opts).expect("cards").map(|card| card.max(decode)).to_vec();
        cards.dedup();
        drop(probe);
        let target = Target::Device {
            device: OffloadDevice::on_device(device.clone(), name.clone(), Arc::new(NoLedger), None),
            total: TOTAL,
            footprints: Vec::new(),
            calls: Vec::new(),
        };
        let cases = validate_presets(&target, &load, &cards, &opts);
        let table = Table(&cases).to_string();
        println!("{value:?}\n{table}");
        let mut streamed = 0;
        for case in &cases {
            let v = match case {
                Case::Measured(v) => v,
                Case::Refused { preset, card, reason } => {
                    panic!("{value:?}: every preset runs on every card; {preset:?} on {card}: {reason}\n{table}")
                }
            };
            assert_eq!(v.predicted.bytes, v.measured.bytes, "{value:?}, {} on {}: bytes\n{table}", v.preset, v.card);
            assert_eq!(v.predicted.moves, v.measured.moves, "{value:?}, {} on {}: moves\n{table}", v.preset, v.card);
            let transformer = v.routes.split('/').nth(1).unwrap_or_default();
            streamed += usize::from(transformer.starts_with("block") || transformer.starts_with("leaf"));
        }
        assert!(streamed >= 2, "{value:?}: the diffusers presets stream the quantized transformer: {table}");
    }
}
