//! Presets applied to the Z-Image pipeline: one call that describes the three components to `offload-core`'s
//! planner, plans them for the device, applies each route, and returns what was chosen and why; capacity profiles
//! and named calibration recorded from measured runs.
//!
//! # Who decides what
//!
//! The planner (`offload_core::plan`) is policy: it sees [`ComponentSpec`]s and a [`Machine`](offload_core::plan::Machine)
//! and returns a [`Plan`](offload_core::plan::Plan). `group_offload::apply` is the model-agnostic mechanism that applies it (resident,
//! component offload, block or leaf group offload, the [`Staged`] strategy). This module holds what only Z-Image
//! knows:
//!
//! - [`component_specs`] completes each component's spec ([`group_offload::apply::component_spec`]: weight bytes, the
//!   layout its `OffloadModel` census names, quantization) with the activation estimates of
//!   [`ZImagePipeline::activation_estimates`] for the workload and FLOPs from the configs. The VAE names no
//!   blocks, so it is routed resident or component-offloaded.
//! - [`enable_pipeline_offload`] plans and applies ([`group_offload::apply::apply_plan`]); `off` is refused with
//!   `group_offload::Error::Unmanaged`.
//! - [`generate_profiled`] runs the phase-staged pipeline and records the measured peak in the capacity profile
//!   of the workload ([`PipelinePlan::record_run`]); with a `profile_name`, the first run is a calibration run
//!   whose recommended resident budget later plans reuse.
//!
//! Settings are validated once, by `Settings::resolve` (the edge); generation options by
//! [`GenerateOptions::validate`]. A component quantized with [`crate::quantize::quantize`] is described at its
//! quantized sizes and as quantized, and the planner routes it as a float component of those sizes: resident,
//! whole (component offload keeps burn's quantized tensors and kernels), or by blocks or leaves when it does not
//! fit whole, its groups moving the quantized bytes as they are (see `docs/lora-and-quantization.md`).

use burn::tensor::Tensor;
use group_offload::apply::component_spec;
use group_offload::handle::Component;
pub use group_offload::{apply::AppliedRoute, apply::PipelinePlan, apply::RunRecord};
use offload_core::plan::{CapacityWarning, ComponentSpec, DeviceFacts, Outcome, PhaseReport, Settings, Workload};

pub use offload_core::offload_strategy::Staged;

use crate::error::{Error, Result};
use crate::pipeline::{GenerateOptions, ZImagePipeline};

/// The three components as plan input, for the workload `opts`: weight bytes, layout and quantization from
/// [`group_offload::apply::component_spec`], the activation estimates of [`ZImagePipeline::activation_estimates`],
/// FLOPs per call from the configs (for the time model only) and the denoising steps as the transformer's calls
/// per image. Refused once the text encoder or the transformer is under group offload (its blocks cannot be
/// measured again). A component the device map puts on another device is left out: it is not planned for this
/// device.
pub fn component_specs(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> Result<Vec<ComponentSpec>> {
    pipeline.validate(opts)?;
    let activations = pipeline.activation_estimates(opts);
    let flops = flops_per_call(pipeline, opts);
    let steps = u32::try_from(opts.steps).unwrap_or(u32::MAX);
    let calls = [1, steps, 1];
    let mut specs = Vec::with_capacity(3);
    for (i, component) in pipeline.components().into_iter().enumerate() {
        // A component the device map puts on another device is not planned for this one.
        if !pipeline.device_map().on_default(component.name()) {
            continue;
        }
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

/// The capacity profile's identity for a run of `plan` with `opts`: the model's sizes, dtype, device, preset and
/// task. The capacity metrics (pixels, tokens, batch) stay out of it.
pub fn run_workload(plan: &PipelinePlan, opts: &GenerateOptions) -> Workload {
    plan.workload(&[("task", if opts.image.is_some() { "image-to-image" } else { "text-to-image" })])
}

/// The warnings a run of `plan` with `opts` deserves against the stored profile, before it runs (each also
/// logged).
pub fn check_capacity(plan: &PipelinePlan, opts: &GenerateOptions) -> Result<Vec<CapacityWarning>> {
    Ok(plan.check_capacity(&run_workload(plan, opts), &metrics(opts))?)
}

/// Records a run of `plan` with `opts` in the workload's capacity profile ([`PipelinePlan::record_run`]): its
/// outcome, the measured device and host peaks and its metrics; a successful calibration run also stores the
/// resident budget it recommends.
pub fn record_run(
    plan: &PipelinePlan,
    opts: &GenerateOptions,
    outcome: Outcome,
    peak_device: u64,
    peak_host: u64,
) -> Result<RunRecord> {
    Ok(plan.record_run(&run_workload(plan, opts), &metrics(opts), outcome, peak_device, peak_host)?)
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
    settings: Settings,
    device: &DeviceFacts,
) -> Result<PipelinePlan> {
    let workload = Workload::new()
        .with("model", "z-image")
        .with("transformer_params", pipeline.transformer_config().num_params().to_string())
        .with("text_encoder_params", pipeline.text_encoder_config().num_params_used().to_string())
        .with("vae_params", pipeline.vae_config().num_params().to_string())
        .with("dtype", format!("{:?}", pipeline.dtype()));
    // A run with components on other devices is another workload for this device's capacity profile.
    let elsewhere: Vec<String> = (pipeline.device_map().components.iter())
        .filter(|(component, _)| !pipeline.device_map().on_default(component))
        .map(|(component, placement)| format!("{component}={}", placement.name()))
        .collect();
    let workload = if elsewhere.is_empty() { workload } else { workload.with("device_map", elsewhere.join(",")) };
    let manager = pipeline.manager().clone();
    // Group moves are charged to the account the pipeline's components are charged to (their placement); a
    // calibration sizes the transformer's resident budget.
    let map = pipeline.device_map().clone();
    let components = &mut pipeline.components_mut();
    let components: &mut Vec<&mut dyn Component> =
        &mut components.iter_mut().map(|c| &mut **c).filter(|c| map.on_default(c.name())).collect();
    let plan =
        group_offload::apply::plan_and_apply(&manager, components, &specs, settings, device, workload, "transformer")?;
    pipeline.enable_further_devices()?;
    Ok(plan)
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
            let peak_device = plan.memory().peak();
            let peak_host = crate::host::peak_resident_bytes();
            let record = record_run(plan, opts, Outcome::Success, peak_device, peak_host)?;
            Ok(ProfiledRun { image: generated.image, phases: generated.phases, peak_device, peak_host, record })
        }
        Err(error) => {
            if is_out_of_memory(&error)
                && let Err(record_error) =
                    record_run(plan, opts, Outcome::Failure, plan.memory().peak(), crate::host::peak_resident_bytes())
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
