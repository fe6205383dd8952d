//! The real-device suite: the tiny checkpoint on a real cubecl runtime, burn's wgpu backend (Vulkan; in CI
//! Mesa's lavapipe driver, which runs on the CPU). What only a device can show: parity against diffusers' goldens,
//! auto offload deciding from the device's own pool readings with no simulated card, block and leaf group
//! offload with prefetch (the pool's high-water within the ring bound, every streamed group's memory returned,
//! resident groups really on the device, every model's prefetches on the device's one upload thread), the decode
//! OOM recovered under a hard cap over the device, a refused allocation typed as a device error with nothing
//! lost, a real out-of-memory of the device (in a child process whose address space is limited) typed as one, and a
//! hung `vulkaninfo` that costs the open its deadline only, and pipelines over two devices (the text encoder on the
//! CPU, or on a second wgpu runtime, the rest on the device) giving the one-device image. The hard cap's account under contention between the prefetch worker and the main thread runs in a
//! process of its own (`contention_device.rs`).
//!
//! Run it with `cargo test -p pipeline-zimage --features wgpu --test real_device` (Debian:
//! `apt-get install mesa-vulkan-drivers libvulkan1` first). The device's pool is one per process, so the tests
//! take turns ([`device`]) and each reads its own readings from a clean pool.

#![cfg(feature = "wgpu")]

mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::Module;
use burn::tensor::{DType, Device, Tensor, TensorData};
use common::{component_bytes as bytes, fixtures, golden, load_tiny, max_abs_diff, tensor4, turbo_options, values};
use group_offload::{GroupLevel, GroupOptions, handle::GroupedModel};
use group_offload::{OffloadDevice, whole::BurnComponent};
use group_offload::{
    config::GroupOffloadConfig, device::CappedDevice, device::PagePolicy, device::PoolReadings,
    device::open_device_with,
};
use offload_core::{Action, ComponentError, DeviceLedger, DeviceMemory, DeviceName, NoLedger, Offloadable, Reason};
use pipeline_zimage::loading::{Checkpoint, LoadOptions};
use pipeline_zimage::pipeline::{DeviceMap, GenerateOptions, ZImagePipeline};
use pipeline_zimage::transformer::ZImageTransformer2DModel;
use pipeline_zimage::vae::AutoencoderKl;

/// The runtime's own small buffers (kernel arguments and metadata) live in the pool too: measured 48 to 1,232
/// bytes in use here beside the tensors; a byte count compared with the pool allows this much.
const RUNTIME_BUFFERS: u64 = 16 * 1024;

/// The size given as the lavapipe device's total: it reports none, and advertises a heap it does not enforce.
const TOTAL: u64 = 1 << 30;

static TURNS: Mutex<()> = Mutex::new(());

/// The wgpu device, its name, and this test's turn on it (held until the test ends), with the pool's cache
/// released so the test starts from what earlier tests left in use (nothing, once their tensors dropped).
fn device() -> (Device, DeviceName, MutexGuard<'static, ()>) {
    let turn = TURNS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let name = DeviceName::parse("wgpu").expect("a device name");
    // Exclusive pages: the pool's pages follow the allocations, so a cap on them (the hard cap's OOM test) is a
    // cap on what the calls allocate, not on cubecl's page sizes.
    let device = open_device_with(&name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (the real-device suite needs a Vulkan driver)"));
    device.memory_cleanup();
    (device, name, turn)
}

fn readings(device: &Device, name: &DeviceName, total: u64) -> Arc<PoolReadings> {
    PoolReadings::open(device.clone(), name.clone(), Some(total)).expect("the wgpu device has a memory pool")
}

/// The one device object of this test process, created at first use, as a program creates its device once: every
/// test lays its own account over it ([`OffloadDevice::with_account`]), so every test uploads on its one upload
/// thread, into one cubecl stream's pools. A device object per test would start each test on a new stream, whose
/// pools size their first pages far above small tensors and shrink toward the requests as it runs, so a test's
/// calibration and its capped run would see different pages.
fn the_device(device: &Device, name: &DeviceName) -> OffloadDevice {
    static DEVICE: std::sync::OnceLock<OffloadDevice> = std::sync::OnceLock::new();
    DEVICE.get_or_init(|| OffloadDevice::on_device(device.clone(), name.clone(), Arc::new(NoLedger), None)).clone()
}

fn placement(
    device: &Device,
    name: &DeviceName,
    ledger: Arc<dyn DeviceLedger>,
    memory: Arc<dyn DeviceMemory>,
) -> OffloadDevice {
    the_device(device, name).with_account(ledger, Some(memory))
}

fn in_use(device: &Device) -> u64 {
    device.memory_pool_usage().expect("pool readings").bytes_in_use
}

/// Everything resident on the device through the manager (never evicted).
fn resident(device: &Device, name: &DeviceName) -> ZImagePipeline {
    let memory = readings(device, name, TOTAL);
    let pipeline = load_tiny(placement(device, name, Arc::new(NoLedger), memory));
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    pipeline
}

#[test]
fn the_tiny_pipeline_matches_diffusers_on_the_real_device() {
    let (device, name, _turn) = device();
    let pipeline = resident(&device, &name);
    let (opts, expected) = turbo_options();
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("generate on wgpu"));
    let error = max_abs_diff(&image, &expected);
    println!("turbo golden on {name}: max abs error {error:.2e}");
    assert!(error <= 1e-3, "max abs error {error}");

    let g = golden("pipeline_t2i_cfg.safetensors");
    let mut cfg = GenerateOptions { steps: 3, guidance: 4.0, ..opts.clone() };
    cfg.negative_prompt = Some("blurry, low quality".into());
    cfg.latents = Some(tensor4(&g, "latents"));
    let image = values(pipeline.generate(&cfg, &mut |_, _| {}).expect("generate with guidance"));
    let error = max_abs_diff(&image, &g["image"].1);
    println!("guidance golden on {name}: max abs error {error:.2e}");
    assert!(error <= 1e-3, "max abs error {error}");

    // Every component went to the device through the manager and is still there, and the pool holds them.
    for (id, placed) in pipeline.manager().placement() {
        assert_eq!(placed, name, "{id}");
    }
    let weights: u64 = pipeline_zimage::pipeline::COMPONENTS.iter().map(|c| bytes(&pipeline, c)).sum();
    assert!(in_use(&device) >= weights, "the pool holds {} for {weights} of weights", in_use(&device));
}

/// Two devices in one pipeline: the text encoder on the host's CPU (flex) with the transformer and the VAE on the
/// wgpu device, each device with its own manager; the prompt embeddings cross to the device at the transformer's
/// boundary. The image is the one-device image, and diffusers', within 1e-3.
#[test]
fn the_text_encoder_on_the_cpu_beside_the_device_gives_the_one_device_image() {
    let (device, name, _turn) = device();
    let (opts, expected) = turbo_options();
    let one = values(resident(&device, &name).generate(&opts, &mut |_, _| {}).expect("one device"));

    let memory = readings(&device, &name, TOTAL);
    let map = DeviceMap::single(placement(&device, &name, Arc::new(NoLedger), memory))
        .with("text_encoder", OffloadDevice::host_only())
        .expect("a component");
    let two = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two devices");
    two.enable_auto_offload(0, true).expect("auto offload");
    let image = values(two.generate(&opts, &mut |_, _| {}).expect("cpu and wgpu"));
    let against_one = max_abs_diff(&image, &one);
    let against_diffusers = max_abs_diff(&image, &expected);
    println!(
        "text encoder on flex, the rest on {name}: {against_one:.2e} from one device, {against_diffusers:.2e} from diffusers"
    );
    assert!(against_one <= 1e-3, "{against_one}");
    assert!(against_diffusers <= 1e-3, "{against_diffusers}");
    // The device's manager holds the transformer and the VAE, both on the device; the text encoder's never moved.
    let on_device = two.manager().placement();
    assert_eq!(on_device.len(), 2, "{on_device:?}");
    assert!(on_device.iter().all(|(id, placed)| !id.starts_with("text_encoder") && *placed == name), "{on_device:?}");
    let elsewhere: Vec<_> = two.managers().skip(1).flat_map(|manager| manager.placement()).collect();
    assert_eq!(elsewhere.len(), 1, "{elsewhere:?}");
    assert!(elsewhere[0].0.starts_with("text_encoder") && elsewhere[0].1.is_cpu(), "{elsewhere:?}");
}

/// A second wgpu runtime beside the device, with its own wgpu device, queue and memory pool: `wgpu:1` where the
/// machine lists a second adapter, else (a CPU with lavapipe, as in CI) a runtime of its own on the one adapter,
/// selected by its kind (burn's `DeviceKind::Cpu`, another runtime than the default's), with exclusive pages.
fn second_runtime() -> (Device, DeviceName) {
    use burn::tensor::DeviceKind;
    use burn::tensor::wgpu::MemoryConfiguration;
    let name = DeviceName::parse("wgpu:1").expect("a device name");
    static SECOND: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    let device = SECOND.get_or_init(|| match open_device_with(&name, PagePolicy::Exclusive) {
        Ok(device) => device,
        Err(error) => {
            println!("{error}; a second runtime on the one adapter instead");
            Device::wgpu_options()
                .device_kind(DeviceKind::Cpu)
                .memory_config(MemoryConfiguration::ExclusivePages)
                .init()
                .unwrap_or_else(|error| panic!("{error} (a second wgpu runtime, on lavapipe's CPU adapter)"))
        }
    });
    (device.clone(), name)
}

/// Two real runtimes in one pipeline: the text encoder on a second wgpu runtime (its own device, queue, pool, upload
/// thread and manager) with the transformer and the VAE on the first; the prompt embeddings cross between the
/// runtimes at the transformer's boundary. The image is the one-device image, and diffusers', within 1e-3; each
/// manager holds its components on its own device, and the second runtime's pool holds the text encoder.
#[test]
fn the_text_encoder_on_a_second_wgpu_runtime_gives_the_one_device_image() {
    let (device, name, _turn) = device();
    let (opts, expected) = turbo_options();
    let one = values(resident(&device, &name).generate(&opts, &mut |_, _| {}).expect("one device"));

    let (second, second_name) = second_runtime();
    assert_ne!(device, second, "two runtimes");
    second.memory_cleanup();
    let before = in_use(&second);
    let first = placement(&device, &name, Arc::new(NoLedger), readings(&device, &name, TOTAL));
    let other = OffloadDevice::pooled(second.clone(), second_name.clone(), readings(&second, &second_name, TOTAL));
    let map = DeviceMap::single(first).with("text_encoder", other).expect("a component");
    let two = ZImagePipeline::load_mapped(fixtures().join("tiny-z-image-turbo"), map, &LoadOptions::new())
        .expect("the tiny checkpoint loads over two runtimes");
    two.enable_auto_offload(0, true).expect("auto offload");
    // What the second runtime's pool holds while the transformer denoises, read at each step.
    let mut held = 0;
    let image = values(
        two.generate(&opts, &mut |_, _| held = held.max(in_use(&second).saturating_sub(before)))
            .expect("two wgpu runtimes"),
    );
    let against_one = max_abs_diff(&image, &one);
    let against_diffusers = max_abs_diff(&image, &expected);
    println!(
        "text encoder on {second_name}, the rest on {name}: {against_one:.2e} from one device, \
         {against_diffusers:.2e} from diffusers"
    );
    assert!(against_one <= 1e-3, "{against_one}");
    assert!(against_diffusers <= 1e-3, "{against_diffusers}");
    // Each component's device object is the one the map gave it, and each device's manager moved its own.
    assert_eq!(two.device_map().placement("text_encoder").name(), &second_name);
    assert_eq!(two.device_map().placement("transformer").name(), &name);
    let managers: Vec<_> = two.managers().collect();
    let [first, other] = managers.as_slice() else { panic!("one manager per device: {}", managers.len()) };
    let onloads = |manager: &offload_core::ComponentsManager| -> Vec<String> {
        let events = manager.offload_record().events();
        events.into_iter().filter(|e| e.action == Action::Onload).map(|e| e.id).collect()
    };
    assert!(onloads(other).iter().all(|id| id.starts_with("text_encoder")), "{:?}", onloads(other));
    assert!(!onloads(other).is_empty(), "the second runtime's manager onloaded the text encoder");
    assert!(onloads(first).iter().all(|id| !id.starts_with("text_encoder")), "{:?}", onloads(first));
    let text_encoder = bytes(&two, "text_encoder");
    println!("{second_name}'s pool held {held} bytes during the steps beside the text encoder's {text_encoder}");
    assert!(held >= text_encoder, "the second runtime's pool holds the text encoder: {held} for {text_encoder}");
}

/// A pipeline loaded for the device but never given auto offload would have run on the host's CPU, with the right
/// image and the device unused: its run is refused with the fix, nothing moved, and it runs on the device once
/// auto offload is on.
#[test]
fn a_run_that_would_compute_on_the_cpu_instead_of_the_device_is_refused() {
    let (device, name, _turn) = device();
    let pipeline = load_tiny(placement(&device, &name, Arc::new(NoLedger), readings(&device, &name, TOTAL)));
    let (opts, expected) = turbo_options();
    let error = pipeline.generate(&opts, &mut |_, _| {}).expect_err("not enabled");
    assert!(error.to_string().contains("has no auto offload, so it would run on the CPU"), "{error}");
    assert!(pipeline.manager().placement().iter().all(|(_, placed)| placed.is_cpu()), "nothing moved");
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("on the device"));
    assert!(max_abs_diff(&image, &expected) <= 1e-3);
    assert!(pipeline.manager().placement().iter().all(|(_, placed)| *placed == name));
}

#[test]
fn one_seed_gives_one_image_on_the_host_and_on_the_device() {
    let (device, name, _turn) = device();
    let (mut opts, _) = turbo_options();
    opts.latents = None;
    opts.seed = 42;
    let on_device = values(resident(&device, &name).generate(&opts, &mut |_, _| {}).expect("wgpu"));
    let on_host = values(load_tiny(OffloadDevice::host_only()).generate(&opts, &mut |_, _| {}).expect("flex"));
    // The noise is drawn on the host from the seed, then moved: only the arithmetic differs.
    let difference = max_abs_diff(&on_device, &on_host);
    println!("seed 42, wgpu against flex: max abs difference {difference:.2e}");
    assert!(difference <= 1e-3, "{difference}");
}

#[test]
fn auto_offload_decides_from_the_devices_own_readings() {
    let (device, name, _turn) = device();
    let baseline = in_use(&device);
    // Load first (on the host) to size the device: the transformer fits, the transformer and the text encoder
    // together do not, so the strategy must evict on the device's own numbers.
    let probe = load_tiny(OffloadDevice::host_only());
    let (te, tr) = (bytes(&probe, "text_encoder"), bytes(&probe, "transformer"));
    drop(probe);
    let total = baseline + tr + te / 2;
    let memory = readings(&device, &name, total);
    // A device object of its own: its link meter then holds this run's onloads alone (the process's one device
    // object, which the other tests share, keeps every test's).
    let on = OffloadDevice::on_device(device.clone(), name.clone(), Arc::new(NoLedger), Some(memory.clone()));
    let pipeline = load_tiny(on);
    pipeline.enable_auto_offload(0, true).expect("auto offload on real readings");
    let (opts, expected) = turbo_options();
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("generate"));
    assert!(max_abs_diff(&image, &expected) <= 1e-3);

    let record = pipeline.manager().offload_record();
    println!("{record}");
    let events = record.events();
    let first = events.iter().find(|e| e.action == Action::Onload).expect("an onload");
    assert_eq!(first.id, pipeline.text_encoder().id());
    // Before the first onload nothing of the run was on the device: the column is the pool's own figure.
    assert_eq!(first.available, Some(total - baseline), "{record}");
    let evicted = events
        .iter()
        .find(|e| e.action == Action::Offload && e.id == pipeline.text_encoder().id())
        .expect("the text encoder is evicted for the transformer");
    assert!(matches!(&evicted.reason, Some(Reason::ReleaseMemoryFor(id)) if *id == pipeline.transformer().id()));
    // The eviction's reading was taken with the text encoder on the device: the pool held at least its weights.
    assert!(evicted.available.expect("a reading") <= total - baseline - te, "{record}");
    assert!(evicted.peak.expect("a reading") >= baseline + te, "{record}");
    assert!(memory.peak() >= baseline + tr, "the transformer was on the device: peak {}", memory.peak());
    // Every whole onload was timed on the device's link meter, once, with the bytes the record shows.
    let onloads: Vec<_> = events.iter().filter(|e| e.action == Action::Onload).collect();
    let link = pipeline.placement().link_rate().expect("the onloads were timed");
    assert_eq!(link.uploads, onloads.len(), "{link}\n{record}");
    assert_eq!(link.bytes, onloads.iter().map(|e| e.bytes).sum::<u64>(), "{link}");
    assert!(link.p10 > 0.0 && link.p10 <= link.median, "{link}");
}

/// The transformer alone, its golden inputs on `device`.
/// The bytes of `offload`'s groups on the device now, by its own account.
fn bytes_on_device(offload: &group_offload::parts::GroupOffload) -> u64 {
    let on_device = offload.on_device();
    offload.groups().into_iter().filter(|(id, _)| on_device.contains(id)).map(|(_, bytes)| bytes).sum()
}

fn transformer_and_inputs(device: &Device) -> (ZImageTransformer2DModel, Vec<Tensor<4>>, Tensor<1>, Vec<Tensor<2>>) {
    let checkpoint = Checkpoint::open(fixtures().join("tiny-z-image-turbo")).expect("the tiny checkpoint");
    let (model, _) = checkpoint.load_transformer(&Device::flex(), &LoadOptions::new()).expect("the transformer");
    let g = golden("transformer.safetensors");
    let x = Tensor::<4>::from_data(TensorData::new(g["x"].1.clone(), g["x"].0.clone()), (device, DType::F32));
    let t = Tensor::<1>::from_data(TensorData::new(g["t"].1.clone(), g["t"].0.clone()), (device, DType::F32));
    let cap = Tensor::<2>::from_data(
        TensorData::new(g["cap_feats"].1.clone(), g["cap_feats"].0.clone()),
        (device, DType::F32),
    );
    (model, vec![x], t, vec![cap])
}

#[test]
fn group_offload_streams_within_the_ring_bound_and_returns_every_groups_memory() {
    let (device, name, _turn) = device();
    let memory = readings(&device, &name, TOTAL);

    // The activation term of the bound, measured: the pages a resident forward adds to the pool above its weights
    // and inputs (exclusive pages follow the allocations, and only grow during the forward: an upper bound of
    // its activations' high-water, where a sampled reading is a lower one).
    let (model, xs, t, caps) = transformer_and_inputs(&device);
    let resident_model = model.clone().to_device(&device);
    let _ = values(resident_model.forward_items(xs.clone(), t.clone(), caps.clone()).remove(0));
    device.memory_cleanup();
    let before = memory.observe().expect("a reading").reserved;
    let reference = values(resident_model.forward_items(xs.clone(), t.clone(), caps.clone()).remove(0));
    let activations = memory.observe().expect("a reading").reserved - before;
    drop(resident_model);
    device.memory_cleanup();

    // Block level stages every streamed group's host copy through the device's staging (pinned where the runtime
    // page-locks it); leaf level streams from pageable memory.
    for (level, depth, pinned_budget) in
        [(GroupLevel::Block { blocks_per_group: 1 }, 2, u64::MAX), (GroupLevel::Leaf, 2, 0)]
    {
        let options =
            GroupOptions { level, prefetch: true, prefetch_depth: depth, pinned_budget, ..GroupOptions::default() };
        let on = the_device(&device, &name).with_account(Arc::new(NoLedger), Some(memory.clone()));
        let config = GroupOffloadConfig::new("transformer", on);
        let mut grouped =
            GroupedModel::<ZImageTransformer2DModel>::new(model.clone(), config, &options).expect("group offload");
        let offload = grouped.offload().clone();
        let inputs = in_use(&device);

        // Resident groups are uploaded and synced by the onload: the pool holds exactly their bytes.
        grouped.onload(&name).expect("onload of the resident parts");
        let resident = offload.resident_bytes();
        let resident_ids = offload.on_device();
        let held = in_use(&device) - inputs;
        assert!(
            (resident..=resident + RUNTIME_BUFFERS).contains(&held),
            "{level:?}: the pool holds {held} B for {resident} B of resident groups"
        );

        let mut outputs = Vec::new();
        let mut peaks = Vec::new();
        for _ in 0..3 {
            memory.reset_peak().expect("a reading");
            let out = grouped
                .run(0, |model, _| model.forward_items(xs.clone(), t.clone(), caps.clone()))
                .expect("a forward under group offload");
            peaks.push(memory.peak() - inputs);
            outputs.push(values(out[0].clone()));
        }
        for out in &outputs {
            assert!(max_abs_diff(out, &reference) <= 1e-6, "{level:?}: the same output as resident");
        }
        let stats = offload.stats();
        assert!(stats.prefetch_hits > 0, "{level:?}: {stats:?}");
        assert_eq!((stats.misses, stats.stray_loads), (0, 0), "{level:?}: {stats:?}");

        // The ring bound, on the pool's in-use high-water (sampled: a lower bound of the pool's, so a spike
        // shorter than a sampling interval could pass unseen) after the capture pass.
        let largest = offload
            .groups()
            .into_iter()
            .filter(|(id, _)| !resident_ids.contains(id))
            .map(|(_, bytes)| bytes)
            .max()
            .unwrap_or(0);
        let bound = resident + (depth as u64 + 1) * largest + activations;
        println!(
            "{level:?} depth {depth}: pool high-water {:?} above the inputs; bound {bound} = resident {resident} + \
             {} x largest streamed group {largest} + activations {activations}",
            peaks,
            depth + 1
        );
        for peak in &peaks[1..] {
            assert!(*peak <= bound, "{level:?}: high-water {peak} above the ring bound {bound}");
        }

        // After a forward only the resident groups and the next forward's prefetched groups are on the device.
        offload.wait_idle();
        let on_device = bytes_on_device(&offload);
        let held = in_use(&device) - inputs;
        assert!(
            (on_device..=on_device + RUNTIME_BUFFERS).contains(&held),
            "{level:?}: the pool holds {held} B, the offloader reports {on_device} B on the device"
        );
        // Offloading the model returns every byte it took.
        Offloadable::offload(&mut grouped).expect("offload");
        assert!(in_use(&device) <= inputs + RUNTIME_BUFFERS, "{level:?}: every group's memory is back");
        let (pinned, locked) = offload.pinned_bytes();
        let streamed = offload.total_bytes() - resident;
        println!("{level:?}: {pinned} B of host copies staged for pinning, of which {locked} B page-locked");
        assert_eq!(pinned, if pinned_budget > 0 { streamed } else { 0 }, "{level:?}");
        assert!(locked <= pinned);
    }
}

/// Two streamed models on one device prefetch on the device's one upload thread (one stream, whose page sizes
/// follow every group it uploaded, where a thread per model started a new stream each time: `docs/devices.md`),
/// and a model dropped with prefetches queued or in flight leaves none of its groups on the device.
#[test]
fn models_on_one_device_prefetch_on_its_one_upload_thread_and_a_dropped_one_leaves_nothing() {
    use offload_core::Timeline;
    use offload_core::timeline::{ArgValue, EventKind, category};

    let (device, name, _turn) = device();
    let (model, xs, t, caps) = transformer_and_inputs(&device);
    let inputs = in_use(&device);
    let timeline = Timeline::enabled();
    let options = GroupOptions {
        level: GroupLevel::Block { blocks_per_group: 1 },
        prefetch: true,
        prefetch_depth: 2,
        ..GroupOptions::default()
    };
    // Both models on one device object: its one upload thread.
    let on = the_device(&device, &name);
    let grouped = |id: &str| {
        let config = GroupOffloadConfig::new(id, on.clone()).with_timeline(timeline.clone());
        GroupedModel::<ZImageTransformer2DModel>::new(model.clone(), config, &options).expect("group offload")
    };
    let (mut first, mut second) = (grouped("first"), grouped("second"));
    for _ in 0..2 {
        for grouped in [&mut first, &mut second] {
            let out = grouped
                .run(0, |model, _| model.forward_items(xs.clone(), t.clone(), caps.clone()))
                .expect("a forward under group offload");
            let _ = values(out[0].clone());
        }
    }
    second.offload().wait_idle();
    let prefetches: Vec<_> = timeline
        .events()
        .into_iter()
        .filter(|e| e.category == category::UPLOAD && matches!(e.kind, EventKind::Span { .. }))
        .filter(|e| matches!(e.arg("reason"), Some(ArgValue::Text(reason)) if reason == &Reason::Prefetch.to_string()))
        .collect();
    let threads: std::collections::BTreeSet<_> = prefetches.iter().map(|e| e.thread).collect();
    assert!(prefetches.len() >= 2, "both models prefetched: {} prefetch spans", prefetches.len());
    assert_eq!(threads.len(), 1, "every prefetch on one thread: {threads:?}");
    let thread = *threads.first().expect("a thread");
    let thread_name = timeline.threads().into_iter().find(|t| t.tid == thread).expect("a named thread").name;
    assert_eq!(thread_name, format!("group-offload-uploads-{name}"));
    for grouped in [&first, &second] {
        assert!(grouped.offload().stats().prefetch_hits > 0, "{:?}", grouped.offload().stats());
    }

    // A forward leaves the next forward's first groups prefetched (queued or in flight); dropping the model then
    // waits for the one in flight and skips the rest, and nothing of it stays on the device.
    let out = first
        .run(0, |model, _| model.forward_items(xs.clone(), t.clone(), caps.clone()))
        .expect("a forward under group offload");
    let _ = values(out[0].clone());
    drop(out);
    drop(first);
    second.offload().wait_idle();
    let second_on_device = bytes_on_device(second.offload());
    let held = in_use(&device) - inputs;
    assert!(
        (second_on_device..=second_on_device + RUNTIME_BUFFERS).contains(&held),
        "the pool holds {held} B with the first model dropped; the second reports {second_on_device} B"
    );
    Offloadable::offload(&mut second).expect("offload");
    assert!(in_use(&device) <= inputs + RUNTIME_BUFFERS, "every group's memory is back");
}

#[test]
fn the_pipeline_streams_both_encoders_on_the_device_and_gives_the_resident_image() {
    let (device, name, _turn) = device();
    let (opts, _) = turbo_options();
    let reference = values(resident(&device, &name).generate(&opts, &mut |_, _| {}).expect("resident"));
    device.memory_cleanup();
    let memory = readings(&device, &name, TOTAL);
    let mut pipeline = load_tiny(placement(&device, &name, Arc::new(NoLedger), memory.clone()));
    let block = GroupOptions { prefetch_depth: 2, ..GroupOptions::default() };
    let leaf = GroupOptions { prefetch_depth: 2, ..GroupOptions::leaf() };
    for (component, options) in [("transformer", &block), ("text_encoder", &leaf)] {
        pipeline.enable_group_offload_with(component, options).expect("group offload");
    }
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("generate"));
    assert!(max_abs_diff(&image, &reference) <= 1e-6, "{}", max_abs_diff(&image, &reference));
    let stats = pipeline.group_stats("transformer").expect("grouped");
    assert!(stats.prefetch_hits > 0 && stats.misses == 0, "{stats:?}");
    // Each prefetch was recorded with the device's reading.
    let record = pipeline.manager().offload_record();
    let prefetch = record.events().into_iter().find(|e| e.reason == Some(Reason::Prefetch));
    assert!(prefetch.and_then(|e| e.available).is_some(), "{record}");
}

#[test]
fn the_decode_oom_recovers_under_a_hard_cap_over_the_real_device() {
    let (device, name, _turn) = device();
    let (opts, _) = turbo_options();
    // Calibration on the uncapped device: the image, and the pages the decode adds to the pool with every
    // component resident (exclusive pages follow the allocations, and are the same for the same calls).
    let memory = readings(&device, &name, TOTAL);
    // One device object for the test: the capped run lays its cap over it (`with_account`) and uploads on the same
    // thread, into the same stream's pools, as the calibration.
    let base = placement(&device, &name, Arc::new(NoLedger), memory.clone());
    let pipeline = load_tiny(base.clone());
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    let reference = values(pipeline.generate(&opts, &mut |_, _| {}).expect("resident"));
    device.memory_cleanup();
    let before = memory.observe().expect("a reading").reserved;
    let _ = values(pipeline.decode(opts.latents.clone().expect("the golden latents")).expect("decode"));
    let decode = memory.observe().expect("a reading").reserved - before;
    let te = bytes(&pipeline, "text_encoder");
    let tr = bytes(&pipeline, "transformer");
    println!("pool pages with every component resident: {before} B; the decode adds {decode} B");
    assert!(te < decode / 2 && decode / 2 < te + tr, "the decode fits once the transformer left, not before");
    drop(pipeline);
    device.memory_cleanup();

    // The cap holds every component and the denoising, but not the decode beside them: the decode fails once
    // it has run, the manager evicts the text encoder (still too little room), then the transformer, and the
    // third decode fits.
    let capacity = before + decode / 2;
    let cap = CappedDevice::new(readings(&device, &name, TOTAL), capacity, true, "cap");
    let pipeline = load_tiny(base.with_account(cap.clone(), Some(cap.clone())));
    pipeline.enable_auto_offload(0, true).expect("auto offload under the cap");
    let generated = pipeline.generate(&opts, &mut |_, _| {});
    let record = pipeline.manager().offload_record();
    println!("{record}");
    let image = values(generated.expect("the OOM retry recovers"));
    assert_eq!(max_abs_diff(&image, &reference), 0.0, "the same image as the uncapped run");
    let vae = pipeline.vae().id().to_string();
    let retries: Vec<(String, String)> = record
        .events()
        .into_iter()
        .filter_map(|e| match e.reason {
            Some(Reason::OomRetry(id)) => Some((e.id, id)),
            _ => None,
        })
        .collect();
    let expected =
        [(pipeline.text_encoder().id().to_string(), vae.clone()), (pipeline.transformer().id().to_string(), vae)];
    assert_eq!(retries, expected, "{record}");
}

#[test]
fn a_refused_allocation_is_a_typed_device_error_and_nothing_is_lost() {
    let (device, name, _turn) = device();
    let memory = readings(&device, &name, TOTAL);
    let pipeline = load_tiny(placement(&device, &name, Arc::new(NoLedger), memory.clone()));
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    let vae = pipeline.vae().id().to_string();
    // A buffer larger than the device can ever give: the runtime refuses it when it is read, not when asked.
    let error = pipeline
        .manager()
        .run(&vae, |c: &mut BurnComponent<AutoencoderKl>| {
            c.run(0, |_, device| {
                Ok::<_, ComponentError>(Tensor::<1>::zeros([1usize << 34], (device, DType::F32)) + 1.0)
            })
        })
        .expect_err("the allocation is refused");
    println!("{error}");
    match &error {
        offload_core::Error::Component { source: ComponentError::Device { device, .. }, .. } => {
            assert_eq!(device, &name)
        }
        other => panic!("expected a typed device error, got {other:?}"),
    }
    let record = pipeline.manager().offload_record();
    assert!(!record.events().iter().any(|e| matches!(e.reason, Some(Reason::OomRetry(_)))), "not an OOM: {record}");
    // Nothing was lost: every component is registered on a known device and the pipeline still matches diffusers.
    assert_eq!(pipeline.manager().placement().len(), 3);
    let (opts, expected) = turbo_options();
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("the pipeline still runs"));
    assert!(max_abs_diff(&image, &expected) <= 1e-3);
}

/// Runs `pipeline-zimage generate` on wgpu (auto offload, 2 steps at 64x64; no device size given: the adapter's
/// largest device-local Vulkan heap; no reserve given: the workload's largest activation estimate) with `extra`
/// arguments and `env`, writing into `dir`: whether it succeeded, its stdout and its stderr.
fn generate_cli(dir: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = dir.join("fox.png");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_pipeline-zimage"));
    command
        .args(["generate", "--device", "wgpu", "--offload", "auto"])
        .args(["--height", "64", "--width", "64", "--steps", "2", "--max-sequence-length", "32"])
        .args(extra)
        .arg("--out")
        .arg(&out)
        // Profiles and link figures stay in the test's directory, not the user's data directory.
        .env("OFFLOAD_PROFILE_DIR", dir.join("profiles"))
        .envs(env.iter().copied());
    let run = command.output().expect("the CLI runs");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (run.status.success() && out.exists(), text(&run.stdout), text(&run.stderr))
}

#[test]
fn the_cli_runs_auto_offload_on_the_device_with_no_card_and_names_a_missing_driver() {
    let dir = std::env::temp_dir().join(format!("real-device-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    // No flag at all: the total is the adapter's device-local heap, and the reserve the workload's largest
    // activation estimate; the run fits.
    let (ok, stdout, stderr) = generate_cli(&dir, &[], &[]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("device memory on wgpu:0 (burn's pool)"), "{stdout}");
    assert!(stdout.contains("(the device's largest device-local Vulkan heap)"), "the total's source: {stdout}");
    // Lavapipe offers no VK_EXT_memory_budget (or vulkaninfo is not installed): the line says which.
    assert!(stdout.contains("no heap budget read: "), "{stdout}");
    // --device-memory overrides the heap.
    let (ok, stdout, stderr) = generate_cli(&dir, &["--device-memory", "1GiB"], &[]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("of 1.00 GB (given by --device-memory)"), "the total's source is named: {stdout}");
    assert!(stdout.contains("reserve: ") && stdout.contains("the workload's largest activation estimate"), "{stdout}");
    assert!(stdout.contains("| Onload "), "the record is printed: {stdout}");
    assert!(stdout.contains("link to wgpu:0: "), "the moves' measured link rate is printed: {stdout}");

    // The planner's link speed: assumed before any run measured this device, then the runs' measured median.
    let fresh = dir.join("planned");
    let planned = ["--preset", "auto", "--profile-dir", fresh.to_str().expect("a UTF-8 path")];
    let (ok, first, stderr) = generate_cli(&dir, &planned, &[]);
    assert!(ok, "{first}\n{stderr}");
    assert!(first.contains("pageable (assumed, not measured"), "{first}");
    assert!(first.contains("link figures for later plans on wgpu:0: pageable "), "{first}");
    let (ok, second, stderr) = generate_cli(&dir, &planned, &[]);
    assert!(ok, "{second}\n{stderr}");
    assert!(second.contains("pageable (measured: one run's median"), "{second}");

    // A hard cap over the device: the decode runs out of memory under it and the OOM retry makes room.
    let (ok, stdout, stderr) = generate_cli(&dir, &["--card", "6MB", "--reserve", "0"], &[]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("oom_retry:vae"), "{stdout}");
    assert!(stdout.contains("capped at 6MB (hard)"), "{stdout}");

    // A dtype the device cannot compute in is refused with the fix.
    let (ok, _, stderr) = generate_cli(&dir, &["--dtype", "bf16"], &[]);
    assert!(!ok);
    assert!(stderr.contains("cannot compute in BF16") && stderr.contains("--dtype f32"), "{stderr}");

    // A second real device named on the command line is opened before the weights load. This machine's adapters
    // decide which way: one (lavapipe, as in CI) and `wgpu:1` names none, a typed error that says so before
    // anything loads (no line starting `loaded_line` is printed); two and the run goes on, its output returned.
    let adapters = Device::enumerate(burn::tensor::DeviceType::Wgpu).len();
    let on_a_second_adapter = |extra: &[&str], loaded_line: &str| {
        let (ok, stdout, stderr) = generate_cli(&dir, extra, &[]);
        if adapters < 2 {
            assert!(!ok, "{stdout}");
            assert!(stderr.contains(&format!("this machine lists {adapters} wgpu adapter(s)")), "{stderr}");
            assert!(!stdout.contains(loaded_line), "refused before the weights load: {stdout}");
            return None;
        }
        assert!(ok, "{stdout}\n{stderr}");
        Some(stdout)
    };
    // In the map: the text encoder runs there.
    if let Some(stdout) = on_a_second_adapter(&["--device-map", "text_encoder=wgpu:1"], "device map: ") {
        assert!(stdout.contains("device map: text_encoder runs on wgpu:1"), "{stdout}");
        assert!(stdout.contains("device memory on wgpu:1 (burn's pool)"), "{stdout}");
    }
    // As a donor of the planned components' streamed groups, its copies' rate timed before the weights load.
    if let Some(stdout) = on_a_second_adapter(&["--preset", "auto", "--donor", "wgpu:1"], "donor: ") {
        assert!(stdout.contains("donor: wgpu:1 (") && stdout.contains("from wgpu:1 onto wgpu:0"), "{stdout}");
    }

    // No Vulkan driver and no EGL one: the runtime finds no adapter, and the error names the package.
    let hidden = [("VK_ICD_FILENAMES", "/nonexistent"), ("__EGL_VENDOR_LIBRARY_FILENAMES", "/nonexistent")];
    let (ok, _, stderr) = generate_cli(&dir, &[], &hidden);
    assert!(!ok);
    assert!(stderr.contains("mesa-vulkan-drivers"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Where the driver offers `VK_EXT_memory_budget`, the device's total is its heap's budget when it opened, read from
/// `vulkaninfo`. Lavapipe offers none, so a stand-in `vulkaninfo` first on `PATH` prints the report a driver with
/// the extension gives (lavapipe's ids, its 2 GiB heap, a 1 GiB budget: another process holds the rest); the
/// device, its runtime and the run are real.
#[test]
fn the_heaps_budget_is_the_total_where_the_driver_offers_it() {
    let dir = std::env::temp_dir().join(format!("real-device-budget-{}", std::process::id()));
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("a temporary directory");
    let report = "GPU0:\nVkPhysicalDeviceProperties:\n\tvendorID          = 0x10005\n\tdeviceID          = 0x0000\n\
                  \tdeviceName        = llvmpipe\nVkPhysicalDeviceMemoryProperties:\nmemoryHeaps: count = 1\n\
                  \tmemoryHeaps[0]:\n\t\tsize   = 2147483648 (0x80000000) (2.00 GiB)\n\
                  \t\tbudget = 1073741824 (0x40000000) (1.00 GiB)\n\t\tusage  = 0 (0x00000000) (0.00 B)\n\
                  \t\tflags: count = 1\n\t\t\tMEMORY_HEAP_DEVICE_LOCAL_BIT\n";
    let script = bin.join("vulkaninfo");
    std::fs::write(&script, format!("#!/bin/sh\nprintf '%b' '{}'\n", report.replace('\n', "\\n").replace('\t', "\\t")))
        .expect("the stand-in");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("an executable stand-in");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let (ok, stdout, stderr) = generate_cli(&dir, &[], &[("PATH", path.as_str())]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("of 1.00 GB (the budget of the device's largest device-local Vulkan heap at open)"),
        "the total is the budget: {stdout}"
    );
    assert!(!stdout.contains("no heap budget read"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A `vulkaninfo` that hangs (a wedged driver) cannot hang the device's open: a stand-in first on `PATH` sleeps for a
/// minute, the open stops it after [`group_offload::vulkaninfo::TIMEOUT`] and goes on with the heap as the total,
/// and the CLI says why no budget was read.
#[test]
fn a_hung_vulkaninfo_costs_the_open_its_deadline_and_is_named() {
    let dir = std::env::temp_dir().join(format!("real-device-hung-{}", std::process::id()));
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("a temporary directory");
    let script = bin.join("vulkaninfo");
    std::fs::write(&script, "#!/bin/sh\nexec sleep 60\n").expect("the stand-in");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("an executable stand-in");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let started = std::time::Instant::now();
    let (ok, stdout, stderr) = generate_cli(&dir, &[], &[("PATH", path.as_str())]);
    let took = started.elapsed();
    assert!(ok, "{stdout}\n{stderr}");
    assert!(took < std::time::Duration::from_secs(50), "the run waited for the hung vulkaninfo: {took:?}");
    assert!(
        stdout.contains(
            "no heap budget read: vulkaninfo did not answer within 5 s and was stopped (a hung Vulkan driver? \
             `vulkaninfo --summary` shows whether it answers)"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("(the device's largest device-local Vulkan heap)"), "the heap is the total: {stdout}");
    println!("the run with a hung vulkaninfo took {took:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Every exit leaves the device cleanly: the typed error of a run that cannot start once the device is open (a
/// `--reserve` larger than the device) exits with code 1, never a signal, 20 times in a row while another
/// thread loads the CPU; a successful run exits 0.
#[test]
fn the_cli_exits_with_a_code_and_never_a_signal() {
    use std::os::unix::process::ExitStatusExt;
    let dir = std::env::temp_dir().join(format!("real-device-exit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    // Load beside the runs: a busy loop on another thread of this process.
    let busy = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spinner = {
        let busy = busy.clone();
        std::thread::spawn(move || {
            let mut x = 0u64;
            while busy.load(std::sync::atomic::Ordering::Relaxed) {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            x
        })
    };
    for run in 0..20 {
        let out = dir.join("fox.png");
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_pipeline-zimage"))
            .args(["generate", "--device", "wgpu", "--device-memory", "1GiB", "--offload", "auto", "--reserve", "2GiB"])
            .args(["--height", "64", "--width", "64"])
            .args(["--steps", "1", "--max-sequence-length", "32", "--out"])
            .arg(&out)
            .output()
            .expect("the CLI runs");
        let stderr = String::from_utf8_lossy(&status.stderr);
        assert_eq!(status.status.signal(), None, "run {run} died of a signal: {stderr}");
        assert_eq!(status.status.code(), Some(1), "run {run}: {stderr}");
        assert!(stderr.contains("reserve"), "run {run}: {stderr}");
    }
    busy.store(false, std::sync::atomic::Ordering::Relaxed);
    let _ = spinner.join();
    let (ok, stdout, stderr) = generate_cli(&dir, &[], &[]);
    assert!(ok, "{stdout}\n{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Set in the child process [`a_real_wgpu_out_of_memory_is_typed_out_of_memory`] starts.
const OUT_OF_MEMORY_CHILD: &str = "REAL_DEVICE_OUT_OF_MEMORY_CHILD";

/// A real out-of-memory on the default wgpu build is `ComponentError::OutOfMemory`, the one the manager's OOM retry
/// handles. Lavapipe does not enforce its 2 GiB heap (the host's memory backs the device), so the test runs itself
/// again as a child process whose address space is limited once the device is open (`prlimit --as`, at what the
/// child maps then plus 512 MiB), and there allocates 64 MiB tensors through `run_call` until one fails. What the
/// runtime does (measured): lavapipe fails the allocation, wgpu reports `Out of Memory` to cubecl's handler, which
/// panics on its runner thread in a task nobody waits for, and the read of the output then says its memory "was
/// never initialized"; the runner's panic is the one trace of why, recorded by the library's panic hook.
#[test]
fn a_real_wgpu_out_of_memory_is_typed_out_of_memory() {
    if std::env::var_os(OUT_OF_MEMORY_CHILD).is_some() {
        return out_of_memory_child();
    }
    let child = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "a_real_wgpu_out_of_memory_is_typed_out_of_memory", "--nocapture", "--test-threads=1"])
        .env(OUT_OF_MEMORY_CHILD, "1")
        // Fewer malloc arenas: each reserves 64 MiB of address space, which the limit would otherwise go to.
        .env("MALLOC_ARENA_MAX", "2")
        .output()
        .expect("the test binary runs again");
    let (stdout, stderr) = (String::from_utf8_lossy(&child.stdout), String::from_utf8_lossy(&child.stderr));
    println!("{stdout}");
    assert!(child.status.success(), "the child failed: {stdout}\n{stderr}");
    assert!(stderr.contains("wgpu error: Out of Memory"), "the runner's panic is the runtime's: {stderr}");
    let typed = stdout.lines().find(|line| line.starts_with("typed: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(typed.starts_with("typed: OutOfMemory { device: DeviceName(\"wgpu:0\")"), "{typed}");
    assert!(stdout.contains("the device computes again once the limit is lifted"), "{stdout}");
}

/// The child's part: limits its own address space, allocates until the device fails, prints the typed error.
fn out_of_memory_child() {
    let (device, name, _turn) = device();
    let memory = readings(&device, &name, TOTAL);
    // The runtime's kernels compiled and its threads started before the limit, so that the limit meets the device.
    let warm = Tensor::<1>::ones([1024], &device) * 2.0;
    warm.into_data();
    let status = std::fs::read_to_string("/proc/self/status").expect("the process's status");
    let mapped_kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmSize:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .expect("VmSize in /proc/self/status");
    let limit = mapped_kib * 1024 + (512 << 20);
    let pid = std::process::id().to_string();
    let limited = std::process::Command::new("prlimit")
        .args(["--pid", pid.as_str(), &format!("--as={limit}:")])
        .status()
        .expect("prlimit runs (util-linux)");
    assert!(limited.success(), "prlimit could not limit the address space");
    let mut kept = Vec::new();
    let mut typed = None;
    let on = the_device(&device, &name).with_account(Arc::new(NoLedger), Some(memory.clone()));
    for _ in 0..32 {
        let run = group_offload::device::run_call(&on, &device, 0, || {
            Ok::<_, ComponentError>(Tensor::<1>::zeros([16usize << 20], (&device, DType::F32)) + 1.0)
        });
        match run {
            Ok(tensor) => kept.push(tensor),
            Err(error) => {
                typed = Some(error);
                break;
            }
        }
    }
    println!("{} allocations of 64 MiB held", kept.len());
    println!("typed: {:?}", typed.expect("an allocation failed under the limit"));
    let lifted = std::process::Command::new("prlimit").args(["--pid", pid.as_str(), "--as=unlimited:"]).status();
    assert!(lifted.is_ok_and(|status| status.success()), "prlimit could not lift the limit");
    drop(kept);
    device.memory_cleanup();
    let again = group_offload::device::run_call(&on, &device, 0, || {
        Ok::<_, ComponentError>(Tensor::<1>::ones([4], &device) * 2.0)
    });
    assert!(again.is_ok(), "{again:?}");
    println!("the device computes again once the limit is lifted");
}
