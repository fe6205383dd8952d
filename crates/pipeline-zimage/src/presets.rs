//! Presets applied to the Z-Image pipeline: one call that describes the three components to `offload-core`'s
//! planner, plans them for the device, applies each route through the `ComponentsManager` and group offload, and
//! returns what was chosen and why; capacity profiles and named calibration recorded from measured runs.
//!
//! # Who decides what
//!
//! The planner (`offload_core::plan`) is policy: it sees [`ComponentSpec`]s and a [`Machine`] and returns a
//! [`Plan`]. This module is the mechanism that feeds and applies it:
//!
//! - [`component_specs`] describes the loaded components at their loaded sizes: the manager's weight bytes, the
//!   text encoder's decoder layers and the transformer's blocks in execution order (`noise_refiner`,
//!   `context_refiner`, `layers`) measured from their parameters, the activation estimates of
//!   [`ZImagePipeline::activation_estimates`] for the workload, and FLOPs from the configs. The VAE is described
//!   without blocks (it is not cut into blocks here), so it is routed resident or component-offloaded.
//! - [`enable_pipeline_offload`] plans and applies: `resident` components are onloaded once and kept,
//!   `component offload` moves a component whole through the manager, `block` puts the text encoder or the
//!   transformer under block-level group offload with the plan's resident budget, prefetch depth and disk store,
//!   and `leaf` under leaf-level group offload (one linear layer at a time, [`crate::layer`]); `off` is refused
//!   with [`Error::Unmanaged`]. The manager runs the [`Staged`] strategy: when a component comes onto the
//!   device, every other one that is not planned resident leaves, which is the phase staging the planner
//!   assumes (each component is priced against the whole device less the resident ones).
//! - [`generate_profiled`] runs the phase-staged pipeline and records the measured peak in the capacity profile
//!   of the workload ([`PipelinePlan::record_run`]); with a `profile_name`, the first run is a calibration run
//!   whose recommended resident budget later plans reuse.
//!
//! Settings are validated once, by `Settings::resolve` (the edge); generation options by
//! [`GenerateOptions::validate`]. A component quantized with [`ZImagePipeline::quantize`] is described as
//! quantized, so the planner routes it resident or whole (component offload keeps burn's quantized tensors and
//! kernels), never to block or leaf offload (see `docs/presets.md`).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Tensor;
use memory_sim::SimCard;
use offload_core::offload_strategy::{OffloadStrategy, OffloadView};
use offload_core::plan::{
    BlockLayout, CapacityProfile, CapacityWarning, ComponentPlan, ComponentSpec, HostMemory, Machine, Observation,
    Outcome, PhaseReport, Plan, ProfileStore, Recommendation, Route, Settings, TimeModel, Workload, plan_pipeline,
};
use offload_core::{DeviceMemory, format_size};

use crate::error::{Error, Result};
use crate::grouped::{GroupLevel, GroupOptions};
use crate::offload::{BurnComponent, module_bytes};
use crate::pipeline::{GenerateOptions, ZImagePipeline};
use crate::text_encoder::TextEncoder;
use crate::transformer::ZImageTransformer2DModel;

pub use crate::pipeline::PipelineComponent;

/// The facts about the execution device a plan is made from: its memory readings, the host's RAM, the time
/// model of its link and compute, and a label that identifies it in capacity profiles.
#[derive(Clone)]
pub struct DeviceFacts {
    /// Readings of the execution device (a simulated card, or a real device's readings). The manager's auto
    /// offload reads it too.
    pub memory: Arc<dyn DeviceMemory>,
    /// Host RAM, from [`HostMemory::read`] or given; the `host_available` setting replaces its `available`.
    pub host: HostMemory,
    /// Link and compute figures for the predictions.
    pub time: TimeModel,
    /// The device's label in capacity profiles (`"12MB"`, `"rtx4090"`, `"cuda:0"`).
    pub label: String,
}

impl fmt::Debug for DeviceFacts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceFacts")
            .field("device", &self.memory.device().as_str().to_string())
            .field("host", &self.host)
            .field("label", &self.label)
            .finish()
    }
}

impl DeviceFacts {
    /// Facts from device readings and a host reading, with the generic time model (PCIe 4.0 x16, 100 TFLOP/s)
    /// and the device's name as label.
    pub fn new(memory: Arc<dyn DeviceMemory>, host: HostMemory) -> Self {
        let label = memory.device().as_str().to_string();
        Self { memory, host, time: TimeModel::generic(), label }
    }

    /// Facts for a simulated card: its readings, its link and compute figures (its pageable fraction too, so
    /// the predictions price pinned and pageable copies as the card does), its label.
    pub fn simulated(card: Arc<SimCard>, host: HostMemory) -> Self {
        let timing = card.spec().timing;
        let mut time =
            TimeModel::new(timing.link_bytes_per_second, timing.link_latency.as_secs_f64(), timing.flops_per_second);
        time.pageable_fraction = timing.pageable_fraction;
        let label = card.spec().label.clone();
        Self { memory: card, host, time, label }
    }

    /// The same facts with another time model.
    pub fn with_time(mut self, time: TimeModel) -> Self {
        self.time = time;
        self
    }

    /// The planner's machine, read now: the device's total and available bytes, the host, the time model.
    pub fn machine(&self) -> Machine {
        Machine::from_device(&*self.memory, self.host).with_time(self.time)
    }
}

/// The transformer's block structure, measured from its loaded parameters: the bytes of each block in the order
/// the forward runs them (`noise_refiner`, `context_refiner`, then `layers`), the bytes outside the blocks
/// (embedders, final layer, pad tokens), and its leaf groups ([`group_offload::leaf_groups`]).
///
/// Fails with [`Error::OffloadAlreadyApplied`] once the transformer is under group offload: its parameters have
/// moved into the group store.
pub fn transformer_layout(pipeline: &ZImagePipeline) -> Result<BlockLayout> {
    not_grouped(pipeline, PipelineComponent::Transformer)?;
    let id = &pipeline.ids().transformer;
    Ok(pipeline.manager().inspect(id, |c: &BurnComponent<ZImageTransformer2DModel>| {
        let model = c.module();
        // A modulated block's forward takes `adaLN_modulation.0` first, an unmodulated one its norms.
        let first =
            if model.noise_refiner.first().is_some_and(|b| b.is_modulated()) { "adaLN_modulation.0" } else { "" };
        measure_layout(model, model.noise_refiner.iter().chain(&model.context_refiner).chain(&model.layers), first)
    })?)
}

/// The text encoder's block structure, measured from its loaded parameters: the bytes of each decoder layer,
/// the bytes outside them (the token embedding) and its leaf groups ([`group_offload::leaf_groups`]).
///
/// Fails with [`Error::OffloadAlreadyApplied`] once the text encoder is under group offload.
pub fn text_encoder_layout(pipeline: &ZImagePipeline) -> Result<BlockLayout> {
    not_grouped(pipeline, PipelineComponent::TextEncoder)?;
    let id = &pipeline.ids().text_encoder;
    Ok(pipeline
        .manager()
        // A decoder layer's forward takes its norms (the group of the parameters under no leaf) first.
        .inspect(id, |c: &BurnComponent<TextEncoder>| measure_layout(c.module(), c.module().layers.iter(), ""))?)
}

fn not_grouped(pipeline: &ZImagePipeline, component: PipelineComponent) -> Result<()> {
    if pipeline.is_grouped(component) {
        return Err(Error::OffloadAlreadyApplied {
            component: component.name().into(),
            reason: "it is already under group offload, so its blocks cannot be measured again".into(),
        });
    }
    Ok(())
}

/// The layout of `model` with `blocks` in execution order; the leaves are those inside the blocks (leaf level
/// keeps the layers outside the blocks resident, as block level does), `first_part` the leaf group of a block
/// its forward takes first.
fn measure_layout<'a, M: Module, B: Module + 'a>(
    model: &M,
    blocks: impl Iterator<Item = &'a B>,
    first_part: &str,
) -> BlockLayout {
    let (mut block_bytes, mut largest_leaf_bytes, mut leaf_count, mut first_leaf_bytes) = (Vec::new(), 0, 0, None);
    for block in blocks {
        block_bytes.push(module_bytes(block));
        let groups = group_offload::leaf_groups(block, &crate::layer::leaf_types());
        largest_leaf_bytes = largest_leaf_bytes.max(groups.iter().map(|(_, bytes)| *bytes).max().unwrap_or(0));
        leaf_count += groups.len();
        first_leaf_bytes =
            first_leaf_bytes.or_else(|| groups.iter().find(|(path, _)| path == first_part).map(|(_, bytes)| *bytes));
    }
    let outside_bytes = module_bytes(model).saturating_sub(block_bytes.iter().sum());
    BlockLayout {
        outside_bytes,
        block_bytes,
        largest_leaf_bytes,
        leaf_count,
        first_leaf_bytes: first_leaf_bytes.unwrap_or(0),
    }
}

/// The three components as plan input, for the workload `opts`: weight bytes from the manager, the text
/// encoder's and the transformer's layouts ([`text_encoder_layout`], [`transformer_layout`]), the activation
/// estimates of [`ZImagePipeline::activation_estimates`], FLOPs per call from the configs (for the time model
/// only), the denoising steps as the transformer's calls per image, and whether each is quantized
/// ([`ZImagePipeline::quantize`]: the planner then moves it only whole).
///
/// The VAE has no layout: it is not cut into blocks in this pipeline, so it is resident or component-offloaded.
pub fn component_specs(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> Result<Vec<ComponentSpec>> {
    pipeline.validate(opts)?;
    let manager = pipeline.manager();
    let ids = pipeline.ids();
    let bytes = |id: &str| manager.component_info(id).map(|info| info.bytes);
    let [text_activation, transformer_activation, vae_activation] = pipeline.activation_estimates(opts);
    let [text_flops, transformer_flops, vae_flops] = flops_per_call(pipeline, opts);
    let steps = u32::try_from(opts.steps).unwrap_or(u32::MAX);
    Ok(vec![
        ComponentSpec::new("text_encoder", bytes(&ids.text_encoder)?)
            .with_layout(text_encoder_layout(pipeline)?)
            .with_activation(text_activation)
            .with_cost(text_flops, 1)
            .quantized(pipeline.is_quantized(PipelineComponent::TextEncoder)),
        ComponentSpec::new("transformer", bytes(&ids.transformer)?)
            .with_layout(transformer_layout(pipeline)?)
            .with_activation(transformer_activation)
            .with_cost(transformer_flops, steps)
            .quantized(pipeline.is_quantized(PipelineComponent::Transformer)),
        ComponentSpec::new("vae", bytes(&ids.vae)?)
            .with_activation(vae_activation)
            .with_cost(vae_flops, 1)
            .quantized(pipeline.is_quantized(PipelineComponent::Vae)),
    ])
}

/// FLOPs of one call of each component, `[text encoder, transformer, VAE]`: 2 × parameters × tokens for the
/// linear layers plus 4 × sequence² × width per attention layer (the prompt and, with guidance, the negative
/// prompt), and for the VAE decoder six 3×3 convolutions per resolution. Estimates for the time model only.
fn flops_per_call(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> [f64; 3] {
    let prompts = if opts.guidance > 0.0 { 2.0 } else { 1.0 };
    let text = pipeline.text_encoder_config();
    let t = opts.max_sequence_length as f64;
    let text_layers = text.num_hidden_layers.saturating_sub(1) as f64;
    let text_flops =
        prompts * (2.0 * text.num_params_used() as f64 * t + text_layers * 4.0 * t * t * text.hidden_size as f64);
    let config = pipeline.transformer_config();
    let s =
        (config.image_tokens(opts.height, opts.width, pipeline.vae_scale_factor()) + opts.max_sequence_length) as f64;
    let blocks = (config.n_layers + 2 * config.n_refiner_layers) as f64;
    let transformer_flops = prompts * (2.0 * config.num_params() as f64 * s + blocks * 4.0 * s * s * config.dim as f64);
    let pixels = (opts.height * opts.width) as f64;
    let vae_flops: f64 = pipeline
        .vae_config()
        .block_out_channels
        .iter()
        .enumerate()
        .map(|(level, &channels)| 6.0 * 2.0 * 9.0 * (channels * channels) as f64 * pixels / 4f64.powi(level as i32))
        .sum();
    [text_flops, transformer_flops, vae_flops]
}

/// The reserve that matches a simulated card exactly: the largest activation estimate of the workload.
///
/// A simulated card charges each call exactly its estimate, so the planner's margin (a quarter of the estimate,
/// at least 256 MiB, for what a real allocator adds) has nothing to cover there. Pass it as the `reserve`
/// setting when planning for a simulated card that is smaller than the margin; on a real device, leave
/// `reserve` unset and let the planner add its margin.
pub fn exact_reserve(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> u64 {
    pipeline.activation_estimates(opts).into_iter().max().unwrap_or(0)
}

/// The manager strategy of a phase-staged plan: when a component comes onto the device, every other resident
/// component leaves except those the plan keeps resident.
///
/// This is the planner's staging model as an [`OffloadStrategy`]: each phase's component runs with the device
/// to itself and the resident components. Like every strategy it only returns candidates (a component running on
/// another thread, or one under non-releasable group offload, stays).
///
/// ```
/// use offload_core::offload_strategy::{ComponentView, MemoryReading, OffloadStrategy, OffloadView, ResidentComponent};
/// use pipeline_zimage::presets::Staged;
///
/// let incoming = ComponentView::new("vae_3", "vae", 1 << 20);
/// let resident = [
///     ResidentComponent::new("text_encoder_1", "text_encoder", 7 << 30),
///     ResidentComponent::new("transformer_4", "transformer", 1 << 30),
/// ];
/// let view = OffloadView {
///     incoming: &incoming,
///     resident: &resident,
///     reading: MemoryReading { available: 60 << 30, total: 80 << 30, peak: 20 << 30 },
///     reserve: 0,
///     device: "cuda:0",
///     use_index: 3,
/// };
/// let staged = Staged::keeping(["text_encoder_1".to_string()]);
/// assert_eq!(staged.decide(&view), ["transformer_4"]);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Staged {
    keep: Vec<String>,
}

impl Staged {
    /// A staged strategy that never offloads the components with these ids.
    pub fn keeping(ids: impl IntoIterator<Item = String>) -> Self {
        Self { keep: ids.into_iter().collect() }
    }

    /// The ids it keeps.
    pub fn kept(&self) -> &[String] {
        &self.keep
    }
}

impl OffloadStrategy for Staged {
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        view.candidates().filter(|r| !self.keep.iter().any(|k| k == r.id())).map(|r| r.id().to_string()).collect()
    }

    fn name(&self) -> &str {
        "staged"
    }
}

/// What was applied to one component: the planned route, the route the pipeline runs, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedRoute {
    /// The component's name.
    pub component: String,
    /// Its id in the manager.
    pub id: String,
    /// The route the plan chose; `None` when the component was not planned ([`enable_offload`] plans one).
    pub planned: Option<Route>,
    /// The route the pipeline applied (differs from the plan where a route is not supported yet).
    pub applied: Route,
    /// The mechanism, in words, and any difference from the plan.
    pub how: String,
}

/// A plan for the pipeline as applied: the planner's [`Plan`] (its `Display` is the table and one reason per
/// component), what each component runs under, notes on what the pipeline does differently from the plan, and
/// the capacity-profile identity of the workload.
pub struct PipelinePlan {
    /// The planner's plan.
    pub plan: Plan,
    /// Per component, in pipeline order: planned and applied route.
    pub applied: Vec<AppliedRoute>,
    /// What the pipeline does differently from the plan, or assumes, one sentence each.
    pub notes: Vec<String>,
    /// The settings the plan was made with (with the named profile's calibration loaded, if any).
    pub settings: Settings,
    /// Whether this plan is a calibration run of `settings.profile_name`: [`record_run`](Self::record_run)
    /// then stores the recommended resident budget.
    pub calibration_run: bool,
    memory: Arc<dyn DeviceMemory>,
    workload: Workload,
    /// Bytes outside the transformer's blocks, to tell its resident budget from its resident bytes.
    transformer_outside: u64,
}

impl fmt::Debug for PipelinePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PipelinePlan")
            .field("plan", &self.plan)
            .field("applied", &self.applied)
            .field("notes", &self.notes)
            .field("calibration_run", &self.calibration_run)
            .finish()
    }
}

impl fmt::Display for PipelinePlan {
    /// The planner's plan, then what was applied per component and the notes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.plan)?;
        writeln!(f, "applied:")?;
        for applied in &self.applied {
            writeln!(f, "  {} ({}): {}", applied.component, applied.id, applied.how)?;
        }
        if !self.notes.is_empty() {
            writeln!(f, "notes:")?;
            for note in &self.notes {
                writeln!(f, "  {note}")?;
            }
        }
        Ok(())
    }
}

/// What recording a run stored and found.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord {
    /// The profile file.
    pub path: PathBuf,
    /// The profile as saved.
    pub profile: CapacityProfile,
    /// The run's metrics past what the profile had validated (already logged).
    pub warnings: Vec<CapacityWarning>,
    /// The recommendation stored by a calibration run.
    pub calibration: Option<Recommendation>,
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

    /// The capacity profile's identity for a run with `opts`: the model's sizes, dtype, device, preset and task.
    /// The capacity metrics (pixels, tokens, batch) stay out of it.
    pub fn workload(&self, opts: &GenerateOptions) -> Workload {
        let task = if opts.image.is_some() { "image-to-image" } else { "text-to-image" };
        self.workload.clone().with("task", task)
    }

    /// The store the settings name (`profile_dir`, or the platform's data directory).
    pub fn profile_store(&self) -> Result<ProfileStore> {
        Ok(ProfileStore::from_settings(&self.settings)?)
    }

    /// The warnings a run with `opts` deserves against the stored profile, before it runs (each also logged).
    pub fn check_capacity(&self, opts: &GenerateOptions) -> Result<Vec<CapacityWarning>> {
        let metrics = metrics(opts);
        let metrics: Vec<(&str, f64)> = metrics.iter().map(|(k, v)| (*k, *v)).collect();
        Ok(self.profile_store()?.check(&self.workload(opts), &metrics)?)
    }

    /// Records a run with `opts` in the workload's capacity profile: its outcome, the measured device and host
    /// peaks and its metrics. A successful calibration run also stores the resident budget it recommends for
    /// the named profile. The warnings compare the run with the profile as it was before.
    pub fn record_run(
        &self,
        opts: &GenerateOptions,
        outcome: Outcome,
        peak_device: u64,
        peak_host: u64,
    ) -> Result<RunRecord> {
        let store = self.profile_store()?;
        let workload = self.workload(opts);
        let mut observation = match outcome {
            Outcome::Success => Observation::success(peak_device, peak_host),
            Outcome::Failure => Observation::failure(peak_device, peak_host),
        };
        for (name, value) in metrics(opts) {
            observation = observation.with_metric(name, value);
        }
        let recorded = store.record(&workload, observation)?;
        let calibration = match (&self.settings.profile_name, self.calibration_run, outcome) {
            (Some(name), true, Outcome::Success) => {
                let budget_used = self
                    .component("transformer")
                    .map_or(0, |c| c.resident_bytes.saturating_sub(self.transformer_outside));
                Some(store.record_calibration(name, self.plan.machine.device_available, peak_device, budget_used)?)
            }
            _ => None,
        };
        Ok(RunRecord {
            path: store.path(&workload),
            profile: recorded.profile,
            warnings: recorded.warnings,
            calibration,
        })
    }
}

/// The capacity metrics of a run: pixels, prompt tokens kept, prompts per call.
fn metrics(opts: &GenerateOptions) -> [(&'static str, f64); 3] {
    let batch = if opts.guidance > 0.0 { 2.0 } else { 1.0 };
    [("pixels", (opts.height * opts.width) as f64), ("tokens", opts.max_sequence_length as f64), ("batch", batch)]
}

/// Plans the whole pipeline for the device and applies every route; see the module documentation.
///
/// `settings` is a resolved [`Settings`] or just a [`Preset`](offload_core::plan::Preset); `opts` is the workload
/// the activation estimates are made for (plan again for a larger image). With `settings.profile_name`, the
/// named calibration is loaded from the profile store first. Auto offload is (re-)enabled on `device.memory`
/// with the [`Staged`] strategy, so any earlier auto offload session ends; a pipeline whose transformer is
/// already under group offload is refused ([`Error::OffloadAlreadyApplied`]): load it again to plan anew.
pub fn enable_pipeline_offload(
    pipeline: &mut ZImagePipeline,
    settings: impl Into<Settings>,
    device: &DeviceFacts,
    opts: &GenerateOptions,
) -> Result<PipelinePlan> {
    let specs = component_specs(pipeline, opts)?;
    plan_and_apply(pipeline, specs, settings.into(), device)
}

/// Plans one component alone for the device and applies its route; the other components are left to the
/// manager, which moves them whole when they run (component offload, staged). Meaningful for the transformer,
/// the one component with block and leaf routes; for the text encoder and the VAE it chooses between resident
/// and component offload.
///
/// The plan sees only this component, so a `resident` route is decided without the others' weights: prefer
/// [`enable_pipeline_offload`] when more than one component competes for the device.
pub fn enable_offload(
    pipeline: &mut ZImagePipeline,
    component: PipelineComponent,
    settings: impl Into<Settings>,
    device: &DeviceFacts,
    opts: &GenerateOptions,
) -> Result<PipelinePlan> {
    let specs: Vec<ComponentSpec> =
        component_specs(pipeline, opts)?.into_iter().filter(|spec| spec.name == component.name()).collect();
    plan_and_apply(pipeline, specs, settings.into(), device)
}

fn plan_and_apply(
    pipeline: &mut ZImagePipeline,
    specs: Vec<ComponentSpec>,
    mut settings: Settings,
    device: &DeviceFacts,
) -> Result<PipelinePlan> {
    if settings.profile_name.is_some() {
        ProfileStore::from_settings(&settings)?.apply_calibration(&mut settings)?;
    }
    // Everything goes back to the host first, so the reading is the device as the plan will have it.
    pipeline.manager().disable_auto_offload()?;
    let machine = device.machine();
    let plan = plan_pipeline(&specs, settings.clone(), &machine)?;
    if let Some(off) = plan.components.iter().find(|c| c.route == Route::Off) {
        return Err(Error::Unmanaged { component: off.component.clone(), preset: plan.preset.to_string() });
    }
    let transformer_outside =
        specs.iter().find(|s| s.name == "transformer").and_then(|s| s.layout.as_ref()).map_or(0, |l| l.outside_bytes);
    let mut streamed = Vec::new();
    for component in [PipelineComponent::TextEncoder, PipelineComponent::Transformer] {
        let layout = specs.iter().find(|s| s.name == component.name()).and_then(|s| s.layout.clone());
        if let Some(applied) = apply_group_offload(pipeline, component, &plan, &settings, device, layout.as_ref())? {
            streamed.push((component, applied));
        }
    }
    let mut notes = Vec::new();
    for planned in &plan.components {
        let streams = streamed.iter().any(|(c, _)| c.name() == planned.component);
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
    for (component, _) in &streamed {
        let Some(offload) = pipeline.group_offload(*component) else { continue };
        let (pinned, page_locked) = offload.pinned_bytes();
        if pinned > page_locked {
            notes.push(format!(
                "{component}: {} of host copies pinned through the device's staging, {} of them page-locked: this \
                 backend has no page-locked memory, so only the simulated card's pricing sees the difference",
                format_size(pinned),
                format_size(page_locked)
            ));
        }
    }

    let manager = pipeline.manager().clone();
    let reserve = plan.components.iter().map(|c| c.headroom_bytes).max().unwrap_or(0);
    manager.enable_auto_offload(device.memory.clone(), reserve, settings.retry_on_oom)?;
    let mut applied = Vec::new();
    let mut keep = Vec::new();
    for component in PipelineComponent::ALL {
        let id = component.id(pipeline).to_string();
        let planned = plan.component(component.name()).map(|c| c.route);
        let group = streamed.iter().find(|(c, _)| *c == component).map(|(_, applied)| applied.clone());
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
        applied.push(AppliedRoute { component: component.name().to_string(), id, planned, applied: route, how });
    }
    manager.set_offload_strategy(Arc::new(Staged::keeping(keep.clone())))?;
    for id in &keep {
        manager.run_any(id, |_| Ok(()))?;
    }
    for route in &applied {
        tracing::info!(component = %route.component, route = %route.applied, "{}", route.how);
    }

    let calibration_run = settings.profile_name.is_some()
        && settings.resident_budget.is_none()
        && (settings.calibration.is_none() || settings.calibrate)
        && plan.component("transformer").is_some_and(|c| matches!(c.route, Route::BlockGroupOffload { .. }));
    let workload = workload(pipeline, device, &plan);
    Ok(PipelinePlan {
        plan,
        applied,
        notes,
        settings,
        calibration_run,
        memory: device.memory.clone(),
        workload,
        transformer_outside,
    })
}

/// Puts `component` under group offload when its planned route streams it (block or leaf level, with the plan's
/// resident budget, prefetch and disk store; the layers outside the blocks kept resident unless the plan streams
/// them); returns the applied route and how.
fn apply_group_offload(
    pipeline: &mut ZImagePipeline,
    component: PipelineComponent,
    plan: &Plan,
    settings: &Settings,
    device: &DeviceFacts,
    layout: Option<&BlockLayout>,
) -> Result<Option<(Route, String)>> {
    let (Some(planned), Some(layout)) = (plan.component(component.name()), layout) else { return Ok(None) };
    let outside = layout.outside_bytes;
    let disk_store = if planned.on_disk { settings.disk_store_dir.clone() } else { None };
    let options = match planned.route {
        Route::BlockGroupOffload { blocks_per_group, prefetch, depth } => {
            // The plan's resident bytes are the kept groups plus the outside layers, unless the full-pin rule
            // streams those too (then it keeps nothing).
            let keep_outside = planned.resident_bytes >= outside;
            GroupOptions {
                level: GroupLevel::Block { blocks_per_group },
                prefetch,
                prefetch_depth: depth,
                resident_budget: planned.resident_bytes.saturating_sub(if keep_outside { outside } else { 0 }),
                pinned_budget: planned.pinned_bytes,
                disk_store,
                releasable: true,
                keep_outside,
            }
        }
        Route::LeafGroupOffload { prefetch } => GroupOptions {
            prefetch,
            pinned_budget: planned.pinned_bytes,
            disk_store,
            releasable: true,
            ..GroupOptions::leaf()
        },
        _ => return Ok(None),
    };
    // Group moves are charged to the ledger the pipeline's components are charged to (the simulated card).
    let ledger = pipeline.placement().ledger.clone();
    pipeline.enable_group_offload_with(component, ledger, Some(device.memory.clone()), &options)?;
    let level = match options.level {
        GroupLevel::Block { blocks_per_group: 1 } => "block level, 1 block per group".to_string(),
        GroupLevel::Block { blocks_per_group } => format!("block level, {blocks_per_group} blocks per group"),
        GroupLevel::Leaf => "leaf level, one linear layer at a time".to_string(),
    };
    let offload = pipeline.group_offload(component);
    let (pinned, page_locked) = offload.map_or((0, 0), |o| o.pinned_bytes());
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
        match &options.disk_store {
            Some(dir) => format!("as files in {}", dir.display()),
            None => "in host memory".to_string(),
        }
    );
    Ok(Some((planned.route, how)))
}

/// The workload identity shared by every run of a plan.
fn workload(pipeline: &ZImagePipeline, device: &DeviceFacts, plan: &Plan) -> Workload {
    Workload::new()
        .with("model", "z-image")
        .with("transformer_params", pipeline.transformer_config().num_params().to_string())
        .with("text_encoder_params", pipeline.text_encoder_config().num_params_used().to_string())
        .with("vae_params", pipeline.vae_config().num_params().to_string())
        .with("dtype", format!("{:?}", pipeline.dtype()))
        .with("device", device.label.clone())
        .with("device_total", plan.machine.device_total.to_string())
        .with("preset", plan.preset.name())
}

/// A run of [`generate_profiled`]: the image, its phases, the measured peaks and what the profile said.
#[derive(Debug, Clone)]
pub struct ProfiledRun {
    /// The image `[1, 3, H, W]` in `[0, 1]`.
    pub image: Tensor<4>,
    /// The `encode`, `denoise` and `decode` phases.
    pub phases: PhaseReport,
    /// The device's peak reading after the run (a simulated card's peak since it was made).
    pub peak_device: u64,
    /// The process's peak resident memory (`VmHWM` on Linux; 0 where it cannot be read).
    pub peak_host: u64,
    /// What was recorded in the capacity profile, with its warnings.
    pub record: RunRecord,
}

/// Runs the pipeline phase-staged under a plan applied by [`enable_pipeline_offload`], then records the run in
/// the workload's capacity profile (and the calibration, for a calibration run). An out-of-memory failure is
/// recorded as a failure before the error is returned, so later runs of that size are warned about.
pub fn generate_profiled(
    pipeline: &ZImagePipeline,
    plan: &PipelinePlan,
    opts: &GenerateOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ProfiledRun> {
    match pipeline.generate_with_report(opts, progress) {
        Ok(generated) => {
            let peak_device = plan.memory.peak();
            let peak_host = crate::host::peak_resident_bytes();
            let record = plan.record_run(opts, Outcome::Success, peak_device, peak_host)?;
            Ok(ProfiledRun { image: generated.image, phases: generated.phases, peak_device, peak_host, record })
        }
        Err(error) => {
            if is_out_of_memory(&error)
                && let Err(record_error) =
                    plan.record_run(opts, Outcome::Failure, plan.memory.peak(), crate::host::peak_resident_bytes())
            {
                tracing::warn!("cannot record the failed run in its capacity profile: {record_error}");
            }
            Err(error)
        }
    }
}

/// Whether a pipeline error is the device running out of memory.
fn is_out_of_memory(error: &Error) -> bool {
    match error {
        Error::Offload(offload_core::Error::DoesNotFit { .. }) => true,
        Error::Offload(offload_core::Error::Component { source, .. }) => source.is_out_of_memory(),
        Error::GroupOffload(inner) => inner.is_out_of_memory(),
        _ => false,
    }
}
