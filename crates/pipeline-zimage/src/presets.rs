//! Presets applied to the Z-Image pipeline: one call that describes the three components to `offload-core`'s
//! planner, plans them for the device, applies each route, and returns what was chosen and why; capacity profiles
//! and named calibration recorded from measured runs.
//!
//! # Who decides what
//!
//! The planner (`offload_core::plan`) is policy: it sees [`ComponentSpec`]s and a [`Machine`](offload_core::plan::Machine)
//! and returns a [`Plan`]. `group_offload::apply` is the model-agnostic mechanism that applies it (resident,
//! component offload, block or leaf group offload, the [`Staged`] strategy). This module holds what only Z-Image
//! knows:
//!
//! - [`component_specs`] completes each component's spec ([`group_offload::component_spec`]: weight bytes, the
//!   layout its `OffloadModel` census names, quantization) with the activation estimates of
//!   [`ZImagePipeline::activation_estimates`] for the workload and FLOPs from the configs. The VAE names no
//!   blocks, so it is routed resident or component-offloaded.
//! - [`enable_pipeline_offload`] plans and applies ([`group_offload::apply_plan`]); `off` is refused with
//!   `group_offload::Error::Unmanaged`.
//! - [`generate_profiled`] runs the phase-staged pipeline and records the measured peak in the capacity profile
//!   of the workload ([`PipelinePlan::record_run`]); with a `profile_name`, the first run is a calibration run
//!   whose recommended resident budget later plans reuse.
//!
//! Settings are validated once, by `Settings::resolve` (the edge); generation options by
//! [`GenerateOptions::validate`]. A component quantized with [`crate::quantize::quantize`] is described as
//! quantized, so the planner routes it resident or whole (component offload keeps burn's quantized tensors and
//! kernels), never to block or leaf offload (see `docs/presets.md`).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use burn::tensor::Tensor;
pub use group_offload::AppliedRoute;
use group_offload::{apply_plan, component_spec};
use offload_core::DeviceMemory;
use offload_core::plan::{
    CapacityProfile, CapacityWarning, ComponentPlan, ComponentSpec, DeviceFacts, Observation, Outcome, PhaseReport,
    Plan, ProfileStore, Recommendation, Route, Settings, Workload, plan_pipeline,
};

pub use offload_core::offload_strategy::Staged;

use crate::error::{Error, Result};
use crate::pipeline::{GenerateOptions, ZImagePipeline};

/// The three components as plan input, for the workload `opts`: weight bytes, layout and quantization from
/// [`group_offload::component_spec`], the activation estimates of [`ZImagePipeline::activation_estimates`],
/// FLOPs per call from the configs (for the time model only) and the denoising steps as the transformer's calls
/// per image. Refused once the text encoder or the transformer is under group offload (its blocks cannot be
/// measured again).
pub fn component_specs(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> Result<Vec<ComponentSpec>> {
    pipeline.validate(opts)?;
    let activations = pipeline.activation_estimates(opts);
    let flops = flops_per_call(pipeline, opts);
    let steps = u32::try_from(opts.steps).unwrap_or(u32::MAX);
    let calls = [1, steps, 1];
    let mut specs = Vec::with_capacity(3);
    for (i, component) in pipeline.components().into_iter().enumerate() {
        let spec = component_spec(pipeline.manager(), component)?;
        specs.push(spec.with_activation(activations[i]).with_cost(flops[i], calls[i]));
    }
    Ok(specs)
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
/// already under group offload is refused (`group_offload::Error::AlreadyApplied`): load it again to plan anew.
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
/// the component with block and leaf routes; for the VAE it chooses between resident and component offload.
/// `component` is one of [`crate::pipeline::COMPONENTS`].
///
/// The plan sees only this component, so a `resident` route is decided without the others' weights: prefer
/// [`enable_pipeline_offload`] when more than one component competes for the device.
pub fn enable_offload(
    pipeline: &mut ZImagePipeline,
    component: &str,
    settings: impl Into<Settings>,
    device: &DeviceFacts,
    opts: &GenerateOptions,
) -> Result<PipelinePlan> {
    let specs: Vec<ComponentSpec> =
        component_specs(pipeline, opts)?.into_iter().filter(|spec| spec.name == component).collect();
    if specs.is_empty() {
        return Err(crate::pipeline::unknown_component(component));
    }
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
    let transformer_outside =
        specs.iter().find(|s| s.name == "transformer").and_then(|s| s.layout.as_ref()).map_or(0, |l| l.outside_bytes);
    // Group moves are charged to the account the pipeline's components are charged to (their placement).
    let manager = pipeline.manager().clone();
    let applied = apply_plan(&manager, &mut pipeline.components_mut(), &specs, &plan, &settings, device)?;
    let calibration_run = settings.profile_name.is_some()
        && settings.resident_budget.is_none()
        && (settings.calibration.is_none() || settings.calibrate)
        && plan.component("transformer").is_some_and(|c| matches!(c.route, Route::BlockGroupOffload { .. }));
    let workload = workload(pipeline, device, &plan);
    Ok(PipelinePlan {
        plan,
        applied: applied.applied,
        notes: applied.notes,
        settings,
        calibration_run,
        memory: device.memory.clone(),
        workload,
        transformer_outside,
    })
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
