//! The UNet gets what the library gives: its forward streams as it runs resident (the free check), block level
//! with one ResNet per group and leaf level both run on a hard simulated card smaller than the UNet with no miss,
//! auto offload and the OOM retry, the `auto` preset and the record, all giving the resident latents. The
//! crate's offload-specific lines are counted against the README.

use std::sync::Arc;

use burn::tensor::{Device, Tensor};
use group_offload::{GroupLevel, GroupOptions, OffloadDevice, OffloadModel, check_streaming, module_bytes};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{HostMemory, Settings, SettingsLayer, Workload};
use offload_core::{Action, DeviceMemory, OffloadRecord, Reason};
use tiny_unet::{EMBED, Encoder, LATENT, SIZE, TinyUnetPipeline, UNet};

const CLASS: i64 = 3;
const STEPS: usize = 2;

/// The random models, made once so that every test runs the same weights.
fn models() -> (Encoder, UNet) {
    static MODELS: std::sync::OnceLock<(Encoder, UNet)> = std::sync::OnceLock::new();
    let device = Device::flex();
    MODELS.get_or_init(|| (Encoder::random(1000, &device), UNet::random(&device))).clone()
}

fn pipeline(placement: OffloadDevice) -> TinyUnetPipeline {
    let (encoder, unet) = models();
    TinyUnetPipeline::new(encoder, unet, placement).expect("registers")
}

fn hard_card(bytes: u64) -> Arc<SimCard> {
    SimCard::new(CardSpec::parse(&bytes.to_string()).expect("a size").with_mode(Mode::Hard).with_context_overhead(0))
}

fn values(latents: Tensor<4>) -> Vec<f32> {
    latents.into_data().try_to_vec::<f32>().expect("f32 latents")
}

fn assert_same(a: &[f32], b: &[f32], context: &str) {
    assert_eq!(a.len(), b.len());
    let difference = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    assert!(difference <= 1e-5, "{context}: the latents differ from the resident ones by {difference}");
}

fn resident() -> Vec<f32> {
    values(pipeline(OffloadDevice::host_only()).generate(CLASS, STEPS).expect("runs resident"))
}

fn unet_bytes() -> u64 {
    module_bytes(&models().1)
}

#[test]
fn the_unet_streams_as_it_runs_resident() {
    let device = Device::flex();
    let x = Tensor::<4>::ones([1, LATENT, SIZE, SIZE], &device);
    let t = Tensor::<2>::ones([1, 1], &device);
    let c = Tensor::<2>::ones([1, EMBED], &device);
    let check =
        check_streaming(models().1, &device, |w| w.forward(x.clone(), t.clone(), c.clone())).expect("the UNet streams");
    // 12 ResNets, the mid block's attention, and the two resamplers: one group each.
    assert_eq!(check.block_groups, 15, "{check:?}");
    assert!(check.leaf_groups > 40, "{check:?}");
}

/// One ResNet per group at block level, one layer at a time at leaf level, each on a hard card at 3/4 of the UNet
/// with the encoder registered beside it: the same latents as resident, every group prefetched after the capture,
/// and no prefetch refused on the images after the first.
#[test]
fn block_and_leaf_level_run_on_a_card_smaller_than_the_unet_with_no_miss() {
    let resident = resident();
    let unet = unet_bytes();
    let capacity = unet * 3 / 4;
    for level in [GroupLevel::Block { blocks_per_group: 1 }, GroupLevel::Leaf] {
        let card = hard_card(capacity);
        let mut pipeline = pipeline(OffloadDevice::simulated(card.clone()));
        let options = GroupOptions { level, ..GroupOptions::default() };
        pipeline.unet.enable_group_offload(&options).expect("the UNet streams");
        // The reserve is the call's activations alone: the manager counts the UNet's window (the group it computes
        // with and the one prefetched) itself, and has the encoder leave when the two do not fit beside it.
        pipeline.manager().enable_auto_offload(card.clone(), TinyUnetPipeline::unet_activations(), true).expect("auto");
        let record = pipeline.manager().offload_record();
        for image in 1..=3 {
            let mark = record.total_added();
            let latents = pipeline.generate(CLASS, STEPS).unwrap_or_else(|e| panic!("{level:?}, image {image}: {e}"));
            assert_same(&values(latents), &resident, &format!("{level:?}, image {image}"));
            let refused = record.refusals_since(mark);
            assert!(refused.is_none(), "{level:?}, image {image}: {}\n{}", refused.unwrap(), record.group_moves());
        }
        let stats = pipeline.unet.group_stats().expect("grouped");
        assert_eq!((stats.misses, stats.order_inserts, stats.stray_loads), (0, 0, 0), "{level:?}: {stats:?}");
        assert_eq!(stats.failed_prefetches, 0, "{level:?}: {stats:?}");
        assert!(stats.prefetch_hits + stats.prefetch_waits > 0, "{level:?}: {stats:?}");
        assert!(card.peak() <= capacity, "{level:?}: peak {} over the card's {capacity}", card.peak());
        let record = pipeline.manager().offload_record();
        for reason in [Reason::GroupOnload, Reason::Prefetch, Reason::GroupOffload] {
            assert!(record.events().iter().any(|e| e.reason.as_ref() == Some(&reason)), "no {reason}: {record}");
        }
        let order = pipeline.unet.group_offload().expect("grouped").order();
        let want = match level {
            GroupLevel::Leaf => "unet/up_blocks.1.resnets.2.conv2",
            GroupLevel::Block { .. } => "unet/up_blocks.1.resnets_2_2",
        };
        assert!(order.iter().any(|id| id == want), "{level:?}: {order:?}");
    }
}

#[test]
fn auto_offload_evicts_the_encoder_for_the_unet_on_a_hard_card() {
    let resident = resident();
    let probe = pipeline(OffloadDevice::host_only());
    let info = |id: &str| probe.manager().component_info(id).expect("registered").bytes;
    let (encoder, unet) = (info(probe.encoder.id()), info(probe.unet.id()));
    let activations = TinyUnetPipeline::unet_activations();
    let capacity = unet + activations + encoder / 2;
    let card = hard_card(capacity);
    let pipeline = pipeline(OffloadDevice::simulated(card.clone()));
    pipeline.manager().enable_auto_offload(card.clone(), activations, true).expect("auto offload");
    assert_same(&values(pipeline.generate(CLASS, STEPS).expect("runs")), &resident, "auto offload");
    assert!(card.peak() <= capacity);
    let record = pipeline.manager().offload_record();
    let evicted = record.events().into_iter().find(|e| e.action == Action::Offload && e.id == pipeline.encoder.id());
    let evicted = evicted.unwrap_or_else(|| panic!("the encoder was never offloaded: {record}"));
    assert_eq!(evicted.reason, Some(Reason::ReleaseMemoryFor(pipeline.unet.id().to_string())), "{record}");
}

#[test]
fn the_oom_retry_recovers_a_call_whose_activations_do_not_fit() {
    let resident = resident();
    let probe = pipeline(OffloadDevice::host_only());
    let info = |id: &str| probe.manager().component_info(id).expect("registered").bytes;
    let (encoder, unet) = (info(probe.encoder.id()), info(probe.unet.id()));
    let activations = TinyUnetPipeline::unet_activations();
    // Both fit, so auto offload (no reserve) keeps the encoder; the UNet's activations beside it do not, and
    // without the encoder they do.
    assert!(encoder > activations / 2, "the recipe needs an encoder of at least half the activations");
    let capacity = encoder + unet + activations / 2;
    let card = hard_card(capacity);
    let pipeline = pipeline(OffloadDevice::simulated(card.clone()));
    pipeline.manager().enable_auto_offload(card.clone(), 0, true).expect("auto offload");
    assert_same(&values(pipeline.generate(CLASS, STEPS).expect("recovers")), &resident, "after the OOM retry");
    let record = pipeline.manager().offload_record();
    let retried = Reason::OomRetry(pipeline.unet.id().to_string());
    assert!(record.events().iter().any(|e| e.reason.as_ref() == Some(&retried)), "no OOM retry: {record}");
    assert!(card.peak() <= capacity);
}

#[test]
fn the_auto_preset_streams_the_unet_on_a_card_too_small_for_it() {
    let resident = resident();
    let unet = unet_bytes();
    let activations = TinyUnetPipeline::unet_activations();
    let capacity = unet * 3 / 4;
    let card = hard_card(capacity);
    let mut pipeline = pipeline(OffloadDevice::simulated(card.clone()));
    let mut explicit = SettingsLayer::default();
    explicit.set("preset", "auto").expect("a preset");
    explicit.set("reserve", &activations.to_string()).expect("a size");
    let settings = Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("valid");
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let manager = pipeline.manager().clone();
    let specs = vec![
        group_offload::apply::component_spec(&manager, &pipeline.encoder).expect("a spec"),
        group_offload::apply::component_spec(&manager, &pipeline.unet).expect("a spec").with_activation(activations),
    ];
    let mut components: [&mut dyn group_offload::handle::Component; 2] = [&mut pipeline.encoder, &mut pipeline.unet];
    let workload = Workload::new().with("model", "tiny-unet");
    let plan =
        group_offload::apply::plan_and_apply(&manager, &mut components, &specs, settings, &facts, workload, "unet")
            .expect("plans and applies");
    let route = plan.applied("unet").expect("the UNet is planned").applied;
    assert!(route.is_group_offload(), "a UNet larger than the card must stream, got {route}:\n{plan}");
    assert!(pipeline.unet.is_grouped());
    assert_same(&values(pipeline.generate(CLASS, STEPS).expect("runs")), &resident, "the auto preset");
    assert!(card.peak() <= capacity, "peak {} over the card's {capacity}", card.peak());
    assert_eq!(<UNet as OffloadModel>::CLASS, "UNet2DModel");
}

#[path = "../../glue_count.rs"]
mod glue_count;

#[test]
fn the_offload_specific_lines_are_those_the_readme_counts() {
    let (marked, accessors) = glue_count::count(include_str!("../src/lib.rs"));
    let lines = marked + accessors;
    let readme = include_str!("../README.md");
    let stated = format!("{lines} offload-specific lines ({marked} marked, {accessors} accessors)");
    assert!(readme.contains(&stated), "the README must state \"{stated}\"");
}

/// Three images on `capacity` at block level, one ResNet per group, the encoder registered beside the UNet, the
/// reserve the UNet's activations alone (the manager counts the window itself). Returns, per image, the refused
/// prefetches and the misses, and checks each image's latents against the resident ones; and the manager's
/// decisions with the UNet's id.
fn three_block_level_images(capacity: u64) -> (Vec<(u64, u64)>, OffloadRecord, String) {
    let resident = resident();
    let card = hard_card(capacity);
    let mut pipeline = pipeline(OffloadDevice::simulated(card.clone()));
    let options = GroupOptions { level: GroupLevel::Block { blocks_per_group: 1 }, ..GroupOptions::default() };
    pipeline.unet.enable_group_offload(&options).expect("the UNet streams");
    let reserve = TinyUnetPipeline::unet_activations();
    pipeline.manager().enable_auto_offload(card.clone(), reserve, true).expect("auto offload");
    let mut per_image = Vec::new();
    let mut before = pipeline.unet.group_stats().expect("grouped");
    for image in 1..=3 {
        let latents = pipeline.generate(CLASS, STEPS).unwrap_or_else(|e| panic!("image {image}: {e}"));
        assert_same(&values(latents), &resident, &format!("image {image}"));
        let after = pipeline.unet.group_stats().expect("grouped");
        per_image.push((after.failed_prefetches - before.failed_prefetches, after.misses - before.misses));
        before = after;
    }
    assert!(card.peak() <= capacity, "peak {} over the card's {capacity}", card.peak());
    (per_image, pipeline.manager().offload_record().decisions(), pipeline.unet.id().to_string())
}

/// Issue 37's case, at the nearest the tiny UNet allows: the user's 55% was a card on which the first image refused
/// nothing and each later image refused 3 prefetches; here that card is 65% of the UNet (its shell, its two largest
/// ResNets and its activations take 60.3% of it). The UNet under block-level group offload, the encoder beside it
/// under auto offload; image 2 brings the encoder back while the UNet holds its next forward's first prefetched
/// group. The manager now makes room for the UNet's window before it runs (the encoder leaves,
/// `release_memory_for`), so no image after the first refuses a prefetch or misses a group (before: images 2 and 3
/// each refused 3 and missed 3 at 65%, refused 5 and missed 3 at 75%).
#[test]
fn block_level_beside_the_encoder_refuses_no_prefetch_after_the_first_image() {
    let unet = unet_bytes();
    for percent in [65, 75] {
        let (per_image, decisions, unet_id) = three_block_level_images(unet * percent / 100);
        assert_eq!(per_image[0], (0, 0), "{percent}%: the first image refused nothing: {per_image:?}");
        assert_eq!(per_image[1..], [(0, 0), (0, 0)], "{percent}%: (refused, missed) per image: {per_image:?}");
        // The record says why the encoder left each time: a decision of its own, made for the UNet's window
        // while the UNet stayed on the device.
        let for_the_window = decisions
            .rows()
            .into_iter()
            .filter(|row| row.onload.is_none() && row.reason == format!("release_memory_for:{unet_id}"))
            .count();
        assert!(for_the_window >= 2, "{percent}%: the encoder left for images 2 and 3:\n{decisions}");
        if percent == 75 {
            // The table docs/offload-record.md shows.
            let expected = "\
# | Onload                | Offloaded             | Available | Peak      | Reason
----------------------------------------------------------------------------------
1 | encoder_1 (266.25 KB) | -                     | 676.79 KB | 0 B       |
2 | unet_3 (21.45 KB)     | encoder_1 (266.25 KB) | 410.54 KB | 266.25 KB |
3 | encoder_1 (266.25 KB) | -                     | 632.90 KB | 543.95 KB |
4 | -                     | encoder_1 (266.25 KB) | 366.65 KB | 543.95 KB | release_memory_for:unet_3
5 | encoder_1 (266.25 KB) | -                     | 632.90 KB | 543.95 KB |
6 | -                     | encoder_1 (266.25 KB) | 366.65 KB | 543.95 KB | release_memory_for:unet_3";
            assert_eq!(decisions.to_string(), expected);
        }
    }
}

/// On a card too small for the UNet's window beside its activations (55% of it: the shell, the two largest ResNets
/// and the activations take 60.3%), prefetches are refused on every image, the first included, whatever the
/// manager evicts. They are not silent: each is a `prefetch_refused` row of the record, and the record sums an
/// image's refusals in the one line a program prints after it (the line docs/offload-record.md shows).
#[test]
fn refusals_the_card_cannot_avoid_are_rows_and_one_line_per_image() {
    let card = hard_card(unet_bytes() * 55 / 100);
    let mut pipeline = pipeline(OffloadDevice::simulated(card.clone()));
    let options = GroupOptions { level: GroupLevel::Block { blocks_per_group: 1 }, ..GroupOptions::default() };
    pipeline.unet.enable_group_offload(&options).expect("the UNet streams");
    pipeline.manager().enable_auto_offload(card.clone(), TinyUnetPipeline::unet_activations(), true).expect("auto");
    let record = pipeline.manager().offload_record();
    let mut lines = Vec::new();
    for image in 1..=3 {
        let mark = record.total_added();
        pipeline.generate(CLASS, STEPS).unwrap_or_else(|e| panic!("image {image}: {e}"));
        lines.push(record.refusals_since(mark).map(|refusals| refusals.to_string()));
    }
    let stats = pipeline.unet.group_stats().expect("grouped");
    assert_eq!(record.total_refused(), stats.failed_prefetches, "every refusal is a row: {stats:?}");
    let refused = record.refusals();
    assert!(refused.iter().all(|e| e.reason == Some(Reason::PrefetchRefused) && e.available.is_some()));
    // One forward prefetches on the first image (the other is the capture), two on each later one.
    let line = |count: u64, bytes: &str| {
        format!(
            "{count} prefetches refused (unet {count}; {bytes} in all; as little as 77.61 KB available): each group \
             was loaded when its forward took it, so the output is right but those copies were not hidden; the \
             record's prefetch_refused rows hold each reading; make room for the model's window: a reserve that \
             covers its call's activations, fewer components resident beside it, a smaller prefetch depth or leaf \
             level, or a larger card"
        )
    };
    assert_eq!(lines, [Some(line(3, "355.62 KB")), Some(line(6, "711.25 KB")), Some(line(6, "711.25 KB"))]);
}

/// One error type serves the handle (issue 37, item 8): registering, running and switching to group offload all
/// return `group_offload::Result`, so the pipeline has no error enum of its own, and a UNet that does not fit the
/// card whole comes back as the manager's typed verdict inside it, pointing to group offload.
#[test]
fn a_unet_too_large_for_the_card_whole_fails_typed_through_the_one_error_type() {
    let unet = unet_bytes();
    let card = hard_card(unet * 3 / 4);
    let pipeline = pipeline(OffloadDevice::simulated(card.clone()));
    pipeline.manager().enable_auto_offload(card.clone(), 0, true).expect("auto offload");
    let error: group_offload::Error = pipeline.generate(CLASS, STEPS).expect_err("the UNet does not fit whole");
    match &error {
        group_offload::Error::Manager(offload_core::Error::DoesNotFit { id, .. }) => assert_eq!(id, pipeline.unet.id()),
        other => panic!("expected the manager's verdict, got {other:?}"),
    }
    assert!(error.to_string().contains("use group offloading for it"), "{error}");
}
