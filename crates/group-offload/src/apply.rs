//! A plan applied to a pipeline's components: the mechanism behind presets, for any model crate.
//!
//! The planner (`offload_core::plan`) is policy: it sees [`ComponentSpec`]s and a machine and returns a [`Plan`].
//! [`component_spec`] describes a registered component at its loaded size (weights, layout, quantization), which
//! the model crate completes with its activation estimate and FLOPs; [`apply_plan`] applies every route through
//! the manager and group offload:
//!
//! - `resident`: onloaded now and kept (the [`Staged`] strategy never offloads it);
//! - `component offload`: moved whole by the manager when it runs, off when the next phase's component comes;
//! - `block` / `leaf`: put under group offload ([`Component::enable_group_offload`]) with the plan's resident
//!   budget, prefetch depth, pinned budget and disk store, released whole between phases;
//! - `off` is refused ([`Error::Unmanaged`]): a pipeline runs every component through its manager.
//!
//! Auto offload is enabled on the device's readings with the [`Staged`] strategy, so each phase's component runs
//! with the device to itself and the resident components: the staging the planner assumes.

use std::sync::Arc;

use offload_core::offload_strategy::Staged;
#[cfg(feature = "io")]
use offload_core::plan::ProfileStore;
use offload_core::plan::{ComponentPlan, ComponentSpec, DeviceFacts, Plan, Route, Settings, Workload, plan_pipeline};
use offload_core::{ComponentsManager, DeviceMemory, format_size};

use crate::error::{Error, Result};
use crate::handle::Component;
use crate::model::{GroupLevel, GroupOptions};

/// What was applied to one component: the planned route, the route it runs, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedRoute {
    /// The component's name.
    pub component: String,
    /// Its id in the manager.
    pub id: String,
    /// The route the plan chose; `None` when the component was not planned (a plan of one component).
    pub planned: Option<Route>,
    /// The route applied (differs from the plan where a route is not supported).
    pub applied: Route,
    /// The mechanism, in words, and any difference from the plan.
    pub how: String,
}

/// A plan as applied: per component, what it runs under, and notes on what differs from the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedPlan {
    /// Per component, in the order given: planned and applied route.
    pub applied: Vec<AppliedRoute>,
    /// What the application does differently from the plan, or assumes, one sentence each.
    pub notes: Vec<String>,
}

/// A registered component as plan input, at its loaded size: its weight bytes (from the manager), its layout
/// ([`Component::layout`]: blocks in execution order, the bytes outside them, its leaf groups, at their quantized
/// sizes for a quantized component) and whether it is quantized. The model crate adds the activation estimate and the FLOPs.
/// Refused once the component is under group offload (its blocks cannot be measured again).
pub fn component_spec(manager: &ComponentsManager, component: &dyn Component) -> Result<ComponentSpec> {
    let bytes = manager.component_info(component.id())?.bytes;
    // Its files serve its host copy when it was registered from them and its weights are as they are stored (a
    // quantized one differs: its copy lives in RAM or the disk store).
    let file_backed = component.is_file_tier() && !component.is_quantized();
    let mut spec =
        ComponentSpec::new(component.name(), bytes).quantized(component.is_quantized()).with_file_backed(file_backed);
    if let Some(layout) = component.layout()? {
        spec = spec.with_layout(layout);
    }
    Ok(spec)
}

/// Applies every route of `plan` to `components` (see the module documentation): group moves are charged to
/// each component's placement (its device's one account), auto offload reads `device.memory`, the resident ones
/// are onloaded now. Components the plan does not
/// name move whole (component offload, staged).
pub fn apply_plan(
    manager: &Arc<ComponentsManager>,
    components: &mut [&mut dyn Component],
    specs: &[ComponentSpec],
    plan: &Plan,
    settings: &Settings,
    device: &DeviceFacts,
) -> Result<AppliedPlan> {
    if let Some(off) = plan.components.iter().find(|c| c.route == Route::Off) {
        return Err(Error::Unmanaged { component: off.component.clone(), preset: plan.preset.to_string() });
    }
    // A component registered from its files that the plan keeps in RAM is read into memory first (the RAM tier);
    // the others keep their files (or go to the disk store when they stream).
    for component in components.iter_mut() {
        let planned = plan.component(component.name());
        if component.is_file_tier() && planned.is_some_and(|p| p.host_tier == offload_core::plan::HostTier::Ram) {
            component.load_into_ram()?;
        }
    }
    let mut streamed: Vec<(String, Route, String)> = Vec::new();
    for component in components.iter_mut() {
        let spec = specs.iter().find(|s| s.name == component.name());
        if let Some(applied) = apply_group_offload(&mut **component, plan, settings, spec)? {
            streamed.push((component.name().to_string(), applied.0, applied.1));
        }
    }
    let mut notes = Vec::new();
    for planned in &plan.components {
        let streams = streamed.iter().any(|(name, ..)| *name == planned.component);
        if planned.pinned_bytes > 0 && !streams {
            notes.push(format!(
                "{}: the plan pins {} of its host copy, but a component that moves whole goes with burn's to_device \
                 from its own host tensors, which are not pinned (on CUDA, burn stages copies under 100 MiB through \
                 its pinned pool by itself): its copies run at the pageable rate, so its predicted time is optimistic",
                planned.component,
                format_size(planned.pinned_bytes)
            ));
        }
    }
    for component in components.iter() {
        let Some(offload) = component.group_offload() else { continue };
        let (pinned, page_locked) = offload.pinned_bytes();
        if pinned > page_locked {
            notes.push(format!(
                "{}: {} of host copies pinned through the device's staging, {} of them page-locked: this backend has \
                 no page-locked memory, so only the simulated card's pricing sees the difference",
                component.name(),
                format_size(pinned),
                format_size(page_locked)
            ));
        }
    }

    let reserve = plan.components.iter().map(|c| c.headroom_bytes).max().unwrap_or(0);
    manager.enable_auto_offload(device.memory.clone(), reserve, settings.retry_on_oom)?;
    let mut applied = Vec::new();
    let mut keep = Vec::new();
    for component in components.iter() {
        let (name, id) = (component.name().to_string(), component.id().to_string());
        let planned = plan.component(&name).map(|c| c.route);
        let group = streamed.iter().find(|(n, ..)| *n == name).map(|(_, route, how)| (*route, how.clone()));
        let (route, how) = match (group, planned) {
            (Some(applied), _) => applied,
            (_, Some(Route::Resident)) => {
                keep.push(id.clone());
                (Route::Resident, "resident: onloaded now and kept; the staged strategy never offloads it".to_string())
            }
            (_, Some(route)) => (
                route,
                "component offload: the manager moves it whole onto the device when it runs and off when the next \
                 phase's component comes"
                    .to_string(),
            ),
            (_, None) => (
                Route::ComponentOffload,
                "not planned: the manager moves it whole when it runs (component offload, staged)".to_string(),
            ),
        };
        applied.push(AppliedRoute { component: name, id, planned, applied: route, how });
    }
    manager.set_offload_strategy(Arc::new(Staged::keeping(keep.clone())))?;
    for id in &keep {
        manager.run_any(id, |_| Ok(()))?;
    }
    for route in &applied {
        tracing::info!(component = %route.component, route = %route.applied, "{}", route.how);
    }
    Ok(AppliedPlan { applied, notes })
}

/// The group options a planned route streams a component with (block or leaf level, with the plan's resident
/// budget, prefetch and disk store; the layers outside the blocks kept resident unless the plan streams them),
/// or `None` for a route that does not stream.
pub fn group_options(plan: &Plan, settings: &Settings, spec: &ComponentSpec) -> Option<GroupOptions> {
    let planned = plan.component(&spec.name)?;
    let outside = spec.layout.as_ref()?.outside_bytes;
    let disk_store = if planned.on_disk { settings.disk_store_dir.clone() } else { None };
    match planned.route {
        Route::BlockGroupOffload { blocks_per_group, prefetch, depth } => {
            // The plan's resident bytes are the kept groups plus the outside layers, unless the full-pin rule
            // streams those too (then it keeps nothing).
            let keep_outside = planned.resident_weight_bytes >= outside;
            Some(GroupOptions {
                level: GroupLevel::Block { blocks_per_group },
                prefetch,
                prefetch_depth: depth,
                resident_budget: planned.resident_weight_bytes.saturating_sub(if keep_outside { outside } else { 0 }),
                pinned_budget: planned.pinned_bytes,
                disk_store,
                ram_budget: planned.ram_streamed_bytes,
                donor_budgets: donor_budgets(plan, planned),
                pinned_groups: planned.pinned_groups.clone(),
                ram_groups: planned.ram_streamed_groups.clone(),
                donor_groups: donor_groups(planned),
                releasable: true,
                keep_outside,
                ..GroupOptions::default()
            })
        }
        Route::LeafGroupOffload { prefetch } => Some(GroupOptions {
            prefetch,
            pinned_budget: planned.pinned_bytes,
            disk_store,
            ram_budget: planned.ram_streamed_bytes,
            donor_budgets: donor_budgets(plan, planned),
            pinned_groups: planned.pinned_groups.clone(),
            ram_groups: planned.ram_streamed_groups.clone(),
            donor_groups: donor_groups(planned),
            releasable: true,
            ..GroupOptions::leaf()
        }),
        _ => None,
    }
}

/// The bytes the plan holds on each of its machine's peers for this component, every peer listed (0 where it
/// holds nothing), so a donor the plan gave nothing holds nothing; empty where the plan had no peers.
fn donor_budgets(plan: &Plan, planned: &ComponentPlan) -> Vec<(String, u64)> {
    plan.machine.peers.iter().map(|peer| (peer.name.clone(), planned.peer_bytes(&peer.name))).collect()
}

/// The sizes of the groups the plan holds on each peer for this component, where it knows them (empty where it
/// does not: each donor then takes what fits its budget).
fn donor_groups(planned: &ComponentPlan) -> Vec<(String, Vec<u64>)> {
    if planned.peers.iter().all(|share| share.group_bytes.is_empty()) {
        return Vec::new();
    }
    planned.peers.iter().map(|share| (share.peer.clone(), share.group_bytes.clone())).collect()
}

/// Puts `component` under group offload when its planned route streams it; returns the applied route and how.
fn apply_group_offload(
    component: &mut dyn Component,
    plan: &Plan,
    settings: &Settings,
    spec: Option<&ComponentSpec>,
) -> Result<Option<(Route, String)>> {
    let Some(spec) = spec else { return Ok(None) };
    let Some(options) = group_options(plan, settings, spec) else { return Ok(None) };
    let Some(planned) = plan.component(&spec.name) else { return Ok(None) };
    let outside = spec.layout.as_ref().map_or(0, |l| l.outside_bytes);
    component.enable_group_offload(&options)?;
    let level = match options.level {
        GroupLevel::Block { blocks_per_group: 1 } => "block level, 1 block per group".to_string(),
        GroupLevel::Block { blocks_per_group } => format!("block level, {blocks_per_group} blocks per group"),
        GroupLevel::Leaf => "leaf level, one leaf layer at a time".to_string(),
    };
    let (pinned, page_locked) = component.group_offload().map_or((0, 0), |o| o.pinned_bytes());
    let how = format!(
        "group offload: {level}, {}, resident budget {} of groups, {} of host copies pinned ({} page-locked), the {} \
         outside the blocks {}, host copies {}; the staged strategy releases every group when the next phase's \
         component comes",
        if options.prefetch { format!("prefetch depth {}", options.prefetch_depth) } else { "no prefetch".into() },
        format_size(options.resident_budget),
        format_size(pinned),
        format_size(page_locked),
        format_size(outside),
        if options.keep_outside { "resident" } else { "streamed as one group" },
        host_copies(&options, component.is_file_tier())
    );
    Ok(Some((planned.route, how)))
}

/// Where a streamed component's host copies are, in the words of the applied plan: in host memory, its checkpoint
/// files or the disk store, and the RAM budget its reads from files are kept in.
fn host_copies(options: &GroupOptions, file_tier: bool) -> String {
    let tier = match &options.disk_store {
        Some(dir) => format!("as files in {}", dir.display()),
        None if file_tier => "in its checkpoint files".to_string(),
        None => "in host memory".to_string(),
    };
    let mut copies = tier;
    if options.ram_budget > 0 {
        copies.push_str(&format!(
            ", the reads of up to {} of streamed groups kept in host memory after their first read (the plan's \
             split of its streamed groups over RAM and the file)",
            format_size(options.ram_budget)
        ));
    }
    for (peer, bytes) in options.donor_budgets.iter().filter(|(_, bytes)| *bytes > 0) {
        copies.push_str(&format!(
            ", up to {} of streamed groups held on {peer} between their uploads (the plan's placement over the peers)",
            format_size(*bytes)
        ));
    }
    copies
}

/// A pipeline's plan as applied: the planner's [`Plan`] (its `Display` is the table and one reason per
/// component), what each component runs under, notes on what differs from the plan, and the capacity-profile
/// identity of its runs. Made by [`plan_and_apply`].
pub struct PipelinePlan {
    /// The planner's plan.
    pub plan: Plan,
    /// Per component, in pipeline order: planned and applied route.
    pub applied: Vec<AppliedRoute>,
    /// What the application does differently from the plan, or assumes, one sentence each.
    pub notes: Vec<String>,
    /// The settings the plan was made with (with the named profile's calibration loaded, if any).
    pub settings: Settings,
    /// Whether this plan is a calibration run of `settings.profile_name`: `record_run` then stores the
    /// recommended resident budget.
    pub calibration_run: bool,
    memory: Arc<dyn DeviceMemory>,
    workload: Workload,
    /// The component a calibration sizes the resident budget of, and its bytes outside the blocks (to tell its
    /// resident budget from its resident bytes).
    #[cfg_attr(not(feature = "io"), allow(dead_code))]
    calibrated: Option<(String, u64)>,
}

impl std::fmt::Debug for PipelinePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelinePlan")
            .field("plan", &self.plan)
            .field("applied", &self.applied)
            .field("notes", &self.notes)
            .field("calibration_run", &self.calibration_run)
            .finish()
    }
}

impl std::fmt::Display for PipelinePlan {
    /// The planner's plan, then what was applied per component and the notes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.plan)?;
        write_applied(f, &self.applied, &self.notes)
    }
}

impl std::fmt::Display for AppliedPlan {
    /// What was applied per component (`applied:`, a line each), then the notes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_applied(f, &self.applied, &self.notes)
    }
}

/// The `applied:` lines and the `notes:` of a plan as applied.
fn write_applied(f: &mut std::fmt::Formatter<'_>, applied: &[AppliedRoute], notes: &[String]) -> std::fmt::Result {
    writeln!(f, "applied:")?;
    for applied in applied {
        writeln!(f, "  {} ({}): {}", applied.component, applied.id, applied.how)?;
    }
    if !notes.is_empty() {
        writeln!(f, "notes:")?;
        for note in notes {
            writeln!(f, "  {note}")?;
        }
    }
    Ok(())
}

/// Plans `specs` for `device` with `settings` and applies the plan to `components` ([`apply_plan`]). Every
/// component goes back to the host first, so the reading is the device as the plan will have it; auto offload is
/// (re-)enabled with the [`Staged`] strategy.
///
/// `workload` is the capacity-profile identity of the pipeline (its model and sizes); the device's label and
/// total and the preset are added to it. `calibrated` names the component whose resident budget a calibration
/// run sizes (the one that streams by blocks). With `settings.profile_name`, the named calibration is loaded
/// from the profile store first (feature `io`; without it a profile name is refused).
pub fn plan_and_apply(
    manager: &Arc<ComponentsManager>,
    components: &mut [&mut dyn Component],
    specs: &[ComponentSpec],
    mut settings: Settings,
    device: &DeviceFacts,
    workload: Workload,
    calibrated: &str,
) -> Result<PipelinePlan> {
    if settings.profile_name.is_some() {
        load_calibration(&mut settings)?;
    }
    manager.disable_auto_offload()?;
    // What the components' weights take on this device where it was measured: stored by earlier runs, then
    // this process's own onloads, which replace them.
    let mut specs = specs.to_vec();
    let footprints: Vec<_> = device.footprints.iter().cloned().chain(manager.device_footprints()).collect();
    offload_core::plan::apply_footprints(&mut specs, &footprints);
    // What their calls took on it, the same way (a call counts as the larger of its estimate and its pages).
    let calls: Vec<_> = device.call_footprints.iter().cloned().chain(manager.call_footprints()).collect();
    offload_core::plan::apply_call_footprints(&mut specs, &calls);
    let specs = specs.as_slice();
    let plan = plan_pipeline(specs, settings.clone(), &device.machine())?;
    let outside = specs.iter().find(|s| s.name == calibrated).and_then(|s| s.layout.as_ref()).map(|l| l.outside_bytes);
    let applied = apply_plan(manager, components, specs, &plan, &settings, device)?;
    let calibration_run = settings.profile_name.is_some()
        && settings.resident_budget.is_none()
        && (settings.calibration.is_none() || settings.calibrate)
        && plan.component(calibrated).is_some_and(|c| matches!(c.route, Route::BlockGroupOffload { .. }));
    let workload = workload
        .with("device", device.label.clone())
        .with("device_total", plan.machine.device_total.to_string())
        .with("preset", plan.preset.name());
    Ok(PipelinePlan {
        plan,
        applied: applied.applied,
        notes: applied.notes,
        settings,
        calibration_run,
        memory: device.memory.clone(),
        workload,
        calibrated: outside.map(|outside| (calibrated.to_string(), outside)),
    })
}

#[cfg(feature = "io")]
fn load_calibration(settings: &mut Settings) -> Result<()> {
    ProfileStore::from_settings(settings)?.apply_calibration(settings)?;
    Ok(())
}

#[cfg(not(feature = "io"))]
fn load_calibration(settings: &mut Settings) -> Result<()> {
    Err(Error::InvalidConfig {
        model: settings.profile_name.clone().unwrap_or_default(),
        problem: "named calibration profiles are read from disk, which this build leaves out: enable \
                  group-offload's `io` feature, or unset profile_name"
            .into(),
    })
}

impl PipelinePlan {
    /// A component's plan by name.
    pub fn component(&self, name: &str) -> Option<&ComponentPlan> {
        self.plan.component(name)
    }

    /// A component's applied route by name.
    pub fn applied(&self, name: &str) -> Option<&AppliedRoute> {
        self.applied.iter().find(|a| a.component == name)
    }

    /// Why the plan routed a component as it did.
    pub fn why(&self, name: &str) -> Option<&str> {
        self.component(name).map(|c| c.why.as_str())
    }

    /// The device readings the plan was made from and the run is measured with.
    pub fn memory(&self) -> &Arc<dyn DeviceMemory> {
        &self.memory
    }

    /// The capacity profile's identity for a run: the pipeline's, the device's and the preset's, with `extra`
    /// (the task, say). The capacity metrics (pixels, tokens, batch) stay out of it.
    pub fn workload(&self, extra: &[(&str, &str)]) -> Workload {
        extra.iter().fold(self.workload.clone(), |workload, (key, value)| workload.with(*key, *value))
    }
}

/// What recording a run stored and found.
#[cfg(feature = "io")]
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord {
    /// The profile file.
    pub path: std::path::PathBuf,
    /// The profile as saved.
    pub profile: offload_core::plan::CapacityProfile,
    /// The run's metrics past what the profile had validated (already logged).
    pub warnings: Vec<offload_core::plan::CapacityWarning>,
    /// The recommendation stored by a calibration run.
    pub calibration: Option<offload_core::plan::Recommendation>,
}

#[cfg(feature = "io")]
impl PipelinePlan {
    /// The store the settings name (`profile_dir`, or the platform's data directory).
    pub fn profile_store(&self) -> Result<ProfileStore> {
        Ok(ProfileStore::from_settings(&self.settings)?)
    }

    /// The warnings a run of `workload` with `metrics` deserves against the stored profile, before it runs (each
    /// also logged).
    pub fn check_capacity(
        &self,
        workload: &Workload,
        metrics: &[(&str, f64)],
    ) -> Result<Vec<offload_core::plan::CapacityWarning>> {
        Ok(self.profile_store()?.check(workload, metrics)?)
    }

    /// Records a run of `workload` with `metrics` in its capacity profile: its outcome and the measured device and
    /// host peaks. A successful calibration run also stores the resident budget it recommends for the named
    /// profile. The warnings compare the run with the profile as it was before.
    pub fn record_run(
        &self,
        workload: &Workload,
        metrics: &[(&str, f64)],
        outcome: offload_core::plan::Outcome,
        peak_device: u64,
        peak_host: u64,
    ) -> Result<RunRecord> {
        use offload_core::plan::{Observation, Outcome};
        let store = self.profile_store()?;
        let mut observation = match outcome {
            Outcome::Success => Observation::success(peak_device, peak_host),
            Outcome::Failure => Observation::failure(peak_device, peak_host),
        };
        for (name, value) in metrics {
            observation = observation.with_metric(*name, *value);
        }
        let recorded = store.record(workload, observation)?;
        let calibration = match (&self.settings.profile_name, self.calibration_run, outcome) {
            (Some(name), true, Outcome::Success) => {
                let budget_used = self.calibrated.as_ref().map_or(0, |(component, outside)| {
                    self.component(component).map_or(0, |c| c.resident_weight_bytes.saturating_sub(*outside))
                });
                Some(store.record_calibration(name, self.plan.machine.device_available, peak_device, budget_used)?)
            }
            _ => None,
        };
        Ok(RunRecord {
            path: store.path(workload),
            profile: recorded.profile,
            warnings: recorded.warnings,
            calibration,
        })
    }
}
