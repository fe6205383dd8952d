//! Quantized weights on the tiny checkpoint: burn's 8-bit quantized linear weights run their own kernels, move
//! whole under the planner's routes with the image unchanged, and are never group-offloaded.

use std::sync::Arc;

use group_offload::GroupOptions;
use group_offload::{whole::BurnComponent, Placement};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{HostMemory, Settings, SettingsLayer};
use offload_core::{Action, DeviceMemory};
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use pipeline_zimage::presets::{enable_pipeline_offload, exact_reserve};
use pipeline_zimage::quantize::quantize;
use pipeline_zimage::quantize::quantized_params;
use pipeline_zimage::transformer::ZImageTransformer2DModel;

mod common;

use common::{component_bytes as bytes, load_tiny as load, max_abs_diff, turbo_options, values};

fn options() -> GenerateOptions {
    turbo_options().0
}

fn resident() -> Placement {
    Placement::host_only()
}

/// A pipeline on a hard simulated card of `bytes`, its text encoder and transformer quantized.
fn quantized_on_card(bytes: u64) -> (ZImagePipeline, Arc<SimCard>) {
    let card = SimCard::new(
        CardSpec::parse(&bytes.to_string()).expect("a size").with_mode(Mode::Hard).with_context_overhead(0),
    );
    let placement = Placement::simulated(card.clone());
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

    // Room for any one component whole beside the activations, not for all of them at once.
    let card_bytes = largest + reserve + vae.min(text) / 2;
    assert!(card_bytes < text + transformer + vae + reserve);
    let (mut pipeline, card) = quantized_on_card(card_bytes);
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let plan = enable_pipeline_offload(&mut pipeline, settings(reserve), &facts, &opts).expect("plans");
    for component in ["text_encoder", "transformer"] {
        let route = plan.applied(component).expect("applied").applied;
        assert!(!route.is_group_offload(), "{component} is quantized, yet it was routed {route}\n{plan}");
    }
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("runs"));
    assert!(max_abs_diff(&image, &quantized_image) <= 1e-6, "moving quantized weights changed the image");
    assert!(card.peak() <= card_bytes);
    let record = pipeline.manager().offload_record();
    let transformer_id = pipeline.transformer().id().to_string();
    assert!(
        record.events().iter().any(|e| e.action == Action::Offload && e.id == transformer_id),
        "the quantized transformer moved whole: {record}"
    );

    // Group offload refuses quantized weights, and loses nothing doing so.
    let error = pipeline
        .enable_group_offload_with("transformer", &GroupOptions::default())
        .expect_err("quantized weights are not streamed");
    assert!(
        matches!(error, pipeline_zimage::Error::GroupOffload(group_offload::Error::RouteUnsupported { .. })),
        "{error:?}"
    );
    assert!(error.to_string().contains("quantized"), "{error}");
    assert_eq!(pipeline.manager().placement().len(), 3);
    let again = values(pipeline.generate(&opts, &mut |_, _| {}).expect("still runs"));
    assert!(max_abs_diff(&again, &quantized_image) <= 1e-6);
}

#[test]
fn a_card_too_small_for_the_quantized_transformer_whole_is_a_typed_planning_error() {
    let opts = options();
    let (probe, _) = quantized_on_card(1 << 30);
    let reserve = exact_reserve(&probe, &opts);
    let transformer = bytes(&probe, "transformer");
    let (mut pipeline, card) = quantized_on_card(transformer / 2 + reserve);
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let error = enable_pipeline_offload(&mut pipeline, settings(reserve), &facts, &opts).expect_err("does not fit");
    let message = error.to_string();
    assert!(message.contains("quantized weights keep their own kernels"), "{message}");
    assert!(matches!(pipeline.manager().placement().len(), 3), "nothing was lost");
}
