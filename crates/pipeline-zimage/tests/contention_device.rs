//! The hard cap's account under contention on a real cubecl runtime (burn's wgpu backend; lavapipe in CI): the
//! prefetch worker and the main thread reserve through one account, and it never holds more than the cap.
//!
//! It runs in a process of its own, on a fresh pool: it places its cap from two caps it finds by bisection on the
//! device, and the pool's page layout, which those caps measure, depends on what ran before in the process. The
//! runtime keeps some pages through `Device::memory_cleanup` (measured on lavapipe: 16,224 B to 81,600 B
//! reserved, nothing in use, after the other real-device tests; 65,376 B after a refused allocation), and after
//! the refused allocation the uncapped run took 3.91 MB of pages instead of 4.68 MB, and the smallest cap a run
//! fitted in moved from 2.06 MB to 2.29–2.64 MB, closer to the full window than a group.
//!
//! Run it with `cargo test -p pipeline-zimage --features wgpu --test contention_device` (Debian:
//! `apt-get install mesa-vulkan-drivers libvulkan1` first).

#![cfg(feature = "wgpu")]

mod common;

use std::sync::Arc;

use common::{load_tiny, max_abs_diff, turbo_options, values};
use group_offload::device::{CappedDevice, PagePolicy, PoolReadings, open_device_with};
use group_offload::{GroupLevel, GroupOptions, OffloadDevice};
use offload_core::{DeviceLedger, DeviceMemory, DeviceName, NoLedger, Reason};

/// The size given as the lavapipe device's total: it reports none, and advertises a heap it does not enforce.
const TOTAL: u64 = 1 << 30;

fn readings(device: &burn::tensor::Device, name: &DeviceName) -> Arc<PoolReadings> {
    PoolReadings::open(device.clone(), name.clone(), Some(TOTAL)).expect("the wgpu device has a memory pool")
}

fn placement(
    device: &burn::tensor::Device,
    name: &DeviceName,
    ledger: Arc<dyn DeviceLedger>,
    memory: Arc<dyn DeviceMemory>,
) -> OffloadDevice {
    OffloadDevice::on_device(device.clone(), name.clone(), ledger, Some(memory))
}

/// The device account under contention: a hard cap over the device, the transformer under block-level group
/// offload with prefetch depth 2 (the worker thread uploads the next two groups while the main thread takes its
/// group and reserves its call's activations), releasable whole as the `auto` plan's routes are.
///
/// The cap is placed by construction where the two threads must meet. The image is 32×32, so the VAE's decode
/// needs less than the transformer's streaming window and the denoising phase is the one the cap binds (at 64×64
/// the decode needs more than the full window, so every cap a run fits in holds the whole window and the worker
/// is never refused). Two caps are found on the device, each bisected to a sixteenth of a group: `fits`, the
/// smallest a run ends with its image in (the resident part, one group and the call's activations), and `ring`,
/// the smallest a run ends in without one refused prefetch (the full window of `1 + depth` groups). They must be
/// at least a group apart, and the test's cap is half-way: half a group or more from either edge, far beyond the
/// few pages a run's layout varies by. 100 runs: the account never holds more than the cap, the worker is refused
/// in every run (the main thread holds what the full window needs), every out-of-memory is retried or re-taken
/// (each run ends with its image, none starved by the worker), and the image is the uncapped run's.
#[test]
fn a_hard_cap_with_block_prefetch_depth_2_holds_under_contention_for_100_runs() {
    let name = DeviceName::parse("wgpu").expect("a device name");
    // Exclusive pages: the pool's pages follow the allocations, so the cap is on what the threads allocate.
    let device = open_device_with(&name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (the real-device suite needs a Vulkan driver)"));
    let (mut opts, _) = turbo_options();
    opts.steps = 2;
    opts.height = 32;
    opts.width = 32;
    opts.latents = None;
    let streamed = GroupOptions {
        level: GroupLevel::Block { blocks_per_group: 1 },
        prefetch_depth: 2,
        releasable: true,
        ..GroupOptions::default()
    };
    // Calibration: the same setup uncapped, its image and the pages it reached.
    let memory = readings(&device, &name);
    let before = memory.observe().expect("a reading").reserved;
    // One device object for the whole test: every capped run lays its cap over it (`with_account`), so every run
    // uploads on the same thread, the same stream's pools, as one process on one device does.
    let base = placement(&device, &name, Arc::new(NoLedger), memory.clone());
    let mut pipeline = load_tiny(base.clone());
    pipeline.enable_group_offload_with("transformer", &streamed).expect("group offload");
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    let reference = values(pipeline.generate(&opts, &mut |_, _| {}).expect("uncapped"));
    let uncapped = memory.reserved_peak().saturating_sub(before);
    // A `GroupOffload` is a handle on the engine and its device tensors: it is dropped here, with the pipeline,
    // or its resident part and prefetched groups would stay on the device beside every capped run.
    let group = pipeline.group_offload("transformer").expect("grouped").largest_streamed_group();
    drop(pipeline);
    base.memory_cleanup();

    /// One run under a hard cap of `capacity` bytes: its outcome, the account's high-water, its `oom_retry` moves
    /// and the transformer's refused prefetches.
    struct Capped {
        outcome: pipeline_zimage::Result<Vec<f32>>,
        held: u64,
        retries: usize,
        refused_prefetches: u64,
        /// The offload record of a run that failed, to say where the room ran out.
        record: Option<String>,
    }
    let capped = |capacity: u64| {
        let cap = CappedDevice::new(readings(&device, &name), capacity, true, "cap");
        let mut pipeline = load_tiny(base.with_account(cap.clone(), Some(cap.clone())));
        pipeline.enable_group_offload_with("transformer", &streamed).expect("group offload");
        pipeline.enable_auto_offload(0, true).expect("auto offload under the cap");
        let outcome = pipeline.generate(&opts, &mut |_, _| {}).map(values);
        if let Err(error) = &outcome
            && !matches!(error, pipeline_zimage::Error::Offload(offload_core::Error::DoesNotFit { .. }))
        {
            panic!("an untyped failure under a {capacity} B cap: {error:?}\n{}", pipeline.manager().offload_record());
        }
        let record = pipeline.manager().offload_record();
        let retries = record.events().iter().filter(|e| matches!(e.reason, Some(Reason::OomRetry(_)))).count();
        let refused_prefetches = pipeline.group_offload("transformer").map_or(0, |g| g.stats().failed_prefetches);
        // A failed run says what its last call reserved beside what it took, every stream's and its own stream's.
        let record = outcome.is_err().then(|| format!("{record}\nlast call: {:?}", cap.last_call()));
        drop(pipeline);
        base.memory_cleanup();
        Capped { outcome, held: cap.reserved_high_water(), retries, refused_prefetches, record }
    };
    // The smallest cap at which `holds` is true of two runs in a row, between `below` (false) and `above` (true),
    // to a sixteenth of a group: one run's luck with the threads' timing and the pool's pages does not place it.
    let smallest = |mut below: u64, mut above: u64, holds: &dyn Fn(&Capped) -> bool| {
        while above - below > group / 16 {
            let middle = below + (above - below) / 2;
            if holds(&capped(middle)) && holds(&capped(middle)) { above = middle } else { below = middle }
        }
        above
    };
    let uncapped_run = capped(uncapped);
    assert!(uncapped_run.outcome.is_ok(), "the run does not fit in the pages it took uncapped ({uncapped} B)");
    assert_eq!(uncapped_run.refused_prefetches, 0, "a prefetch was refused in the pages the run took uncapped");
    // Half a group fits nothing; the uncapped pages fit everything. The pool's page layout moves between runs
    // (measured: the smallest cap that fits from 2.06 MB to 2.56 MB with the full window at 2.62 MB), so the two
    // caps are found again, up to three times, until the window is a group wider than what a run needs.
    let (mut fits, mut ring) = (0, 0);
    for attempt in 1..=3 {
        // The full window first, then what a run fits in: the runs at the larger caps of the first search are then
        // behind the second as they are behind the 100 runs. Measured on lavapipe: found first, `fits` came out at
        // 2.29 to 2.33 MB in 5 of 14 runs of this test (2.06 to 2.13 MB in the others), and then the half-way cap
        // ended a run with DoesNotFit; found second, 2.08 to 2.11 MB in 4 of 4, each of which passed.
        ring = smallest(group / 2, uncapped, &|run| run.outcome.is_ok() && run.refused_prefetches == 0);
        fits = smallest(group / 2, ring, &|run| run.outcome.is_ok());
        println!(
            "attempt {attempt}: uncapped pages {uncapped} B; the smallest cap that fits {fits} B; the smallest that \
             holds the full window {ring} B; largest streamed group {group} B"
        );
        if ring - fits >= group {
            break;
        }
    }
    assert!(
        ring - fits >= group,
        "the full window ({ring} B) is less than a group ({group} B) above what a run needs ({fits} B): no cap \
         between them makes the threads contend by a clear margin"
    );
    let capacity = fits + (ring - fits) / 2;

    let (mut retries, mut refused_prefetches) = (0usize, 0u64);
    for run in 0..100 {
        let Capped { outcome, held, retries: moves, refused_prefetches: refusals, record } = capped(capacity);
        // Every out-of-memory retried: a refused main-thread upload gives back the idle prefetches and tries again,
        // so the worker never starves the thread that computes and no run ends with `DoesNotFit`.
        let image = outcome.unwrap_or_else(|error| {
            panic!("run {run} under a {capacity} B cap: {error:?}\n{}", record.unwrap_or_default())
        });
        assert_eq!(max_abs_diff(&image, &reference), 0.0, "run {run}: the uncapped run's image");
        assert!(held <= capacity, "run {run}: the account held {held} B of a {capacity} B cap");
        assert!(refusals > 0, "run {run}: the worker was never refused under a {capacity} B cap: no contention");
        retries += moves;
        refused_prefetches += refusals;
    }
    println!("100 runs under a {capacity} B cap: {refused_prefetches} refused prefetches, {retries} oom_retry moves");
}
