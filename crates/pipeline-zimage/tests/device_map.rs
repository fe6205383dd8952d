//! A pipeline over two devices (`DeviceMap`): the text encoder on the host's CPU beside the transformer and the
//! VAE on a simulated card, each device with its own manager, the image the one-device pipeline's.

mod common;

use std::sync::Arc;

use group_offload::OffloadDevice;
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
    let one = load_tiny(OffloadDevice::simulated(one_card.clone()));
    one.enable_auto_offload(0, true).expect("auto offload");
    let expected = values(one.generate(&opts, &mut |_, _| {}).expect("one device"));

    let two_card = card();
    let map = DeviceMap::single(OffloadDevice::simulated(two_card.clone()))
        .with("text_encoder", OffloadDevice::host_only())
        .expect("a component");
    let two = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two devices");
    two.enable_auto_offload(0, true).expect("auto offload");
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
    let map = DeviceMap::single(OffloadDevice::simulated(card.clone()))
        .with("text_encoder", OffloadDevice::host_only())
        .expect("a component");
    let mut pipeline = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two devices");
    let (opts, _) = turbo_options();
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let plan = enable_pipeline_offload(&mut pipeline, Preset::Auto, &facts, &opts).expect("a plan");
    let planned: Vec<&str> = plan.plan.components.iter().map(|c| c.component.as_str()).collect();
    assert_eq!(planned, ["transformer", "vae"]);
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("planned run"));
    let resident = values(load_tiny(OffloadDevice::host_only()).generate(&opts, &mut |_, _| {}).expect("resident"));
    assert_eq!(image, resident);
}

#[test]
fn a_map_names_each_component_once() {
    let map = DeviceMap::single(OffloadDevice::host_only());
    assert!(matches!(
        map.clone().with("unet", OffloadDevice::host_only()),
        Err(Error::InvalidArgument { name: "component", .. })
    ));
    let once = map.with("vae", OffloadDevice::host_only()).expect("a component");
    let err = once.with("vae", OffloadDevice::host_only()).unwrap_err();
    assert!(err.to_string().contains("vae is placed twice"), "{err}");
}

/// A second simulated card, named `cuda:1`.
fn second_card(label: &str) -> Arc<SimCard> {
    let mut spec = CardSpec::parse(label).expect("a size").with_mode(Mode::Hard).with_context_overhead(0);
    spec.device = offload_core::DeviceName::parse("cuda:1").expect("a name");
    SimCard::new(spec)
}

/// The pipeline's own `enable_auto_offload` (or a plan's application) also enables each further device the map
/// places a component on: without it, the second card's manager ran the text encoder where it was, on the host,
/// and the card never held it. A further device given its own reserve first keeps it.
#[test]
fn the_pipelines_auto_offload_runs_each_component_on_the_device_the_map_gives_it() {
    let (opts, _) = turbo_options();
    let second = second_card("64MiB");
    let gpu1 = OffloadDevice::simulated(second.clone());
    let map = DeviceMap::single(OffloadDevice::simulated(card())).with("text_encoder", gpu1.clone()).expect("mapped");
    let two = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two cards");
    two.enable_auto_offload(0, true).expect("auto offload on every device of the map");
    two.generate(&opts, &mut |_, _| {}).expect("two cards");
    let text_encoder = resident_bytes(&two, "text_encoder");
    let activations = two.activation_estimates(&opts)[0];
    assert_eq!(second.peak(), text_encoder + activations, "the second card held the text encoder and its call");
    let settings = gpu1.manager().auto_offload().expect("the second card's manager has auto offload");
    assert_eq!((settings.reserve, settings.retry_on_oom), (0, true));

    // A reserve given to the further device first is kept.
    let gpu1 = OffloadDevice::simulated(second_card("64MiB"));
    let map = DeviceMap::single(OffloadDevice::simulated(card())).with("text_encoder", gpu1.clone()).expect("mapped");
    let two = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two cards");
    gpu1.enable_auto_offload(1 << 20).expect("the second card's own reserve");
    two.enable_auto_offload(0, true).expect("auto offload");
    assert_eq!(gpu1.manager().auto_offload().map(|settings| settings.reserve), Some(1 << 20));
}

/// Two accelerators in one run: the text encoder on a second card, the transformer and the VAE on the first, each
/// card with its own device object, manager, account and record. The image is the one-device image, the first
/// card held everything but the text encoder, and the second exactly the text encoder and its call's activations.
#[test]
fn two_cards_in_one_pipeline_each_hold_their_components() {
    let (opts, _) = turbo_options();
    let one_card = card();
    let one = load_tiny(OffloadDevice::simulated(one_card.clone()));
    one.enable_auto_offload(0, true).expect("auto offload");
    let expected = values(one.generate(&opts, &mut |_, _| {}).expect("one device"));

    let (first, second) = (card(), second_card("64MiB"));
    let (gpu0, gpu1) = (OffloadDevice::simulated(first.clone()), OffloadDevice::simulated(second.clone()));
    let map = DeviceMap::single(gpu0.clone()).with("text_encoder", gpu1.clone()).expect("a component");
    let two = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two cards");
    gpu0.enable_auto_offload(0).expect("auto offload on the first card");
    gpu1.enable_auto_offload(0).expect("auto offload on the second card");
    let image = values(two.generate(&opts, &mut |_, _| {}).expect("two cards"));
    assert_eq!(image, expected, "the same image bit for bit");

    let text_encoder = resident_bytes(&one, "text_encoder");
    let activations = two.activation_estimates(&opts)[0];
    assert_eq!(second.peak(), text_encoder + activations, "the second card held the text encoder and its call alone");
    assert_eq!(one_card.peak() - first.peak(), text_encoder, "the first card held everything but the text encoder");
    // Each card's record names its own moves; the pipeline's managers are the two devices' own.
    let on_second: Vec<String> = gpu1.manager().offload_record().events().into_iter().map(|e| e.id).collect();
    assert!(!on_second.is_empty() && on_second.iter().all(|id| id.starts_with("text_encoder")), "{on_second:?}");
    assert!(gpu0.manager().offload_record().events().iter().all(|e| !e.id.starts_with("text_encoder")));
    let managers: Vec<_> = two.managers().collect();
    assert!(Arc::ptr_eq(managers[0], gpu0.manager()) && Arc::ptr_eq(managers[1], gpu1.manager()));
    let table = offload_core::DeviceRecords::new([
        (gpu0.name().clone(), gpu0.manager().offload_record()),
        (gpu1.name().clone(), gpu1.manager().offload_record()),
    ])
    .to_string();
    assert!(table.lines().any(|line| line.starts_with("cuda:1 | 1 | text_encoder")), "{table}");
}

/// `balanced` over two cards, diffusers' rule: the largest component on the first card, the next on the second, the
/// third on the second again (the cycle turns back), the image the one-device image, and each card's peak within
/// its size. A card too small for its turn's component sends it to the host.
#[test]
fn a_balanced_map_deals_the_components_over_two_cards_largest_first() {
    let dir = fixtures().join("tiny-z-image-turbo");
    let sizes = pipeline_zimage::pipeline::component_weight_bytes(&dir, None).expect("sizes from the files");
    let mut by_size = sizes.to_vec();
    by_size.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
    let (first, second) = (card(), second_card("64MiB"));
    let devices = [OffloadDevice::simulated(first.clone()), OffloadDevice::simulated(second.clone())];
    let (map, placed) = DeviceMap::balanced(&devices, &sizes, 0).expect("a map");
    let expected = [Some(0), Some(1), Some(1)];
    for ((component, _), device) in by_size.iter().zip(expected) {
        assert_eq!(placed.device_of(component), Some(device), "{placed}");
        assert_eq!(map.placement(component).name(), devices[device.expect("a card")].name());
    }
    let pipeline = ZImagePipeline::load_mapped(&dir, map, &LoadOptions::new()).expect("loads over two cards");
    for device in &devices {
        device.enable_auto_offload(0).expect("auto offload");
    }
    let (opts, _) = turbo_options();
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("balanced"));
    let resident = values(load_tiny(OffloadDevice::host_only()).generate(&opts, &mut |_, _| {}).expect("resident"));
    assert_eq!(image, resident);
    let largest = resident_bytes(&pipeline, by_size[0].0);
    assert!(first.peak() >= largest && second.peak() > 0, "{} {}", first.peak(), second.peak());

    // A second card smaller than the second-largest component: that one goes to the host, the next to the card.
    let tiny = second_card(&(by_size[1].1 / 2).to_string());
    let small = [OffloadDevice::simulated(card()), OffloadDevice::simulated(tiny)];
    let (map, placed) = DeviceMap::balanced(&small, &sizes, 0).expect("a map");
    assert_eq!(placed.device_of(by_size[1].0), Some(None), "{placed}");
    assert!(map.placement(by_size[1].0).name().is_cpu());
    assert!(DeviceMap::balanced(&[], &sizes, 0).is_err(), "no device is refused");
}

/// Runs `generate` on the tiny checkpoint (64x64, 4 steps) with `args`, writing `name` under `dir`; returns the
/// image's bytes and the standard output.
fn generate(dir: &std::path::Path, name: &str, args: &[&str]) -> (Vec<u8>, String) {
    let out = dir.join(name);
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_pipeline-zimage"))
        .args(["generate", "--height", "64", "--width", "64", "--steps", "4"])
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("the CLI runs");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    (std::fs::read(&out).expect("the image"), stdout)
}

/// `generate --card 8MB --card 8MB --offload group --donor cuda:1@nvlink` on the tiny checkpoint: the second card
/// holds some of the transformer's streamed groups, later uploads copy them from it (the closing report says how
/// much), and the image is the one the same run writes without a donor, byte for byte. Over PCIe 3.0 x8, slower
/// than the card's own host link, the donor is left unused.
#[test]
fn the_cli_holds_streamed_groups_on_a_donor_card_and_writes_the_same_image() {
    let dir = std::env::temp_dir().join(format!("device-map-donor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let cards = ["--card", "8MB", "--card", "8MB", "--offload", "group"];
    let (without, _) = generate(&dir, "host.png", &cards);
    let (with, stdout) = generate(&dir, "donor.png", &[&cards[..], &["--donor", "cuda:1@nvlink"]].concat());
    assert_eq!(with, without, "the donor changes where the groups come from, not the image");
    assert!(stdout.contains("donor: cuda:1 (7.63 MB free) holds the transformer's streamed groups"), "{stdout}");
    let line = stdout.lines().find(|line| line.starts_with("donor: ") && line.contains("held on cuda:1"));
    let line = line.unwrap_or_else(|| panic!("no donor line in the report:\n{stdout}"));
    assert!(!line.contains("donor: 0 B") && !line.ends_with(" 0 B of its copies to the device from it"), "{line}");
    let (slow, stdout) = generate(&dir, "slow.png", &[&cards[..], &["--donor", "cuda:1@pcie3x8"]].concat());
    assert_eq!(slow, without);
    assert!(stdout.contains("donor: cuda:1 is not used: its link (pcie3x8, 3.12 GB/s) is no faster"), "{stdout}");
    assert!(!stdout.contains("held on cuda:1"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `generate --card 4MB --card 8MB --preset auto --donor cuda:1@nvlink`: the plan places the transformer's
/// streamed groups over the second card and RAM by cost, the run holds exactly the plan's share on the card, and
/// the image is the one the plan without the card writes.
#[test]
fn under_the_planner_a_donor_holds_the_share_the_plan_placed_on_it() {
    let dir = std::env::temp_dir().join(format!("device-map-planned-donor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let (alone, _) = generate(&dir, "alone.png", &["--card", "4MB", "--preset", "auto"]);
    let args = ["--card", "4MB", "--card", "8MB", "--preset", "auto", "--donor", "cuda:1@nvlink"];
    let (with, stdout) = generate(&dir, "donor.png", &args);
    assert_eq!(with, alone, "the plan's donor changes where the groups come from, not the image");
    let row = stdout.lines().find(|line| line.starts_with("transformer ")).expect("the plan's row");
    assert!(row.contains("ram+cuda:1"), "{row}");
    holds_the_plans_share(&stdout, "cuda:1");
    std::fs::remove_dir_all(&dir).ok();
}

/// Two donor cards under the planner, the first too small for every group (`--card 600KB`): the plan places the
/// transformer's streamed groups over both, and the run holds on each exactly the plan's share, its uploads copied
/// from each as the record and each card's meter count them, with the image of the plan without them.
#[test]
fn under_the_planner_two_donors_each_hold_the_share_the_plan_placed_on_it() {
    let dir = std::env::temp_dir().join(format!("device-map-two-donors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let (alone, _) = generate(&dir, "alone.png", &["--card", "4MB", "--preset", "auto"]);
    let cards = ["--card", "4MB", "--card", "600KB", "--card", "8MB", "--preset", "auto"];
    let donors = ["--donor", "cuda:1@nvlink", "--donor", "cuda:2@nvlink"];
    let (with, stdout) = generate(&dir, "donors.png", &[&cards[..], &donors[..]].concat());
    assert_eq!(with, alone, "the plan's donors change where the groups come from, not the image");
    let row = stdout.lines().find(|line| line.starts_with("transformer ")).expect("the plan's row");
    assert!(row.contains("ram+cuda:1+cuda:2"), "{row}");
    holds_the_plans_share(&stdout, "cuda:1");
    holds_the_plans_share(&stdout, "cuda:2");
    std::fs::remove_dir_all(&dir).ok();
}

/// Checks `generate`'s output for one donor: the transformer's share the plan applied on it is what the run held
/// there, the record's group moves name it on some uploads, and its peer meter timed as many copies.
fn holds_the_plans_share(stdout: &str, donor: &str) {
    let share = stdout
        .split(&format!(" of streamed groups held on {donor} between their uploads"))
        .next()
        .and_then(|before| before.rsplit("up to ").next())
        .unwrap_or_else(|| panic!("no applied share on {donor}:\n{stdout}"));
    let held = stdout.lines().find(|line| line.starts_with("donor: ") && line.contains(&format!("held on {donor},")));
    let held = held.unwrap_or_else(|| panic!("no line for {donor} in the report:\n{stdout}"));
    assert!(held.starts_with(&format!("donor: {share} of the transformer's groups")), "{share} planned: {held}");
    // The record names the donor on each upload copied from it.
    let moves = stdout.lines().find(|line| line.starts_with("group moves: ")).expect("the group moves line");
    let copied = moves.split(&format!(" copied from {donor}")).next().and_then(|before| before.rsplit(", ").next());
    assert!(copied.is_some_and(|n| n.parse::<usize>().is_ok_and(|n| n > 0)), "{moves}");
    // The execution device's peer meter timed each of those copies: as many as the record's rows name the donor.
    let timed =
        stdout.lines().find_map(|line| line.strip_prefix(&format!("copies from {donor}: ")).map(str::to_string));
    let timed = timed.unwrap_or_else(|| panic!("no peer meter line for {donor}:\n{stdout}"));
    assert_eq!(timed.split(' ').next(), copied, "{timed} against {moves}");
    assert!(timed.contains("measured by the clock"), "{timed}");
}
