//! The second model gets what the library gives: its forwards stream as they run resident (the free check),
//! auto offload and the OOM retry on a hard simulated card smaller than the pipeline, block- and leaf-level
//! group offload with prefetch, a preset planned for a card smaller than the DiT, and the record of every move,
//! all giving the resident image. The crate's offload-specific lines are counted against the README.

use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};
use group_offload::{GroupLevel, GroupOptions, OffloadDevice, OffloadModel, check_streaming};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{HostMemory, Route, Settings, SettingsLayer};
use offload_core::{Action, DeviceMemory, Reason};
use tiny_dit::{Config, Models, TinyDitPipeline};

const PROMPT: [i64; 5] = [3, 14, 15, 92, 65];
const STEPS: usize = 3;

fn models() -> Models {
    Models::random(&Config::small(), &Device::flex())
}

fn pipeline(models: &Models, placement: OffloadDevice) -> TinyDitPipeline {
    TinyDitPipeline::new(models.clone(), Config::small(), placement).expect("registers")
}

fn hard_card(bytes: u64) -> Arc<SimCard> {
    SimCard::new(CardSpec::parse(&bytes.to_string()).expect("a size").with_mode(Mode::Hard).with_context_overhead(0))
}

fn values(image: Tensor<3>) -> Vec<f32> {
    image.into_data().try_to_vec::<f32>().expect("f32 pixels")
}

fn assert_same(a: &[f32], b: &[f32], context: &str) {
    assert_eq!(a.len(), b.len());
    let difference = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    assert!(difference <= 1e-5, "{context}: the image differs from the resident one by {difference}");
}

/// Bytes of each registered component, `[encoder, dit, decoder]`.
fn sizes(pipeline: &TinyDitPipeline) -> [u64; 3] {
    let manager = pipeline.manager();
    [pipeline.encoder.id(), pipeline.dit.id(), pipeline.decoder.id()]
        .map(|id| manager.component_info(id).expect("registered").bytes)
}

fn resident_image(models: &Models) -> Vec<f32> {
    values(pipeline(models, OffloadDevice::host_only()).generate(&PROMPT, STEPS).expect("runs resident"))
}

#[test]
fn the_dit_and_the_encoder_stream_as_they_run_resident() {
    let device = Device::flex();
    let Models { encoder, dit, .. } = models();
    let x = Tensor::<3>::ones([1, 16, 8], &device);
    let t = Tensor::<2>::ones([1, 1], &device);
    let c = Tensor::<2>::ones([1, 32], &device);
    let check = check_streaming(dit, &device, |w| w.forward(x.clone(), t.clone(), c.clone())).expect("the DiT streams");
    assert_eq!(check.block_groups, 6);
    // Per block: modulation, qkv, proj, fc1, fc2 and the norms' group (the shell is counted at neither level).
    assert_eq!(check.leaf_groups, 6 * 6, "{check:?}");
    let ids = Tensor::<2, Int>::from_data(TensorData::new(PROMPT.to_vec(), [1, 5]), &device);
    let check = check_streaming(encoder, &device, |w| w.forward(ids.clone())).expect("the encoder streams");
    assert_eq!(check.block_groups, 3);
}

#[test]
fn auto_offload_on_a_hard_card_smaller_than_the_pipeline_gives_the_resident_image() {
    let models = models();
    let resident = resident_image(&models);
    let probe = pipeline(&models, OffloadDevice::host_only());
    let [encoder, dit, decoder] = sizes(&probe);
    let [_, dit_activations, _] = probe.activation_estimates(PROMPT.len());
    // The DiT and its activations fit, the encoder does not fit beside them.
    let capacity = dit + dit_activations + encoder / 2;
    assert!(capacity < encoder + dit + decoder + dit_activations);
    let card = hard_card(capacity);
    let pipeline = pipeline(&models, OffloadDevice::simulated(card.clone()));
    pipeline.manager().enable_auto_offload(card.clone(), dit_activations, true).expect("auto offload");
    assert_same(&values(pipeline.generate(&PROMPT, STEPS).expect("runs")), &resident, "auto offload");
    assert!(card.peak() <= capacity, "peak {} over the card's {capacity}", card.peak());
    let record = pipeline.manager().offload_record();
    let evicted = record.events().into_iter().find(|e| e.action == Action::Offload && e.id == pipeline.encoder.id());
    let evicted = evicted.unwrap_or_else(|| panic!("the encoder was never offloaded: {record}"));
    assert_eq!(evicted.reason, Some(Reason::ReleaseMemoryFor(pipeline.dit.id().to_string())), "{record}");
}

#[test]
fn the_oom_retry_recovers_a_call_whose_activations_do_not_fit() {
    let models = models();
    let resident = resident_image(&models);
    let probe = pipeline(&models, OffloadDevice::host_only());
    let [encoder, dit, _] = sizes(&probe);
    let [_, dit_activations, _] = probe.activation_estimates(PROMPT.len());
    // Both weights fit, so auto offload (no reserve) keeps the encoder; the DiT's activations beside it do not,
    // and once the retry has evicted the encoder they do: which holds only while the encoder is at least half the
    // activations.
    assert!(encoder >= dit_activations / 2, "the recipe needs an encoder of at least half the DiT's activations");
    let capacity = encoder + dit + dit_activations / 2;
    let card = hard_card(capacity);
    let pipeline = pipeline(&models, OffloadDevice::simulated(card.clone()));
    pipeline.manager().enable_auto_offload(card.clone(), 0, true).expect("auto offload");
    assert_same(&values(pipeline.generate(&PROMPT, STEPS).expect("recovers")), &resident, "after the OOM retry");
    let record = pipeline.manager().offload_record();
    let retried = Reason::OomRetry(pipeline.dit.id().to_string());
    assert!(record.events().iter().any(|e| e.reason.as_ref() == Some(&retried)), "no OOM retry: {record}");
    assert!(card.peak() <= capacity);
}

#[test]
fn block_and_leaf_group_offload_with_prefetch_give_the_resident_image() {
    let models = models();
    let resident = resident_image(&models);
    let card = hard_card(64 << 20);
    let mut pipeline = pipeline(&models, OffloadDevice::simulated(card.clone()));
    let block = GroupOptions { level: GroupLevel::Block { blocks_per_group: 2 }, ..GroupOptions::default() };
    pipeline.dit.enable_group_offload(&block).expect("the DiT streams by blocks");
    pipeline.encoder.enable_group_offload(&GroupOptions::leaf()).expect("leaves");
    pipeline.manager().enable_auto_offload(card.clone(), 1 << 20, true).expect("auto offload");
    for run in ["capture", "prefetched"] {
        assert_same(&values(pipeline.generate(&PROMPT, STEPS).expect("runs")), &resident, run);
    }
    let dit = pipeline.dit.group_stats().expect("grouped");
    assert_eq!(dit.stray_loads, 0, "{dit:?}");
    assert!(dit.prefetches > 0 && dit.misses == 0, "prefetched in the captured order: {dit:?}");
    let order = pipeline.dit.group_offload().expect("grouped").order();
    assert_eq!(order.iter().filter(|id| id.starts_with("dit/blocks_")).count(), 3, "{order:?}");
    let encoder = pipeline.encoder.group_stats().expect("grouped");
    assert_eq!(encoder.stray_loads, 0, "{encoder:?}");
    let record = pipeline.manager().offload_record();
    for reason in [Reason::GroupOnload, Reason::Prefetch, Reason::GroupOffload] {
        assert!(record.events().iter().any(|e| e.reason.as_ref() == Some(&reason)), "no {reason}: {record}");
    }
    assert!(record.events().iter().any(|e| e.id.starts_with("encoder/layers.0.fc1")), "{record}");
}

#[test]
fn the_auto_preset_streams_the_dit_on_a_card_too_small_for_it() {
    let models = models();
    let resident = resident_image(&models);
    let probe = pipeline(&models, OffloadDevice::host_only());
    let [_, dit, _] = sizes(&probe);
    let reserve = probe.activation_estimates(PROMPT.len()).into_iter().max().unwrap_or(0);
    let capacity = dit * 3 / 4;
    let card = hard_card(capacity);
    let mut pipeline = pipeline(&models, OffloadDevice::simulated(card.clone()));
    let mut explicit = SettingsLayer::default();
    explicit.set("preset", "auto").expect("a preset");
    explicit.set("reserve", &reserve.to_string()).expect("a size");
    let settings = Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("valid");
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let plan = pipeline.enable_preset(settings, &facts, PROMPT.len()).expect("plans and applies");
    let route = plan.applied("dit").expect("the DiT is planned").applied;
    assert!(route.is_group_offload(), "a DiT larger than the card must stream, got {route}:\n{plan}");
    assert!(plan.to_string().contains("dit"), "{plan}");
    assert!(!matches!(route, Route::Off));
    assert!(pipeline.dit.is_grouped());
    assert_same(&values(pipeline.generate(&PROMPT, STEPS).expect("runs")), &resident, "the auto preset");
    assert!(card.peak() <= capacity, "peak {} over the card's {capacity}", card.peak());
    assert_eq!(<tiny_dit::Dit as OffloadModel>::CLASS, "TinyDit");
}

#[path = "../../glue_count.rs"]
mod glue_count;

#[test]
fn the_offload_specific_lines_are_those_the_readme_counts() {
    let (marked, accessors) = glue_count::count(include_str!("../src/lib.rs"));
    let lines = marked + accessors;
    assert!(lines <= 60, "{lines} offload-specific lines; the goal is at most 60");
    let readme = include_str!("../README.md");
    let stated = format!("{lines} offload-specific lines ({marked} marked, {accessors} accessors)");
    assert!(readme.contains(&stated), "the README must state \"{stated}\"");
}
