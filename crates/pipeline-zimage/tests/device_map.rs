//! A pipeline over two devices (`DeviceMap`): the text encoder on the host's CPU beside the transformer and the
//! VAE on a simulated card, each device with its own manager, the image the one-device pipeline's.

mod common;

use std::sync::Arc;

use group_offload::Placement;
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::DeviceMemory;
use offload_core::plan::{HostMemory, Preset};
use pipeline_zimage::Error;
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::pipeline::{DeviceMap, ZImagePipeline};
use pipeline_zimage::presets::enable_pipeline_offload;

use common::{fixtures, load_tiny, turbo_options, values};

/// A hard simulated card of `label`, no context overhead.
fn card_of(label: &str) -> Arc<SimCard> {
    SimCard::new(CardSpec::parse(label).expect("a size").with_mode(Mode::Hard).with_context_overhead(0))
}

fn card() -> Arc<SimCard> {
    card_of("64MiB")
}

/// What `component` takes on its device while resident, as its manager knows it.
fn resident_bytes(pipeline: &ZImagePipeline, component: &str) -> u64 {
    let handle = pipeline.component(component).expect("a component");
    let manager = pipeline.managers().find(|m| m.ids().iter().any(|id| id == handle.id())).expect("its manager");
    manager.component_info(handle.id()).expect("registered").resident_bytes
}

#[test]
fn the_text_encoder_on_the_cpu_beside_a_card_gives_the_one_device_image() {
    let (opts, _) = turbo_options();
    let one_card = card();
    let one = load_tiny(Placement::simulated(one_card.clone()));
    one.enable_auto_offload(one_card.clone(), 0, true).expect("auto offload");
    let expected = values(one.generate(&opts, &mut |_, _| {}).expect("one device"));

    let two_card = card();
    let map = DeviceMap::single(Placement::simulated(two_card.clone()))
        .with("text_encoder", Placement::host_only())
        .expect("a component");
    let two = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two devices");
    two.enable_auto_offload(two_card.clone(), 0, true).expect("auto offload");
    let image = values(two.generate(&opts, &mut |_, _| {}).expect("two devices"));
    assert_eq!(image, expected, "flex computes both: the same image bit for bit");

    // Each device has its own manager: the card's holds the transformer and the VAE, the CPU's the text encoder,
    // which the card never held.
    assert_eq!(two.managers().count(), 2);
    let on_card: Vec<String> = two.manager().placement().into_iter().map(|(id, _)| id).collect();
    assert_eq!(on_card.len(), 2, "{on_card:?}");
    assert!(on_card.iter().all(|id| !id.starts_with("text_encoder")), "{on_card:?}");
    let text_encoder = resident_bytes(&one, "text_encoder");
    assert!(text_encoder > 0);
    assert_eq!(one_card.peak() - two_card.peak(), text_encoder, "the card held everything but the text encoder");
    assert!(!two.device_map().on_default("text_encoder") && two.device_map().on_default("vae"));
}

#[test]
fn a_plan_for_the_card_leaves_out_the_component_placed_elsewhere() {
    let card = card_of("1GiB");
    let map = DeviceMap::single(Placement::simulated(card.clone()))
        .with("text_encoder", Placement::host_only())
        .expect("a component");
    let mut pipeline = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two devices");
    let (opts, _) = turbo_options();
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let plan = enable_pipeline_offload(&mut pipeline, Preset::Auto, &facts, &opts).expect("a plan");
    let planned: Vec<&str> = plan.plan.components.iter().map(|c| c.component.as_str()).collect();
    assert_eq!(planned, ["transformer", "vae"]);
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("planned run"));
    let resident = values(load_tiny(Placement::host_only()).generate(&opts, &mut |_, _| {}).expect("resident"));
    assert_eq!(image, resident);
}

#[test]
fn a_map_names_each_component_once() {
    let map = DeviceMap::single(Placement::host_only());
    assert!(matches!(
        map.clone().with("unet", Placement::host_only()),
        Err(Error::InvalidArgument { name: "component", .. })
    ));
    let once = map.with("vae", Placement::host_only()).expect("a component");
    let err = once.with("vae", Placement::host_only()).unwrap_err();
    assert!(err.to_string().contains("vae is placed twice"), "{err}");
}
