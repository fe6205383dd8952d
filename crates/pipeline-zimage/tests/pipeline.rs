//! The whole pipeline against diffusers' goldens (text-to-image with and without guidance, image-to-image), and
//! the same images under every offload mode on a simulated card in hard mode: real decisions, real OOM retries,
//! real output equivalence against the fully resident run.

use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor};
use group_offload::OffloadDevice;
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{DeviceMemory, Reason};
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};

mod common;

use common::{fixtures, golden, tensor4};

fn max_abs_diff(a: &Tensor<4>, expected: &[f32]) -> f32 {
    let got: Vec<f32> = a.clone().into_data().try_into_vec_as::<f32>().expect("f32 data");
    assert_eq!(got.len(), expected.len());
    got.iter().zip(expected).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn resident_placement() -> OffloadDevice {
    OffloadDevice::host_only()
}

fn load(placement: OffloadDevice) -> ZImagePipeline {
    ZImagePipeline::load(fixtures().join("tiny-z-image-turbo"), placement, &LoadOptions::new())
        .expect("the tiny checkpoint loads")
}

fn options(meta_prompt: &str, steps: usize, guidance: f32, latents: Tensor<4>) -> GenerateOptions {
    let mut opts = GenerateOptions::turbo(meta_prompt);
    opts.steps = steps;
    opts.guidance = guidance;
    opts.height = 64;
    opts.width = 64;
    opts.max_sequence_length = 32;
    opts.latents = Some(latents);
    opts
}

fn turbo_options() -> (GenerateOptions, Vec<f32>) {
    let g = golden("pipeline_t2i_turbo.safetensors");
    (options("a red fox in the snow", 4, 0.0, tensor4(&g, "latents")), g["image"].1.clone())
}

#[test]
fn text_to_image_matches_diffusers() {
    let pipeline = load(resident_placement());
    let (opts, expected) = turbo_options();
    let mut steps = Vec::new();
    let image = pipeline.generate(&opts, &mut |step, total| steps.push((step, total))).expect("generate");
    assert_eq!(steps, vec![(1, 4), (2, 4), (3, 4), (4, 4)]);
    let error = max_abs_diff(&image, &expected);
    assert!(error <= 1e-3, "max abs error {error}");
}

#[test]
fn text_to_image_with_guidance_matches_diffusers() {
    let pipeline = load(resident_placement());
    let g = golden("pipeline_t2i_cfg.safetensors");
    let mut opts = options("a red fox in the snow", 3, 4.0, tensor4(&g, "latents"));
    opts.negative_prompt = Some("blurry, low quality".into());
    let image = pipeline.generate(&opts, &mut |_, _| {}).expect("generate");
    let error = max_abs_diff(&image, &g["image"].1);
    assert!(error <= 1e-3, "max abs error {error}");
}

#[test]
fn image_to_image_matches_diffusers() {
    let pipeline = load(resident_placement());
    let g = golden("pipeline_img2img.safetensors");
    let mut opts = options("a red fox in the snow", 4, 0.0, tensor4(&g, "noise"));
    opts.image = Some(tensor4(&g, "init_image"));
    opts.strength = 0.6;
    let image = pipeline.generate(&opts, &mut |_, _| {}).expect("generate");
    let error = max_abs_diff(&image, &g["image"].1);
    assert!(error <= 1e-3, "max abs error {error}");
}

#[test]
fn bad_arguments_are_typed_errors() {
    let pipeline = load(resident_placement());
    let (mut opts, _) = turbo_options();
    opts.height = 60;
    assert!(matches!(pipeline.generate(&opts, &mut |_, _| {}), Err(pipeline_zimage::Error::InvalidSize { .. })));
    let (mut opts, _) = turbo_options();
    opts.steps = 0;
    assert!(matches!(pipeline.generate(&opts, &mut |_, _| {}), Err(pipeline_zimage::Error::ZeroSteps)));
    let (mut opts, _) = turbo_options();
    opts.strength = 1.5;
    assert!(matches!(pipeline.generate(&opts, &mut |_, _| {}), Err(pipeline_zimage::Error::InvalidStrength { .. })));
    let (mut opts, _) = turbo_options();
    opts.latents = Some(Tensor::zeros([1, 16, 4, 4], &Device::flex()));
    assert!(matches!(pipeline.generate(&opts, &mut |_, _| {}), Err(pipeline_zimage::Error::InvalidArgument { .. })));
}

/// A simulated card in hard mode sized so the three tiny components do not fit together: the manager must
/// evict, and its record must show it.
fn simulated(group: bool, card_bytes: u64, reserve: u64) -> (ZImagePipeline, Arc<SimCard>) {
    let card = SimCard::new(
        CardSpec::parse(&card_bytes.to_string()).expect("a size").with_mode(Mode::Hard).with_context_overhead(0),
    );
    let placement = OffloadDevice::simulated(card.clone());
    let mut pipeline = load(placement);
    if group {
        pipeline.enable_group_offload(1, 1).expect("group offload");
    }
    pipeline.enable_auto_offload(reserve, true).expect("auto offload");
    (pipeline, card)
}

#[test]
fn the_same_image_under_auto_and_group_offload_on_a_small_card() {
    let (opts, expected) = turbo_options();
    let resident = load(resident_placement()).generate(&opts, &mut |_, _| {}).expect("resident run");
    let resident_values: Vec<f32> = resident.into_data().try_into_vec_as::<f32>().expect("f32");
    assert!(resident_values.iter().zip(&expected).all(|(a, b)| (a - b).abs() <= 1e-3));

    let (sizes, estimates) = {
        let probe = load(resident_placement());
        let sizes = probe
            .components()
            .map(|c| c.id().to_string())
            .map(|id| probe.manager().component_info(&id).expect("info").bytes);
        (sizes, probe.activation_estimates(&opts))
    };
    let [te, tr, vae] = sizes;
    // Two cards, each too small for what the flow would hold without offload:
    // - no reserve, and no room for the text encoder beside the transformer's activations: the transformer's run
    //   fails with out-of-memory and the manager retries after evicting the text encoder;
    // - a reserve as large as the transformer's activations, and no room for the VAE beside the transformer
    //   with that reserve: the strategy evicts the transformer before the VAE loads.
    let scenarios =
        [("oom retry", tr + estimates[1] + te / 2, 0), ("reserve", tr + estimates[1] + vae / 2, estimates[1])];
    for group in [false, true] {
        for (name, card_bytes, reserve) in scenarios {
            // A group-offloaded transformer stays registered on the card with its outside layers, so the decode
            // (whose measured activations exceed a denoising step's) needs its own room beside them.
            let card_bytes = card_bytes + if group { vae + estimates[2] } else { 0 };
            let (pipeline, card) = simulated(group, card_bytes, reserve);
            let image =
                pipeline.generate(&opts, &mut |_, _| {}).unwrap_or_else(|e| panic!("{name}, group={group}: {e}"));
            let error = max_abs_diff(&image, &resident_values);
            assert!(error <= 1e-6, "{name}, group={group}: offloaded image differs by {error}");
            let record = pipeline.manager().offload_record();
            let evictions = record
                .events()
                .iter()
                .filter(|e| matches!(e.reason, Some(Reason::ReleaseMemoryFor(_)) | Some(Reason::OomRetry(_))))
                .count();
            if group {
                // Streaming the transformer's blocks needs less room than holding it whole: its groups move
                // through the card (and may make evictions unnecessary).
                let group_moves = record.events().iter().filter(|e| e.id.starts_with("transformer/")).count();
                assert!(group_moves > 0, "{name}: no group moved\n{record}");
            } else {
                assert!(evictions > 0, "{name}: nothing was evicted\n{record}");
                let expected = |reason: &Option<Reason>| match reason {
                    Some(Reason::OomRetry(_)) => reserve == 0,
                    Some(Reason::ReleaseMemoryFor(_)) => reserve > 0,
                    _ => false,
                };
                assert!(record.events().iter().any(|e| expected(&e.reason)), "{name}: not the expected move\n{record}");
            }
            assert!(card.peak() <= card_bytes, "{name}, group={group}: the hard card exceeded its capacity");
            if let Some(stats) = pipeline.group_stats("transformer") {
                assert_eq!(stats.misses, 0, "{name}: steady steps prefetch every group: {stats:?}");
            }
        }
    }
}

/// The simulation's Z-Image-Turbo profile uses the sizes this crate's configs compute.
#[test]
fn memory_sim_profile_sizes_come_from_the_configs() {
    use pipeline_zimage::config::TransformerConfig;
    use pipeline_zimage::text_encoder::TextEncoderConfig;
    use pipeline_zimage::vae::VaeConfig;
    let profile = memory_sim::PipelineProfile::z_image_turbo(4);
    let bytes = |name: &str| profile.component(name).expect("in the profile").bytes;
    assert_eq!(TransformerConfig::z_image_turbo().bytes(DType::BF16), bytes("transformer"));
    assert_eq!(TextEncoderConfig::z_image_turbo().bytes(2), bytes("text_encoder"));
    assert_eq!(VaeConfig::z_image_turbo().bytes(2), bytes("vae"));
    // The block structure `cargo xtask plan` reads is the configs' too.
    use memory_sim::profile::z_image_turbo as facts;
    let transformer = TransformerConfig::z_image_turbo();
    assert_eq!(transformer.modulated_block_params() as u64 * 2, facts::MODULATED_BLOCK_BYTES);
    assert_eq!(transformer.context_block_params() as u64 * 2, facts::CONTEXT_BLOCK_BYTES);
    assert_eq!(TextEncoderConfig::z_image_turbo().layer_params() as u64 * 2, facts::TEXT_LAYER_BYTES);
}

/// The card declarations that `cargo xtask integration` checks for the simulated Z-Image-Turbo serve the real
/// pipeline too: the tiny checkpoint's runs on two hard simulated cards, declared the same way.
#[test]
fn the_tiny_pipeline_meets_its_card_declarations() {
    use memory_sim::expect::{CardExpectation, diff, observed};
    let declarations = memory_sim::Expectations::parse(
        r#"
        pipeline = "tiny-z-image-turbo"
        reserve = "0"
        steps = 4

        # The transformer's activations leave no room for the text encoder: one OOM retry evicts it. The decode's
        # activations (measured larger than a step's) leave no room for the transformer beside the VAE.
        [cards.oom]
        offload = { text_encoder = 1, transformer = 1 }
        oom = { transformer = 1 }
        final_device = { text_encoder = "cpu", transformer = "cpu", vae = "cuda" }
        "#,
    )
    .expect("valid declarations");
    let (opts, _) = turbo_options();
    let probe = load(resident_placement());
    let size = |id: &str| probe.manager().component_info(id).expect("info").bytes;
    let (te, tr) = (size(probe.text_encoder().id()), size(probe.transformer().id()));
    let card_bytes = tr + probe.activation_estimates(&opts)[1] + te / 2;
    let (pipeline, _) = simulated(false, card_bytes, 0);
    pipeline.generate(&opts, &mut |_, _| {}).expect("the run completes");
    let seen: CardExpectation =
        observed(&pipeline.manager().offload_record().events(), &pipeline.manager().placement());
    let declared = &declarations.cards["oom"];
    assert_eq!(diff(declared, &seen), None, "{}", pipeline.manager().offload_record());
}
