//! The UNet gets what the library gives: its forward streams as it runs resident (the free check), block level
//! with one ResNet per group and leaf level both run on a hard simulated card smaller than the UNet with no miss,
//! auto offload and the OOM retry, the `auto` preset and the record, all giving the resident latents. The
//! crate's offload-specific lines are counted against the README.

use std::sync::Arc;

use burn::tensor::{Device, Tensor};
use group_offload::{GroupLevel, GroupOptions, OffloadModel, Placement, check_streaming, module_bytes};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{HostMemory, Settings, SettingsLayer, Workload};
use offload_core::{Action, DeviceMemory, Reason};
use tiny_unet::{EMBED, Encoder, LATENT, SIZE, TinyUnetPipeline, UNet};

const CLASS: i64 = 3;
const STEPS: usize = 2;

/// The random models, made once so that every test runs the same weights.
fn models() -> (Encoder, UNet) {
    static MODELS: std::sync::OnceLock<(Encoder, UNet)> = std::sync::OnceLock::new();
    let device = Device::flex();
    MODELS.get_or_init(|| (Encoder::random(1000, &device), UNet::random(&device))).clone()
}

fn pipeline(placement: Placement) -> TinyUnetPipeline {
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
    values(pipeline(Placement::host_only()).generate(CLASS, STEPS).expect("runs resident"))
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

/// One ResNet per group at block level, one layer at a time at leaf level, each on a hard card smaller than the
/// UNet: the same latents as resident, every group prefetched after the capture.
#[test]
fn block_and_leaf_level_run_on_a_card_smaller_than_the_unet_with_no_miss() {
    let resident = resident();
    let unet = unet_bytes();
    for (level, capacity) in
        [(GroupLevel::Block { blocks_per_group: 1 }, unet * 9 / 10), (GroupLevel::Leaf, unet * 3 / 4)]
    {
        let card = hard_card(capacity);
        let mut pipeline = pipeline(Placement::simulated(card.clone()));
        let options = GroupOptions { level, ..GroupOptions::default() };
        pipeline.unet.enable_group_offload(&options).expect("the UNet streams");
        // The reserve covers a call's activations and the ring of streamed groups (the running one and the one
        // prefetched), so the encoder leaves before the UNet runs instead of failing a prefetch.
        let ring = 2 * pipeline.unet.group_offload().expect("grouped").largest_group();
        let reserve = TinyUnetPipeline::unet_activations() + ring;
        pipeline.manager().enable_auto_offload(card.clone(), reserve, true).expect("auto offload");
        for run in ["capture", "prefetched"] {
            let latents = pipeline.generate(CLASS, STEPS).unwrap_or_else(|e| panic!("{level:?}, {run}: {e}"));
            assert_same(&values(latents), &resident, &format!("{level:?}, {run}"));
        }
        let stats = pipeline.unet.group_stats().expect("grouped");
        assert_eq!((stats.misses, stats.order_inserts, stats.stray_loads), (0, 0, 0), "{level:?}: {stats:?}");
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
    let probe = pipeline(Placement::host_only());
    let info = |id: &str| probe.manager().component_info(id).expect("registered").bytes;
    let (encoder, unet) = (info(probe.encoder.id()), info(probe.unet.id()));
    let activations = TinyUnetPipeline::unet_activations();
    let capacity = unet + activations + encoder / 2;
    let card = hard_card(capacity);
    let pipeline = pipeline(Placement::simulated(card.clone()));
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
    let probe = pipeline(Placement::host_only());
    let info = |id: &str| probe.manager().component_info(id).expect("registered").bytes;
    let (encoder, unet) = (info(probe.encoder.id()), info(probe.unet.id()));
    let activations = TinyUnetPipeline::unet_activations();
    // Both fit, so auto offload (no reserve) keeps the encoder; the UNet's activations beside it do not, and
    // without the encoder they do.
    assert!(encoder > activations / 2, "the recipe needs an encoder of at least half the activations");
    let capacity = encoder + unet + activations / 2;
    let card = hard_card(capacity);
    let pipeline = pipeline(Placement::simulated(card.clone()));
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
    let mut pipeline = pipeline(Placement::simulated(card.clone()));
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
