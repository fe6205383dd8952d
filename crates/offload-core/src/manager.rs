//! `ComponentsManager`: the registry of components and the auto offloader that moves them on demand.
//!
//! # Locks
//!
//! - `state` (one mutex) protects the registry, each component's cached placement, the auto offload settings,
//!   the schedule of uses and the timeline's handle. Every decision and every move happens with it held, so two
//!   threads never decide on the same reading and a component is never onloaded twice.
//! - Each component sits in its own `slot` mutex. A run holds its component's slot for the whole call, without
//!   `state`, so components compute in parallel.
//! - A claim is a handle on a component's slot, cloned under `state`; the claims on a component are its slot's
//!   handles less the registry's own, so a claim is released by dropping it, without `state`.
//! - Lock order: a thread that holds `state` only locks the slots of components that nobody has claimed; a
//!   thread that runs a component claims it (under `state`) before it locks that slot. So a slot wanted under
//!   `state` is never held by a thread that waits for `state`, and no cycle can form.
//! - The record has its own small lock, taken only to push or copy events; so has the timeline.
//!
//! # The resident path
//!
//! A run of a component that is already on the execution device takes `state` once (find the component, check
//! its type, claim it, count the use, see that it is resident, clone the timeline's handle), then its slot for
//! the call: no allocation, no second look-up, and nothing more while the timeline is disabled. A resident component
//! that streams ([`Offloadable::window_bytes`] above 0: a model under group offload) takes `state` a second time,
//! to check that its window still fits beside the reserve and make room for it when it does not.

use std::any::{TypeId, type_name};
use std::fmt;
use std::sync::Arc;

use offload_strategy::{Auto, ComponentView, OffloadStrategy, OffloadView, ResidentComponent};
use parking_lot::Mutex;

use crate::component::{ComponentError, Offloadable};
use crate::device::{DeviceMemory, DeviceName};
use crate::error::{Error, Result};
use crate::record::{Action, OffloadEvent, OffloadRecord, Reason, format_table};
use crate::size::format_size;
use crate::timeline::{Timeline, category};

type Slot = Arc<Mutex<Box<dyn Offloadable>>>;

struct Entry {
    id: String,
    /// Shared with the schedule of uses, which records a use without copying the name.
    name: Arc<str>,
    collection: Option<String>,
    class_name: String,
    /// The component's concrete type, so a run checks it under `state` without locking the slot.
    type_id: TypeId,
    slot: Slot,
    /// Full weight size.
    bytes: u64,
    /// Bytes held on the device while resident.
    resident_bytes: u64,
    /// Where the component is, as of its last move.
    device: DeviceName,
    evictable: bool,
    /// Its footprint on the execution device, once a whole onload measured it ([`Offloadable::device_footprint`]).
    footprint: Option<u64>,
    /// The use index of the component's most recent run since auto offload was enabled.
    last_use: u64,
}

impl Entry {
    /// Runs in flight (or about to start) and inspections on this component; a claimed component is never
    /// moved by others. Every handle on the slot outside the registry is a claim's: handles are cloned only
    /// under `state` by [`ComponentsManager::claim`]. Read under `state`, the count cannot grow meanwhile; it
    /// may only fall, as a run ends.
    fn claims(&self) -> usize {
        Arc::strong_count(&self.slot) - 1
    }
}

struct AutoOffload {
    memory: Arc<dyn DeviceMemory>,
    device: DeviceName,
    reserve: u64,
    retry_on_oom: bool,
    strategy: Arc<dyn OffloadStrategy>,
    /// The uses counted so far: the index of the last one.
    use_index: u64,
    /// The name of the component of each use, in order.
    uses: Schedule,
}

impl AutoOffload {
    /// Counts a use of the component named `name` and returns its index (1 for the first).
    fn count_use(&mut self, name: &Arc<str>) -> u64 {
        self.use_index += 1;
        self.uses.push(name);
        self.use_index
    }
}

/// The schedule of uses, run-length encoded: consecutive uses of one name are one run, so the thousands of steps
/// of a denoising loop are one entry, and recording a use never copies a name (it shares the entry's).
#[derive(Default)]
struct Schedule {
    runs: Vec<(Arc<str>, u64)>,
}

impl Schedule {
    fn push(&mut self, name: &Arc<str>) {
        match self.runs.last_mut() {
            Some((last, count)) if Arc::ptr_eq(last, name) || **last == **name => *count += 1,
            _ => self.runs.push((name.clone(), 1)),
        }
    }

    /// One name per use, in order: the `i`-th is use `i + 1`.
    fn names(&self) -> Vec<String> {
        let mut names = Vec::with_capacity(self.runs.iter().map(|(_, n)| *n as usize).sum());
        for (name, count) in &self.runs {
            names.extend(std::iter::repeat_n(name.to_string(), *count as usize));
        }
        names
    }
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    next_seq: u64,
    auto: Option<AutoOffload>,
    /// Where runs and moves are recorded; its handle is cloned under `state` with the rest of a run's start.
    timeline: Timeline,
}

impl State {
    fn index(&self, id: &str) -> Result<usize> {
        self.entries.iter().position(|e| e.id == id).ok_or_else(|| Error::UnknownComponent {
            id: id.to_string(),
            known: self.entries.iter().map(|e| e.id.as_str()).collect::<Vec<_>>().join(", "),
        })
    }
}

/// A filter for [`ComponentsManager::get_one`]: by id alone, or by name and/or collection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookup {
    /// An exact component id; takes no other filter.
    pub id: Option<String>,
    /// An exact component name.
    pub name: Option<String>,
    /// An exact collection name.
    pub collection: Option<String>,
}

impl Lookup {
    /// Looks up by id.
    pub fn id(id: impl Into<String>) -> Self {
        Self { id: Some(id.into()), ..Self::default() }
    }

    /// Looks up by name.
    pub fn name(name: impl Into<String>) -> Self {
        Self { name: Some(name.into()), ..Self::default() }
    }

    /// Narrows the lookup to a collection.
    pub fn in_collection(mut self, collection: impl Into<String>) -> Self {
        self.collection = Some(collection.into());
        self
    }
}

impl fmt::Display for Lookup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = [("id", &self.id), ("name", &self.name), ("collection", &self.collection)]
            .iter()
            .filter_map(|(key, value)| value.as_ref().map(|v| format!("{key}={v:?}")))
            .collect();
        if parts.is_empty() { f.write_str("(no filter)") } else { f.write_str(&parts.join(" ")) }
    }
}

/// What the manager knows about one component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentInfo {
    /// The id, `<name>_<n>`.
    pub id: String,
    /// The name it was added under.
    pub name: String,
    /// Its collection, if any.
    pub collection: Option<String>,
    /// Its class name.
    pub class_name: String,
    /// Total weight bytes.
    pub bytes: u64,
    /// Bytes on the device while resident.
    pub resident_bytes: u64,
    /// Where it is now.
    pub device: DeviceName,
    /// The execution device, when auto offload is enabled.
    pub execution_device: Option<DeviceName>,
    /// Whether the manager may evict it wholesale ([`Offloadable::evictable`]): false for a model under group
    /// offload that is never released whole.
    pub evictable: bool,
}

/// The settings of auto offload, as enabled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoOffloadSettings {
    /// The execution device.
    pub device: DeviceName,
    /// Bytes kept free for activations.
    pub reserve: u64,
    /// Whether out-of-memory errors are retried after offloading another component.
    pub retry_on_oom: bool,
    /// The strategy's name.
    pub strategy: String,
}

/// A registry of components with auto offload: components move onto the execution device when they run, and
/// a strategy decides what leaves to make room.
///
/// The manager is `Send + Sync`; share it behind an `Arc` and run components from several threads. See the
/// module documentation for what each lock protects.
///
/// ```
/// use std::sync::Arc;
/// use offload_core::{ComponentError, ComponentsManager, DeviceMemory, DeviceName, Offloadable};
///
/// # struct Card;
/// # impl DeviceMemory for Card {
/// #     fn device(&self) -> DeviceName { DeviceName::parse("cuda").unwrap() }
/// #     fn total(&self) -> u64 { 1 << 30 }
/// #     fn available(&self) -> u64 { 1 << 30 }
/// #     fn allocated(&self) -> u64 { 0 }
/// #     fn peak(&self) -> u64 { 0 }
/// # }
/// struct Model { device: DeviceName }
/// impl Offloadable for Model {
///     fn bytes(&self) -> u64 { 4096 }
///     fn device(&self) -> DeviceName { self.device.clone() }
///     fn onload(&mut self, d: &DeviceName) -> Result<(), ComponentError> { self.device = d.clone(); Ok(()) }
///     fn offload(&mut self) -> Result<(), ComponentError> { self.device = DeviceName::cpu(); Ok(()) }
/// }
///
/// let manager = ComponentsManager::new();
/// let id = manager.add("unet", Model { device: DeviceName::cpu() }, None)?;
/// manager.enable_auto_offload(Arc::new(Card), 0, true)?;
/// let where_it_ran = manager.run(&id, |model: &mut Model| Ok(model.device.to_string()))?;
/// assert_eq!(where_it_ran, "cuda:0");
/// println!("{}", manager.offload_record());
/// # Ok::<(), offload_core::Error>(())
/// ```
pub struct ComponentsManager {
    state: Mutex<State>,
    record: OffloadRecord,
}

impl Default for ComponentsManager {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ComponentsManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock();
        f.debug_struct("ComponentsManager")
            .field("components", &state.entries.iter().map(|e| &e.id).collect::<Vec<_>>())
            .field("auto_offload", &state.auto.as_ref().map(|a| a.device.as_str()))
            .finish()
    }
}

/// A claim on a component: a handle on its slot, cloned under `state` ([`ComponentsManager::claim`]) and
/// released when a run or an inspection ends, however it ends, by dropping it ([`Entry::claims`] counts them).
/// A component without claims has no slot handle outside the registry, so `remove` can always take it back.
type Claim = Slot;

/// What a run learns under `state` as it starts ([`ComponentsManager::start_run`]).
struct Started {
    claim: Claim,
    timeline: Timeline,
    /// The run's use index, or `None` while auto offload is disabled.
    use_index: Option<u64>,
    /// Whether the component is where the run computes (always, while auto offload is disabled). A claimed
    /// component is never moved off the device by another thread, so it stays true once the slot is locked.
    ready: bool,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl ComponentsManager {
    /// An empty manager with auto offload disabled.
    pub fn new() -> Self {
        Self { state: Mutex::new(State::default()), record: OffloadRecord::new() }
    }

    /// Adds a component under `name` (and optionally a collection) and returns its id, `<name>_<n>`.
    ///
    /// A collection holds one component per name: adding a second `vae` to a collection replaces the first,
    /// which is removed from the manager (moved to the host and dropped). While auto offload is enabled the
    /// newcomer is moved to the host and hooked in; nothing else moves.
    pub fn add<C: Offloadable>(&self, name: &str, component: C, collection: Option<&str>) -> Result<String> {
        if !valid_name(name) {
            return Err(Error::InvalidName { name: name.to_string() });
        }
        if let Some(collection) = collection
            && !valid_name(collection)
        {
            return Err(Error::InvalidName { name: collection.to_string() });
        }
        let mut component: Box<dyn Offloadable> = Box::new(component);
        let mut state = self.state.lock();
        if state.auto.is_some() && !component.device().is_cpu() {
            component.offload().map_err(|source| Error::Component {
                operation: "offload",
                id: name.to_string(),
                source,
            })?;
        }
        if let Some(collection) = collection {
            let replaced = state
                .entries
                .iter()
                .find(|e| *e.name == *name && e.collection.as_deref() == Some(collection))
                .map(|e| e.id.clone());
            if let Some(old) = replaced {
                tracing::warn!("collection {collection} already holds a {name} ({old}); replacing it");
                Self::remove_locked(&mut state, &old)?;
            }
        }
        state.next_seq += 1;
        let id = format!("{name}_{}", state.next_seq);
        let entry = Entry {
            id: id.clone(),
            name: name.into(),
            collection: collection.map(str::to_string),
            class_name: component.class_name(),
            type_id: TypeId::of::<C>(),
            bytes: component.bytes(),
            resident_bytes: component.resident_bytes(),
            device: component.device(),
            evictable: component.evictable(),
            footprint: component.device_footprint(),
            slot: Arc::new(Mutex::new(component)),
            last_use: 0,
        };
        state.entries.push(entry);
        Ok(id)
    }

    /// Removes a component, moves it to the host and hands it back. Only that component is detached.
    pub fn remove(&self, id: &str) -> Result<Box<dyn Offloadable>> {
        let mut state = self.state.lock();
        Self::remove_locked(&mut state, id)
    }

    fn remove_locked(state: &mut State, id: &str) -> Result<Box<dyn Offloadable>> {
        let index = state.index(id)?;
        // Every slot handle outside the registry is a claim, cloned only under `state`: with none, nobody can
        // reach the component while it is taken out.
        if state.entries[index].claims() > 0 {
            return Err(Error::InUse { id: id.to_string(), operation: "remove" });
        }
        {
            let mut component = state.entries[index].slot.lock();
            if !component.device().is_cpu() {
                component.offload().map_err(|source| Error::Component {
                    operation: "offload",
                    id: id.to_string(),
                    source,
                })?;
            }
        }
        let entry = state.entries.remove(index);
        // Nobody else holds the slot: it is unclaimed and we hold `state`.
        match Arc::try_unwrap(entry.slot) {
            Ok(slot) => Ok(slot.into_inner()),
            Err(_) => Err(Error::InUse { id: id.to_string(), operation: "remove" }),
        }
    }

    /// Finds exactly one component: by id alone, or by name and/or collection. None or several is an error.
    pub fn get_one(&self, lookup: &Lookup) -> Result<String> {
        let state = self.state.lock();
        if let Some(id) = &lookup.id {
            if lookup.name.is_some() || lookup.collection.is_some() {
                return Err(Error::AmbiguousLookup { query: lookup.to_string() });
            }
            return state.index(id).map(|i| state.entries[i].id.clone());
        }
        let mut ids: Vec<String> = state
            .entries
            .iter()
            .filter(|e| lookup.name.as_deref().is_none_or(|n| n == &*e.name))
            .filter(|e| lookup.collection.as_ref().is_none_or(|c| Some(c) == e.collection.as_ref()))
            .map(|e| e.id.clone())
            .collect();
        match ids.len() {
            0 => Err(Error::NoMatch { query: lookup.to_string() }),
            1 => Ok(ids.remove(0)),
            _ => {
                ids.sort();
                Err(Error::MultipleMatches { query: lookup.to_string(), ids })
            }
        }
    }

    /// The ids of every component, in registration order.
    pub fn ids(&self) -> Vec<String> {
        self.state.lock().entries.iter().map(|e| e.id.clone()).collect()
    }

    /// The ids in a collection, in registration order.
    pub fn collection(&self, collection: &str) -> Vec<String> {
        let state = self.state.lock();
        state.entries.iter().filter(|e| e.collection.as_deref() == Some(collection)).map(|e| e.id.clone()).collect()
    }

    /// What the manager knows about a component.
    pub fn component_info(&self, id: &str) -> Result<ComponentInfo> {
        let state = self.state.lock();
        let entry = &state.entries[state.index(id)?];
        Ok(ComponentInfo {
            id: entry.id.clone(),
            name: entry.name.to_string(),
            collection: entry.collection.clone(),
            class_name: entry.class_name.clone(),
            bytes: entry.bytes,
            resident_bytes: entry.resident_bytes,
            device: entry.device.clone(),
            execution_device: state.auto.as_ref().map(|a| a.device.clone()),
            evictable: entry.evictable,
        })
    }

    /// The footprints on the execution device measured so far, one per component that measured one at a whole
    /// onload ([`Offloadable::device_footprint`]), in registration order, under the names the components were
    /// added with: what a plan for that device counts their weights as ([`DeviceFacts::with_footprints`]), and
    /// what `ProfileStore::record_footprints` (feature `io`) keeps for the next process.
    ///
    /// [`DeviceFacts::with_footprints`]: crate::plan::DeviceFacts::with_footprints
    pub fn device_footprints(&self) -> Vec<crate::measured::Footprint> {
        let state = self.state.lock();
        state
            .entries
            .iter()
            .filter_map(|e| {
                e.footprint.map(|device_bytes| crate::measured::Footprint {
                    component: e.name.to_string(),
                    weight_bytes: e.bytes,
                    device_bytes,
                })
            })
            .collect()
    }

    /// The call footprints measured so far, one per component that measured its first call at an estimate on a
    /// device with pages of its own ([`Offloadable::call_footprint`]), in registration order, under the names the
    /// components were added with: what a plan for that device counts their calls as
    /// ([`DeviceFacts::with_call_footprints`]), and what `ProfileStore::record_call_footprints` (feature `io`)
    /// keeps for the next process. Each component is asked under its own lock, so this waits for a run in
    /// progress; call it between runs.
    ///
    /// [`DeviceFacts::with_call_footprints`]: crate::plan::DeviceFacts::with_call_footprints
    pub fn call_footprints(&self) -> Vec<crate::measured::CallFootprint> {
        let slots: Vec<(String, Slot)> =
            self.state.lock().entries.iter().map(|e| (e.name.to_string(), e.slot.clone())).collect();
        slots
            .into_iter()
            .filter_map(|(component, slot)| {
                slot.lock().call_footprint().map(|call| crate::measured::CallFootprint {
                    component,
                    estimate_bytes: call.estimate_bytes,
                    device_bytes: call.device_bytes,
                })
            })
            .collect()
    }

    /// Where each component is now, in registration order.
    pub fn placement(&self) -> Vec<(String, DeviceName)> {
        self.state.lock().entries.iter().map(|e| (e.id.clone(), e.device.clone())).collect()
    }

    /// The shared offload record. It survives `disable_auto_offload` and is cleared by the next enable.
    pub fn offload_record(&self) -> OffloadRecord {
        self.record.clone()
    }

    /// Records every run, onload and offload from now on in `timeline` (as spans of categories `run`,
    /// `onload` and `offload` named by the component id, with its bytes and the move's reason), with a sample of
    /// the device memory counter before and after each move. Disabled by default ([`Timeline::disabled`]).
    ///
    /// Share the same timeline with everything else that records the run (a group offloader's configuration, a
    /// pipeline's phases) before they start: they keep the timeline they were given.
    pub fn set_timeline(&self, timeline: Timeline) {
        self.state.lock().timeline = timeline;
    }

    /// The timeline moves are recorded in (a disabled one unless [`set_timeline`](Self::set_timeline) set one).
    pub fn timeline(&self) -> Timeline {
        self.state.lock().timeline.clone()
    }

    /// The current auto offload settings, or `None` when disabled.
    pub fn auto_offload(&self) -> Option<AutoOffloadSettings> {
        self.state.lock().auto.as_ref().map(|a| AutoOffloadSettings {
            device: a.device.clone(),
            reserve: a.reserve,
            retry_on_oom: a.retry_on_oom,
            strategy: a.strategy.name().to_string(),
        })
    }

    /// Enables auto offload onto the device `memory` reads, keeping `reserve` bytes free for activations.
    ///
    /// Every component moves to the host, the record is cleared and the strategy is [`Auto`]. Calling it again
    /// is safe: the previous session is disabled first (recording `offloading_disabled` for what was
    /// resident), then the new one starts the same way. Fails with [`Error::InUse`] while a run is in flight,
    /// and with [`Error::HostExecution`] when `memory` reads the host (`cpu`): there is nothing to offload to.
    pub fn enable_auto_offload(&self, memory: Arc<dyn DeviceMemory>, reserve: u64, retry_on_oom: bool) -> Result<()> {
        if memory.device().is_cpu() {
            return Err(Error::HostExecution { device: memory.device() });
        }
        let mut state = self.state.lock();
        self.disable_locked(&mut state)?;
        for entry in &mut state.entries {
            entry.last_use = 0;
            if !entry.device.is_cpu() {
                entry.slot.lock().offload().map_err(|source| Error::Component {
                    operation: "offload",
                    id: entry.id.clone(),
                    source,
                })?;
                entry.device = DeviceName::cpu();
            }
        }
        self.record.clear();
        let device = memory.device();
        tracing::info!(%device, reserve = %format_size(reserve), retry_on_oom, "auto offload enabled");
        state.auto = Some(AutoOffload {
            memory,
            device,
            reserve,
            retry_on_oom,
            strategy: Arc::new(Auto),
            use_index: 0,
            uses: Schedule::default(),
        });
        Ok(())
    }

    /// The component name of every run since auto offload was enabled, in order, one per use (an OOM retry's
    /// re-run is the same use): the schedule a [`Lookahead`](offload_strategy::Lookahead) replays, whose
    /// positions are the strategies' [`use_index`](offload_strategy::OffloadView::use_index). Empty while
    /// disabled.
    pub fn uses(&self) -> Vec<String> {
        self.state.lock().auto.as_ref().map(|a| a.uses.names()).unwrap_or_default()
    }

    /// Replaces the strategy. Components added later inherit it. Fails before `enable_auto_offload`.
    pub fn set_offload_strategy(&self, strategy: Arc<dyn OffloadStrategy>) -> Result<()> {
        let mut state = self.state.lock();
        let auto = state.auto.as_mut().ok_or(Error::NotEnabled)?;
        auto.strategy = strategy;
        Ok(())
    }

    /// Disables auto offload: records `offloading_disabled` for each resident component, moves everything to
    /// the host and keeps the record. Does nothing when already disabled.
    pub fn disable_auto_offload(&self) -> Result<()> {
        let mut state = self.state.lock();
        self.disable_locked(&mut state)
    }

    fn disable_locked(&self, state: &mut State) -> Result<()> {
        let Some(auto) = state.auto.as_ref() else { return Ok(()) };
        if let Some(busy) = state.entries.iter().find(|e| e.claims() > 0) {
            return Err(Error::InUse { id: busy.id.clone(), operation: "disable auto offload while running" });
        }
        let memory = auto.memory.clone();
        let device = auto.device.clone();
        let timeline = state.timeline.clone();
        for entry in &mut state.entries {
            if entry.device != device {
                continue;
            }
            self.offload_entry(entry, memory.as_ref(), &timeline, Reason::OffloadingDisabled)?;
        }
        state.auto = None;
        tracing::info!(%device, "auto offload disabled");
        Ok(())
    }

    /// Runs a component of type `C`: onloads it (asking the strategy what to offload first), then calls `f`.
    ///
    /// `f` is any entry point (`forward`, a VAE's `decode`): the run is a closure, not a method name. When `f`
    /// or the onload fails with [`ComponentError::OutOfMemory`] and retry is on, the smallest other resident
    /// component is offloaded (recorded as `oom_retry:<id>`) and `f` runs again from the same inputs, one
    /// component per failure. When nothing is left to offload, what the components under group offload hold only
    /// for their next call goes back ([`Offloadable::release_idle`]: the others', then, once a run, this one's own)
    /// and `f` runs again; when nothing of that is left either, the error is [`Error::DoesNotFit`], which points
    /// to group offload. With auto offload disabled, `f` runs wherever the component is.
    pub fn run<C, R>(&self, id: &str, mut f: impl FnMut(&mut C) -> Result<R, ComponentError>) -> Result<R>
    where
        C: Offloadable,
    {
        self.run_dyn(id, Some((TypeId::of::<C>(), type_name::<C>())), |component| {
            let any: &mut dyn std::any::Any = component;
            match any.downcast_mut::<C>() {
                Some(typed) => f(typed),
                // The type was checked when the run started, and a registered component's type never changes.
                None => Err(ComponentError::other("component type changed during a run")),
            }
        })
    }

    /// Runs a component without knowing its type; see [`run`](Self::run).
    pub fn run_any<R>(&self, id: &str, f: impl FnMut(&mut dyn Offloadable) -> Result<R, ComponentError>) -> Result<R> {
        self.run_dyn(id, None, f)
    }

    /// Runs `f` on the component `id`, whose type must be `requested` (its `TypeId` and name) when one is given.
    fn run_dyn<R>(
        &self,
        id: &str,
        requested: Option<(TypeId, &'static str)>,
        mut f: impl FnMut(&mut dyn Offloadable) -> Result<R, ComponentError>,
    ) -> Result<R> {
        let Started { claim, timeline, use_index, mut ready } = self.start_run(id, requested)?;
        // The claim is released last: after the slot's guard, and after the run's span is recorded.
        let mut component = claim.lock();
        // A resident component that streams (a model under group offload) goes through the decision all the same:
        // what its call brings onto the device may no longer fit beside what was onloaded since its last call.
        if ready && use_index.is_some() && component.window_bytes() > 0 {
            ready = false;
        }
        // The run's span covers its onload (and the offloads that made room for it), its call and any retry.
        let _run = timeline.into_span(category::RUN, id);
        let mut offloaded_for_retry: Vec<String> = Vec::new();
        let mut gave_back_own_idle = false;
        loop {
            let outcome = match (ready, use_index) {
                (true, _) | (false, None) => f(component.as_mut()),
                (false, Some(use_index)) => match self.prepare(id, component.as_mut(), use_index) {
                    Ok(()) => f(component.as_mut()),
                    Err(PrepareFailure::Manager(error)) => return Err(error),
                    Err(PrepareFailure::OutOfMemory(error)) => Err(error),
                },
            };
            // A retry checks the placement again under `state`, and onloads if it must.
            ready = false;
            match outcome {
                Ok(value) => return Ok(value),
                Err(error) if error.is_out_of_memory() => {
                    // The failed call's partial allocations are held while the retry is decided and recorded,
                    // then given back before the call runs again or the error leaves.
                    let made_room = self.make_room_after_oom(id, error, &mut offloaded_for_retry);
                    component.release_failed_call();
                    match made_room {
                        // Nothing of the others is left to give: what this component holds only for its own next
                        // call (a grouped model's prefetches, which its worker may have uploaded while the call
                        // ran) goes back, once a run, so a call that fills the room again each time it runs ends
                        // with the verdict instead of a loop. Its failed call has ended: nothing borrows them.
                        Err(does_not_fit @ Error::DoesNotFit { .. }) => {
                            if gave_back_own_idle {
                                return Err(does_not_fit);
                            }
                            gave_back_own_idle = true;
                            let released = component.release_idle();
                            if released == 0 {
                                return Err(does_not_fit);
                            }
                            tracing::warn!(
                                component = id,
                                released = %format_size(released),
                                "out of device memory with nothing else to offload; gave back what this component \
                                 had prefetched for its next call, and retrying"
                            );
                        }
                        other => other?,
                    }
                }
                Err(source) => return Err(Error::Component { operation: "run", id: id.to_string(), source }),
            }
        }
    }

    /// Starts a run under one lock of `state`: finds the component, checks its type (nothing is claimed or
    /// counted for the wrong one), claims it, counts the use and says whether it is already where it computes.
    fn start_run(&self, id: &str, requested: Option<(TypeId, &'static str)>) -> Result<Started> {
        let mut state = self.state.lock();
        let index = state.index(id)?;
        let State { entries, auto, timeline, .. } = &mut *state;
        let entry = &mut entries[index];
        if let Some((type_id, requested)) = requested
            && entry.type_id != type_id
        {
            return Err(Error::WrongType {
                id: id.to_string(),
                actual: entry.class_name.clone(),
                requested: requested.to_string(),
            });
        }
        let (use_index, ready) = match auto {
            Some(auto) => {
                let use_index = auto.count_use(&entry.name);
                entry.last_use = use_index;
                (Some(use_index), entry.device == auto.device)
            }
            None => (None, true),
        };
        Ok(Started { claim: entry.slot.clone(), timeline: timeline.clone(), use_index, ready })
    }

    /// Makes the claimed component resident on the execution device for its use `use_index` (counted when the
    /// run started), asking the strategy what to offload; for a component already there, makes room for what its
    /// call streams ([`Offloadable::window_bytes`]) when that does not fit beside the reserve.
    ///
    /// Both are one decision path: the strategy sees the incoming component at what its call needs on the device
    /// (its resident bytes and its window on an onload, its window alone once resident, the groups it holds
    /// already being in the reading), and each component it chooses leaves recorded as
    /// `release_memory_for:<id>`.
    fn prepare(&self, id: &str, component: &mut dyn Offloadable, use_index: u64) -> Result<(), PrepareFailure> {
        let mut state = self.state.lock();
        let index = state.index(id)?;
        let Some(auto) = state.auto.as_ref() else { return Ok(()) };
        let device = auto.device.clone();
        let onloaded = state.entries[index].device == device;
        // A streamed model holds only part of what its call needs: the groups it will hold at once as it runs are
        // counted, so that another component onloaded beside it since its last call leaves instead of refusing
        // its prefetches.
        let window = component.window_bytes();
        if onloaded && window == 0 {
            return Ok(());
        }
        let (memory, strategy, reserve) = (auto.memory.clone(), auto.strategy.clone(), auto.reserve);
        let timeline = state.timeline.clone();
        let resident_bytes = state.entries[index].resident_bytes;
        let incoming = {
            let entry = &state.entries[index];
            let needs = if onloaded { window } else { resident_bytes.saturating_add(window) };
            ComponentView::new(entry.id.clone(), entry.name.to_string(), needs)
        };
        let resident: Vec<ResidentComponent> = state
            .entries
            .iter()
            .filter(|e| e.id != id && e.device == device)
            .map(|e| ResidentComponent {
                component: ComponentView::new(e.id.clone(), e.name.to_string(), e.resident_bytes),
                evictable: e.evictable,
                in_use: e.claims() > 0,
                last_use: e.last_use,
            })
            .collect();
        // The decision is made on a reading that was taken: a device that cannot be read stops it, typed, rather
        // than deciding on a number that stands for nothing.
        let reading = memory.try_reading().map_err(|unknown| {
            PrepareFailure::Manager(Error::Component {
                operation: "read the device's memory for",
                id: id.to_string(),
                source: ComponentError::Device { device: unknown.device.clone(), message: unknown.to_string() },
            })
        })?;
        let view = OffloadView {
            incoming: &incoming,
            resident: &resident,
            reading,
            reserve,
            device: device.as_str(),
            use_index,
        };
        if onloaded && view.fits() {
            return Ok(());
        }
        // With nothing resident there is nothing to choose from, so the strategy is not asked.
        let chosen = if resident.is_empty() { Vec::new() } else { strategy.decide(&view) };
        for choice in &chosen {
            let problem = match resident.iter().find(|r| r.id() == choice) {
                None => Some("it is not resident on the execution device"),
                Some(r) if !r.evictable => Some("it is under group offload and is never evicted wholesale"),
                Some(r) if r.in_use => Some("it is running on another thread"),
                Some(_) => None,
            };
            if let Some(problem) = problem {
                return Err(PrepareFailure::Manager(Error::InvalidDecision {
                    strategy: strategy.name().to_string(),
                    id: choice.clone(),
                    incoming: id.to_string(),
                    problem,
                }));
            }
        }
        // Offload in registration order, each move recorded with the reading taken just before it.
        let victims: Vec<usize> = (0..state.entries.len()).filter(|i| chosen.contains(&state.entries[*i].id)).collect();
        for victim in victims {
            let reason = Reason::ReleaseMemoryFor(id.to_string());
            self.offload_entry(&mut state.entries[victim], memory.as_ref(), &timeline, reason)?;
        }
        if onloaded {
            tracing::debug!(
                component = id,
                window = %format_size(window),
                evicted = chosen.len(),
                "made room for the window of a streamed component: {}",
                view.describe()
            );
            return Ok(());
        }
        // The reading is taken just before the move; the event is recorded only once the move succeeded, so
        // the record's moves always add up to the placement.
        let reading = memory.reading();
        timeline.sample_memory(memory.as_ref());
        let mut span = timeline.span(category::ONLOAD, id).arg("bytes", resident_bytes).arg("device", device.as_str());
        let onloaded = component.onload(&device);
        if let Err(error) = &onloaded {
            span.set_arg("error", error.to_string());
        }
        drop(span);
        timeline.sample_memory(memory.as_ref());
        match onloaded {
            Ok(()) => {
                self.record.add(OffloadEvent {
                    action: Action::Onload,
                    id: id.to_string(),
                    bytes: resident_bytes,
                    reason: None,
                    available: Some(reading.available),
                    peak: Some(reading.peak),
                    read: None,
                    from_peer: None,
                });
                tracing::info!(component = id, device = %device, bytes = %format_size(resident_bytes), "onload");
                let entry = &mut state.entries[index];
                entry.device = device;
                entry.resident_bytes = component.resident_bytes();
                entry.footprint = component.device_footprint().or(entry.footprint);
                Ok(())
            }
            Err(error) if error.is_out_of_memory() => Err(PrepareFailure::OutOfMemory(error)),
            Err(source) => {
                Err(PrepareFailure::Manager(Error::Component { operation: "onload", id: id.to_string(), source }))
            }
        }
    }

    fn offload_entry(
        &self,
        entry: &mut Entry,
        memory: &dyn DeviceMemory,
        timeline: &Timeline,
        reason: Reason,
    ) -> Result<()> {
        let reading = memory.reading();
        timeline.sample_memory(memory);
        let mut span = timeline
            .span(category::OFFLOAD, &entry.id)
            .arg("bytes", entry.resident_bytes)
            .arg("reason", reason.to_string());
        let offloaded = entry.slot.lock().offload();
        if let Err(error) = &offloaded {
            span.set_arg("error", error.to_string());
        }
        drop(span);
        timeline.sample_memory(memory);
        offloaded.map_err(|source| Error::Component { operation: "offload", id: entry.id.clone(), source })?;
        entry.device = DeviceName::cpu();
        tracing::info!(component = %entry.id, %reason, bytes = %format_size(entry.resident_bytes), "offload");
        self.record.add(OffloadEvent {
            action: Action::Offload,
            id: entry.id.clone(),
            bytes: entry.resident_bytes,
            reason: Some(reason),
            available: Some(reading.available),
            peak: Some(reading.peak),
            read: None,
            from_peer: None,
        });
        Ok(())
    }

    /// After an out-of-memory error: offloads the smallest other resident component, or gives up.
    fn make_room_after_oom(&self, id: &str, error: ComponentError, offloaded: &mut Vec<String>) -> Result<()> {
        let mut state = self.state.lock();
        let Some(auto) = state.auto.as_ref() else {
            return Err(Error::Component { operation: "run", id: id.to_string(), source: error });
        };
        let (memory, device, retry) = (auto.memory.clone(), auto.device.clone(), auto.retry_on_oom);
        if !retry {
            return Err(Error::Component { operation: "run", id: id.to_string(), source: error });
        }
        let smallest = state
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.id != id && e.device == device && e.evictable && e.claims() == 0)
            .filter(|(_, e)| !offloaded.contains(&e.id))
            .min_by_key(|(i, e)| (e.resident_bytes, *i))
            .map(|(i, _)| i);
        let Some(victim) = smallest else {
            // Nothing left to evict: what the others hold only for their next call goes back before the verdict.
            let released: u64 = state
                .entries
                .iter()
                .filter(|e| e.id != id && e.device == device && !e.evictable && e.claims() == 0)
                .map(|e| e.slot.lock().release_idle())
                .sum();
            if released > 0 {
                tracing::warn!(
                    component = id,
                    released = %format_size(released),
                    "out of device memory ({error}); gave back what the components under group offload had \
                     prefetched, and retrying"
                );
                return Ok(());
            }
            let bytes = state.index(id).map(|i| state.entries[i].resident_bytes).unwrap_or(0);
            return Err(Error::DoesNotFit { id: id.to_string(), bytes, device, source: error });
        };
        tracing::warn!(
            component = id,
            evicted = %state.entries[victim].id,
            "out of device memory ({error}); offloading and retrying; if this repeats, set a larger reserve"
        );
        offloaded.push(state.entries[victim].id.clone());
        let timeline = state.timeline.clone();
        self.offload_entry(&mut state.entries[victim], memory.as_ref(), &timeline, Reason::OomRetry(id.to_string()))?;
        Ok(())
    }

    /// Claims a component for a run or an inspection: it will not be moved by others or removed meanwhile.
    fn claim(&self, id: &str) -> Result<Claim> {
        let state = self.state.lock();
        let index = state.index(id)?;
        Ok(state.entries[index].slot.clone())
    }

    /// Reads a component without moving it. While `f` runs the component is claimed: it is not moved or
    /// removed by other threads.
    pub fn inspect<C: Offloadable, R>(&self, id: &str, f: impl FnOnce(&C) -> R) -> Result<R> {
        let claim = self.claim(id)?;
        let component = claim.lock();
        let any: &dyn std::any::Any = component.as_ref();
        match any.downcast_ref::<C>() {
            Some(typed) => Ok(f(typed)),
            None => Err(Error::WrongType {
                id: id.to_string(),
                actual: component.class_name(),
                requested: type_name::<C>().to_string(),
            }),
        }
    }
}

enum PrepareFailure {
    Manager(Error),
    OutOfMemory(ComponentError),
}

impl From<Error> for PrepareFailure {
    fn from(error: Error) -> Self {
        PrepareFailure::Manager(error)
    }
}

impl fmt::Display for ComponentsManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock();
        let exec = state.auto.as_ref().map(|a| a.device.clone());
        let rows: Vec<Vec<String>> = state
            .entries
            .iter()
            .map(|e| {
                let device = match &exec {
                    Some(exec) => format!("{}({exec})", e.device),
                    None => e.device.to_string(),
                };
                let mode = if e.evictable { "component" } else { "group offload" };
                vec![
                    e.id.clone(),
                    e.class_name.clone(),
                    device,
                    format_size(e.bytes),
                    mode.to_string(),
                    e.collection.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        writeln!(f, "Components:")?;
        let lines = format_table(&["Name_ID", "Class", "Device: act(exec)", "Size", "Offload", "Collection"], &rows);
        let rule = "=".repeat(lines[0].chars().count());
        writeln!(f, "{rule}")?;
        for line in &lines {
            writeln!(f, "{line}")?;
        }
        match state.auto.as_ref() {
            Some(a) => write!(
                f,
                "auto offload: on {} with {} reserved, strategy {}, OOM retry {}",
                a.device,
                format_size(a.reserve),
                a.strategy.name(),
                if a.retry_on_oom { "on" } else { "off" }
            ),
            None => write!(f, "auto offload: off"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ReadingUnavailable;

    /// Readings that cannot be taken: the plain numbers read as a full device, `try_reading` says why.
    struct Unreadable;

    impl DeviceMemory for Unreadable {
        fn device(&self) -> DeviceName {
            DeviceName::parse("cuda").expect("a name")
        }
        fn total(&self) -> u64 {
            1 << 30
        }
        fn available(&self) -> u64 {
            0
        }
        fn allocated(&self) -> u64 {
            1 << 30
        }
        fn peak(&self) -> u64 {
            1 << 30
        }
        fn try_reading(&self) -> std::result::Result<offload_strategy::MemoryReading, ReadingUnavailable> {
            Err(ReadingUnavailable { device: self.device(), message: "the pool gave no answer".into() })
        }
    }

    struct Model {
        device: DeviceName,
        onloads: usize,
    }

    impl Offloadable for Model {
        fn bytes(&self) -> u64 {
            4096
        }
        fn device(&self) -> DeviceName {
            self.device.clone()
        }
        fn onload(&mut self, device: &DeviceName) -> std::result::Result<(), ComponentError> {
            self.onloads += 1;
            self.device = device.clone();
            Ok(())
        }
        fn offload(&mut self) -> std::result::Result<(), ComponentError> {
            self.device = DeviceName::cpu();
            Ok(())
        }
    }

    #[test]
    fn a_reading_that_cannot_be_taken_stops_the_decision_typed_and_moves_nothing() {
        let manager = ComponentsManager::new();
        let id = manager.add("unet", Model { device: DeviceName::cpu(), onloads: 0 }, None).expect("added");
        manager.enable_auto_offload(Arc::new(Unreadable), 0, true).expect("enabled");
        let error = manager.run(&id, |_: &mut Model| Ok(())).expect_err("no decision on an unknown reading");
        match &error {
            Error::Component { source: ComponentError::Device { message, .. }, .. } => {
                assert!(message.contains("cannot read the memory of cuda:0: the pool gave no answer"), "{message}");
            }
            other => panic!("expected a typed device error, got {other:?}"),
        }
        let onloads = manager.inspect(&id, |model: &Model| (model.onloads, model.device.clone())).expect("registered");
        assert_eq!(onloads, (0, DeviceName::cpu()), "nothing moved");
        assert!(manager.offload_record().events().is_empty(), "nothing recorded");
    }
}
