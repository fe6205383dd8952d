//! The public face: [`GroupOffload`] (one per model) and the parts it streams: [`BlockOffload`] (runs of
//! blocks), [`LeafOffload`] (one group per leaf layer) and [`ModuleOffload`] (a whole module as one group,
//! resident or streamed), each handing out [`GroupGuard`]s.

use std::collections::HashSet;
use std::ops::Deref;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Device;
use offload_core::timeline::category;
use parking_lot::Mutex;

use crate::config::{GroupOffloadConfig, LeafPredicate};
use crate::engine::{Engine, GroupStats, Room};
use crate::error::{Error, Result};
use crate::store::{ExtractedParam, GroupHost, HostReadError};
use crate::walk::{Installed, Slot, extract, install};
use crate::weights::FileTable;

/// The group offloader of one model: it owns the host copies, the captured order and the prefetch worker.
/// Parts ([`blocks`](Self::blocks), [`leaves`](Self::leaves), [`module`](Self::module)) are added to it and share
/// its order, so a model made of several block lists and loose layers prefetches across all of them in the
/// order it calls them.
///
/// Cloning is cheap and shares the offloader.
#[derive(Clone)]
pub struct GroupOffload {
    engine: Arc<Engine>,
    parts: Arc<Mutex<HashSet<String>>>,
    /// What is left of the pinned budget for the groups still to be added.
    pinning: Arc<Pinning>,
}

/// What is decided for each group as it is added: whether it stays resident (the first streamed groups, in
/// registration order, that fit the resident budget: [`GroupOffloadConfig::resident_budget`]) and whether its host
/// copy is pinned (the pinned budget's room, and the sizes it takes where a plan gave them). A group that stays
/// resident is uploaded once and gains nothing from pinning, so its bytes stay for a streamed group. Both are
/// decided here, once, whatever order the model then calls its groups in: the engine keeps exactly the groups
/// chosen here ([`Engine::add_group`]), so no group is pinned that then stays resident.
struct Pinning {
    pinned: Room,
    resident_left: Mutex<u64>,
}

impl std::fmt::Debug for GroupOffload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupOffload")
            .field("config", &self.engine.shared.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Where a [`ModuleOffload`] keeps its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residency {
    /// Uploaded once when the part is added and kept on the device (the default for top-level layers).
    #[default]
    Resident,
    /// Streamed like any block group: uploaded when taken (or prefetched), offloaded when released.
    Streamed,
}

impl GroupOffload {
    /// Starts an offloader (and its prefetch worker thread) for one model.
    pub fn new(config: GroupOffloadConfig) -> Result<Self> {
        let pinning = Arc::new(Pinning {
            pinned: Room::new(config.pinned_budget, config.pinned_groups.clone()),
            resident_left: Mutex::new(config.resident_budget),
        });
        Ok(Self { engine: Engine::start(config)?, parts: Arc::new(Mutex::new(HashSet::new())), pinning })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &GroupOffloadConfig {
        &self.engine.shared.config
    }

    /// Block level: `blocks` cut into groups of `num_blocks_per_group` consecutive blocks, named
    /// `{name}_{first}_{last}` as diffusers names them.
    ///
    /// The blocks' weights move into the host store here; the returned part hands out device copies. More than
    /// one block per group prefetches correctly: the unit of upload, prefetch and release is the group, so the
    /// hazard that makes diffusers force one block per group (a hook per block) does not arise.
    pub fn blocks<M: Module>(
        &self,
        name: &str,
        blocks: Vec<M>,
        num_blocks_per_group: usize,
    ) -> Result<BlockOffload<M>> {
        if num_blocks_per_group == 0 {
            return Err(self.invalid(format!("num_blocks_per_group of {name} is 0; use 1 or more")));
        }
        self.claim_part(name)?;
        let device = self.engine.device().clone();
        let mut skeletons = Vec::with_capacity(blocks.len());
        let mut slots = Vec::with_capacity(blocks.len());
        let mut groups = Vec::new();
        let mut pending: Vec<ExtractedParam> = Vec::new();
        let mut first = 0;
        let count = blocks.len();
        for (i, block) in blocks.into_iter().enumerate() {
            let (skeleton, params) = self.extract(block, &device)?;
            let group = groups.len();
            let mut block_slots = Vec::with_capacity(params.len());
            for mut param in params {
                block_slots.push(Slot { group, index: pending.len() });
                param.path.insert(0, i.to_string());
                pending.push(param);
            }
            skeletons.push(skeleton);
            slots.push(block_slots);
            let last = i + 1 == count || (i + 1 - first) == num_blocks_per_group;
            if last {
                let id = format!("{name}_{first}_{i}");
                let index = self.add_group(&id, std::mem::take(&mut pending), false)?;
                groups.push((index, first..i + 1));
                first = i + 1;
            }
        }
        // Slots were numbered by position in the part; turn them into engine indices.
        for block_slots in &mut slots {
            for slot in block_slots.iter_mut() {
                slot.group = groups[slot.group].0;
            }
        }
        Ok(BlockOffload { core: PartCore::new(self, name), skeletons, slots, groups })
    }

    /// Leaf level: every module whose container type `leaves` accepts (Linear, Conv, Embedding by default) is a
    /// group named `{name}.{path}`; parameters under no leaf (norm weights, bare parameters) travel with the
    /// deepest enclosing struct that holds a leaf (a norm's weight with its block: `{name}.blocks.0`), or with
    /// the root (`{name}`).
    pub fn leaves<M: Module>(&self, name: &str, module: M, leaves: &LeafPredicate) -> Result<LeafOffload<M>> {
        self.claim_part(name)?;
        let device = self.engine.device().clone();
        let (skeleton, params) = self.extract(module, &device)?;
        let assignment = assign_leaves(&params, leaves);
        let mut names: Vec<String> = Vec::new();
        for group in &assignment {
            if !names.contains(group) {
                names.push(group.clone());
            }
        }
        let mut buckets: Vec<Vec<ExtractedParam>> = names.iter().map(|_| Vec::new()).collect();
        let mut slots = Vec::with_capacity(params.len());
        for (param, group) in params.into_iter().zip(&assignment) {
            let local = names.iter().position(|n| n == group).unwrap_or(0);
            slots.push(Slot { group: local, index: buckets[local].len() });
            buckets[local].push(param);
        }
        let mut groups = Vec::with_capacity(names.len());
        for (path, bucket) in names.into_iter().zip(buckets) {
            let id = if path.is_empty() { name.to_string() } else { format!("{name}.{path}") };
            groups.push((path, self.add_group(&id, bucket, false)?));
        }
        for slot in &mut slots {
            slot.group = groups[slot.group].1;
        }
        Ok(LeafOffload { core: PartCore::new(self, name), skeleton, slots, groups })
    }

    /// A whole module as one group named `name`: the top-level layers outside the blocks. Resident by default.
    pub fn module<M: Module>(&self, name: &str, module: M, placement: Residency) -> Result<ModuleOffload<M>> {
        self.claim_part(name)?;
        let device = self.engine.device().clone();
        let (skeleton, params) = self.extract(module, &device)?;
        let slots = (0..params.len()).map(|index| Slot { group: 0, index }).collect::<Vec<_>>();
        let group = self.add_group(name, params, placement == Residency::Resident)?;
        let slots = slots.into_iter().map(|s| Slot { group, ..s }).collect();
        Ok(ModuleOffload { core: PartCore::new(self, name), skeleton, slots, group })
    }

    fn claim_part(&self, name: &str) -> Result<()> {
        if name.is_empty() || name.contains('/') {
            return Err(self.invalid(format!("part name {name:?} must be non-empty and contain no '/'")));
        }
        if !self.parts.lock().insert(name.to_string()) {
            return Err(self.invalid(format!("a part named {name:?} was already added; give each part its own name")));
        }
        Ok(())
    }

    fn invalid(&self, problem: String) -> Error {
        Error::InvalidConfig { model: self.engine.model().to_string(), problem }
    }

    /// Takes `module` apart ([`extract`]) with the offloader's file table: a parameter bound to its checkpoint file
    /// keeps it as its host copy.
    fn extract<M: Module>(&self, module: M, device: &Device) -> Result<(M, Vec<ExtractedParam>)> {
        let config = &self.engine.shared.config;
        extract(module, device, config.files.as_ref(), &config.model)
    }

    fn add_group(&self, group: &str, params: Vec<ExtractedParam>, kept: bool) -> Result<usize> {
        let config = &self.engine.shared.config;
        let id = format!("{}/{group}", config.model);
        let bytes: u64 = params.iter().map(ExtractedParam::bytes_len).sum();
        let stays = !kept && {
            let mut left = self.pinning.resident_left.lock();
            let fits = bytes <= *left;
            if fits {
                *left -= bytes;
            }
            fits
        };
        let host = match &config.disk_dir {
            None => {
                // Streamed groups are pinned in registration order while they fit in the pinned budget; a
                // resident part, or a group chosen to stay resident, is uploaded once and gains nothing from it,
                // and a group read from its checkpoint file at each upload has no host copy to pin.
                let stage =
                    !kept && !stays && !params.iter().any(ExtractedParam::is_file) && self.pinning.pinned.take(bytes);
                GroupHost::in_memory(id, params, stage.then_some(config.device.exec()))
            }
            Some(dir) => GroupHost::on_disk(id.clone(), &config.model, params, dir).map_err(|error| match error {
                HostReadError::File(error) => error,
                HostReadError::Disk(message) => Error::Disk { group: id, path: dir.display().to_string(), message },
            })?,
        };
        self.engine.add_group(host, kept, stays)
    }

    /// Checks that `device` is the one this offloader uploads to; call it at the top of a forward with the
    /// input's device.
    pub fn ensure_device(&self, device: &Device) -> Result<()> {
        let prepared = self.engine.device();
        if device == prepared {
            return Ok(());
        }
        Err(Error::WrongDevice {
            model: self.engine.model().to_string(),
            prepared: format!("{prepared:?}"),
            requested: format!("{device:?}"),
        })
    }

    /// Gives back every group on the device only because the worker prefetched it and that no guard borrows
    /// (it comes back on its first take, as a miss); returns their bytes. The worker's uploads in flight are
    /// waited for first, so the ones it had reserved room for are given back too: call it only where no call of
    /// this model runs (nothing of its own is loading). A call whose activations the device
    /// refuses calls it before it runs ([`run_call_making_room`](crate::device::run_call_making_room)), and so
    /// does the manager when another component ran out of memory with nothing evictable left
    /// ([`Offloadable::release_idle`](offload_core::Offloadable::release_idle)); the record shows each release
    /// as `oom_retry:<model>`: offloaded because a call ran out of memory.
    pub fn release_idle_prefetches(&self) -> u64 {
        let reason = offload_core::Reason::OomRetry(self.engine.model().to_string());
        self.engine.shared.release_idle_prefetches(&reason)
    }

    /// The rate of this offloader's reads of host copies from files (its groups' checkpoint files, or its disk-store
    /// files), measured by the clock (median and 10th percentile of the latest reads) on its disk meter (the file
    /// table's, for a model registered from its files, which also times its parameters read through their
    /// initialisers); `None` before the first.
    pub fn disk_rate(&self) -> Option<offload_core::link::DiskRate> {
        self.engine.shared.config.disk.rate()
    }

    /// Every read its disk meter noted: counts, bytes and seconds since the offloader was built.
    pub fn disk_totals(&self) -> offload_core::link::DiskTotals {
        self.engine.shared.config.disk.totals()
    }

    /// The bytes of the groups' host copies held in host memory: 0 for a model streamed from its checkpoint file
    /// (the file tier) or from the disk store, but for the reads kept within its RAM budget
    /// ([`kept_read_bytes`](Self::kept_read_bytes)); the model's weights for one held in memory.
    pub fn host_memory_bytes(&self) -> u64 {
        self.engine.host_memory_bytes()
    }

    /// The bytes each forward reads from checkpoint files: every group's file tensors (the file tier).
    pub fn file_bytes(&self) -> u64 {
        self.engine.file_bytes()
    }

    /// The link rate measured by the clock (median and 10th percentile of the latest copies) on this
    /// offloader's link meter: for a registered model that is its placement's, which every move onto the device
    /// notes (whole onloads too); `None` before the first.
    pub fn link_rate(&self) -> Option<offload_core::link::LinkRate> {
        self.engine.shared.link_rate()
    }

    /// What the next forward will still bring onto the device beyond [`resident_bytes`](Self::resident_bytes):
    /// the `1 + prefetch depth` largest streamed groups, less the streamed groups on the device now. What the
    /// manager makes room for before the model runs ([`Offloadable::window_bytes`](offload_core::Offloadable::window_bytes)).
    pub fn window_bytes(&self) -> u64 {
        self.engine.window_bytes()
    }

    /// Counters since the offloader was built.
    pub fn stats(&self) -> GroupStats {
        self.engine.stats()
    }

    /// The first parameters (at most 16) loaded outside the groups that hold them ([`GroupStats::stray_loads`]
    /// counts them all), by their paths in the model.
    pub fn stray_parameters(&self) -> Vec<String> {
        self.engine.strays()
    }

    /// Group ids (`model/group`) in the order the model calls them: the captured sequence, with the steps learnt
    /// since (a group called twice per forward appears twice).
    pub fn order(&self) -> Vec<String> {
        self.engine.order()
    }

    /// Whether the first forward's capture is still running (no prefetch yet).
    pub fn is_capturing(&self) -> bool {
        self.engine.is_capturing()
    }

    /// Runs one forward of the model: `forward` takes the model's groups, in whatever order and as often as
    /// it needs (a part taken twice, a block applied twice, weights tied between two layers). The capture is the
    /// first forward: when the first `run` returns `Ok`, the order it took its groups in is the captured order,
    /// and from then on each take prefetches the next groups of that order. A first `run` that fails is
    /// forgotten, so the next one captures again. [`ModelHandle::run`](crate::ModelHandle::run) and
    /// [`check_streaming`](crate::check_streaming) call it for you. Parts driven without `run` (or
    /// [`end_capture`](Self::end_capture)) stay capturing and never prefetch: after 64 takes per group the
    /// offloader warns once (`tracing`) and its order stops growing.
    ///
    /// The prefetches the device refused (or that failed) during the forward, or since the last one returned, are
    /// logged once as it returns, in one warning (`tracing`); each is a `prefetch_refused` or `prefetch_failed` row
    /// of the record, which a program reads with
    /// [`OffloadRecord::refusals_since`](offload_core::OffloadRecord::refusals_since).
    ///
    /// A stray load during the forward that could not read its host copy (a disk-stored group's file removed
    /// while the model runs) makes the run fail with [`Error::Disk`] naming the file, whatever the forward
    /// returned (what it computed read zeros for that parameter); the host copies of the other groups, and the
    /// device, are as they were.
    pub fn run<T, E: From<Error>>(
        &self,
        forward: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let capturing = self.engine.is_capturing();
        // A failure left by a forward that ended before the check (a panic) is not this run's.
        let _ = self.engine.take_stray_failure();
        let mut out = forward();
        if let Some(failure) = self.engine.take_stray_failure() {
            out = Err(E::from(failure));
        }
        // A refused prefetch costs a forward its overlap and is never silent: each is a row of the record, and the
        // forward says so once, here.
        let refusals = self.engine.take_refusals();
        if !refusals.is_empty() {
            tracing::warn!(model = self.engine.model(), "group offload: {refusals}");
        }
        if capturing {
            match &out {
                Ok(_) => self.engine.end_capture(),
                Err(_) => self.engine.recapture(),
            }
        }
        out
    }

    /// Ends the capture now: the groups taken since the offloader was built (or since
    /// [`recapture`](Self::recapture)) are the captured order. [`run`](Self::run) calls it when the first forward
    /// returns; call it yourself when you drive the parts without `run`.
    pub fn end_capture(&self) {
        self.engine.end_capture();
    }

    /// Forgets the order and captures it again on the next calls (after the model's control flow changed).
    pub fn recapture(&self) {
        self.engine.recapture();
    }

    /// Every group's id and size, in registration order.
    pub fn groups(&self) -> Vec<(String, u64)> {
        self.engine.groups()
    }

    /// Ids of the groups on the device now.
    pub fn on_device(&self) -> Vec<String> {
        self.engine.on_device()
    }

    /// Sum of every group's size.
    pub fn total_bytes(&self) -> u64 {
        self.engine.total_bytes()
    }

    /// Resident parts plus the resident budget: what the model keeps on the device between uses.
    pub fn resident_bytes(&self) -> u64 {
        self.engine.resident_bytes()
    }

    /// Bytes of host copies pinned within the pinned budget (uploads of these are copies from pinned memory),
    /// and of those, the bytes that are page-locked memory now: all of them on CUDA, none on a CPU backend,
    /// which has no page-locked memory.
    pub fn pinned_bytes(&self) -> (u64, u64) {
        self.engine.pinned_bytes()
    }

    /// Bytes of streamed groups held in the donors' memory ([`GroupOffloadConfig::donors`]), and how many groups:
    /// their uploads copy from a donor over its link.
    pub fn donor_bytes(&self) -> (u64, usize) {
        self.engine.donor_bytes()
    }

    /// What each donor holds, in the order the groups try them: its device's name, the bytes of the streamed groups
    /// it holds, and how many groups.
    pub fn donor_holdings(&self) -> Vec<(offload_core::DeviceName, u64, usize)> {
        self.engine.donor_holdings()
    }

    /// Bytes of streamed groups' reads from their files kept in host memory within the RAM budget
    /// ([`GroupOffloadConfig::ram_budget`]), and how many groups keep one: their uploads copy from host memory
    /// and read no file.
    pub fn kept_read_bytes(&self) -> (u64, usize) {
        self.engine.kept_read_bytes()
    }

    /// The largest group's size: with resident bytes and prefetch depth `d`, the device holds at most
    /// `resident + (d + 1) × largest` bytes of weights while guards are taken one at a time.
    pub fn largest_group(&self) -> u64 {
        self.engine.largest_group()
    }

    /// The largest group that streams (the resident parts, which stay on the device, left out): with resident
    /// bytes and prefetch depth `d`, the ring of groups in use holds at most `(d + 1) ×` this.
    pub fn largest_streamed_group(&self) -> u64 {
        self.engine.largest_streamed_group()
    }

    /// A checksum of every group's host copy, to show an upload (or a failed one) left it unchanged.
    pub fn host_checksums(&self) -> Vec<(String, std::result::Result<u64, String>)> {
        self.engine.host_checksums()
    }

    /// Offloads every group, resident parts included (they come back with [`onload_resident`](Self::onload_resident)
    /// or on their next use). Fails while a guard is alive.
    pub fn offload_all(&self) -> Result<()> {
        self.engine.offload_all()
    }

    /// Uploads the resident parts again.
    pub fn onload_resident(&self) -> Result<()> {
        self.engine.onload_resident()
    }

    /// Blocks until no prefetch is in flight (for tests and measurements).
    pub fn wait_idle(&self) {
        self.engine.wait_idle();
    }

    /// The paths of the groups' files in the disk store, if it is used.
    pub fn disk_files(&self) -> Vec<std::path::PathBuf> {
        let count = self.engine.groups().len();
        (0..count).filter_map(|g| self.engine.host(g)).filter_map(|h| h.path().map(|p| p.to_path_buf())).collect()
    }

    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
}

/// For each parameter, the dotted path of the group it joins at leaf level ("" = the root).
fn assign_leaves(params: &[ExtractedParam], leaves: &LeafPredicate) -> Vec<String> {
    let located: Vec<ParamPlace<'_>> =
        params.iter().map(|p| ParamPlace { path: &p.path, containers: &p.containers }).collect();
    assign_leaf_groups(&located, leaves)
}

/// Where a parameter sits in its module: the field names from the root and, per segment, the container type.
struct ParamPlace<'a> {
    path: &'a [String],
    containers: &'a [String],
}

/// The groups leaf level forms from `module`, in parameter order, each with its bytes: what
/// [`GroupOffload::leaves`] would make of it, read without copying any weight. A planner counts its moves and
/// sizes its window from these.
pub fn leaf_groups<M: Module>(module: &M, leaves: &LeafPredicate) -> Vec<(String, u64)> {
    leaf_groups_on(module, leaves, None)
}

/// [`leaf_groups`] with each group's bytes as `exec` holds them
/// ([`tensor_bytes_on`](crate::whole::tensor_bytes_on)); `None`: as the module holds them.
pub fn leaf_groups_on<M: Module>(module: &M, leaves: &LeafPredicate, exec: Option<&Device>) -> Vec<(String, u64)> {
    leaf_groups_with(module, leaves, exec, None)
}

/// [`leaf_groups_on`] of a model bound to its checkpoint files: a bound parameter is sized from `files`, unread.
pub fn leaf_groups_with<M: Module>(
    module: &M,
    leaves: &LeafPredicate,
    exec: Option<&Device>,
    files: Option<&FileTable>,
) -> Vec<(String, u64)> {
    let params = crate::walk::param_places(module, exec, files);
    let located: Vec<ParamPlace<'_>> =
        params.iter().map(|(path, containers, _)| ParamPlace { path, containers }).collect();
    let assignment = assign_leaf_groups(&located, leaves);
    let mut groups: Vec<(String, u64)> = Vec::new();
    for ((_, _, bytes), group) in params.iter().zip(assignment) {
        match groups.iter_mut().find(|(name, _)| *name == group) {
            Some((_, total)) => *total += bytes,
            None => groups.push((group, *bytes)),
        }
    }
    groups
}

fn assign_leaf_groups(params: &[ParamPlace<'_>], leaves: &LeafPredicate) -> Vec<String> {
    // The module at prefix path[..k] has the type containers[k] (the struct whose field path[k] is).
    let leaf_of =
        |p: &ParamPlace<'_>| -> Option<usize> { (0..p.path.len()).find(|k| leaves.is_leaf(&p.containers[*k])) };
    let leaf_paths: Vec<String> = params.iter().filter_map(|p| leaf_of(p).map(|k| p.path[..k].join("."))).collect();
    let holds_leaf = |prefix: &str| {
        leaf_paths.iter().any(|l| prefix.is_empty() || l == prefix || l.starts_with(&format!("{prefix}.")))
    };
    params
        .iter()
        .map(|p| match leaf_of(p) {
            Some(k) => p.path[..k].join("."),
            None => (0..p.path.len())
                .rev()
                .filter(|k| p.containers[*k].starts_with("Struct:") || p.containers[*k].starts_with("Enum:"))
                .map(|k| p.path[..k].join("."))
                .find(|prefix| !leaf_paths.is_empty() && holds_leaf(prefix))
                .unwrap_or_default(),
        })
        .collect()
}

/// What every part needs to install device tensors into its skeletons.
struct PartCore {
    engine: Arc<Engine>,
    name: String,
}

impl PartCore {
    fn new(offload: &GroupOffload, name: &str) -> Self {
        Self { engine: offload.engine().clone(), name: name.to_string() }
    }

    fn take(&self, groups: &[usize]) -> Result<Vec<(usize, Arc<[crate::uploads::DeviceTensor]>)>> {
        self.engine.acquire(groups)
    }

    fn build<'a, T>(&'a self, groups: Vec<usize>, value: T) -> GroupGuard<'a, T> {
        let computing_since = self.engine.shared.config.timeline.now_ns();
        GroupGuard { value: Some(value), engine: &self.engine, groups, computing_since }
    }

    fn install<M: Module>(
        &self,
        skeleton: &M,
        slots: &[Slot],
        taken: &[(usize, Arc<[crate::uploads::DeviceTensor]>)],
    ) -> M {
        let engine = &self.engine;
        let hosts = |g: usize| engine.host(g);
        let installed =
            Installed { groups: taken, hosts: &hosts, engine: Arc::downgrade(engine), device: engine.device() };
        install(skeleton, slots, &installed)
    }

    fn unknown(&self, group: &str, known: impl Iterator<Item = String>) -> Error {
        Error::UnknownGroup {
            model: self.engine.model().to_string(),
            group: group.to_string(),
            known: known.collect::<Vec<_>>().join(", "),
        }
    }
}

/// A borrowed group on the execution device. It derefs to the device-resident module(s); while it lives the
/// group stays on the device, and dropping it releases the group (offloaded unless kept or next in line).
///
/// Keep the guard alive for as long as its module computes: a tensor cloned out of it keeps device memory that
/// the ledger already counts as freed once the guard drops.
pub struct GroupGuard<'a, T> {
    // Always `Some` until `drop`, which takes it out so the device tensors go before the group is released.
    value: Option<T>,
    engine: &'a Engine,
    groups: Vec<usize>,
    /// When the guard was handed out, on the timeline; `None` when the timeline is disabled.
    computing_since: Option<u64>,
}

impl<T> Deref for GroupGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        match &self.value {
            Some(value) => value,
            None => unreachable!("a group guard's value is only taken in drop"),
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for GroupGuard<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupGuard").field("groups", &self.groups).finish_non_exhaustive()
    }
}

impl<T> Drop for GroupGuard<'_, T> {
    fn drop(&mut self) {
        drop(self.value.take());
        if let Some(start) = self.computing_since {
            // The guard's life is the group's compute: its layers ran (or were queued, on an asynchronous device)
            // while it was borrowed.
            let ids: Vec<String> =
                self.groups.iter().filter_map(|g| self.engine.host(*g)).map(|host| host.id.clone()).collect();
            let timeline = &self.engine.shared.config.timeline;
            timeline.span_since(category::COMPUTE, &ids.join(" + "), start, Vec::new());
        }
        for group in &self.groups {
            self.engine.release(*group);
        }
    }
}

/// Block-level group offload of a list of blocks. See [`GroupOffload::blocks`].
pub struct BlockOffload<M> {
    core: PartCore,
    skeletons: Vec<M>,
    slots: Vec<Vec<Slot>>,
    groups: Vec<(usize, std::ops::Range<usize>)>,
}

impl<M> std::fmt::Debug for BlockOffload<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockOffload").field("name", &self.core.name).field("groups", &self.groups.len()).finish()
    }
}

impl<M: Module> BlockOffload<M> {
    /// How many groups the blocks were cut into.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// How many blocks there are.
    pub fn num_blocks(&self) -> usize {
        self.skeletons.len()
    }

    /// The blocks in group `k`.
    pub fn blocks_of(&self, k: usize) -> std::ops::Range<usize> {
        self.groups.get(k).map_or(0..0, |(_, r)| r.clone())
    }

    /// Takes group `k`: its blocks on the device, in order. Blocks until they are there.
    pub fn group(&self, k: usize) -> Result<GroupGuard<'_, Vec<M>>> {
        let Some((group, range)) = self.groups.get(k).cloned() else {
            let names = (0..self.groups.len()).map(|i| i.to_string());
            return Err(self.core.unknown(&k.to_string(), names));
        };
        let taken = self.core.take(&[group])?;
        let blocks = range.map(|b| self.core.install(&self.skeletons[b], &self.slots[b], &taken)).collect();
        Ok(self.core.build(vec![group], blocks))
    }

    /// Every group in declaration order, taken one at a time as the iterator advances. Drop each guard before
    /// taking the next, or the ring bound grows by one group per guard held.
    pub fn iter(&self) -> impl Iterator<Item = Result<GroupGuard<'_, Vec<M>>>> + '_ {
        (0..self.groups.len()).map(move |k| self.group(k))
    }
}

/// Leaf-level group offload of one module. See [`GroupOffload::leaves`].
///
/// A guard derefs to the whole module, but only the parameters of the groups it took are on the device; every
/// other parameter is a placeholder that loads itself (counted in [`GroupStats::stray_loads`]) if touched.
pub struct LeafOffload<M> {
    core: PartCore,
    skeleton: M,
    slots: Vec<Slot>,
    groups: Vec<(String, usize)>,
}

impl<M> std::fmt::Debug for LeafOffload<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafOffload").field("name", &self.core.name).field("groups", &self.groups.len()).finish()
    }
}

impl<M: Module> LeafOffload<M> {
    /// The part's name (`blocks.3`, `down.0.blocks.1`: its groups' ids are `{model}/{name}.{path}`) and its
    /// model's, for errors that name the block.
    pub fn names(&self) -> (&str, &str) {
        (self.core.engine.model(), &self.core.name)
    }

    /// The groups' paths inside the module (`""` is the root group), in visit order.
    pub fn group_paths(&self) -> Vec<&str> {
        self.groups.iter().map(|(p, _)| p.as_str()).collect()
    }

    /// Takes the group at `path` (`"blocks.0.fc1"`).
    pub fn group(&self, path: &str) -> Result<GroupGuard<'_, M>> {
        self.groups_at(&[path])
    }

    /// Takes several groups at once (a leaf and the group holding its norm, say).
    pub fn groups_at(&self, paths: &[&str]) -> Result<GroupGuard<'_, M>> {
        let mut wanted = Vec::with_capacity(paths.len());
        for path in paths {
            match self.groups.iter().find(|(p, _)| p == path) {
                Some((_, g)) => wanted.push(*g),
                None => return Err(self.core.unknown(path, self.groups.iter().map(|(p, _)| format!("{p:?}")))),
            }
        }
        let taken = self.core.take(&wanted)?;
        let module = self.core.install(&self.skeleton, &self.slots, &taken);
        Ok(self.core.build(wanted, module))
    }

    /// The module with no group taken: every weight a placeholder that loads itself when read (a stray load).
    pub fn bare(&self) -> GroupGuard<'_, M> {
        let module = self.core.install(&self.skeleton, &self.slots, &[]);
        self.core.build(Vec::new(), module)
    }

    /// The module's structure, for its non-weight fields. Its weights are placeholders: read none through it.
    pub fn skeleton(&self) -> &M {
        &self.skeleton
    }
}

/// A whole module as one group. See [`GroupOffload::module`].
pub struct ModuleOffload<M> {
    core: PartCore,
    skeleton: M,
    slots: Vec<Slot>,
    group: usize,
}

impl<M> std::fmt::Debug for ModuleOffload<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModuleOffload").field("name", &self.core.name).finish()
    }
}

impl<M: Module> ModuleOffload<M> {
    /// Takes the module: on the device while the guard lives.
    pub fn get(&self) -> Result<GroupGuard<'_, M>> {
        let taken = self.core.take(&[self.group])?;
        let module = self.core.install(&self.skeleton, &self.slots, &taken);
        Ok(self.core.build(vec![self.group], module))
    }

    /// The module's structure, for its non-weight fields. Its weights are placeholders: read none through it.
    pub fn skeleton(&self) -> &M {
        &self.skeleton
    }
}
