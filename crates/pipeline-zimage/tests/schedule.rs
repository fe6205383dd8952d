//! The schedule of uses on the tiny pipeline: a lookahead built from the first image runs the images after it,
//! and the replay that sets a run beside `auto` reproduces measured runs of both strategies on the simulated card.

mod common;

use std::sync::Arc;

use common::{load_tiny, turbo_options};
use group_offload::OffloadDevice;
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::DeviceMemory;
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use pipeline_zimage::schedule::{StrategyChoice, compare_moves, lookahead_after_first_image, recorded_moves};

const IMAGES: usize = 3;

/// A hard card that holds every component and each call's estimate except the transformer's beside all three:
/// the VAE has to make way for the denoising of every image after the first.
fn card_for(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> CardSpec {
    let manager = pipeline.manager();
    let bytes = |id: &str| manager.component_info(id).expect("registered").resident_bytes;
    let [te, tr, vae] = pipeline.components().map(|c| bytes(c.id()));
    let [_, transformer_activations, _] = pipeline.activation_estimates(opts);
    let capacity = te + tr + vae + transformer_activations - vae / 2;
    CardSpec::parse(&capacity.to_string()).expect("a size").with_mode(Mode::Hard).with_context_overhead(0)
}

/// Runs `IMAGES` images with `strategy` as the CLI does; returns the pipeline, its card and the first image's
/// number of uses.
fn run(strategy: StrategyChoice) -> (ZImagePipeline, Arc<SimCard>, usize, GenerateOptions) {
    let (mut opts, _) = turbo_options();
    let sizing = load_tiny(OffloadDevice::host_only());
    let card = SimCard::new(card_for(&sizing, &opts));
    let pipeline = load_tiny(OffloadDevice::simulated(card.clone()));
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    pipeline.manager().set_offload_strategy(strategy.first_image()).expect("enabled");
    let mut first = 0;
    for index in 0..IMAGES {
        opts.seed = index as u64;
        pipeline.generate(&opts, &mut |_, _| {}).expect("generates");
        if index == 0 && strategy == StrategyChoice::Lookahead {
            let uses = pipeline.manager().uses();
            first = uses.len();
            let lookahead = lookahead_after_first_image(&uses, IMAGES);
            pipeline.manager().set_offload_strategy(Arc::new(lookahead)).expect("enabled");
        }
    }
    (pipeline, card, first, opts)
}

#[test]
fn the_first_images_schedule_repeats_for_every_image_after_it() {
    let (pipeline, _card, first, _) = run(StrategyChoice::Lookahead);
    let uses = pipeline.manager().uses();
    assert_eq!(uses.len(), first * IMAGES, "{uses:?}");
    assert_eq!(uses[..first], uses[first..2 * first], "the flow repeats image after image");
    assert_eq!(pipeline.manager().auto_offload().expect("enabled").strategy, "lookahead");
}

/// The replay decides as the runs did: replaying the lookahead run reproduces its moves, and the `auto` figure
/// printed beside it is what a measured `auto` run on the same card moved. The optimum bounds both.
#[test]
fn the_replay_reproduces_measured_runs_of_both_strategies() {
    let (lookahead, card, first, opts) = run(StrategyChoice::Lookahead);
    let comparison = compare_moves(&lookahead, &opts, StrategyChoice::Lookahead, first, card.spec().clone(), 0, true)
        .expect("replays");
    println!("{comparison}");
    let stats = card.stats();
    assert_eq!(comparison.measured.1, stats.bytes_to_device + stats.bytes_to_host, "the record agrees with the card");
    assert_eq!(comparison.replayed, comparison.measured, "the replay of the lookahead run reproduces it");

    let (auto, auto_card, _, _) = run(StrategyChoice::Auto);
    let measured_auto = recorded_moves(auto.manager());
    assert_eq!(comparison.auto, measured_auto, "the auto figure is what auto moved on the same card");
    assert!(measured_auto.0 > 3, "the card forces moves after the first image: {measured_auto:?}");
    let optimum = comparison.optimum.expect("searched");
    assert!(optimum <= comparison.measured.1 && optimum <= measured_auto.1, "{comparison}");
    assert!(auto_card.peak() <= auto_card.total(), "a hard card");
}

#[test]
fn unknown_strategies_name_the_choices() {
    let error = StrategyChoice::parse("belady").expect_err("not a strategy");
    assert!(error.to_string().contains("choose auto, sequential or lookahead"), "{error}");
    assert_eq!(StrategyChoice::parse("lookahead").expect("known"), StrategyChoice::Lookahead);
}
