//! Faults injected at every allocation and every transfer of the tiny real Z-Image-Turbo flow (text-to-image,
//! 64x64, 4 steps, guidance 0, diffusers' latents) on a simulated card in hard mode: under auto offload alone,
//! with the transformer under block-level group offload, and with both encoders under leaf-level group offload.
//!
//! A fault-free run counts the allocations (and transfers) the flow makes; then the flow runs once per point,
//! on a fresh pipeline and card, with exactly that allocation (or transfer) failing. Every run must end with an
//! image equal to the fault-free one (max abs diff ≤ 1e-6) or with a typed error that names the component and
//! the fix. Afterwards, whatever the outcome:
//! - every component is on a known device: the manager's placement, its component info and the component itself
//!   agree;
//! - the card holds exactly the weights the placement says are resident (nothing leaked, nothing lost);
//! - every component's weights are intact: a checksum of every float parameter of the plain components equals
//!   the one taken before the run, and every group's host copy has the checksum it had (`host_checksums`);
//! - the record explains what happened: the manager's moves add up to the final placement, and a run that
//!   recovered from an out-of-memory shows an `oom_retry` row (or, under group offload, a failed prefetch that
//!   was loaded again when taken);
//! - the same pipeline, with the fault cleared, generates the fault-free image again.

#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

use std::collections::HashMap;

use std::sync::{Arc, Mutex, OnceLock};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use group_offload::{OffloadDevice, whole::BurnComponent};
use memory_sim::{CardSpec, Faults, Mode, SimCard};
use offload_core::{Action, ComponentError, DeviceLedger, DeviceMemory, Direction, OffloadRecord, Offloadable, Reason};
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};
use pipeline_zimage::text_encoder::TextEncoder;
use pipeline_zimage::transformer::ZImageTransformer2DModel;
use pipeline_zimage::vae::AutoencoderKl;

mod common;

use common::{load_tiny as load, max_abs_diff, values};

/// The initial latents of diffusers' Turbo run, `[1, 16, 8, 8]`, and its image.
fn golden() -> (Tensor<4>, Vec<f32>) {
    let turbo = common::golden("pipeline_t2i_turbo.safetensors");
    (common::tensor4(&turbo, "latents"), turbo["image"].1.clone())
}

fn options() -> GenerateOptions {
    let mut opts = GenerateOptions::turbo("a red fox in the snow");
    opts.steps = 4;
    opts.guidance = 0.0;
    opts.height = 64;
    opts.width = 64;
    opts.max_sequence_length = 32;
    opts.latents = Some(golden().0);
    opts
}

/// FNV-1a over the shape and the f32 bits of every float parameter, in visit order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Checksum {
    hash: u64,
    params: usize,
}

fn checksum<M: Module>(module: &M) -> Checksum {
    struct Visitor(Checksum);
    impl Visitor {
        fn eat(&mut self, bytes: &[u8]) {
            for byte in bytes {
                self.0.hash ^= u64::from(*byte);
                self.0.hash = self.0.hash.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    impl ModuleVisitor for Visitor {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            for dim in tensor.dims() {
                self.eat(&dim.to_le_bytes());
            }
            let data = tensor.into_data().try_into_vec_as::<f32>().expect("f32 parameters");
            for value in data {
                self.eat(&value.to_bits().to_le_bytes());
            }
            self.0.params += 1;
        }
    }
    let mut visitor = Visitor(Checksum { hash: 0xcbf2_9ce4_8422_2325, params: 0 });
    module.visit(&mut visitor);
    visitor.0
}

/// A checksum per component of every float parameter. The grouped transformer's groups are inside the
/// pipeline's private component type, which no public accessor reaches yet, so its weights are checked by
/// generating again after the fault (see [`check_again`]) instead of by the groups' host checksums.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Weights {
    text_encoder: Option<Checksum>,
    transformer: Option<Checksum>,
    vae: Checksum,
    /// The host copies of every grouped component's groups.
    groups: Vec<(String, Result<u64, String>)>,
}

/// The components' ids in the manager.
struct Ids {
    text_encoder: String,
    transformer: String,
    vae: String,
}

fn ids(pipeline: &ZImagePipeline) -> Ids {
    let [text_encoder, transformer, vae] = pipeline.components().map(|c| c.id().to_string());
    Ids { text_encoder, transformer, vae }
}

fn weights(pipeline: &ZImagePipeline) -> Weights {
    let manager = pipeline.manager();
    let ids = ids(pipeline);
    let text_encoder = if pipeline.is_grouped("text_encoder") {
        None
    } else {
        Some(manager.inspect(&ids.text_encoder, |c: &BurnComponent<TextEncoder>| checksum(c.module())).unwrap())
    };
    let vae = manager.inspect(&ids.vae, |c: &BurnComponent<AutoencoderKl>| checksum(c.module())).unwrap();
    let transformer = if pipeline.is_grouped("transformer") {
        None
    } else {
        Some(
            manager
                .inspect(&ids.transformer, |c: &BurnComponent<ZImageTransformer2DModel>| checksum(c.module()))
                .unwrap(),
        )
    };
    let groups = pipeline_zimage::pipeline::COMPONENTS
        .into_iter()
        .filter_map(|c| pipeline.group_offload(c))
        .flat_map(|offload| offload.host_checksums())
        .collect();
    Weights { text_encoder, transformer, vae, groups }
}

/// Every component is on a known device, and the card holds exactly the resident weights: the plain
/// components the placement puts on the card, and the groups of the grouped transformer on it (the bytes its
/// offloader uploaded less those it dropped, once no prefetch is in flight).
fn check_placement(pipeline: &ZImagePipeline, card: &SimCard, context: &str) {
    let manager = pipeline.manager();
    let ids = ids(pipeline);
    let placement = manager.placement();
    assert_eq!(placement.len(), 3, "{context}: every component is still registered: {placement:?}");
    let mut resident = 0;
    for (id, device) in &placement {
        let info = manager.component_info(id).unwrap();
        assert_eq!(&info.device, device, "{context}: {id}: placement and component info disagree");
        assert!(device.is_cpu() || *device == card.device(), "{context}: {id} is on an unknown device {device}");
        let own = if *id == ids.text_encoder && !pipeline.is_grouped("text_encoder") {
            Some(manager.inspect(id, |c: &BurnComponent<TextEncoder>| c.device()).unwrap())
        } else if *id == ids.text_encoder {
            None
        } else if *id == ids.vae {
            Some(manager.inspect(id, |c: &BurnComponent<AutoencoderKl>| c.device()).unwrap())
        } else if !pipeline.is_grouped("transformer") {
            Some(manager.inspect(id, |c: &BurnComponent<ZImageTransformer2DModel>| c.device()).unwrap())
        } else {
            None
        };
        if let Some(own) = own {
            assert_eq!(&own, device, "{context}: the manager says {id} is on {device}, the component says {own}");
        }
        if info.evictable && !device.is_cpu() {
            resident += info.bytes;
        }
    }
    let groups = || {
        pipeline_zimage::pipeline::COMPONENTS
            .into_iter()
            .filter_map(|c| pipeline.group_stats(c))
            .map(|s| s.bytes_onloaded - s.bytes_offloaded)
            .sum::<u64>()
    };
    // A prefetch of the next forward's first group may still be in flight: its bytes are allocated before
    // the offloader counts them.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while card.allocated() != resident + groups() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(
        card.allocated(),
        resident + groups(),
        "{context}: the card holds {} bytes, the resident weights are {resident} plus {} of groups",
        card.allocated(),
        groups()
    );
}

/// With the fault gone, the same pipeline generates the fault-free image again: whatever the fault left is
/// usable, and no weight that the image depends on changed.
fn check_again(pipeline: &ZImagePipeline, card: &SimCard, reference: &[f32], before: &Weights, context: &str) {
    card.set_faults(Faults::default());
    let again = values(
        pipeline
            .generate(&options(), &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{context}: the run after the fault failed: {e}")),
    );
    let diff = max_abs_diff(&again, reference);
    assert!(diff <= 1e-6, "{context}: the run after the fault differs by {diff}");
    check_placement(pipeline, card, context);
    check_record(pipeline, context);
    assert_eq!(&weights(pipeline), before, "{context}: weights changed after the second run");
}

/// The manager's own moves (not the groups', whose ids carry a `/`) replayed from the record give the
/// placement. Returns the number of `oom_retry` rows.
fn check_record(pipeline: &ZImagePipeline, context: &str) -> usize {
    let manager = pipeline.manager();
    let events = manager.offload_record().events();
    let mut replayed: HashMap<String, bool> = HashMap::new();
    for event in events.iter().filter(|e| !e.id.contains('/')) {
        replayed.insert(event.id.clone(), event.action == Action::Onload);
    }
    for (id, device) in manager.placement() {
        if !manager.component_info(&id).unwrap().evictable {
            continue;
        }
        let resident = replayed.get(&id).copied().unwrap_or(false);
        assert_eq!(
            resident,
            !device.is_cpu(),
            "{context}: the record's moves of {id} do not add up to {device}\n{}",
            manager.offload_record()
        );
    }
    events.iter().filter(|e| matches!(e.reason, Some(Reason::OomRetry(_)))).count()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Allocation,
    Transfer,
}

/// One allocation or transfer the flow made, as the card saw it.
#[derive(Debug, Clone)]
struct Point {
    fault: Fault,
    /// The card's 1-based ordinal of this allocation or transfer.
    ordinal: u64,
    bytes: u64,
    /// Made by the group offloader's prefetch worker rather than the thread that runs the pipeline.
    prefetch: bool,
    failed: bool,
    /// An allocation larger than what was available: it fails in hard mode with or without injection.
    natural: bool,
    /// Events in the record when it was made.
    record_len: usize,
}

/// The card's ledger, logging every allocation and transfer with its ordinal. One lock around the card's call
/// and the reading of its counters keeps ordinals exact when the prefetch worker allocates concurrently.
struct Traced {
    card: Arc<SimCard>,
    record: OnceLock<OffloadRecord>,
    log: Mutex<Vec<Point>>,
}

impl Traced {
    fn log(
        &self,
        fault: Fault,
        bytes: u64,
        call: impl FnOnce() -> Result<(), ComponentError>,
    ) -> Result<(), ComponentError> {
        let mut log = self.log.lock().unwrap();
        let result = call();
        let stats = self.card.stats();
        let natural =
            matches!(result, Err(ComponentError::OutOfMemory { requested, available, .. }) if requested > available);
        log.push(Point {
            fault,
            ordinal: if fault == Fault::Allocation { stats.allocations } else { stats.transfers },
            bytes,
            prefetch: std::thread::current().name().is_some_and(|n| n.starts_with("group-offload-")),
            failed: result.is_err(),
            natural,
            record_len: self.record.get().map_or(0, OffloadRecord::len),
        });
        result
    }

    fn point(&self, fault: Fault, ordinal: u64) -> Option<Point> {
        self.log.lock().unwrap().iter().find(|p| p.fault == fault && p.ordinal == ordinal).cloned()
    }
}

impl DeviceLedger for Traced {
    fn allocate(&self, bytes: u64) -> Result<(), ComponentError> {
        self.log(Fault::Allocation, bytes, || self.card.allocate(bytes))
    }

    fn free(&self, bytes: u64) {
        self.card.free(bytes);
    }

    fn transfer(&self, bytes: u64, direction: Direction) -> Result<(), ComponentError> {
        self.log(Fault::Transfer, bytes, || self.card.transfer(bytes, direction))
    }
}

/// How the flow places its components.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    /// Auto offload only.
    Auto,
    /// The transformer under block-level group offload (one block per group, prefetch depth 1).
    Block,
    /// The text encoder and the transformer under leaf-level group offload (prefetch depth 1).
    Leaf,
}

/// A pipeline on a fresh hard card of `capacity` bytes (no context overhead, no reserve, OOM retry on), placed
/// as `setup` says. Faults are set before anything is placed, so setup allocations count too.
fn pipeline_on_card(
    setup: Setup,
    capacity: u64,
    faults: Faults,
) -> (Result<ZImagePipeline, pipeline_zimage::Error>, Arc<SimCard>, Arc<Traced>) {
    let card =
        SimCard::new(CardSpec::parse(&capacity.to_string()).unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    card.set_faults(faults);
    let traced = Arc::new(Traced { card: card.clone(), record: OnceLock::new(), log: Mutex::new(Vec::new()) });
    let placement = OffloadDevice::on_device(Device::flex(), card.device(), traced.clone(), None);
    let mut pipeline = load(placement);
    let _ = traced.record.set(pipeline.manager().offload_record());
    let enabled = (|| {
        match setup {
            Setup::Auto => {}
            Setup::Block => pipeline.enable_group_offload(1, 1)?,
            Setup::Leaf => {
                for component in ["text_encoder", "transformer"] {
                    let leaf = group_offload::GroupOptions::leaf();
                    pipeline.enable_group_offload_with(component, &leaf)?;
                }
            }
        }
        pipeline.enable_auto_offload(0, true)
    })();
    (enabled.map(|()| pipeline), card, traced)
}

/// A card too small to hold the transformer with its activations beside the text encoder: the flow needs the
/// manager to offload.
fn card_capacity(setup: Setup) -> u64 {
    let resident = OffloadDevice::host_only();
    let probe = load(resident);
    let ids = ids(&probe);
    let bytes = |id: &str| probe.manager().component_info(id).unwrap().bytes;
    let activations = probe.activation_estimates(&options());
    // Under group offload the transformer's outside layers stay on the card through the decode, whose measured
    // activations exceed a denoising step's: the decode needs its own room beside them.
    let decode = if matches!(setup, Setup::Auto) { 0 } else { bytes(&ids.vae) + activations[2] };
    bytes(&ids.transformer) + activations[1] + bytes(&ids.text_encoder) / 2 + decode
}

#[derive(Debug, Default)]
struct Tally {
    points: u64,
    recovered: u64,
    recovered_by_retry: u64,
    recovered_by_prefetch_fallback: u64,
    does_not_fit: u64,
    component_errors: u64,
    /// Allocations larger than what was available: they fail in hard mode with or without the injection.
    would_fail_anyway: u64,
}

/// Runs the flow once per injection point of `fault` after the setup and checks every outcome.
fn every_point(setup: Setup, fault: Fault) -> Tally {
    let capacity = card_capacity(setup);
    let opts = options();
    let mode = match setup {
        Setup::Auto => "auto offload",
        Setup::Block => "block-level group offload",
        Setup::Leaf => "leaf-level group offload of both encoders",
    };

    // The fault-free run: its image, its weights, and how many points the flow has after the setup.
    let (clean, card, _) = pipeline_on_card(setup, capacity, Faults::default());
    let clean = clean.expect("the fault-free setup succeeds");
    let before = weights(&clean);
    let set_up = card.stats();
    let reference = values(clean.generate(&opts, &mut |_, _| {}).expect("the fault-free run completes"));
    let (_, expected) = golden();
    assert!(max_abs_diff(&reference, &expected) <= 1e-3, "{mode}: the fault-free run matches diffusers");
    check_placement(&clean, &card, mode);
    check_record(&clean, mode);
    assert_eq!(weights(&clean), before, "{mode}: the fault-free run changed the weights");
    let stats = card.stats();
    let (first, count) = match fault {
        Fault::Allocation => (set_up.allocations, stats.allocations - set_up.allocations),
        Fault::Transfer => (set_up.transfers, stats.transfers - set_up.transfers),
    };
    assert!(count > 0, "{mode}: the flow makes no {fault:?}");

    let mut tally = Tally { points: count, ..Tally::default() };
    for n in first + 1..=first + count {
        let context = format!("{mode}, {fault:?} #{n} failed");
        let faults = match fault {
            Fault::Allocation => Faults { fail_allocation: Some(n), ..Faults::default() },
            Fault::Transfer => Faults { fail_transfer: Some(n), ..Faults::default() },
        };
        let (pipeline, card, traced) = pipeline_on_card(setup, capacity, faults);
        let pipeline =
            pipeline.unwrap_or_else(|e| panic!("{context}: the setup failed before the injection point: {e}"));
        let outcome = pipeline.generate(&opts, &mut |_, _| {});
        let point = traced.point(fault, n).unwrap_or_else(|| panic!("{context}: the flow never reached the point"));
        assert!(point.failed, "{context}: the injected fault did not fail {point:?}");
        let context = format!("{context} ({} bytes{})", point.bytes, if point.prefetch { ", a prefetch" } else { "" });
        tally.would_fail_anyway += u64::from(point.natural);
        check_placement(&pipeline, &card, &context);
        check_record(&pipeline, &context);
        assert_eq!(weights(&pipeline), before, "{context}: weights changed");
        let events = pipeline.manager().offload_record().events();
        let retried_after = events.iter().skip(point.record_len).any(|e| matches!(e.reason, Some(Reason::OomRetry(_))));
        match outcome {
            Ok(image) => {
                let diff = max_abs_diff(&values(image), &reference);
                assert!(diff <= 1e-6, "{context}: the image differs from the fault-free one by {diff}");
                tally.recovered += 1;
                if point.prefetch {
                    // A failed prefetch is absorbed: the group is loaded again, synchronously, when taken.
                    let failed: u64 = pipeline_zimage::pipeline::COMPONENTS
                        .into_iter()
                        .filter_map(|c| pipeline.group_stats(c))
                        .map(|stats| stats.failed_prefetches)
                        .sum();
                    assert!(failed >= 1, "{context}: a failed prefetch is not counted");
                    tally.recovered_by_prefetch_fallback += 1;
                } else {
                    assert_eq!(
                        fault,
                        Fault::Allocation,
                        "{context}: a failed transfer on the running thread was absorbed"
                    );
                    // The manager offloaded a component and ran again: the record says so after the failure.
                    assert!(
                        retried_after,
                        "{context}: recovered, but no oom_retry row follows the failure\n{}",
                        pipeline.manager().offload_record()
                    );
                    tally.recovered_by_retry += 1;
                }
            }
            Err(error) => {
                assert!(!point.prefetch, "{context}: a failed prefetch surfaced as an error: {error}");
                let message = error.to_string();
                let ids = ids(&pipeline);
                let names_component =
                    [&ids.text_encoder, &ids.transformer, &ids.vae].iter().any(|id| message.contains(id.as_str()));
                assert!(names_component, "{context}: the error names no component: {message}");
                match &error {
                    pipeline_zimage::Error::Offload(offload_core::Error::DoesNotFit { .. }) => {
                        assert_eq!(fault, Fault::Allocation, "{context}: {message}");
                        assert!(
                            message.contains("use group offloading") && message.contains("larger card"),
                            "{context}: no fix in {message}"
                        );
                        tally.does_not_fit += 1;
                    }
                    pipeline_zimage::Error::Offload(offload_core::Error::Component { .. }) => {
                        assert_eq!(fault, Fault::Transfer, "{context}: {message}");
                        assert!(message.contains("host copy is intact"), "{context}: no fix in {message}");
                        tally.component_errors += 1;
                    }
                    other => panic!("{context}: unexpected error {other:?}"),
                }
            }
        }
        check_again(&pipeline, &card, &reference, &before, &context);
    }
    assert_eq!(tally.recovered + tally.does_not_fit + tally.component_errors, tally.points);
    println!(
        "{mode}, {fault:?}: {} injection points: {} recovered with the fault-free image ({} by an OOM retry, {} by a \
         synchronous load after a failed prefetch), {} DoesNotFit, {} typed transfer errors; {} of the points \
         fail without injection too",
        tally.points,
        tally.recovered,
        tally.recovered_by_retry,
        tally.recovered_by_prefetch_fallback,
        tally.does_not_fit,
        tally.component_errors,
        tally.would_fail_anyway
    );
    tally
}

#[test]
fn an_out_of_memory_at_every_allocation_under_auto_offload() {
    let tally = every_point(Setup::Auto, Fault::Allocation);
    assert!(tally.recovered_by_retry > 0, "{tally:?}");
}

#[test]
fn an_out_of_memory_at_every_allocation_under_group_offload() {
    let tally = every_point(Setup::Block, Fault::Allocation);
    assert!(tally.recovered > 0, "{tally:?}");
}

#[test]
fn a_failed_transfer_at_every_point_under_auto_offload() {
    every_point(Setup::Auto, Fault::Transfer);
}

#[test]
fn a_failed_transfer_at_every_point_under_group_offload() {
    every_point(Setup::Block, Fault::Transfer);
}

#[test]
fn an_out_of_memory_at_every_allocation_under_leaf_level_offload_of_both_encoders() {
    let tally = every_point(Setup::Leaf, Fault::Allocation);
    assert!(tally.recovered > 0, "{tally:?}");
}

#[test]
fn a_failed_transfer_at_every_point_under_leaf_level_offload_of_both_encoders() {
    every_point(Setup::Leaf, Fault::Transfer);
}

/// Enabling group offload cannot fail half-way and lose the transformer: taking it apart touches no device
/// memory (its resident layers upload when the manager onloads it), and a disk store that cannot be written is a
/// typed error with the transformer still registered, and the pipeline still runs.
#[test]
fn enabling_group_offload_loses_nothing() {
    let capacity = card_capacity(Setup::Block);
    let card =
        SimCard::new(CardSpec::parse(&capacity.to_string()).unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let placement = OffloadDevice::simulated(card.clone());
    let mut pipeline = load(placement);
    pipeline.enable_group_offload(1, 1).unwrap();
    assert_eq!(card.stats().allocations, 0, "building the groups allocates nothing on the device");

    let card =
        SimCard::new(CardSpec::parse(&capacity.to_string()).unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let placement = OffloadDevice::simulated(card.clone());
    let mut pipeline = load(placement);
    // A file where the store's directory should be: the store cannot be created.
    let blocked = std::env::temp_dir().join(format!("zimage-blocked-store-{}", std::process::id()));
    std::fs::write(&blocked, b"not a directory").unwrap();
    let options_with_store =
        group_offload::GroupOptions { disk_store: Some(blocked.join("groups")), ..Default::default() };
    let error = pipeline.enable_group_offload_with("transformer", &options_with_store).unwrap_err();
    assert!(matches!(error, pipeline_zimage::Error::GroupOffload(group_offload::Error::Disk { .. })), "{error:?}");
    assert_eq!(pipeline.manager().placement().len(), 3, "the transformer is still registered");
    pipeline.enable_auto_offload(0, true).unwrap();
    pipeline.generate(&options(), &mut |_, _| {}).expect("the pipeline still runs, without group offload");
    std::fs::remove_file(&blocked).ok();
}

/// The golden transformer inputs (`transformer.safetensors`): one item, its timestep and caption features.
fn transformer_inputs() -> (Vec<Tensor<4>>, Tensor<1>, Vec<Tensor<2>>) {
    let g = common::golden("transformer.safetensors");
    let flex = Device::flex();
    let x = Tensor::<4>::from_data(burn::tensor::TensorData::new(g["x"].1.clone(), g["x"].0.clone()), &flex);
    let t = Tensor::<1>::from_data(burn::tensor::TensorData::new(g["t"].1.clone(), g["t"].0.clone()), &flex);
    let cap = Tensor::<2>::from_data(
        burn::tensor::TensorData::new(g["cap_feats"].1.clone(), g["cap_feats"].0.clone()),
        &flex,
    );
    (vec![x], t, vec![cap])
}

/// What the contention runs saw.
#[derive(Debug, Default)]
struct Contention {
    refused: u64,
    failed_prefetches: u64,
    retried: usize,
    /// Forwards that ended with the manager's typed `DoesNotFit`: the main thread's own upload refused while the
    /// worker's prefetches held the last bytes (the engine now gives those back and retries, so it stays at 0).
    starved: usize,
}

/// The account under contention on the simulated card: a hard card, the transformer under block-level group
/// offload with prefetch depth 2, so the worker uploads the next two groups while the main thread takes its group
/// and charges its call's activations. The card holds half a group less than the ring of depth 2 needs (the
/// transformer's resident shell, the text encoder, the call's activations and three groups): a computing group
/// and two prefetched ones do not fit, so the worker and the main thread contend for the last bytes (transfers
/// take no wall time here, so the worker runs ahead and fills the ring, as it does on a fast link). `runs` runs of
/// three forwards through the manager: the card's peak never passes its capacity, every forward that returns
/// returns the resident output, and one that does not is the manager's typed `DoesNotFit`.
fn contention_runs(runs: usize) -> Contention {
    let (xs, t, caps) = transformer_inputs();
    let forward = |pipeline: &ZImagePipeline, activation: u64| {
        pipeline
            .transformer()
            .try_run(activation, |weights, _| weights.forward_items(xs.clone(), t.clone(), caps.clone()))
    };
    let (reference, capacity, activation) = {
        let mut probe = load(OffloadDevice::host_only());
        let reference = values(forward(&probe, 0).unwrap().remove(0));
        probe.enable_group_offload(1, 2).unwrap();
        let offload = probe.group_offload("transformer").unwrap();
        let streamed: Vec<u64> =
            offload.groups().into_iter().filter(|(id, _)| !id.ends_with("/shell")).map(|(_, b)| b).collect();
        let group = streamed.iter().copied().max().unwrap();
        let activation = probe.activation_estimates(&options())[1];
        let shell = offload.total_bytes() - streamed.iter().sum::<u64>();
        let text_encoder = probe.manager().component_info(&ids(&probe).text_encoder).unwrap().bytes;
        // The ring of depth 2 beside the call: the shell, the text encoder, the activations, the computing group
        // and two prefetched ones (what one forward reaches on a roomy card when the worker runs ahead: 2,649,734
        // B measured); half a group less, so the ring does not fit whole.
        let ring = shell + text_encoder + activation + 3 * group;
        (reference, ring - group / 2, activation)
    };
    let mut seen = Contention::default();
    for run in 0..runs {
        let card = SimCard::new(
            CardSpec::parse(&capacity.to_string()).unwrap().with_mode(Mode::Hard).with_context_overhead(0),
        );
        let mut pipeline = load(OffloadDevice::simulated(card.clone()));
        pipeline.enable_group_offload(1, 2).unwrap();
        pipeline.enable_auto_offload(0, true).unwrap();
        // The text encoder first, so the OOM retry has something to evict.
        pipeline.encode_prompts(&["a red fox".to_string()], 32).unwrap();
        for call in 0..3 {
            match forward(&pipeline, activation) {
                Ok(mut output) => {
                    let diff = max_abs_diff(&values(output.remove(0)), &reference);
                    assert!(diff <= 1e-6, "run {run}, call {call}: the output differs from the resident one by {diff}");
                }
                Err(group_offload::Error::Manager(error @ offload_core::Error::DoesNotFit { .. })) => {
                    println!("run {run}, call {call}: {error}");
                    seen.starved += 1;
                }
                Err(error) => panic!("run {run}, call {call}: an untyped failure: {error:?}"),
            }
        }
        let peak = card.peak();
        assert!(peak <= capacity, "run {run}: the card held {peak} B of its {capacity} B");
        seen.refused += card.stats().failed_allocations;
        seen.failed_prefetches += pipeline.group_stats("transformer").map_or(0, |stats| stats.failed_prefetches);
        seen.retried += pipeline
            .manager()
            .offload_record()
            .events()
            .iter()
            .filter(|event| matches!(event.reason, Some(Reason::OomRetry(_))))
            .count();
    }
    println!("{runs} runs of 3 forwards on a {capacity} B hard card: {seen:?}");
    // The card was sized for the threads to contend: some allocation was refused.
    assert!(seen.refused > 0, "no allocation was ever refused: the card is too large to make the threads contend");
    seen
}

/// 100 contention runs: never over the card, every output the resident one, every failure typed.
#[test]
fn a_hard_card_with_block_prefetch_depth_2_never_passes_its_capacity_under_contention() {
    contention_runs(100);
}

/// The same runs, and every out-of-memory recovered: after a refused prefetch of group k+2 the worker may go on
/// to k+3 and take the bytes the main thread then needs for k+2; the main thread's refused upload gives back the
/// prefetched groups nobody borrows and tries again, so no forward is starved (the grouped transformer is not
/// evictable, so the manager itself could free nothing).
#[test]
fn every_out_of_memory_under_contention_is_recovered() {
    let seen = contention_runs(100);
    assert_eq!(seen.starved, 0, "{seen:?}");
}

/// A disk-stored group whose file is removed while the model runs: the next upload that needs it fails with
/// a typed error naming the file (never a panic), and nothing else is lost: every component stays registered on a
/// known device, the card holds only what the placement says, and with the file written back the pipeline runs
/// again.
#[test]
fn a_disk_group_removed_while_the_model_runs_is_a_typed_error_and_nothing_else_is_lost() {
    let dir = std::env::temp_dir().join(format!("zimage-vanishing-store-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let capacity = card_capacity(Setup::Block);
    let card =
        SimCard::new(CardSpec::parse(&capacity.to_string()).unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let mut pipeline = load(OffloadDevice::simulated(card.clone()));
    let options_with_store = group_offload::GroupOptions {
        disk_store: Some(dir.clone()),
        prefetch: false,
        ..group_offload::GroupOptions::default()
    };
    pipeline.enable_group_offload_with("transformer", &options_with_store).unwrap();
    pipeline.enable_auto_offload(0, true).unwrap();
    let reference = values(pipeline.generate(&options(), &mut |_, _| {}).unwrap());

    let files = pipeline.group_offload("transformer").unwrap().disk_files();
    assert!(!files.is_empty(), "the groups are on disk");
    let saved: Vec<(std::path::PathBuf, Vec<u8>)> =
        files.iter().map(|path| (path.clone(), std::fs::read(path).unwrap())).collect();
    for path in &files {
        std::fs::remove_file(path).unwrap();
    }
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pipeline.generate(&options(), &mut |_, _| {})));
    let error = match outcome {
        Err(_) => panic!("a vanished disk group panicked instead of failing typed"),
        Ok(Ok(_)) => panic!("the run succeeded without its groups' files"),
        Ok(Err(error)) => error,
    };
    let message = error.to_string();
    println!("{message}");
    assert!(message.contains(&dir.display().to_string()), "the error names the file: {message}");
    assert!(message.contains("host copy is intact") || message.contains("transfer"), "{message}");
    assert_eq!(pipeline.manager().placement().len(), 3, "every component is still registered");
    check_placement(&pipeline, &card, "after a vanished disk group");

    for (path, bytes) in saved {
        std::fs::write(path, bytes).unwrap();
    }
    let again = values(pipeline.generate(&options(), &mut |_, _| {}).unwrap());
    assert!(max_abs_diff(&again, &reference) <= 1e-6, "the pipeline runs again with the files back");
    std::fs::remove_dir_all(&dir).ok();
}
