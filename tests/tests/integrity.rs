//! Weight integrity under random operations: 10,000 onloads, offloads, runs, removals and additions of
//! components in a `ComponentsManager`, and takes of groups of a `GroupOffload` with prefetch on, from four
//! threads on a hard simulated card, with failed uploads and failed offloads injected between operations.
//!
//! Every component's and group's weights are checksummed first: the host copy of each plain component and of
//! each group, and, whenever something is on the device, its device copy. The checksums never change: a failed
//! upload leaves the host copy as it was, a failed offload leaves the component on the device with both copies
//! intact, and every device copy a run or a guard sees equals the host copy it came from. At the end, with
//! everything offloaded, the card holds nothing: no operation leaked device memory. A deadlock fails the test
//! after a timeout instead of hanging it.

#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor};
use group_offload::{
    OffloadDevice, component::GroupOffloadedModel, config::GroupOffloadConfig, parts::BlockOffload,
    parts::GroupOffload, parts::ModuleOffload, parts::Residency,
};
use memory_sim::{CardSpec, Faults, Mode, SimCard};
use offload_core::{
    ComponentError, ComponentsManager, DeviceLedger, DeviceMemory, DeviceName, Direction, Error, Offloadable,
};
use parking_lot::Mutex;

const OPERATIONS: u64 = 10_000;
const THREADS: u64 = 4;
const DIM: usize = 16;
const HIDDEN: usize = 32;
const BLOCKS: usize = 6;

/// A two-layer MLP: the weights of a plain component and of one block of a grouped model.
#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self { fc1: LinearConfig::new(DIM, HIDDEN).init(device), fc2: LinearConfig::new(HIDDEN, DIM).init(device) }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.clone() + self.fc2.forward(gelu(self.fc1.forward(x)))
    }
}

/// FNV-1a over the shape and the f32 bits of every float parameter, in visit order.
fn checksum<M: Module>(module: &M) -> u64 {
    struct Visitor(u64);
    impl Visitor {
        fn eat(&mut self, bytes: &[u8]) {
            for byte in bytes {
                self.0 = (self.0 ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    impl ModuleVisitor for Visitor {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            for dim in tensor.dims() {
                self.eat(&dim.to_le_bytes());
            }
            for value in tensor.into_data().try_into_vec_as::<f32>().unwrap() {
                self.eat(&value.to_bits().to_le_bytes());
            }
        }
    }
    let mut visitor = Visitor(0xcbf2_9ce4_8422_2325);
    module.visit(&mut visitor);
    visitor.0
}

/// A copy of a module that shares no tensor memory with it, as a copy across a host link would be.
fn deep_copy<M: Module>(module: &M) -> M {
    struct Copy;
    impl ModuleMapper for Copy {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|tensor| {
                let device = tensor.device();
                Tensor::from_data(tensor.into_data(), &device)
            })
        }
    }
    module.clone().map(&mut Copy)
}

/// A plain component with real weights: a host copy, and a device copy while it is resident. Onload allocates
/// and transfers before it copies; offload transfers back, copies the device weights over the host copy (as
/// `module.to("cpu")` does) and frees. A run checks its device copy and computes with it.
struct Weights {
    host: Mlp,
    device_copy: Option<Mlp>,
    card: Arc<SimCard>,
    bytes: u64,
    device: DeviceName,
}

impl Weights {
    fn run(&mut self, expected: u64) -> Result<u64, ComponentError> {
        let Some(device_copy) = &self.device_copy else {
            return Err(ComponentError::other("ran without a device copy: the manager did not onload it"));
        };
        let seen = checksum(device_copy);
        // An activation: on a crowded card this fails, and the manager's OOM retry makes room.
        self.card.allocate(self.bytes / 2)?;
        let x = Tensor::<2>::ones([2, DIM], &Device::flex());
        let _ = device_copy.forward(x).into_data();
        self.card.free(self.bytes / 2);
        assert_eq!(seen, expected, "a run saw a device copy that differs from the host copy it came from");
        Ok(seen)
    }

    fn host_checksum(&self) -> u64 {
        checksum(&self.host)
    }
}

impl Offloadable for Weights {
    fn bytes(&self) -> u64 {
        self.bytes
    }

    fn device(&self) -> DeviceName {
        self.device.clone()
    }

    fn onload(&mut self, device: &DeviceName) -> Result<(), ComponentError> {
        self.card.allocate(self.bytes)?;
        if let Err(error) = self.card.transfer(self.bytes, Direction::HostToDevice) {
            self.card.free(self.bytes);
            return Err(error);
        }
        self.device_copy = Some(deep_copy(&self.host));
        self.device = device.clone();
        Ok(())
    }

    fn offload(&mut self) -> Result<(), ComponentError> {
        self.card.transfer(self.bytes, Direction::DeviceToHost)?;
        if let Some(device_copy) = self.device_copy.take() {
            self.host = deep_copy(&device_copy);
        }
        self.card.free(self.bytes);
        self.device = DeviceName::cpu();
        Ok(())
    }
}

/// A grouped model: a resident input layer, then blocks streamed through the card, prefetched.
struct Grouped {
    offload: GroupOffload,
    top: ModuleOffload<Linear>,
    blocks: BlockOffload<Mlp>,
    /// Checksums of each block's weights, taken before the model was taken apart.
    block_sums: Vec<u64>,
    top_sum: u64,
}

impl Grouped {
    fn new(card: &Arc<SimCard>, name: &str, per_group: usize) -> Self {
        let device = Device::flex();
        let top = LinearConfig::new(DIM, DIM).init(&device);
        let blocks: Vec<Mlp> = (0..BLOCKS).map(|_| Mlp::new(&device)).collect();
        let block_sums = blocks.iter().map(checksum).collect();
        let top_sum = checksum(&top);
        let config = GroupOffloadConfig::new(name, OffloadDevice::simulated(card.clone())).with_prefetch(true);
        let offload = GroupOffload::new(config).unwrap();
        let top = offload.module("top", top, Residency::Resident).unwrap();
        let blocks = offload.blocks("blocks", blocks, per_group).unwrap();
        Self { offload, top, blocks, block_sums, top_sum }
    }

    /// A forward that checks every device copy it is handed against the block it came from.
    fn forward(&self) -> Result<(), group_offload::Error> {
        let mut x = {
            let top = self.top.get()?;
            assert_eq!(checksum(&*top), self.top_sum, "the resident layer's device copy changed");
            top.forward(Tensor::<2>::ones([2, DIM], &Device::flex()))
        };
        for k in 0..self.blocks.num_groups() {
            let group = self.blocks.group(k)?;
            for (block, index) in group.iter().zip(self.blocks.blocks_of(k)) {
                assert_eq!(
                    checksum(block),
                    self.block_sums[index],
                    "block {index}: the device copy differs from the host copy"
                );
                x = block.forward(x);
            }
        }
        let _ = x.into_data();
        Ok(())
    }

    /// Takes one group, checks its device copy, and drops it.
    fn take(&self, k: usize) -> Result<(), group_offload::Error> {
        let group = self.blocks.group(k)?;
        for (block, index) in group.iter().zip(self.blocks.blocks_of(k)) {
            assert_eq!(
                checksum(block),
                self.block_sums[index],
                "block {index}: the device copy differs from the host copy"
            );
        }
        Ok(())
    }
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A component slot: its name, its current id (`None` while a thread has it out of the manager) and its
/// weights' checksum.
struct Slot {
    name: &'static str,
    id: Mutex<Option<String>>,
    sum: u64,
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    typed_errors: AtomicU64,
    faults_set: AtomicU64,
    removed_and_added: AtomicU64,
    /// Onloads (of a component or a group) that failed: injected or real out-of-memory, injected transfers.
    failed_uploads: AtomicU64,
    /// Offloads that failed (an injected transfer back to the host): the component stayed on the device.
    failed_offloads: AtomicU64,
    does_not_fit: AtomicU64,
}

impl Counts {
    fn error(&self, error: &Error) {
        self.typed_errors.fetch_add(1, Ordering::Relaxed);
        let counter = match error {
            Error::Component { operation: "offload", .. } => &self.failed_offloads,
            Error::Component { operation: "onload", .. } => &self.failed_uploads,
            // A group that could not be uploaded inside a run.
            Error::Component { source, .. } if source.to_string().contains("cannot onload group") => {
                &self.failed_uploads
            }
            Error::DoesNotFit { .. } => &self.does_not_fit,
            _ => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

struct World {
    card: Arc<SimCard>,
    manager: ComponentsManager,
    plain: Vec<Slot>,
    /// The grouped model the manager holds (as a group-offloaded component named `transformer`).
    grouped: Arc<Grouped>,
    grouped_slot: Slot,
    /// A grouped model taken directly, outside the manager.
    standalone: Grouped,
    standalone_host: Vec<(String, Result<u64, String>)>,
    grouped_host: Vec<(String, Result<u64, String>)>,
    counts: Counts,
}

/// The errors an operation may end with: a typed refusal, never a panic or a silent corruption.
fn allowed(error: &Error) -> bool {
    matches!(
        error,
        Error::DoesNotFit { .. } | Error::Component { .. } | Error::UnknownComponent { .. } | Error::InUse { .. }
    )
}

impl World {
    fn check_plain_host(&self, slot: &Slot) {
        let Some(id) = slot.id.lock().clone() else { return };
        // The slot may have been removed since: an unknown id is fine, a changed checksum is not.
        if let Ok((host, device)) =
            self.manager.inspect(&id, |w: &Weights| (w.host_checksum(), w.device_copy.as_ref().map(checksum)))
        {
            assert_eq!(host, slot.sum, "{}: the host copy changed", slot.name);
            if let Some(device) = device {
                assert_eq!(device, slot.sum, "{}: the device copy changed", slot.name);
            }
        }
    }

    fn check_groups_host(&self) {
        assert_eq!(
            self.standalone.offload.host_checksums(),
            self.standalone_host,
            "a standalone group's host copy changed"
        );
        assert_eq!(self.grouped.offload.host_checksums(), self.grouped_host, "a managed group's host copy changed");
    }

    fn outcome<T>(&self, result: Result<T, Error>, after: impl FnOnce()) {
        match result {
            Ok(_) => {
                self.counts.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => {
                assert!(allowed(&error), "an operation failed with an unexpected error: {error}");
                self.counts.error(&error);
                // Whatever failed, the host copies are intact.
                after();
            }
        }
    }

    fn operation(&self, rng: &mut Rng) {
        match rng.below(100) {
            // Run a plain component: onload (evicting others), check its device copy, compute.
            0..=34 => {
                let slot = &self.plain[rng.below(self.plain.len() as u64) as usize];
                let Some(id) = slot.id.lock().clone() else { return };
                let result = self.manager.run(&id, |w: &mut Weights| w.run(slot.sum));
                self.outcome(result, || self.check_plain_host(slot));
            }
            // Onload only: a run that does nothing.
            35..=44 => {
                let slot = &self.plain[rng.below(self.plain.len() as u64) as usize];
                let Some(id) = slot.id.lock().clone() else { return };
                let result = self.manager.run_any(&id, |_| Ok(()));
                self.outcome(result, || self.check_plain_host(slot));
            }
            // Run the grouped model through the manager: every group streams through the card.
            45..=59 => {
                let Some(id) = self.grouped_slot.id.lock().clone() else { return };
                let grouped = self.grouped.clone();
                let result =
                    self.manager.run(&id, |_: &mut GroupedModel| grouped.forward().map_err(ComponentError::from));
                self.outcome(result, || self.check_groups_host());
            }
            // Take groups of the standalone model directly, with prefetch on.
            60..=79 => {
                let result = if rng.below(2) == 0 {
                    (0..self.standalone.blocks.num_groups()).try_for_each(|k| self.standalone.take(k))
                } else {
                    self.standalone.take(rng.below(self.standalone.blocks.num_groups() as u64) as usize)
                };
                match result {
                    Ok(()) => {
                        self.counts.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(error) => {
                        assert!(
                            matches!(error, group_offload::Error::Onload { .. }),
                            "taking a group failed with {error}"
                        );
                        self.counts.typed_errors.fetch_add(1, Ordering::Relaxed);
                        self.counts.failed_uploads.fetch_add(1, Ordering::Relaxed);
                        self.check_groups_host();
                    }
                }
            }
            // Remove a component (offloading it), check it out of the manager, add it back.
            80..=87 => {
                let index = rng.below(self.plain.len() as u64 + 1) as usize;
                let slot = self.plain.get(index).unwrap_or(&self.grouped_slot);
                let Some(id) = slot.id.lock().take() else { return };
                let removed = { self.manager.remove(&id) };
                match removed {
                    Ok(component) => {
                        let component: Box<dyn Any> = component;
                        let id = match component.downcast::<Weights>() {
                            Ok(weights) => {
                                assert!(
                                    weights.device.is_cpu() && weights.device_copy.is_none(),
                                    "{}: removed while on the device",
                                    slot.name
                                );
                                assert_eq!(weights.host_checksum(), slot.sum, "{}: the host copy changed", slot.name);
                                self.manager.add(slot.name, *weights, None).unwrap()
                            }
                            Err(component) => {
                                let model = component.downcast::<GroupedModel>().unwrap();
                                self.check_groups_host();
                                self.manager.add(slot.name, *model, None).unwrap()
                            }
                        };
                        *slot.id.lock() = Some(id);
                        self.counts.removed_and_added.fetch_add(1, Ordering::Relaxed);
                        self.counts.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(error) => {
                        // Still registered: running, or its offload failed and it stays on the device.
                        assert!(
                            self.manager.component_info(&id).is_ok(),
                            "{}: a failed removal ({error}) dropped it from the manager",
                            slot.name
                        );
                        *slot.id.lock() = Some(id);
                        assert!(allowed(&error), "removal failed with an unexpected error: {error}");
                        self.counts.error(&error);
                        if index < self.plain.len() {
                            self.check_plain_host(slot);
                        } else {
                            self.check_groups_host();
                        }
                    }
                }
            }
            // Offload everything: disable auto offload (which offloads every resident component), enable it again.
            88..=89 => {
                let result = self.manager.disable_auto_offload();
                self.outcome(result, || self.plain.iter().for_each(|slot| self.check_plain_host(slot)));
                let result = self.manager.enable_auto_offload(self.card.clone(), 0, true);
                self.outcome(result, || self.plain.iter().for_each(|slot| self.check_plain_host(slot)));
            }
            // Inject a failed upload and a failed offload (or a failed allocation) a few moves from now.
            90..=96 => {
                let stats = self.card.stats();
                self.card.set_faults(Faults {
                    fail_allocation: Some(stats.allocations + 1 + rng.below(4)),
                    fail_transfer: Some(stats.transfers + 1 + rng.below(4)),
                    ..Faults::default()
                });
                self.counts.faults_set.fetch_add(1, Ordering::Relaxed);
            }
            // Check the checksums now.
            _ => {
                self.plain.iter().for_each(|slot| self.check_plain_host(slot));
                self.check_groups_host();
            }
        }
    }
}

/// The grouped model as the manager holds it.
type GroupedModel = GroupOffloadedModel;

#[test]
fn ten_thousand_random_operations_leave_every_weight_intact() {
    let device = Device::flex();
    device.seed(17);
    let plain_bytes = (2 * DIM * HIDDEN + HIDDEN + DIM) as u64 * 4;
    let block_bytes = plain_bytes;
    // Room for the two resident layers, a few groups in flight, and two of the four plain components with
    // their activations: runs evict, activations run out, prefetches fail now and then.
    let capacity = 2 * (DIM * DIM + DIM) as u64 * 4 + 6 * block_bytes + 2 * plain_bytes + plain_bytes / 2;
    let card =
        SimCard::new(CardSpec::parse(&capacity.to_string()).unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let manager = ComponentsManager::new();
    let names = ["text_encoder", "vae", "refiner", "controlnet"];
    let plain: Vec<Slot> = names
        .iter()
        .map(|name| {
            let host = Mlp::new(&device);
            let sum = checksum(&host);
            let weights =
                Weights { host, device_copy: None, card: card.clone(), bytes: plain_bytes, device: DeviceName::cpu() };
            Slot { name, id: Mutex::new(Some(manager.add(name, weights, None).unwrap())), sum }
        })
        .collect();
    let grouped = Arc::new(Grouped::new(&card, "transformer", 1));
    let grouped_id = manager.add("transformer", GroupOffloadedModel::new(grouped.offload.clone()), None).unwrap();
    let standalone = Grouped::new(&card, "unet", 2);
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    let world = Arc::new(World {
        card: card.clone(),
        manager,
        plain,
        grouped_slot: Slot { name: "transformer", id: Mutex::new(Some(grouped_id)), sum: 0 },
        standalone_host: standalone.offload.host_checksums(),
        grouped_host: grouped.offload.host_checksums(),
        grouped,
        standalone,
        counts: Counts::default(),
    });
    assert!(world.standalone_host.iter().chain(&world.grouped_host).all(|(_, sum)| sum.is_ok()));

    let started = Instant::now();
    let (done, finished) = mpsc::channel::<Result<u64, String>>();
    for t in 0..THREADS {
        let world = world.clone();
        let done = done.clone();
        std::thread::spawn(move || {
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                for _ in 0..OPERATIONS / THREADS {
                    world.operation(&mut rng);
                }
                OPERATIONS / THREADS
            }));
            let _ = done.send(outcome.map_err(|panic| {
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            }));
        });
    }
    drop(done);
    let mut operations = 0;
    for _ in 0..THREADS {
        match finished.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(n)) => operations += n,
            Ok(Err(panic)) => panic!("a thread failed: {panic}"),
            Err(_) => panic!("deadlock: a thread did not finish its operations within 120 s"),
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(operations, OPERATIONS);

    // Every component is still registered, and every checksum is unchanged, host and device copies alike.
    world.card.set_faults(Faults::default());
    for slot in world.plain.iter().chain([&world.grouped_slot]) {
        let id = slot.id.lock().clone().unwrap();
        assert!(world.manager.component_info(&id).is_ok(), "{} ({id}) is no longer in the manager", slot.name);
    }
    world.plain.iter().for_each(|slot| world.check_plain_host(slot));
    world.check_groups_host();
    for k in 0..world.standalone.blocks.num_groups() {
        world.standalone.take(k).unwrap();
    }
    // With everything offloaded, the card holds nothing.
    world.manager.disable_auto_offload().unwrap();
    world.plain.iter().for_each(|slot| world.check_plain_host(slot));
    for offload in [&world.standalone.offload, &world.grouped.offload] {
        offload.wait_idle();
        offload.offload_all().unwrap();
    }
    world.check_groups_host();
    assert_eq!(world.card.allocated(), 0, "device memory leaked");

    let counts = &world.counts;
    let stats = world.card.stats();
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let failed_prefetches =
        world.standalone.offload.stats().failed_prefetches + world.grouped.offload.stats().failed_prefetches;
    println!(
        "{operations} operations on {THREADS} threads in {:.2} s: {} completed, {} typed errors ({} failed uploads, \
         {} failed offloads, {} DoesNotFit), {} failed prefetches absorbed, {} fault injections ({} allocations \
         refused on the card), {} removals and re-additions; the checksums of {} groups and {} components unchanged",
        elapsed.as_secs_f64(),
        load(&counts.ok),
        load(&counts.typed_errors),
        load(&counts.failed_uploads),
        load(&counts.failed_offloads),
        load(&counts.does_not_fit),
        failed_prefetches,
        load(&counts.faults_set),
        stats.failed_allocations,
        load(&counts.removed_and_added),
        world.standalone_host.len() + world.grouped_host.len(),
        world.plain.len(),
    );
    assert!(load(&counts.failed_uploads) > 0, "no upload failed: the faults were not exercised");
    assert!(load(&counts.failed_offloads) > 0, "no offload failed: the faults were not exercised");
    assert!(counts.typed_errors.load(Ordering::Relaxed) > 0, "no operation failed: the faults were not exercised");
    assert!(
        counts.ok.load(Ordering::Relaxed) > counts.typed_errors.load(Ordering::Relaxed),
        "most operations complete"
    );
}

/// A removal racing an inspection of the same component: the removal either succeeds (and hands the component
/// back) or fails with `InUse` and the component still registered. (This test found a race: `inspect` held the
/// slot without a claim, and `remove` took the entry out before finding the slot shared. `inspect` now claims
/// the component as `run` does, and `remove` refuses before moving anything while any handle is out.)
#[test]
fn a_removal_racing_an_inspection_never_loses_the_component() {
    let card = SimCard::new(CardSpec::parse("1GiB").unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let manager = Arc::new(ComponentsManager::new());
    let host = Mlp::new(&Device::flex());
    let weights = Weights { host, device_copy: None, card: card.clone(), bytes: 4096, device: DeviceName::cpu() };
    let id = Arc::new(Mutex::new(manager.add("vae", weights, None).unwrap()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let inspector = {
        let (manager, id, stop) = (manager.clone(), id.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let current = id.lock().clone();
                let _ = manager.inspect(&current, |w: &Weights| w.bytes);
            }
        })
    };
    let (done, finished) = mpsc::channel();
    let remover = {
        let manager = manager.clone();
        std::thread::spawn(move || {
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                for _ in 0..20_000 {
                    let current = id.lock().clone();
                    match manager.remove(&current) {
                        Ok(component) => {
                            let component: Box<dyn Any> = component;
                            *id.lock() = manager.add("vae", *component.downcast::<Weights>().unwrap(), None).unwrap();
                        }
                        Err(error) => assert!(
                            manager.component_info(&current).is_ok(),
                            "a failed removal ({error}) lost the component"
                        ),
                    }
                }
            }));
            let _ = done.send(outcome.is_ok());
        })
    };
    let passed = finished.recv_timeout(Duration::from_secs(120)).expect("no deadlock");
    stop.store(true, Ordering::Relaxed);
    let _ = (inspector.join(), remover.join());
    assert!(passed, "a failed removal lost the component");
}

/// The record of a group offloader adds up to what is on the device, failed uploads included: replaying its
/// onloads and offloads per group gives exactly the groups on the device. Today `Shared::upload` records the
/// onload before it allocates, so an upload that fails leaves an onload row for a group that never arrived.
#[test]
fn a_failed_group_upload_leaves_no_onload_in_the_record() {
    let card = SimCard::new(CardSpec::parse("1GiB").unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let record = offload_core::OffloadRecord::new();
    let config =
        GroupOffloadConfig::new("m", OffloadDevice::on_device(Device::flex(), card.device(), card.clone(), None))
            .with_record(record.clone())
            .with_prefetch(false);
    let offload = GroupOffload::new(config).unwrap();
    let blocks = offload.blocks("blocks", (0..3).map(|_| Mlp::new(&Device::flex())).collect(), 1).unwrap();
    card.set_faults(Faults { fail_allocation: Some(2), ..Faults::default() });
    let first = blocks.group(0).unwrap();
    assert!(blocks.group(1).is_err(), "the injected allocation fails the second group's upload");
    let mut balance: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
    // Refused rows move nothing: only onloads and offloads add up to the placement.
    for event in record.events() {
        *balance.entry(event.id.clone()).or_default() += match event.action {
            offload_core::Action::Onload => 1,
            offload_core::Action::Offload => -1,
            _ => 0,
        };
    }
    let on_device = offload.on_device();
    for (group, moves) in &balance {
        assert_eq!(*moves, i64::from(on_device.contains(group)), "{group}: the record's moves do not add up\n{record}");
    }
    drop(first);
}
