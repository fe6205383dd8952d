//! Quantized weights on the tiny checkpoint: burn's quantized linear weights run their own kernels, move whole or
//! stream by blocks and leaves under the planner's routes with the quantized image unchanged bit for bit, stream
//! the bytes the plan predicts, survive an out-of-memory retry, and are refused by name for a scheme the CPU
//! backend does not compute. The last test measures each scheme's image error against f32 and its bytes per
//! step (`docs/lora-and-quantization.md`).

use std::sync::Arc;

use burn::tensor::quantization::QuantScheme;
use group_offload::GroupOptions;
use group_offload::{OffloadDevice, whole::BurnComponent};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{HostMemory, Settings, SettingsLayer};
use offload_core::{Action, DeviceMemory, Reason};
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use pipeline_zimage::presets::{enable_offload, enable_pipeline_offload, exact_reserve};
use pipeline_zimage::quantize::{named_scheme, quantize, quantize_linear_weights, quantize_with, quantized_params};
use pipeline_zimage::transformer::ZImageTransformer2DModel;
use pipeline_zimage::validate::{Case, Table, Target, validate_presets, validation_cards};

mod common;

use common::{component_bytes as bytes, load_tiny as load, max_abs_diff, turbo_options, values};

fn options() -> GenerateOptions {
    turbo_options().0
}

fn resident() -> OffloadDevice {
    OffloadDevice::host_only()
}

/// A pipeline on a hard simulated card of `bytes`, its text encoder and transformer quantized.
fn quantized_on_card(bytes: u64) -> (ZImagePipeline, Arc<SimCard>) {
    quantized_on(bytes, Mode::Hard)
}

/// A pipeline on a simulated card of `bytes` in `mode`, its text encoder and transformer quantized.
fn quantized_on(bytes: u64, mode: Mode) -> (ZImagePipeline, Arc<SimCard>) {
    let card =
        SimCard::new(CardSpec::parse(&bytes.to_string()).expect("a size").with_mode(mode).with_context_overhead(0));
    let placement = OffloadDevice::simulated(card.clone());
    let mut pipeline = load(placement);
    quantize(pipeline.text_encoder_mut()).expect("quantizes");
    quantize(pipeline.transformer_mut()).expect("quantizes");
    (pipeline, card)
}

fn settings(reserve: u64) -> Settings {
    let mut explicit = SettingsLayer::default();
    explicit.set("reserve", &reserve.to_string()).expect("a size");
    Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("valid settings")
}

#[test]
fn quantized_linear_weights_shrink_the_components_and_keep_the_image_close() {
    let opts = options();
    let float = load(resident());
    let float_image = values(float.generate(&opts, &mut |_, _| {}).expect("float run"));
    let mut pipeline = load(resident());
    let transformer_before = bytes(&pipeline, "transformer");
    let text_before = bytes(&pipeline, "text_encoder");
    let transformer_linears = quantize(pipeline.transformer_mut()).expect("quantizes");
    let text_linears = quantize(pipeline.text_encoder_mut()).expect("quantizes");
    assert_eq!(quantize(pipeline.transformer_mut()).expect("again"), 0, "quantizing twice does nothing");
    // Every PtLinear weight: per modulated block 8, per context-refiner block 7, plus the embedders and head.
    let config = pipeline.transformer_config().clone();
    let blocks = 8 * (config.n_layers + config.n_refiner_layers) + 7 * config.n_refiner_layers;
    assert!(transformer_linears > blocks, "{transformer_linears} quantized, {blocks} in the blocks alone");
    assert_eq!(text_linears, 7 * (pipeline.text_encoder_config().num_hidden_layers - 1));
    let counted = pipeline
        .manager()
        .inspect(pipeline.transformer().id(), |c: &BurnComponent<ZImageTransformer2DModel>| {
            quantized_params(c.module())
        })
        .expect("inspects");
    assert_eq!(counted, transformer_linears);
    let transformer_after = bytes(&pipeline, "transformer");
    let text_after = bytes(&pipeline, "text_encoder");
    println!(
        "transformer {transformer_before} -> {transformer_after} bytes, text encoder {text_before} -> {text_after}"
    );
    assert!(transformer_after < transformer_before / 2, "{transformer_before} -> {transformer_after}");
    assert!(text_after < text_before, "{text_before} -> {text_after}");

    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("quantized run"));
    assert!(image.iter().all(|v| v.is_finite() && (0.0..=1.0).contains(v)));
    let error = max_abs_diff(&image, &float_image);
    println!("int8 weights: max abs difference from the float image {error:e}");
    assert!(error > 0.0, "the weights were quantized, so the image must move");
    assert!(error < 0.1, "int8 weights moved the image by {error}");
}

#[test]
fn a_quantized_pipeline_moves_whole_under_the_plan_and_gives_the_same_image() {
    let opts = options();
    let (probe, _) = quantized_on_card(1 << 30);
    let quantized_image = values(probe.generate(&opts, &mut |_, _| {}).expect("resident quantized run"));
    let reserve = exact_reserve(&probe, &opts);
    let [text, transformer, vae] = ["text_encoder", "transformer", "vae"].map(|c| bytes(&probe, c));
    let largest = text.max(transformer).max(vae);

    // Room for any one component whole beside the activations, not for all of them at once: the planner moves
    // them whole, quantized as they are.
    let card_bytes = largest + reserve + vae.min(text) / 2;
    assert!(card_bytes < text + transformer + vae + reserve);
    let (mut pipeline, card) = quantized_on_card(card_bytes);
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let plan = enable_pipeline_offload(&mut pipeline, settings(reserve), &facts, &opts).expect("plans");
    for component in ["text_encoder", "transformer"] {
        let applied = plan.applied(component).expect("applied");
        assert!(
            !applied.applied.is_group_offload(),
            "{component} fits whole, yet it was routed {}\n{plan}",
            applied.applied
        );
    }
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("runs"));
    assert_eq!(image, quantized_image, "moving quantized weights whole changed the image");
    assert!(card.peak() <= card_bytes);
    let record = pipeline.manager().offload_record();
    let transformer_id = pipeline.transformer().id().to_string();
    assert!(
        record.events().iter().any(|e| e.action == Action::Offload && e.id == transformer_id),
        "the quantized transformer moved whole: {record}"
    );
}

/// The second image's onloads of `component`'s groups (record ids `component/...`), in bytes.
fn group_bytes_onloaded(pipeline: &ZImagePipeline, component: &str, from: usize) -> u64 {
    let prefix = format!("{component}/");
    let events = pipeline.manager().offload_record().events();
    events[from..].iter().filter(|e| e.action == Action::Onload && e.id.starts_with(&prefix)).map(|e| e.bytes).sum()
}

#[test]
fn a_quantized_transformer_streams_by_blocks_and_leaves_with_the_quantized_resident_image() {
    let opts = options();
    let (probe, _) = quantized_on_card(1 << 30);
    let quantized_image = values(probe.generate(&opts, &mut |_, _| {}).expect("resident quantized run"));
    let transformer = bytes(&probe, "transformer");
    for options in [GroupOptions::default(), GroupOptions::leaf()] {
        let (mut pipeline, _card) = quantized_on_card(1 << 30);
        pipeline.enable_group_offload_with("transformer", &options).expect("a quantized transformer streams");
        pipeline.enable_group_offload_with("text_encoder", &GroupOptions::leaf()).expect("and a text encoder");
        pipeline.enable_auto_offload(0, true).expect("auto offload");
        let groups = pipeline.transformer().group_offload().expect("grouped").groups();
        assert_eq!(groups.iter().map(|(_, b)| b).sum::<u64>(), transformer, "the groups hold the quantized bytes");
        for image in 0..2 {
            let from = pipeline.manager().offload_record().events().len();
            let streamed = values(pipeline.generate(&opts, &mut |_, _| {}).expect("streams"));
            // The groups rebuild the very quantized tensors the resident run holds, and each product is the same
            // operation on the same values, so the image is the same bit for bit.
            assert_eq!(streamed, quantized_image, "{:?}, image {image}: streaming changed the image", options.level);
            assert!(group_bytes_onloaded(&pipeline, "transformer", from) > 0, "{:?}: nothing streamed", options.level);
        }
        let stats = pipeline.group_stats("transformer").expect("grouped");
        assert_eq!(stats.stray_loads, 0, "{stats:?}");
        assert!(stats.prefetch_hits > 0 && stats.misses == 0, "{:?}: {stats:?}", options.level);
    }
}

#[test]
fn a_card_too_small_for_the_quantized_transformer_whole_streams_it_as_the_plan_predicts() {
    let opts = options();
    let (probe, _) = quantized_on_card(1 << 30);
    let quantized_image = values(probe.generate(&opts, &mut |_, _| {}).expect("resident quantized run"));
    let reserve = probe.activation_estimates(&opts)[1];
    let transformer = bytes(&probe, "transformer");
    // Room for the transformer's outside layers, a few blocks and a step's activations, not for it whole. On the
    // tiny checkpoint the float VAE is larger than the quantized transformer, so a hard card this small could not
    // decode: the card is soft (it records, never refuses), and the plan is the transformer's alone.
    let card_bytes = transformer * 3 / 4 + reserve;
    let (mut pipeline, card) = quantized_on(card_bytes, Mode::Soft);
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let plan = enable_offload(&mut pipeline, "transformer", settings(reserve), &facts, &opts).expect("streams it");
    let route = plan.applied("transformer").expect("applied").applied;
    assert!(route.is_group_offload(), "{route}\n{plan}");
    let planned = plan.component("transformer").expect("planned");
    assert!(planned.why.starts_with("its weights are quantized"), "{}", planned.why);
    // The first image captures the call order; the second streams as every later one does.
    pipeline.generate(&opts, &mut |_, _| {}).expect("first image");
    let from = pipeline.manager().offload_record().events().len();
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("second image"));
    assert_eq!(image, quantized_image, "streaming the quantized transformer changed the image");
    let streamed = group_bytes_onloaded(&pipeline, "transformer", from);
    assert_eq!(streamed, planned.streamed_per_image, "bytes streamed per image, measured and planned\n{plan}");
    // Per step, the plan leaves out the last step's prefetch of the next forward's first group (released unused
    // with the phase): the image's last group upload.
    let events = pipeline.manager().offload_record().events();
    let tail = events[from..]
        .iter()
        .rev()
        .find(|e| e.action == Action::Onload && e.id.starts_with("transformer/"))
        .filter(|e| e.reason == Some(Reason::Prefetch))
        .map_or(0, |e| e.bytes);
    let steps = opts.steps as u64;
    assert_eq!(
        streamed - tail,
        planned.streamed_per_step * steps,
        "bytes streamed per step, measured and planned\n{plan}"
    );
    assert!(planned.streamed_per_step > 0 && planned.streamed_per_step < transformer, "{plan}");
    println!("{route}: {} bytes streamed per image ({} per step), as planned", streamed, planned.streamed_per_step);
}

#[test]
fn every_preset_predicts_a_quantized_pipelines_bytes_and_moves_exactly() {
    let opts = options();
    let load = |placement: OffloadDevice| -> pipeline_zimage::Result<ZImagePipeline> {
        let mut pipeline = load(placement);
        quantize(pipeline.text_encoder_mut())?;
        quantize(pipeline.transformer_mut())?;
        Ok(pipeline)
    };
    let probe = load(resident()).expect("loads");
    // The smallest validation card is sized for the transformer to stream, but the float VAE is larger than the
    // quantized transformer and must decode on the card: every card holds it beside its activations. On such
    // cards the diffusers presets stream the transformer (by blocks, by leaves) and the others move it whole.
    let decode = bytes(&probe, "vae") + exact_reserve(&probe, &opts);
    let mut cards = validation_cards(&probe, &opts).expect("cards").map(|card| card.max(decode)).to_vec();
    cards.dedup();
    let cases = validate_presets(&Target::Simulated, &load, &cards, &opts);
    let table = Table(&cases).to_string();
    println!("{table}");
    let mut streamed = 0;
    for case in &cases {
        let Case::Measured(v) = case else { panic!("every preset runs on every card: {table}") };
        assert_eq!(v.predicted.bytes, v.measured.bytes, "{} on {}: bytes\n{table}", v.preset, v.card);
        assert_eq!(v.predicted.moves, v.measured.moves, "{} on {}: moves\n{table}", v.preset, v.card);
        let transformer = v.routes.split('/').nth(1).unwrap_or_default();
        streamed += usize::from(transformer.starts_with("block") || transformer.starts_with("leaf"));
    }
    assert!(streamed >= 2, "the diffusers presets stream the quantized transformer on every card: {table}");
}

#[test]
fn an_out_of_memory_retry_on_a_tight_hard_card_still_gives_the_quantized_image() {
    let opts = options();
    let (probe, _) = quantized_on_card(1 << 30);
    let quantized_image = values(probe.generate(&opts, &mut |_, _| {}).expect("resident quantized run"));
    let estimates = probe.activation_estimates(&opts);
    let [text, _, vae] = ["text_encoder", "transformer", "vae"].map(|c| bytes(&probe, c));
    let layout = probe.transformer().layout().expect("whole").expect("blocks");
    // The decode is the tightest phase: the VAE and its activations, and half the text encoder. With no reserve
    // the manager brings the VAE in beside the text encoder and the streamed transformer's outside layers (its
    // weights fit), the decode's activations run out of memory, and the retry releases them, quantized groups
    // included, before decoding again; the next image uploads the transformer's groups again.
    let card_bytes = vae + estimates[2] + text / 2;
    assert!(card_bytes < vae + estimates[2] + text + layout.outside_bytes, "the decode cannot keep the others");
    let (mut pipeline, card) = quantized_on_card(card_bytes);
    let options = GroupOptions { releasable: true, ..GroupOptions::default() };
    pipeline.enable_group_offload_with("transformer", &options).expect("a quantized transformer streams");
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    for image in 0..2 {
        let streamed = values(pipeline.generate(&opts, &mut |_, _| {}).expect("recovers and runs"));
        assert_eq!(streamed, quantized_image, "image {image} after the retry differs");
    }
    assert!(card.peak() <= card_bytes, "the hard card held {} of {card_bytes}", card.peak());
    let record = pipeline.manager().offload_record();
    let retries = record.events().iter().filter(|e| matches!(e.reason, Some(Reason::OomRetry(_)))).count();
    assert!(retries > 0, "no out-of-memory retry on a {card_bytes} B card\n{record}");
    // The retry released the streamed transformer (its row is the retry's), its groups with it.
    let events = record.events();
    let transformer = pipeline.transformer().id().to_string();
    let retry = events
        .iter()
        .position(|e| {
            e.action == Action::Offload && e.id == transformer && matches!(e.reason, Some(Reason::OomRetry(_)))
        })
        .unwrap_or_else(|| panic!("the retry did not release the transformer\n{record}"));
    assert!(
        events[..retry].iter().rev().take_while(|e| e.action == Action::Offload).any(|e| e.id == "transformer/shell"),
        "its groups were released before it\n{record}"
    );
    let again = events[retry..].iter().any(|e| e.action == Action::Onload && e.id == "transformer/shell");
    assert!(again, "the next image uploaded its quantized groups again\n{record}");
}

#[test]
fn a_scheme_the_cpu_backend_does_not_compute_is_refused_by_name_and_changes_nothing() {
    let mut pipeline = load(resident());
    let before = bytes(&pipeline, "transformer");
    for name in ["e4m3", "e5m2", "e2m1"] {
        let scheme = named_scheme(name).expect("a scheme");
        let error = quantize_with(pipeline.transformer_mut(), &scheme).expect_err("flex has no float values");
        let message = error.to_string();
        assert!(
            matches!(error, pipeline_zimage::Error::GroupOffload(group_offload::Error::SchemeUnsupported { .. })),
            "{error:?}"
        );
        assert!(message.contains(&format!("{:?}", scheme.value)) && message.contains("transformer"), "{message}");
        assert!(!pipeline.transformer().is_quantized() && bytes(&pipeline, "transformer") == before);
    }
    // Blocks that do not tile a weight are refused before any weight is touched too.
    let error = quantize_with(pipeline.transformer_mut(), &named_scheme("q8s-b7").expect("a scheme")).expect_err("7");
    assert!(error.to_string().contains("do not tile"), "{error}");
    assert!(!pipeline.transformer().is_quantized());
    // Quantize first, then stream: a component under group offload is refused.
    pipeline.enable_group_offload_with("transformer", &GroupOptions::default()).expect("streams");
    let error = quantize(pipeline.transformer_mut()).expect_err("grouped");
    assert!(error.to_string().contains("quantize it before enabling offload"), "{error}");
}

/// A pipeline on a roomy hard card with its text encoder and transformer quantized with `scheme` (none: f32) and
/// its transformer streamed with `options`: its resident image, the transformer's bytes, and the bytes the
/// transformer streams per step of the second streamed image (from the record; the first captures the order).
/// `checked` quantizes through `quantize_with`; otherwise the scheme is applied as burn computes it, unchecked.
fn measure(scheme: Option<QuantScheme>, checked: bool, streaming: &GroupOptions) -> (Vec<f32>, u64, u64) {
    let opts = options();
    let card = SimCard::new(CardSpec::parse("1GiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0));
    let mut pipeline = load(OffloadDevice::simulated(card.clone()));
    if let Some(scheme) = scheme {
        if checked {
            quantize_with(pipeline.text_encoder_mut(), &scheme).expect("quantizes");
            quantize_with(pipeline.transformer_mut(), &scheme).expect("quantizes");
        } else {
            pipeline.text_encoder_mut().replace(|m| quantize_linear_weights(m, &scheme)).expect("quantizes");
            pipeline.transformer_mut().replace(|m| quantize_linear_weights(m, &scheme)).expect("quantizes");
        }
    }
    let resident = values(pipeline.generate(&opts, &mut |_, _| {}).expect("resident"));
    let transformer = bytes(&pipeline, "transformer");
    pipeline.enable_group_offload_with("transformer", streaming).expect("streams");
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    pipeline.generate(&opts, &mut |_, _| {}).expect("first streamed image");
    let from = pipeline.manager().offload_record().events().len();
    let streamed = values(pipeline.generate(&opts, &mut |_, _| {}).expect("second streamed image"));
    assert_eq!(streamed, resident, "{scheme:?}, {:?}: streaming changed the image", streaming.level);
    // Between images nothing is released, so the last step's prefetch of the next image's first group is the one
    // the second image's first step uses: the image streams its steps' bytes exactly.
    (resident, transformer, group_bytes_onloaded(&pipeline, "transformer", from) / opts.steps as u64)
}

/// Each scheme the CPU backend computes, against the f32 image from the same latents: the image's max abs error,
/// the transformer's bytes, and the bytes block offload (one block per group, prefetch depth 1) and leaf offload
/// stream per step (the layers outside the blocks resident), measured from the record. The figures go to
/// `docs/lora-and-quantization.md`. `E4M3` is measured too, applied unchecked, to show why it is refused on `flex`.
#[test]
fn each_scheme_is_measured_against_f32_with_the_bytes_it_streams_per_step() {
    let block = GroupOptions::default();
    let leaf = GroupOptions::leaf();
    let (float, float_bytes, float_block) = measure(None, true, &block);
    let mut rows = vec![("f32", 0.0, float_bytes, float_block, measure(None, true, &leaf).2)];
    // Per-tensor scales only: a per-block scheme must tile every linear weight, and the tiny transformer's
    // feed-forward width (170) shares no block size above 2 with its other widths (64, 32).
    for name in ["q8s", "q4s", "q2s", "e4m3"] {
        let scheme = named_scheme(name).expect("a scheme");
        let checked = name != "e4m3";
        let (image, transformer, per_block_step) = measure(Some(scheme), checked, &block);
        let (leaf_image, _, per_leaf_step) = measure(Some(scheme), checked, &leaf);
        assert_eq!(image, leaf_image, "{name}: the two levels compute the same image");
        rows.push((name, max_abs_diff(&image, &float), transformer, per_block_step, per_leaf_step));
    }
    println!(
        "| scheme | max abs error vs f32 | transformer bytes | streamed per step, block x1 | streamed per step, leaf |"
    );
    println!("|---|---|---|---|---|");
    for (name, error, transformer, block, leaf) in &rows {
        println!("| {name} | {error:.3e} | {transformer} | {block} | {leaf} |");
    }
    let row = |scheme: &str| *rows.iter().find(|r| r.0 == scheme).expect("measured");
    // Fewer bits, larger error.
    assert!(0.0 < row("q8s").1 && row("q8s").1 < row("q4s").1 && row("q4s").1 < row("q2s").1, "{rows:?}");
    // flex rounds E4M3 values to integers that saturate at 127 of 448 steps: far worse than 8-bit integers.
    assert!(row("e4m3").1 > row("q8s").1 * 4.0, "{rows:?}");
    // Quantized weights stream fewer bytes; on the CPU backend every value takes a byte, so 4 and 2 bits stream
    // what 8 bits do.
    assert!(row("q8s").3 * 2 < row("f32").3 && row("q8s").4 * 2 < row("f32").4, "{rows:?}");
    for name in ["q4s", "q2s", "e4m3"] {
        assert_eq!((row(name).3, row(name).4), (row("q8s").3, row("q8s").4), "{rows:?}");
    }
}

/// Runs `pipeline-zimage generate` on the tiny checkpoint on an 8 MB simulated card with `extra` arguments:
/// whether it succeeded, its stdout and its stderr.
fn generate_cli(extra: &[&str]) -> (bool, String, String) {
    let dir = std::env::temp_dir().join(format!("quantized-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let out = dir.join(format!("fox-{}.png", extra.join("-")));
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_pipeline-zimage"))
        .args(["generate", "--height", "64", "--width", "64", "--steps", "2", "--card", "8MB"])
        .args(extra)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("the CLI runs");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (run.status.success() && out.exists(), text(&run.stdout), text(&run.stderr))
}

#[test]
fn the_cli_streams_a_transformer_quantized_with_a_named_scheme_and_refuses_one_the_cpu_cannot_compute() {
    let (ok, stdout, stderr) = generate_cli(&["--preset", "diffusers_offload_compat", "--quantize", "q4s"]);
    assert!(ok, "{stdout}\n{stderr}");
    let output = format!("{stdout}\n{stderr}");
    assert!(output.contains("transformer:") && output.contains("linear weights quantized (Q4S"), "{output}");
    // The record prints the manager's decisions, and one line for the group moves: the transformer streamed.
    assert!(
        output.contains("group moves: ") && !output.contains("group moves: 0 uploads"),
        "the quantized transformer streamed by blocks: {output}"
    );

    let (ok, stdout, stderr) = generate_cli(&["--quantize", "e4m3"]);
    let output = format!("{stdout}\n{stderr}");
    assert!(!ok, "{output}");
    assert!(output.contains("cannot quantize text_encoder with E4M3") && output.contains("Q8S"), "{output}");

    let (ok, stdout, stderr) = generate_cli(&["--quantize", "int3"]);
    assert!(!ok && stderr.contains("unknown scheme \"int3\""), "{stdout}\n{stderr}");
}
