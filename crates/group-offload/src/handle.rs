//! A model registered with a [`ComponentsManager`]: [`ModelHandle`], the one handle a pipeline keeps per
//! component. It runs the model wherever its weights are (moved whole by the manager, [`BurnComponent`], or
//! streamed by group offload, [`GroupedModel`]) through the model's one forward over its
//! [`Weights`](OffloadModel::Weights), and it switches the model to group offload in place.
//!
//! One onload, followed through the crates: the pipeline calls [`ModelHandle::run`]; the manager
//! (`ComponentsManager::run`) asks its strategy what to evict, calls the component's `onload`
//! ([`BurnComponent`]: the ledger's `allocate` and `transfer`, burn's `to_device`, a read-back that proves the
//! upload landed; [`GroupedModel`]: the resident groups' upload), then runs the call through
//! [`run_call`](crate::device::run_call) (the activations charged, the device synced and read back), and on an
//! out-of-memory evicts and calls again. Under group offload, each group the forward takes is uploaded by the
//! engine (`allocate`, `transfer`, an event in the manager's record) and released when its guard drops.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use burn::tensor::Device;
use offload_core::plan::BlockLayout;
use offload_core::{ComponentError, ComponentsManager, DeviceName, Offloadable};

use crate::OffloadDevice;
use crate::component::GroupOffloadedModel;
use crate::config::GroupOffloadConfig;
use crate::device::{DeviceOutput, run_call_making_room};
use crate::engine::GroupStats;
use crate::error::{Error, Result};
use crate::model::{GroupOptions, OffloadModel, Split, measure_layout, measure_layout_on, measure_layout_with};
use crate::parts::{GroupOffload, ModuleOffload};
use crate::weights::FileTable;
use crate::whole::{BurnComponent, module_is_quantized, module_is_quantized_with};

/// How a grouped model was taken apart.
enum Layout<M: OffloadModel> {
    /// Into its declared parts (block or leaf level).
    Parts(M::Parts),
    /// Into one group, the whole module: a model moved whole by the manager from a host copy the offloader
    /// holds (a model bound to its checkpoint file, which is never copied whole into memory).
    Whole(ModuleOffload<M>),
}

/// A model taken apart for group offload: its parts, the offloader that streams them, the ledger its activations
/// are charged to. Registered with the manager as group-offloaded (never evicted wholesale) unless
/// [`GroupOptions::releasable`].
pub struct GroupedModel<M: OffloadModel> {
    model: GroupOffloadedModel,
    parts: Layout<M>,
    /// The device it streams to: its ledger is charged each call's activations.
    device: OffloadDevice,
    releasable: bool,
}

impl<M: OffloadModel> std::fmt::Debug for GroupedModel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupedModel")
            .field("class", &M::CLASS)
            .field("groups", &self.model.offload().groups().len())
            .field("releasable", &self.releasable)
            .finish()
    }
}

impl<M: OffloadModel> GroupedModel<M> {
    /// Takes `model` apart under `config` (its device and record) with `options` (level, prefetch, budgets, disk
    /// store: [`GroupOptions::configure`]); the device's ledger is charged each call's activations.
    pub fn new(model: M, config: GroupOffloadConfig, options: &GroupOptions) -> Result<Self> {
        options.validate(&config.model)?;
        let offload = GroupOffload::new(options.configure(config))?;
        Self::split(model, offload, options)
    }

    /// Takes `model` apart into an offloader already built with `options` (its worker started), so that nothing
    /// fallible but the split itself is left once the model is given.
    fn split(model: M, offload: GroupOffload, options: &GroupOptions) -> Result<Self> {
        let parts = model.split(&Split::new(&offload, options, M::leaf_types()))?;
        let device = offload.config().device.clone();
        Ok(Self {
            model: GroupOffloadedModel::new(offload),
            parts: Layout::Parts(parts),
            device,
            releasable: options.releasable,
        })
    }

    /// Takes `model` into one group, the whole module, named `whole` (the record shows `{model}/whole`): resident
    /// when `options` keep the layers outside the blocks (uploaded when the manager onloads the model, and kept
    /// until the manager releases it whole, which [`GroupOptions::releasable`] allows), streamed otherwise
    /// (uploaded for each call). What a model that declares no parts (a VAE) moves as when its host copy is its
    /// checkpoint file ([`ModelHandle::register_files`]).
    pub fn whole(model: M, config: GroupOffloadConfig, options: &GroupOptions) -> Result<Self> {
        options.validate(&config.model)?;
        let offload = GroupOffload::new(options.configure(config))?;
        Self::split_whole(model, offload, options)
    }

    fn split_whole(model: M, offload: GroupOffload, options: &GroupOptions) -> Result<Self> {
        let part = offload.module("whole", model, options.outside())?;
        let device = offload.config().device.clone();
        Ok(Self {
            model: GroupOffloadedModel::new(offload),
            parts: Layout::Whole(part),
            device,
            releasable: options.releasable,
        })
    }

    /// The offloader, for its statistics and call order.
    pub fn offload(&self) -> &GroupOffload {
        self.model.offload()
    }

    /// The weights as the forward reads them; `None` for a model taken into one whole group
    /// ([`whole`](Self::whole)), whose weights exist only while a call borrows its group. A forward over them
    /// outside [`call`](Self::call) is not one [`GroupOffload::run`], so it does not end the capture.
    pub fn weights(&self) -> Option<M::Weights<'_>> {
        match &self.parts {
            Layout::Parts(parts) => Some(M::streamed(parts)),
            Layout::Whole(_) => None,
        }
    }

    /// One forward over the weights, with no device accounting: one [`GroupOffload::run`] (the first is the
    /// capture). [`run`](Self::run) is the same with the call's activations charged and the device checked.
    /// The closure's error type takes this crate's ([`Error`]): the run fails with it when a stray load cannot
    /// read its host copy, or when a parameter bound to its checkpoint file was read through its initialiser and
    /// the read failed.
    pub fn call<T, E: From<Error>>(
        &self,
        forward: impl FnOnce(M::Weights<'_>) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let files = self.offload().config().files.clone();
        self.offload().run(|| {
            let out = match &self.parts {
                Layout::Parts(parts) => forward(M::streamed(parts)),
                Layout::Whole(part) => {
                    let guard = part.get()?;
                    forward(guard.weights())
                }
            };
            match files.as_ref().and_then(FileTable::take_failure) {
                Some(failure) => Err(E::from(failure)),
                None => out,
            }
        })
    }

    /// Runs `f` over the weights with `activation_bytes` accounted on the ledger, as [`BurnComponent::run`] does
    /// ([`run_call`](crate::device::run_call): the call succeeds only once the device has done its work).
    pub fn run<R: DeviceOutput, E: Into<ComponentError>>(
        &mut self,
        activation_bytes: u64,
        f: impl FnOnce(M::Weights<'_>, &Device) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, ComponentError> {
        let config = self.model.offload().config();
        let files = config.files.clone();
        let (device, parts) = (&self.device, &self.parts);
        let exec = device.exec();
        // One call is one forward: the first that returns ends the capture of the call order.
        let offload = self.model.offload();
        // Activations the device refuses are first made room for with the groups prefetched for this call that
        // it has not taken yet: the worker must never starve the call it prefetches for.
        let make_room = || offload.release_idle_prefetches() > 0;
        run_call_making_room(device, exec, activation_bytes, make_room, || {
            offload.run(|| {
                let out = match parts {
                    Layout::Parts(parts) => f(M::streamed(parts), exec).map_err(Into::into),
                    Layout::Whole(part) => {
                        let guard = part.get().map_err(ComponentError::from)?;
                        f(guard.weights(), exec).map_err(Into::into)
                    }
                };
                // A bound parameter read through its initialiser read zeros where its file failed: the call's
                // output is not to be used.
                match files.as_ref().and_then(FileTable::take_failure) {
                    Some(failure) => Err(ComponentError::from(failure)),
                    None => out,
                }
            })
        })
    }
}

impl<M: OffloadModel> Offloadable for GroupedModel<M> {
    fn bytes(&self) -> u64 {
        self.model.bytes()
    }

    fn device(&self) -> DeviceName {
        self.model.device()
    }

    fn onload(&mut self, device: &DeviceName) -> std::result::Result<(), ComponentError> {
        self.model.onload(device)
    }

    fn offload(&mut self) -> std::result::Result<(), ComponentError> {
        Offloadable::offload(&mut self.model)
    }

    fn resident_bytes(&self) -> u64 {
        self.model.resident_bytes()
    }

    fn window_bytes(&self) -> u64 {
        self.model.window_bytes()
    }

    fn evictable(&self) -> bool {
        self.releasable
    }

    fn release_idle(&mut self) -> u64 {
        self.model.release_idle()
    }

    fn class_name(&self) -> String {
        format!("{} (group offload)", M::CLASS)
    }
}

/// The device object's side of registration: a model is registered on the device it runs on, in that device's
/// manager (written here, beside [`ModelHandle`], so that the device object needs no handle of its own).
impl OffloadDevice {
    /// Registers `model` (on the host device) in the device's manager as `name`, moved whole until
    /// [`ModelHandle::enable_group_offload`] streams it ([`ModelHandle::register`]).
    pub fn register<M: OffloadModel + Clone>(&self, name: &str, model: M) -> Result<ModelHandle<M>> {
        ModelHandle::register(self.manager(), name, model, self.clone())
    }

    /// Registers `model`, bound to its checkpoint files, in the device's manager as `name`: its host copy is the
    /// files ([`ModelHandle::register_files`]).
    pub fn register_files<M: OffloadModel + Clone>(
        &self,
        name: &str,
        model: M,
        files: FileTable,
    ) -> Result<ModelHandle<M>> {
        ModelHandle::register_files(self.manager(), name, model, files, self.clone())
    }
}

/// A model registered with a manager, as the pipeline keeps it: its name and id, where it computes, and whether
/// it is under group offload. Every call goes through [`run`](Self::run), whatever moves the weights.
pub struct ModelHandle<M: OffloadModel> {
    manager: Arc<ComponentsManager>,
    name: String,
    id: String,
    placement: OffloadDevice,
    grouped: Option<GroupOffload>,
    /// The model bound to its checkpoint files, when its host copy is the files (the file tier).
    files: Option<FileTier<M>>,
    /// The further devices that hold streamed groups between their uploads, in the order added
    /// ([`ModelHandle::add_donor`]).
    donors: Vec<crate::config::PeerDonor>,
    model: PhantomData<fn() -> M>,
}

/// A model whose host copy is its checkpoint files: what a new split of it takes.
struct FileTier<M> {
    /// The bound model, never taken apart: each split takes a clone of it, which copies no weight (its bound
    /// parameters are uninitialised handles that read nothing).
    skeleton: M,
    table: FileTable,
    /// The options it streams with since [`ModelHandle::enable_group_offload`]; `None` while it moves whole.
    options: Option<GroupOptions>,
}

/// Dropping the handle removes its component from its manager (moved to the host first, so the device's account
/// gives its bytes back). A device's manager lives as long as the device object, and every component holds the
/// device: without this, a dropped pipeline's components would stay registered, and on the device, for as long as
/// anything holds the device, and a component that holds the device it is registered on would keep it alive for
/// ever.
impl<M: OffloadModel> Drop for ModelHandle<M> {
    fn drop(&mut self) {
        if let Err(error) = self.manager.remove(&self.id) {
            tracing::warn!(component = %self.id, "the dropped handle's component stays registered: {error}");
        }
    }
}

impl<M: OffloadModel> std::fmt::Debug for ModelHandle<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelHandle")
            .field("id", &self.id)
            .field("class", &M::CLASS)
            .field("grouped", &self.grouped.is_some())
            .field("files", &self.files.as_ref().map(|files| &files.table))
            .finish()
    }
}

impl<M: OffloadModel + Clone> ModelHandle<M> {
    /// Registers `model` (on `placement.host()`) with `manager` as `name`, moved whole ([`BurnComponent`]). The
    /// manager's refusal (an invalid name, say) is [`Error::Manager`]: every method of the handle returns this
    /// crate's [`Result`], so a model crate needs no error type of its own over the two crates'.
    pub fn register(manager: &Arc<ComponentsManager>, name: &str, model: M, placement: OffloadDevice) -> Result<Self> {
        let id = manager.add(name, BurnComponent::new(model, M::CLASS, placement.clone()), None)?;
        Ok(Self {
            manager: manager.clone(),
            name: name.to_string(),
            id,
            placement,
            grouped: None,
            files: None,
            donors: Vec::new(),
            model: PhantomData,
        })
    }

    /// Registers `model`, bound to its checkpoint files ([`crate::weights::bind`], which gave `files`), with
    /// `manager` as `name`, so that it is never copied whole into host memory: its host copy is the files (the file
    /// tier). Until [`enable_group_offload`](Self::enable_group_offload) streams it, it is one group, the whole
    /// module ([`GroupedModel::whole`]): the manager onloads it from the files when it runs (a kept group, read and
    /// uploaded tensor by tensor) and may release it whole between phases. Its size, layout and quantization come
    /// from `files` without reading a byte ([`bytes`](offload_core::Offloadable::bytes), [`layout`](Self::layout),
    /// [`is_quantized`](Self::is_quantized)). A parameter something already read (initialised: a LoRA's low-rank
    /// factors added after binding) is held in host memory as it would be without the file tier.
    ///
    /// Every read is timed on `files`' disk meter ([`disk_rate`](Self::disk_rate)), recorded as the group's
    /// `from file` read in the record and as a `file_read` span on the timeline of the thread that read.
    pub fn register_files(
        manager: &Arc<ComponentsManager>,
        name: &str,
        model: M,
        files: FileTable,
        placement: OffloadDevice,
    ) -> Result<Self> {
        let mut handle = Self {
            manager: manager.clone(),
            name: name.to_string(),
            id: String::new(),
            placement,
            grouped: None,
            files: None,
            donors: Vec::new(),
            model: PhantomData,
        };
        let grouped = handle.split_files(model.clone(), &files, None)?;
        handle.grouped = Some(grouped.offload().clone());
        handle.id = manager.add(name, grouped, None)?;
        handle.files = Some(FileTier { skeleton: model, table: files, options: None });
        Ok(handle)
    }

    /// Reads a model registered from its checkpoint files ([`register_files`](Self::register_files)) into host
    /// memory and registers it from there, moved whole, as [`register`](Self::register) does (the RAM tier: the
    /// component a plan keeps in RAM). Every weight is read once, through the file table (its transform and dtype
    /// applied), timed on its disk meter; the model is read first, so a failure leaves the component registered
    /// from its files as it was. Does nothing for a model already in memory; refused once the model streams from
    /// its files (call it before [`enable_group_offload`](Self::enable_group_offload)).
    pub fn load_into_ram(&mut self) -> Result<()> {
        let Some(files) = &self.files else { return Ok(()) };
        if files.options.is_some() {
            return Err(Error::AlreadyApplied {
                component: self.name.clone(),
                action: "load into host memory".into(),
                reason: "it streams from its checkpoint files already; load it into memory before enabling group \
                         offload"
                    .into(),
            });
        }
        let model = crate::weights::materialize(files.skeleton.clone(), &files.table, self.placement.host())?;
        self.manager.remove(&self.id)?;
        self.id = self.manager.add(&self.name, BurnComponent::new(model, M::CLASS, self.placement.clone()), None)?;
        self.grouped = None;
        self.files = None;
        Ok(())
    }

    /// The offloader's configuration for this handle's device, recorded in the handle's manager (its record and
    /// timeline).
    fn group_config(&self) -> GroupOffloadConfig {
        let config = GroupOffloadConfig::new(self.name.as_str(), self.placement.clone())
            .with_record(self.manager.offload_record())
            .with_timeline(self.manager.timeline());
        self.donors.iter().fold(config, |config, donor| config.with_donor(donor.clone()))
    }

    /// Adds a donor to the model: a further device whose memory holds its streamed groups between their uploads, up
    /// to the donor's budget, each later upload copied from there over the donor's link
    /// ([`PeerDonor`](crate::config::PeerDonor)). A group tries the donors in the order they were added (a plan's
    /// budgets order them as its peers, `GroupOptions::donor_budgets`); a device given twice is refused when the
    /// model starts streaming. Add them before [`enable_group_offload`](Self::enable_group_offload); refused once the
    /// model streams ([`Error::AlreadyApplied`]), whose groups were placed without it.
    pub fn add_donor(&mut self, donor: crate::config::PeerDonor) -> Result<()> {
        if self.grouped.is_some() && self.files.as_ref().is_none_or(|files| files.options.is_some()) {
            return Err(Error::AlreadyApplied {
                component: self.name.clone(),
                action: "add a donor".into(),
                reason: "it already streams; add its donors before enable_group_offload".into(),
            });
        }
        self.donors.push(donor);
        Ok(())
    }

    /// Takes a bound `model` apart with its host copies in `files`: with `options`, into its parts; without, into
    /// one group, the whole module, released whole by the manager between phases.
    fn split_files(&self, model: M, files: &FileTable, options: Option<&GroupOptions>) -> Result<GroupedModel<M>> {
        let config = self.group_config().with_files(files.clone());
        match options {
            Some(options) => GroupedModel::new(model, config, options),
            None => {
                let whole =
                    GroupOptions { releasable: true, prefetch: false, prefetch_depth: 0, ..GroupOptions::default() };
                GroupedModel::whole(model, config, &whole)
            }
        }
    }

    /// Registers a new split of the bound model (`skeleton`, now the handle's) in place of the registered one, at
    /// the handle's options: the new split is made first, so a failure leaves the component as it was.
    fn resplit_files(&mut self, skeleton: M, options: Option<GroupOptions>) -> Result<()> {
        let Some(table) = self.files.as_ref().map(|files| files.table.clone()) else {
            return Err(self.not_bound("split from its files"));
        };
        let grouped = self.split_files(skeleton.clone(), &table, options.as_ref())?;
        self.manager.remove(&self.id)?;
        self.grouped = Some(grouped.offload().clone());
        self.id = self.manager.add(&self.name, grouped, None)?;
        self.files = Some(FileTier { skeleton, table, options });
        Ok(())
    }

    fn not_bound(&self, action: &str) -> Error {
        Error::AlreadyApplied {
            component: self.name.clone(),
            action: action.to_string(),
            reason: "it was not registered from its checkpoint files".into(),
        }
    }

    /// The table of the model's checkpoint files, when it was registered from them
    /// ([`register_files`](Self::register_files)).
    pub fn file_table(&self) -> Option<&FileTable> {
        self.files.as_ref().map(|files| &files.table)
    }

    /// Whether the model's host copy is its checkpoint files ([`register_files`](Self::register_files)).
    pub fn is_file_tier(&self) -> bool {
        self.files.is_some()
    }

    /// The rate of the model's reads of host copies from files (its checkpoint files, or its disk-store files),
    /// measured by the clock; `None` before the first, or when it is not grouped.
    pub fn disk_rate(&self) -> Option<offload_core::link::DiskRate> {
        self.grouped.as_ref().and_then(GroupOffload::disk_rate)
    }

    /// The component's name (the planner's and the record's: `transformer`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its id in the manager (it changes when the component is re-registered).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where it computes and what accounts for it.
    pub fn placement(&self) -> &OffloadDevice {
        &self.placement
    }

    /// The manager holding it.
    pub fn manager(&self) -> &Arc<ComponentsManager> {
        &self.manager
    }

    /// The group offloader when the model is under group offload (a handle that shares it).
    pub fn group_offload(&self) -> Option<&GroupOffload> {
        self.grouped.as_ref()
    }

    /// Whether the model is under group offload.
    pub fn is_grouped(&self) -> bool {
        self.grouped.is_some()
    }

    /// Group-offload statistics (onloads, prefetch hits, misses, stray loads), when it is grouped.
    pub fn group_stats(&self) -> Option<GroupStats> {
        self.grouped.as_ref().map(GroupOffload::stats)
    }

    /// Runs `f` over the model's weights on its execution device with `activation_bytes` charged for the call,
    /// through the manager (which onloads it, evicts others, and retries after an out-of-memory: so `f` may run
    /// more than once). One call is one forward: under group offload, the first call that returns is the
    /// capture of the order the forward takes its groups in.
    ///
    /// `f` returns this crate's [`Result`], so a closure that cannot fail is `|vae, device| Ok(vae.decode(z))`;
    /// [`try_run`](Self::try_run) takes a closure with an error type of its own. The manager's errors (an
    /// out-of-memory the retry could not recover, [`offload_core::Error::DoesNotFit`]) come as [`Error::Manager`].
    pub fn run<R: DeviceOutput>(
        &self,
        activation_bytes: u64,
        f: impl FnMut(M::Weights<'_>, &Device) -> Result<R>,
    ) -> Result<R> {
        self.try_run(activation_bytes, f)
    }

    /// [`run`](Self::run) for a closure whose error type is its own (`Into<ComponentError>`: the manager
    /// recognises an out-of-memory inside it).
    pub fn try_run<R: DeviceOutput, E: Into<ComponentError>>(
        &self,
        activation_bytes: u64,
        mut f: impl FnMut(M::Weights<'_>, &Device) -> std::result::Result<R, E>,
    ) -> Result<R> {
        self.check_runs_on_its_device()?;
        let ran = if self.grouped.is_some() {
            self.manager.run(&self.id, |c: &mut GroupedModel<M>| c.run(activation_bytes, &mut f))
        } else {
            self.manager.run(&self.id, |c: &mut BurnComponent<M>| {
                c.run(activation_bytes, |model, device| f(model.weights(), device))
            })
        };
        Ok(ran?)
    }

    /// Refuses a run that would silently compute on the host's CPU: a whole model on the host, registered on a
    /// device that computes elsewhere (its execution device is not the host's, as a GPU's or a wgpu runtime's; a
    /// simulated card computes on the host and is not refused), whose manager has no auto offload to bring it
    /// there ([`Error::NotOnDevice`]). A model under group offload uploads its groups itself.
    fn check_runs_on_its_device(&self) -> Result<()> {
        if self.grouped.is_some() || self.placement.exec() == self.placement.host() {
            return Ok(());
        }
        if self.manager.auto_offload().is_some() {
            return Ok(());
        }
        let on_host = self.manager.component_info(&self.id).is_ok_and(|info| info.device.is_cpu());
        if !on_host {
            return Ok(());
        }
        Err(Error::NotOnDevice { model: self.id.clone(), device: self.placement.name().to_string() })
    }

    /// Reads the model while it is whole (not under group offload, whose store holds its weights: then
    /// [`Error::AlreadyApplied`]). A model registered from its files is read as bound: its structure as it is, and
    /// a weight read through it is read from its file (and counted in its [`FileTable`]).
    pub fn inspect<T>(&self, f: impl FnOnce(&M) -> T) -> Result<T> {
        if let Some(files) = &self.files {
            return Ok(f(&files.skeleton));
        }
        self.whole("read", f)
    }

    /// [`inspect`](Self::inspect), refused in the words of `action`.
    fn whole<T>(&self, action: &str, f: impl FnOnce(&M) -> T) -> Result<T> {
        self.not_grouped(action)?;
        Ok(self.manager.inspect(&self.id, |c: &BurnComponent<M>| f(c.module()))?)
    }

    /// The planner's layout of the model, its sizes as the placement's execution device holds them
    /// ([`measure_layout_on`]); `None` for a model with no block lists. Refused once the model is under group
    /// offload (its parameters moved into the group store).
    pub fn layout(&self) -> Result<Option<BlockLayout>> {
        let exec = self.placement.exec().clone();
        if let Some(files) = &self.files {
            // Measured from the files' table, whatever streams it now: nothing is read.
            return Ok(measure_layout_with(&files.skeleton, Some(&exec), &files.table));
        }
        self.whole("measure the blocks of", |model| measure_layout_on(model, &exec))
    }

    /// Whether the model's weights are quantized (burn's quantized tensors). A quantized model streams under group
    /// offload as a float one does, its groups moving their quantized bytes and scales as they are. A model
    /// registered from its files is quantized where its binding's transform quantizes it.
    pub fn is_quantized(&self) -> bool {
        if let Some(files) = &self.files {
            return module_is_quantized_with(&files.skeleton, Some(&files.table));
        }
        self.inspect(module_is_quantized).unwrap_or(false)
    }

    /// Replaces the model with `f` of a copy of it (quantization, say), re-registered under the same name with
    /// its new size; the id changes. Nothing is unregistered until `f` returned, so a failure leaves the model as
    /// it was. Refused under group offload.
    pub fn replace<T>(&mut self, f: impl FnOnce(M) -> (M, T)) -> Result<T> {
        if let Some(files) = &self.files {
            let (model, value) = f(files.skeleton.clone());
            let options = files.options.clone();
            self.resplit_files(model, options)?;
            return Ok(value);
        }
        let (model, value) = f(self.whole("replace", M::clone)?);
        self.manager.remove(&self.id)?;
        self.id = self.manager.add(&self.name, BurnComponent::new(model, M::CLASS, self.placement.clone()), None)?;
        Ok(value)
    }

    /// Takes the model (its host copy) out of the manager and gives it to `f` by value, so that `f` can rewrite
    /// its tensors in place (a LoRA fused into its weights) with no second copy of them; the result is
    /// re-registered under the same name with its new size, and the id changes. Refused under group offload.
    /// Unlike [`replace`](Self::replace), the model is out of the manager while `f` runs, so `f` must not fail:
    /// check everything it needs first.
    ///
    /// A model registered from its files is rewritten as bound (`f` gets the bound model; a weight it reads is
    /// read from its file, and one it writes is held in host memory from then on) and split again as it was
    /// streamed: then, as with [`replace`](Self::replace), a failure leaves it as it was.
    pub fn rebuild<T>(&mut self, f: impl FnOnce(M) -> (M, T)) -> Result<T> {
        if self.files.is_some() {
            return self.replace(f);
        }
        self.not_grouped("rewrite")?;
        let component: Box<dyn Any> = self.manager.remove(&self.id)?;
        let model = match component.downcast::<BurnComponent<M>>() {
            Ok(component) => component.into_module(),
            Err(_) => unreachable!("the handle registered {} as a BurnComponent", self.id),
        };
        let (model, value) = f(model);
        self.id = self.manager.add(&self.name, BurnComponent::new(model, M::CLASS, self.placement.clone()), None)?;
        Ok(value)
    }

    /// Puts the model under group offload with `options` on the device of its [`OffloadDevice`]: its groups are
    /// charged to the placement's ledger, read through its readings for the out-of-memory reports (the device's one
    /// account, the same as the whole model's), recorded in the manager's record and timeline. Does nothing when
    /// it already is (the first options stay); refused for a model that declares no blocks
    /// ([`Error::RouteUnsupported`]). A quantized model streams: its groups hold the quantized parameters' bytes
    /// (values and scales, never dequantized on the host), uploads rebuild the quantized tensors on the device,
    /// and every byte count (groups, ledger, record) is the quantized size.
    ///
    /// Nothing is lost when it fails: the options and the offloader's configuration are checked before the model
    /// is touched, and the model stays registered as it was.
    ///
    /// A model registered from its files ([`register_files`](Self::register_files)) moves whole until this call,
    /// which splits it again from its files at `options`' level (no weight is read or copied: its host copies stay
    /// the files, or with a disk store, are written there tensor by tensor); the whole registration is replaced
    /// only once the split exists.
    pub fn enable_group_offload(&mut self, options: &GroupOptions) -> Result<()> {
        if let Some(files) = &self.files {
            if files.options.is_some() {
                return Ok(());
            }
            options.validate(&self.name)?;
            let skeleton = files.skeleton.clone();
            return self.resplit_files(skeleton, Some(options.clone()));
        }
        if self.grouped.is_some() {
            return Ok(());
        }
        options.validate(&self.name)?;
        let config = self.group_config();
        // The offloader (its configuration checked, its worker started) exists before the model is touched.
        let offload = GroupOffload::new(options.configure(config))?;
        // Taking the model apart into an in-memory store touches no device and cannot fail once the options are
        // valid (resident layers upload later, when the manager onloads the model), so the registered component
        // is taken out and consumed: its host tensors become the group store without a copy. A disk store can
        // fail (a full or read-only disk), and a model may refuse to be split, so then the store is built from a
        // copy of the handles while the registered component stays where it is, and is removed only once the
        // store exists.
        let copy = options.disk_store.is_some() || self.whole("split", |m| measure_layout(m).is_none())?;
        let model = if copy {
            self.whole("split", M::clone)?
        } else {
            let component: Box<dyn Any> = self.manager.remove(&self.id)?;
            match component.downcast::<BurnComponent<M>>() {
                Ok(component) => component.into_module(),
                Err(_) => unreachable!("the handle registered {} as a BurnComponent", self.id),
            }
        };
        let grouped = GroupedModel::split(model, offload, options)?;
        if copy {
            self.manager.remove(&self.id)?;
        }
        self.grouped = Some(grouped.offload().clone());
        self.id = self.manager.add(&self.name, grouped, None)?;
        Ok(())
    }

    fn not_grouped(&self, action: &str) -> Result<()> {
        if self.grouped.is_some() {
            return Err(Error::AlreadyApplied {
                component: self.name.clone(),
                action: action.to_string(),
                reason: "it is under group offload, whose store holds its weights".into(),
            });
        }
        Ok(())
    }
}

/// What a pipeline asks of any of its components without knowing its model type: the planner's and the
/// presets' view of a [`ModelHandle`].
pub trait Component {
    /// The component's name.
    fn name(&self) -> &str;
    /// Its id in the manager.
    fn id(&self) -> &str;
    /// The group offloader when it is under group offload.
    fn group_offload(&self) -> Option<&GroupOffload>;
    /// Whether it is under group offload.
    fn is_grouped(&self) -> bool {
        self.group_offload().is_some()
    }
    /// Group-offload statistics, when it is grouped.
    fn group_stats(&self) -> Option<GroupStats> {
        self.group_offload().map(GroupOffload::stats)
    }
    /// Whether its weights are quantized.
    fn is_quantized(&self) -> bool;
    /// Its layout for the planner; `None` for a model without block lists.
    fn layout(&self) -> Result<Option<BlockLayout>>;
    /// Puts it under group offload ([`ModelHandle::enable_group_offload`]).
    fn enable_group_offload(&mut self, options: &GroupOptions) -> Result<()>;
    /// Whether its host copy is its checkpoint files ([`ModelHandle::is_file_tier`]).
    fn is_file_tier(&self) -> bool {
        false
    }
    /// Reads it from its checkpoint files into host memory ([`ModelHandle::load_into_ram`]); nothing for a
    /// component already in memory.
    fn load_into_ram(&mut self) -> Result<()> {
        Ok(())
    }
}

impl<M: OffloadModel + Clone> Component for ModelHandle<M> {
    fn name(&self) -> &str {
        ModelHandle::name(self)
    }

    fn id(&self) -> &str {
        ModelHandle::id(self)
    }

    fn group_offload(&self) -> Option<&GroupOffload> {
        ModelHandle::group_offload(self)
    }

    fn is_quantized(&self) -> bool {
        ModelHandle::is_quantized(self)
    }

    fn layout(&self) -> Result<Option<BlockLayout>> {
        ModelHandle::layout(self)
    }

    fn enable_group_offload(&mut self, options: &GroupOptions) -> Result<()> {
        ModelHandle::enable_group_offload(self, options)
    }

    fn is_file_tier(&self) -> bool {
        ModelHandle::is_file_tier(self)
    }

    fn load_into_ram(&mut self) -> Result<()> {
        ModelHandle::load_into_ram(self)
    }
}
