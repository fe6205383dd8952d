//! `ZImagePipeline`: text-to-image and image-to-image with every component run through a
//! `ComponentsManager`, so auto offload, OOM retry and the record apply to the real model.
//!
//! The flow is diffusers' `ZImagePipeline` (and `ZImageImg2ImgPipeline`): chat-templated prompt → Qwen3
//! `hidden_states[-2]` (valid rows) → flow-match Euler over the transformer's negated output, with classifier-free
//! guidance when `guidance > 0` → VAE decode → `clamp(x / 2 + 0.5, 0, 1)`. Image-to-image encodes the image with
//! the VAE (the latent mean), scales it, truncates the schedule by `strength` and noises it to the first sigma.
//!
//! Generation is phase-staged: `encode` (the prompt, and the input image for image-to-image), `denoise` and
//! `decode` run one after the other under `offload_core::plan::Phases`, timed, with the execution device's memory
//! released between them (`Device::memory_cleanup`). The pipeline keeps no caches of its own, so the cleanup is
//! all a release has to do; which component leaves the device between phases is the manager's strategy's
//! decision (the staged strategy of [`crate::presets`] offloads the finished phase's component).

use std::path::Path;
use std::sync::Arc;

use burn::tensor::{DType, Device, Distribution, Tensor, TensorData};
use group_offload::{
    GroupLevel, GroupOptions, ModelHandle, OffloadDevice, engine::GroupStats, handle::Component, parts::GroupOffload,
};
use offload_core::plan::{PhaseReport, Phases};
use offload_core::timeline::{Timeline, category};
use offload_core::{ComponentsManager, DeviceName};

use crate::config::TransformerConfig;
use crate::error::{Error, Result};
use crate::loading::{Checkpoint, LoadOptions, LoadReport};
use crate::lora::{self, AppliedLoras, ComponentLayers, LoraFile, LoraMode, LoraSpec, LoraTarget};
use crate::scheduler::{Schedule, SchedulerConfig};
use crate::text_encoder::{TextEncoder, TextEncoderConfig};
use crate::tokenizer::PromptTokenizer;
use crate::transformer::ZImageTransformer2DModel;
use crate::vae::{AutoencoderKl, VaeConfig};

/// The largest height or width accepted: a 16,384 × 16,384 image is 268 million pixels (3 GiB as f32), and every
/// size the pipeline derives from it (latents, tokens, pixels × channels × bytes) fits a `usize`.
pub const MAX_SIDE: usize = 16_384;

/// The most denoising steps accepted: Turbo takes 8 and base models 50, so a schedule past this is a mistake, and
/// the schedule and progress bar are sized by it.
pub const MAX_STEPS: usize = 10_000;

/// The most prompt tokens accepted, whatever the checkpoint (the tokenizer pads every prompt to this length, so an
/// absurd one would allocate before any check of the model's own position tables).
pub const MAX_SEQUENCE_LENGTH: usize = 65_536;

/// What to generate. [`GenerateOptions::turbo`] gives Z-Image-Turbo's defaults.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// The prompt.
    pub prompt: String,
    /// The negative prompt, used only with guidance; empty when `None`.
    pub negative_prompt: Option<String>,
    /// Denoising steps (Turbo: 8).
    pub steps: usize,
    /// Classifier-free guidance scale; guidance is on when it is above 0 (Turbo: 0).
    pub guidance: f32,
    /// Image height in pixels, a multiple of twice the VAE's scale factor (16 for the FLUX VAE).
    pub height: usize,
    /// Image width in pixels, a multiple of twice the VAE's scale factor (16 for the FLUX VAE).
    pub width: usize,
    /// Prompt tokens kept (512 in diffusers).
    pub max_sequence_length: usize,
    /// Seed of the initial noise when `latents` is not given.
    pub seed: u64,
    /// The initial noise, `[1, 16, h, w]` with `[h, w]` = [`latent_size`](Self::latent_size), to reproduce a
    /// diffusers run.
    pub latents: Option<Tensor<4>>,
    /// An input image `[1, 3, H, W]` in `[0, 1]`: image-to-image.
    pub image: Option<Tensor<4>>,
    /// How much of the schedule image-to-image runs, in `[0, 1]`.
    pub strength: f64,
}

impl GenerateOptions {
    /// Z-Image-Turbo's defaults: 8 steps, no guidance, 1024×1024, 512 tokens, seed 0, strength 0.6.
    pub fn turbo(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            negative_prompt: None,
            steps: 8,
            guidance: 0.0,
            height: 1024,
            width: 1024,
            max_sequence_length: 512,
            seed: 0,
            latents: None,
            image: None,
            strength: 0.6,
        }
    }

    /// Checks the counts and numbers a user gives that need no checkpoint, with errors that say what to change: the
    /// sides (1 to [`MAX_SIDE`]), the steps (1 to [`MAX_STEPS`]), the prompt tokens (1 to [`MAX_SEQUENCE_LENGTH`]),
    /// the guidance (finite, at least 0) and the strength (in `[0, 1]`). Every size the pipeline derives from them
    /// (latents, tokens, pixels × channels × bytes) then fits a `usize`, and nothing allocates for a count it was
    /// never going to reach. [`validate`](Self::validate) runs it first.
    pub fn check_counts(&self) -> Result<()> {
        let too_large = |name: &'static str, value: usize, bound: usize, unit: &str| Error::InvalidArgument {
            name,
            reason: format!("{value} is more than the largest accepted ({bound} {unit}); pass a smaller value"),
        };
        for (name, side) in [("height", self.height), ("width", self.width)] {
            if side > MAX_SIDE {
                return Err(too_large(name, side, MAX_SIDE, "pixels"));
            }
        }
        if self.steps == 0 {
            return Err(Error::ZeroSteps);
        }
        if self.steps > MAX_STEPS {
            return Err(too_large("steps", self.steps, MAX_STEPS, "steps"));
        }
        if self.max_sequence_length == 0 {
            return Err(Error::InvalidArgument { name: "max_sequence_length", reason: "it must be at least 1".into() });
        }
        if self.max_sequence_length > MAX_SEQUENCE_LENGTH {
            return Err(too_large("max_sequence_length", self.max_sequence_length, MAX_SEQUENCE_LENGTH, "tokens"));
        }
        if !(0.0..=1.0).contains(&self.strength) || self.strength.is_nan() {
            return Err(Error::InvalidStrength { strength: self.strength });
        }
        if !self.guidance.is_finite() || self.guidance < 0.0 {
            return Err(Error::InvalidArgument {
                name: "guidance",
                reason: format!("{} is not a finite number of at least 0; use 0 for Turbo", self.guidance),
            });
        }
        Ok(())
    }

    /// Checks everything a user gives against the pipeline's `configs`, with errors that say what to change: the
    /// counts ([`check_counts`](Self::check_counts)); sides that are multiples of twice the VAE's scale factor, as
    /// diffusers requires; the latents' shape (the VAE's latent channels) and the input image's.
    pub fn validate(&self, configs: &CheckpointConfigs) -> Result<()> {
        self.check_counts()?;
        let vae_scale_factor = configs.vae.scale_factor();
        let multiple = 2 * vae_scale_factor.max(1);
        if self.height == 0
            || self.width == 0
            || !self.height.is_multiple_of(multiple)
            || !self.width.is_multiple_of(multiple)
        {
            return Err(Error::InvalidSize { height: self.height, width: self.width, multiple });
        }
        let [h, w] = self.latent_size(vae_scale_factor);
        let channels = configs.vae.latent_channels;
        if let Some(latents) = &self.latents
            && latents.dims() != [1, channels, h, w]
        {
            return Err(Error::InvalidArgument {
                name: "latents",
                reason: format!(
                    "shape {:?} does not match {}x{} (expected [1, {channels}, {h}, {w}])",
                    latents.dims(),
                    self.height,
                    self.width
                ),
            });
        }
        if let Some(image) = &self.image
            && image.dims() != [1, IMAGE_CHANNELS, self.height, self.width]
        {
            return Err(Error::InvalidArgument {
                name: "image",
                reason: format!(
                    "shape {:?} is not [1, {IMAGE_CHANNELS}, {}, {}]; resize the image or pass its size",
                    image.dims(),
                    self.height,
                    self.width
                ),
            });
        }
        Ok(())
    }

    /// The latent size for a VAE of `vae_scale_factor`, as diffusers derives it: `[2·(H/2s), 2·(W/2s)]` (the
    /// transformer's 2×2 patches need an even size): `[2·(H/16), 2·(W/16)]` for the FLUX VAE's 8.
    pub fn latent_size(&self, vae_scale_factor: usize) -> [usize; 2] {
        let cell = 2 * vae_scale_factor.max(1);
        [2 * (self.height / cell), 2 * (self.width / cell)]
    }

    fn guided(&self) -> bool {
        self.guidance > 0.0
    }
}

/// The configs of a pipeline's components, read before any weight loads ([`CheckpointConfigs::read`]) and checked
/// against each other ([`CheckpointConfigs::check`]): each config's own `validate` checks it alone, and a VAE whose
/// latents the transformer cannot take, or a text encoder wider than the transformer's caption input, would
/// otherwise fail deep in a forward, after the whole denoise.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointConfigs {
    /// `text_encoder/config.json`.
    pub text_encoder: TextEncoderConfig,
    /// `transformer/config.json`.
    pub transformer: TransformerConfig,
    /// `vae/config.json`.
    pub vae: VaeConfig,
    /// `scheduler/scheduler_config.json`.
    pub scheduler: SchedulerConfig,
}

/// The channels of the images the pipeline reads and writes (RGB).
pub const IMAGE_CHANNELS: usize = 3;

impl CheckpointConfigs {
    /// Reads every component's config from `checkpoint` (each validated on its own) and checks them against each
    /// other; reads no weight.
    pub fn read(checkpoint: &Checkpoint) -> Result<Self> {
        let configs = Self {
            text_encoder: TextEncoderConfig::from_file(checkpoint.config_path("text_encoder"))?,
            transformer: checkpoint.transformer_config()?,
            vae: VaeConfig::from_file(checkpoint.config_path("vae"))?,
            scheduler: SchedulerConfig::from_file(checkpoint.config_path("scheduler"))?,
        };
        configs.check()?;
        Ok(configs)
    }

    /// Checks the components against each other: the VAE reads and writes RGB images, its latent channels are the
    /// transformer's input channels, and the text encoder's width is the transformer's caption width. The error
    /// names both configs and what to use instead.
    pub fn check(&self) -> Result<()> {
        let incompatible = |first: &str, second: &str, problem: String| Error::IncompatibleComponents {
            first: first.to_string(),
            second: second.to_string(),
            problem,
        };
        let (vae, te, tr) = (&self.vae, &self.text_encoder, &self.transformer);
        for (field, channels) in [("in_channels", vae.in_channels), ("out_channels", vae.out_channels)] {
            if channels != IMAGE_CHANNELS {
                return Err(incompatible(
                    "vae/config.json",
                    "the pipeline's RGB images",
                    format!(
                        "the VAE's {field} is {channels}, but the pipeline reads and writes {IMAGE_CHANNELS}-channel                          images; use a VAE made for RGB images ({field} {IMAGE_CHANNELS})"
                    ),
                ));
            }
        }
        if vae.latent_channels != tr.in_channels {
            return Err(incompatible(
                "vae/config.json",
                "transformer/config.json",
                format!(
                    "the VAE makes latents of {} channels, but the transformer takes {} (in_channels); use the VAE                      that came with this transformer",
                    vae.latent_channels, tr.in_channels
                ),
            ));
        }
        if te.hidden_size != tr.cap_feat_dim {
            return Err(incompatible(
                "text_encoder/config.json",
                "transformer/config.json",
                format!(
                    "the text encoder's hidden_size is {}, but the transformer takes captions of width {}                      (cap_feat_dim); use the text encoder that came with this transformer",
                    te.hidden_size, tr.cap_feat_dim
                ),
            ));
        }
        Ok(())
    }
}

/// A generated image and the timings of the phases that made it.
#[derive(Debug, Clone)]
pub struct Generated {
    /// The image `[1, 3, H, W]` in `[0, 1]` (f32).
    pub image: Tensor<4>,
    /// The `encode`, `denoise` and `decode` phases, in order, with the release after each.
    pub phases: PhaseReport,
}

/// The names of the phases [`ZImagePipeline::generate_with_report`] runs, in order.
pub const PHASES: [&str; 3] = ["encode", "denoise", "decode"];

/// The Z-Image(-Turbo) pipeline: its three components, each a [`ModelHandle`] registered in one
/// `ComponentsManager`, and the generation flow.
pub struct ZImagePipeline {
    /// The manager of the execution device: every component the device map leaves there.
    manager: Arc<ComponentsManager>,
    /// One manager per other device of the map, each with its own account.
    elsewhere: Vec<Arc<ComponentsManager>>,
    /// Where each component runs.
    map: DeviceMap,
    text_encoder: ModelHandle<TextEncoder>,
    transformer: ModelHandle<ZImageTransformer2DModel>,
    vae: ModelHandle<AutoencoderKl>,
    tokenizer: PromptTokenizer,
    /// The components' configs, checked against each other.
    configs: CheckpointConfigs,
    placement: OffloadDevice,
    reports: Vec<LoadReport>,
    transformer_dtype: DType,
    /// Called with each phase's name once it finished ([`set_phase_observer`](Self::set_phase_observer)).
    phase_observer: Option<PhaseObserver>,
    /// The LoRAs applied to the transformer and the text encoder, and what removing them needs.
    loras: AppliedLoras,
}

/// A callback told each phase's name once the phase finished (before the memory release after it).
pub type PhaseObserver = Arc<dyn Fn(&str) + Send + Sync>;

impl std::fmt::Debug for ZImagePipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZImagePipeline")
            .field("text_encoder", &self.text_encoder)
            .field("transformer", &self.transformer)
            .field("vae", &self.vae)
            .field("map", &self.map)
            .finish()
    }
}

/// The names of the pipeline's components, as the planner, the manager and the record know them, in pipeline
/// order.
pub const COMPONENTS: [&str; 3] = ["text_encoder", "transformer", "vae"];

/// Where each component runs: the pipeline's execution device, and components placed on devices of their own
/// (diffusers' `device_map` with whole components). Each device has its own manager, so its own account, reserve,
/// OOM retry and record; tensors cross devices at the components' boundaries (the prompt embeddings go to the
/// transformer's device, its latents to the VAE's). `generate --device wgpu --device-map text_encoder=cpu` runs
/// the text encoder on the CPU (flex) beside the transformer and the VAE on the device.
#[derive(Debug, Clone)]
pub struct DeviceMap {
    /// The placement of every component the map does not name: the execution device, the one the latents live on.
    pub default: OffloadDevice,
    /// Components placed elsewhere, by name (one of [`COMPONENTS`]).
    pub components: Vec<(String, OffloadDevice)>,
}

impl DeviceMap {
    /// Every component on one placement.
    pub fn single(placement: OffloadDevice) -> Self {
        Self { default: placement, components: Vec::new() }
    }

    /// The same map with `component` on `placement`. Fails on a name that is not one of [`COMPONENTS`], or one
    /// already placed.
    pub fn with(mut self, component: &str, placement: OffloadDevice) -> Result<Self> {
        if !COMPONENTS.contains(&component) {
            return Err(unknown_component(component));
        }
        if self.components.iter().any(|(name, _)| name == component) {
            return Err(Error::InvalidArgument {
                name: "device map",
                reason: format!("{component} is placed twice; give each component one device"),
            });
        }
        self.components.push((component.to_string(), placement));
        Ok(self)
    }

    /// Where `component` runs.
    pub fn placement(&self, component: &str) -> &OffloadDevice {
        self.components.iter().find(|(name, _)| name == component).map_or(&self.default, |(_, placement)| placement)
    }

    /// diffusers' `device_map="balanced"` over `devices`: the components, largest first, dealt to the devices in a
    /// back-and-forth cycle by their free bytes ([`offload_core::plan::balance`]); one larger than what its turn's
    /// device has left runs on the host ([`OffloadDevice::host_only`]). `sizes` are the components' weight bytes
    /// ([`component_weight_bytes`]); a device's free bytes are its readings' available bytes less `reserve`. The
    /// first device is the execution device, where the latents live: a component dealt elsewhere takes its inputs
    /// there and gives its output back at its boundary. Returns the map and the placement, for printing. Fails on no device, or on a name in `sizes` that is not one of [`COMPONENTS`].
    pub fn balanced(
        devices: &[OffloadDevice],
        sizes: &[(&str, u64)],
        reserve: u64,
    ) -> Result<(Self, offload_core::plan::Balanced)> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument {
                name: "device map",
                reason: "a balanced map needs at least one device; give the execution device".into(),
            });
        }
        if let Some((name, _)) = sizes.iter().find(|(name, _)| !COMPONENTS.contains(name)) {
            return Err(unknown_component(name));
        }
        let free: Vec<u64> =
            devices.iter().map(|device| device.readings().available().saturating_sub(reserve)).collect();
        let balanced = offload_core::plan::balance(sizes, &free);
        let host = OffloadDevice::host_only();
        let mut map = Self::single(devices[0].clone());
        for (component, _) in sizes {
            let device = match balanced.device_of(component).flatten() {
                Some(index) => &devices[index],
                None => &host,
            };
            if !device.is(&devices[0]) {
                map = map.with(component, device.clone())?;
            }
        }
        Ok((map, balanced))
    }

    /// Whether `component` runs on the execution device (the map names it nowhere else, or names that device).
    pub fn on_default(&self, component: &str) -> bool {
        self.placement(component).name() == self.default.name()
    }

    /// The execution device's manager, and the manager of each other device the map names (components on one
    /// device share its manager): every device's own ([`OffloadDevice::manager`]), each given `timeline` when
    /// there is one.
    fn managers(
        &self,
        timeline: Option<&Timeline>,
    ) -> (Arc<ComponentsManager>, Vec<(DeviceName, Arc<ComponentsManager>)>) {
        let main = self.default.manager().clone();
        let with_timeline = |manager: &Arc<ComponentsManager>| {
            if let Some(timeline) = timeline {
                manager.set_timeline(timeline.clone());
            }
        };
        with_timeline(&main);
        let mut others: Vec<(DeviceName, Arc<ComponentsManager>)> = Vec::new();
        for (_, placement) in &self.components {
            if placement.name() != self.default.name() && !others.iter().any(|(name, _)| name == placement.name()) {
                let manager = placement.manager().clone();
                with_timeline(&manager);
                others.push((placement.name().clone(), manager));
            }
        }
        (main, others)
    }
}

/// The weight bytes of each of the checkpoint's components ([`COMPONENTS`]' order), read from no weight: at
/// `dtype`, from their configs' parameter counts; `None` (the dtype the files store), the sizes of their
/// safetensors files (headers included, a few KB). What [`DeviceMap::balanced`] deals out: an estimate, since a
/// device's pages round each tensor up.
pub fn component_weight_bytes(dir: impl AsRef<Path>, dtype: Option<DType>) -> Result<[(&'static str, u64); 3]> {
    let checkpoint = Checkpoint::open(dir)?;
    let [te, tr, vae] = COMPONENTS;
    let Some(dtype) = dtype else {
        let stored = |component: &'static str| -> Result<(&'static str, u64)> {
            let mut bytes = 0;
            for file in checkpoint.weight_files(component)?.files() {
                bytes += std::fs::metadata(&file).map_err(|source| Error::Io { path: file.clone(), source })?.len();
            }
            Ok((component, bytes))
        };
        return Ok([stored(te)?, stored(tr)?, stored(vae)?]);
    };
    let configs = CheckpointConfigs::read(&checkpoint)?;
    Ok([
        (te, configs.text_encoder.bytes_used(dtype.size())),
        (tr, configs.transformer.bytes(dtype)),
        (vae, configs.vae.bytes(dtype.size())),
    ])
}

/// The manager `component` registers in: the execution device's, or its own device's.
fn manager_for<'a>(
    map: &DeviceMap,
    component: &str,
    main: &'a Arc<ComponentsManager>,
    others: &'a [(DeviceName, Arc<ComponentsManager>)],
) -> &'a Arc<ComponentsManager> {
    let name = &map.placement(component).name();
    others.iter().find(|(device, _)| device == *name).map_or(main, |(_, manager)| manager)
}

impl ZImagePipeline {
    /// Loads a diffusers checkpoint directory onto `placement.host()` and registers its components in a new
    /// manager. Auto offload is not enabled: call [`enable_auto_offload`](Self::enable_auto_offload), or run
    /// everything where it is, on the host (on a GPU or a wgpu runtime such a run is refused, as it would compute
    /// on the CPU: `group_offload::Error::NotOnDevice`).
    pub fn load(dir: impl AsRef<Path>, placement: OffloadDevice, opts: &LoadOptions) -> Result<Self> {
        Self::load_mapped(dir, DeviceMap::single(placement), opts)
    }

    /// [`load`](Self::load), each component onto its own placement's host and registered in the manager of its
    /// device ([`DeviceMap`]).
    pub fn load_mapped(dir: impl AsRef<Path>, map: DeviceMap, opts: &LoadOptions) -> Result<Self> {
        let checkpoint = Checkpoint::open(dir)?;
        // Every config is read, and the components are checked against each other, before any weight loads.
        let scheduler = CheckpointConfigs::read(&checkpoint)?.scheduler;
        let [te, tr, va] = COMPONENTS;
        let tokenizer = PromptTokenizer::from_dir(checkpoint.component_dir("tokenizer")?, 512)?;
        let (text_encoder_config, text_encoder, te_report) =
            TextEncoder::load(checkpoint.component_dir("text_encoder")?, map.placement(te).host(), opts)?;
        let (transformer, tr_report) = checkpoint.load_transformer(map.placement(tr).host(), opts)?;
        let transformer_config = transformer.config.clone();
        let (vae_config, vae, vae_report) =
            AutoencoderKl::load(checkpoint.component_dir("vae")?, map.placement(va).host(), opts)?;
        let reports = vec![te_report, tr_report, vae_report];
        Self::from_parts_mapped(
            Parts {
                tokenizer,
                scheduler,
                text_encoder,
                text_encoder_config,
                transformer,
                transformer_config,
                vae,
                vae_config,
            },
            map,
            reports,
        )
    }

    /// Opens a diffusers checkpoint directory and registers its components from their files (the file tier: each
    /// component's host copy is its checkpoint files): only the files' headers are read, every weight stays on disk
    /// until a component runs, and each component reads what it uploads (`group_offload::ModelHandle::register_files`).
    /// The same checks and reports as [`load`](Self::load): every config and the components against each other,
    /// every tensor's shape and dtype, and the applied, missing and unused tensors. With `quantize`, the text
    /// encoder's and the transformer's linear weights are quantized tensor by tensor as they are read
    /// ([`crate::loading::QuantizeLinearWeights`]), never the whole float model in memory.
    ///
    /// An offload plan then keeps each component in RAM or reads it from its files, as the host's budget allows
    /// ([`crate::presets::enable_pipeline_offload`]; `docs/host-memory.md`). `timeline` is the pipeline's from the
    /// start ([`set_timeline`](Self::set_timeline) cannot change it later: each component's offloader is built now
    /// with it); `Timeline::disabled()` records nothing.
    pub fn bind(
        dir: impl AsRef<Path>,
        placement: OffloadDevice,
        opts: &LoadOptions,
        quantize: Option<&burn::tensor::quantization::QuantScheme>,
        timeline: Timeline,
    ) -> Result<Self> {
        Self::bind_mapped(dir, DeviceMap::single(placement), opts, quantize, timeline)
    }

    /// [`bind`](Self::bind), each component registered in the manager of its device ([`DeviceMap`]).
    pub fn bind_mapped(
        dir: impl AsRef<Path>,
        map: DeviceMap,
        opts: &LoadOptions,
        quantize: Option<&burn::tensor::quantization::QuantScheme>,
        timeline: Timeline,
    ) -> Result<Self> {
        let checkpoint = Checkpoint::open(dir)?;
        let configs = CheckpointConfigs::read(&checkpoint)?;
        let [te, tr, va] = COMPONENTS;
        let tokenizer = PromptTokenizer::from_dir(checkpoint.component_dir("tokenizer")?, 512)?;
        let transform = quantize.map(|scheme| {
            Arc::new(crate::loading::QuantizeLinearWeights { scheme: *scheme })
                as Arc<dyn group_offload::weights::TensorTransform>
        });
        let (_, text_encoder) = checkpoint.bind_text_encoder(map.placement(te).host(), opts, transform.clone())?;
        let transformer = checkpoint.bind_transformer(map.placement(tr).host(), opts, transform)?;
        let (_, vae) = checkpoint.bind_vae(map.placement(va).host(), opts)?;
        // The dtype the transformer computes in, from its table: asking the bound model would read a weight.
        let dtype = transformer.files.get(transformer.model.x_pad_token.id).map_or(DType::F32, |entry| entry.dtype());
        let reports = vec![text_encoder.report, transformer.report, vae.report];
        let (manager, others) = map.managers(Some(&timeline));
        let on = |component| manager_for(&map, component, &manager, &others);
        let at = |component| map.placement(component).clone();
        Ok(Self {
            text_encoder: ModelHandle::register_files(on(te), te, text_encoder.model, text_encoder.files, at(te))?,
            transformer: ModelHandle::register_files(on(tr), tr, transformer.model, transformer.files, at(tr))?,
            vae: ModelHandle::register_files(on(va), va, vae.model, vae.files, at(va))?,
            placement: map.default.clone(),
            elsewhere: others.iter().map(|(_, manager)| manager.clone()).collect(),
            manager,
            map,
            tokenizer,
            configs,
            reports,
            transformer_dtype: dtype,
            phase_observer: None,
            loras: AppliedLoras::default(),
        })
    }

    /// Assembles a pipeline from loaded parts.
    pub fn from_parts(parts: Parts, placement: OffloadDevice, reports: Vec<LoadReport>) -> Result<Self> {
        Self::from_parts_mapped(parts, DeviceMap::single(placement), reports)
    }

    /// [`from_parts`](Self::from_parts), each component registered in the manager of its device ([`DeviceMap`]).
    pub fn from_parts_mapped(parts: Parts, map: DeviceMap, reports: Vec<LoadReport>) -> Result<Self> {
        let configs = CheckpointConfigs {
            text_encoder: parts.text_encoder_config,
            transformer: parts.transformer_config,
            vae: parts.vae_config,
            scheduler: parts.scheduler,
        };
        configs.check()?;
        let (manager, others) = map.managers(None);
        let on = |component| manager_for(&map, component, &manager, &others);
        let at = |component| map.placement(component).clone();
        let dtype = parts.transformer.dtype();
        let [te, tr, vae] = COMPONENTS;
        Ok(Self {
            text_encoder: ModelHandle::register(on(te), te, parts.text_encoder, at(te))?,
            transformer: ModelHandle::register(on(tr), tr, parts.transformer, at(tr))?,
            vae: ModelHandle::register(on(vae), vae, parts.vae, at(vae))?,
            placement: map.default.clone(),
            elsewhere: others.iter().map(|(_, manager)| manager.clone()).collect(),
            manager,
            map,
            tokenizer: parts.tokenizer,
            configs,
            reports,
            transformer_dtype: dtype,
            phase_observer: None,
            loras: AppliedLoras::default(),
        })
    }

    /// Puts the transformer under block-level group offload: its refiner and main blocks stream through the
    /// device in groups of `blocks_per_group`, the next `prefetch_depth` groups uploaded on a worker thread
    /// (none when `prefetch_depth` is 0). Every group move is charged to `ledger` and recorded in the manager's
    /// record. The manager then holds it as a group-offloaded component, never evicted wholesale.
    ///
    /// Call it before [`enable_auto_offload`](Self::enable_auto_offload). For the text encoder, leaf level, the
    /// resident budget, a disk store and release between phases, call
    /// [`ModelHandle::enable_group_offload`] on [`transformer_mut`](Self::transformer_mut) or
    /// [`text_encoder_mut`](Self::text_encoder_mut) with [`GroupOptions`].
    pub fn enable_group_offload(&mut self, blocks_per_group: usize, prefetch_depth: usize) -> Result<()> {
        let options = GroupOptions {
            level: GroupLevel::Block { blocks_per_group },
            prefetch: prefetch_depth > 0,
            prefetch_depth: prefetch_depth.max(1),
            ..GroupOptions::default()
        };
        Ok(self.transformer.enable_group_offload(&options)?)
    }

    /// Applies the LoRA files `specs` (each at its scale) to the transformer and the text encoder in `mode`,
    /// replacing whatever LoRAs were applied before (their removal restores the base weights bit for bit). An
    /// empty `specs` removes them all.
    ///
    /// Every file is read and every key checked against the models first; the first problem is returned typed,
    /// naming its file and key ([`Error::LoraKey`], [`Error::LoraShape`], [`Error::LoraFile`]), and then nothing
    /// has changed. Call it before putting a component under group offload (whose store then holds the fused
    /// weights, or the low-rank terms with their layers' groups); under group offload it is refused
    /// ([`Error::LoraUnsupported`]). Auto offload is fine: a component is re-registered with its new size.
    pub fn set_loras(&mut self, specs: &[LoraSpec], mode: LoraMode) -> Result<&AppliedLoras> {
        if self.transformer.is_grouped() || self.text_encoder.is_grouped() {
            return Err(Error::LoraUnsupported {
                reason: "a component is under group offload, whose store holds its weights; apply LoRAs after \
                         loading and before enabling group offload or an offload plan"
                    .into(),
            });
        }
        let files = specs.iter().map(|spec| Ok((spec.clone(), LoraFile::read(&spec.path)?))).collect::<Result<_>>()?;
        self.set_lora_files(files, mode)
    }

    /// [`set_loras`](Self::set_loras) with the files already read (each [`LoraFile::read`] beside its spec), so a
    /// caller can refuse a bad file before it loads the checkpoint. The same checks, the same all-or-nothing rule.
    pub fn set_lora_files(&mut self, loras: Vec<(LoraSpec, LoraFile)>, mode: LoraMode) -> Result<&AppliedLoras> {
        let streams = |handle: bool, file_tier: bool| handle && !file_tier;
        if streams(self.transformer.is_grouped(), self.transformer.is_file_tier())
            || streams(self.text_encoder.is_grouped(), self.text_encoder.is_file_tier())
        {
            return Err(Error::LoraUnsupported {
                reason: "a component is under group offload, whose store holds its weights; apply LoRAs after \
                         loading and before enabling group offload or an offload plan"
                    .into(),
            });
        }
        let (specs, files): (Vec<LoraSpec>, Vec<(LoraFile, f32)>) = loras
            .into_iter()
            .map(|(spec, file)| {
                let scale = spec.scale;
                (spec, (file, scale))
            })
            .unzip();
        // A component whose host copy is its checkpoint files takes a LoRA at run time: fusing would read every
        // layer it updates into host memory and keep it there.
        let file_tier = self.transformer.is_file_tier() || self.text_encoder.is_file_tier();
        let mode = if file_tier { LoraMode::Runtime } else { mode };
        let tr_files = self.transformer.file_table().cloned();
        let te_files = self.text_encoder.file_table().cloned();
        let transformer = self.transformer.inspect(|m| ComponentLayers::transformer_with(m, tr_files.as_ref()))?;
        let text_encoder = self.text_encoder.inspect(|m| ComponentLayers::text_encoder_with(m, te_files.as_ref()))?;
        let resolved = lora::resolve(&files, &transformer, &text_encoder)?;
        let layers = [(LoraTarget::Transformer, &transformer), (LoraTarget::TextEncoder, &text_encoder)];
        lora::check_mode(&resolved, mode, &layers)?;
        lora::check_removal(&self.loras, &layers)?;
        let old = std::mem::take(&mut self.loras);
        let mut applied = AppliedLoras::new(specs, mode, resolved.skipped.clone());
        // Checked above; each rewrite works in place on the host copy. What can still fail is a fused weight that
        // would not be finite: `swap` then leaves that model as it was, and a transformer already swapped is put
        // back here, so both hold the LoRAs before, bit for bit.
        let transformer = self.transformer.rebuild(|mut model| {
            let swapped = lora::swap(&mut model, LoraTarget::Transformer, &old, &resolved, &mut applied);
            (model, swapped)
        })?;
        if let Err(error) = transformer {
            self.loras = old;
            return Err(error);
        }
        let text_encoder = self.text_encoder.rebuild(|mut model| {
            let swapped = lora::swap(&mut model, LoraTarget::TextEncoder, &old, &resolved, &mut applied);
            (model, swapped)
        })?;
        if let Err(error) = text_encoder {
            self.transformer.rebuild(|mut model| {
                lora::revert(&mut model, LoraTarget::Transformer, &applied, &old);
                (model, ())
            })?;
            self.loras = old;
            return Err(error);
        }
        self.loras = applied;
        Ok(&self.loras)
    }

    /// Gives back the fused LoRAs' removal records ([`AppliedLoras::drop_removal`]) for a run that never changes
    /// its LoRAs again; returns their bytes. [`set_loras`](Self::set_loras) then refuses any change.
    pub fn keep_loras(&mut self) -> usize {
        self.loras.drop_removal()
    }

    /// The LoRAs applied ([`set_loras`](Self::set_loras)); empty when none.
    pub fn loras(&self) -> &AppliedLoras {
        &self.loras
    }

    /// The Qwen3 text encoder.
    pub fn text_encoder(&self) -> &ModelHandle<TextEncoder> {
        &self.text_encoder
    }

    /// The Qwen3 text encoder, to put it under group offload or quantize it.
    pub fn text_encoder_mut(&mut self) -> &mut ModelHandle<TextEncoder> {
        &mut self.text_encoder
    }

    /// The Z-Image transformer.
    pub fn transformer(&self) -> &ModelHandle<ZImageTransformer2DModel> {
        &self.transformer
    }

    /// The Z-Image transformer, to put it under group offload or quantize it.
    pub fn transformer_mut(&mut self) -> &mut ModelHandle<ZImageTransformer2DModel> {
        &mut self.transformer
    }

    /// The VAE.
    pub fn vae(&self) -> &ModelHandle<AutoencoderKl> {
        &self.vae
    }

    /// The VAE, to quantize it.
    pub fn vae_mut(&mut self) -> &mut ModelHandle<AutoencoderKl> {
        &mut self.vae
    }

    /// The three components in pipeline order ([`COMPONENTS`]), as the planner sees them.
    pub fn components(&self) -> [&dyn Component; 3] {
        [&self.text_encoder, &self.transformer, &self.vae]
    }

    /// The three components in pipeline order, to apply a plan's routes.
    pub fn components_mut(&mut self) -> [&mut dyn Component; 3] {
        [&mut self.text_encoder, &mut self.transformer, &mut self.vae]
    }

    /// The component named `name` ([`COMPONENTS`]).
    pub fn component(&self, name: &str) -> Option<&dyn Component> {
        self.components().into_iter().find(|c| c.name() == name)
    }

    /// The component named `name` ([`COMPONENTS`]), to put it under group offload.
    pub fn component_mut(&mut self, name: &str) -> Option<&mut dyn Component> {
        self.components_mut().into_iter().find(|c| c.name() == name)
    }

    /// Puts the component named `name` under group offload with `options` ([`ModelHandle::enable_group_offload`]);
    /// refused for a name that is not a component ([`Error::InvalidArgument`]) and for the VAE, which declares no
    /// blocks (`group_offload::Error::RouteUnsupported`).
    pub fn enable_group_offload_with(&mut self, name: &str, options: &GroupOptions) -> Result<()> {
        let component = self.component_mut(name).ok_or_else(|| unknown_component(name))?;
        Ok(component.enable_group_offload(options)?)
    }

    /// The group offloader of the component named `name`, when it is grouped (a handle that shares it).
    pub fn group_offload(&self, name: &str) -> Option<GroupOffload> {
        self.component(name).and_then(|c| c.group_offload().cloned())
    }

    /// Group-offload statistics of the component named `name`, when it is grouped.
    pub fn group_stats(&self, name: &str) -> Option<GroupStats> {
        self.component(name).and_then(|c| c.group_stats())
    }

    /// Whether the component named `name` is under group offload.
    pub fn is_grouped(&self, name: &str) -> bool {
        self.component(name).is_some_and(|c| c.is_grouped())
    }

    /// The dtype the transformer computes in, which the activation estimates assume.
    pub fn dtype(&self) -> DType {
        self.transformer_dtype
    }

    /// The execution device: where the components the device map leaves there execute, what accounts for them,
    /// and where the latents live.
    pub fn placement(&self) -> &OffloadDevice {
        &self.placement
    }

    /// Where each component runs ([`DeviceMap::single`] unless the pipeline was made with a map).
    pub fn device_map(&self) -> &DeviceMap {
        &self.map
    }

    /// The execution device's manager: it holds every component the device map leaves on that device (all three
    /// without a map). Offload plans and auto offload apply to it.
    pub fn manager(&self) -> &Arc<ComponentsManager> {
        &self.manager
    }

    /// Every device's manager, the execution device's first: one per device of the map, each with its own
    /// account and record.
    pub fn managers(&self) -> impl Iterator<Item = &Arc<ComponentsManager>> {
        std::iter::once(&self.manager).chain(&self.elsewhere)
    }

    /// What loading applied, and found missing or unused, per component.
    pub fn load_reports(&self) -> &[LoadReport] {
        &self.reports
    }

    /// The transformer's configuration.
    pub fn transformer_config(&self) -> &TransformerConfig {
        &self.configs.transformer
    }

    /// Enables auto offload onto the execution device, deciding by the device object's own readings
    /// ([`OffloadDevice::readings`]: a simulated card's, a real device's pool or its cap; unbounded where nothing
    /// reads it), with `reserve` bytes kept free and, with `retry_on_oom`, a call that runs out of memory retried
    /// after evicting. The device was handed over once, when the pipeline was loaded. Each further device the map
    /// places a component on gets auto offload too, where it has none yet ([`enable_further_devices`]).
    ///
    /// [`enable_further_devices`]: Self::enable_further_devices
    pub fn enable_auto_offload(&self, reserve: u64, retry_on_oom: bool) -> Result<()> {
        self.manager.enable_auto_offload(self.placement.readings(), reserve, retry_on_oom)?;
        self.enable_further_devices()
    }

    /// Enables auto offload (no reserve, the OOM retry) on each further device the map places a component on (not
    /// the execution device, not the host) whose manager has none yet, so that a component runs on the device the
    /// map gives it: a manager without auto offload runs its components where they are, on the host. A device given
    /// its own reserve first ([`OffloadDevice::enable_auto_offload`]) keeps it. Called by
    /// [`enable_auto_offload`](Self::enable_auto_offload) and by an offload plan's application
    /// ([`crate::presets::enable_pipeline_offload`]), which set the execution device's.
    pub(crate) fn enable_further_devices(&self) -> Result<()> {
        for (_, placement) in &self.map.components {
            let further = placement.name() != self.placement.name() && !placement.name().is_cpu();
            if further && placement.manager().auto_offload().is_none() {
                placement.enable_auto_offload(0)?;
            }
        }
        Ok(())
    }

    /// Activation bytes each component's call holds beside its weights, for a generation: what a run charges
    /// a simulated card (`[text encoder, transformer, VAE]`); a real device allocates for itself.
    pub fn activation_estimates(&self, opts: &GenerateOptions) -> [u64; 3] {
        let dtype = self.transformer_dtype;
        let caption = self.caption_tokens(opts);
        let s = self.vae_scale_factor();
        [
            text_encoder_activation_bytes(&self.configs.text_encoder, opts.max_sequence_length, dtype),
            self.configs.transformer.activation_bytes_with_caption(opts.height, opts.width, s, caption, dtype),
            vae_activation_bytes(&self.configs.vae, opts.height, opts.width, dtype),
        ]
    }

    /// The caption tokens the transformer sees for `opts`: the longest prompt's real tokens (the negative one too
    /// with guidance), at most `max_sequence_length`; `max_sequence_length` when a prompt cannot be tokenized.
    pub fn caption_tokens(&self, opts: &GenerateOptions) -> usize {
        let mut prompts = vec![opts.prompt.clone()];
        if opts.guided() {
            prompts.push(opts.negative_prompt.clone().unwrap_or_default());
        }
        let tokenizer = self.tokenizer.with_max_sequence_length(opts.max_sequence_length);
        tokenizer
            .encode(&prompts)
            .map_or(opts.max_sequence_length, |tokens| tokens.lengths().into_iter().max().unwrap_or(0))
    }

    /// Encodes prompts: one `[len, hidden]` tensor of valid rows each.
    pub fn encode_prompts(&self, prompts: &[String], max_sequence_length: usize) -> Result<Vec<Tensor<2>>> {
        let tokenizer = self.tokenizer.with_max_sequence_length(max_sequence_length);
        let tokens = tokenizer.encode(prompts)?;
        let activations =
            text_encoder_activation_bytes(&self.configs.text_encoder, max_sequence_length, self.transformer_dtype);
        let run = self.text_encoder.try_run(activations, |weights, device| {
            weights.encode(tokens.input_ids_tensor(device), tokens.attention_mask_tensor(device))
        });
        Ok(run?)
    }

    /// Generates an image `[1, 3, H, W]` in `[0, 1]` (f32), calling `progress(step, steps)` after each step.
    pub fn generate(&self, opts: &GenerateOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Tensor<4>> {
        self.generate_with_report(opts, progress).map(|generated| generated.image)
    }

    /// Generates an image as [`generate`](Self::generate) does, in three timed phases ([`PHASES`]): `encode`
    /// (the prompts, and the input image for image-to-image), `denoise` and `decode`. Between two phases the
    /// execution device's memory is released (`OffloadDevice::memory_cleanup`: the computing thread's stream's
    /// pools and the upload thread's; a simulated card needs nothing more).
    pub fn generate_with_report(
        &self,
        opts: &GenerateOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Generated> {
        self.validate(opts)?;
        let device = self.placement.exec().clone();
        let release_device = self.placement.clone();
        let observer = self.phase_observer.clone();
        let timeline = self.manager.timeline();
        let release_timeline = timeline.clone();
        let memory = self.placement.memory().clone();
        let sample = move |timeline: &Timeline| {
            if let Some(memory) = &memory {
                timeline.sample_memory(memory.as_ref());
            }
        };
        let release_sample = sample.clone();
        let mut phases = Phases::new(move |finished: &str| {
            if let Some(observer) = &observer {
                observer(finished);
            }
            tracing::debug!(phase = finished, "releasing device memory between phases");
            let span = release_timeline.span(category::PHASE, &format!("release after {finished}"));
            release_device.memory_cleanup();
            drop(span);
            release_sample(&release_timeline);
        });
        // Each phase is a span on the calling thread, with a memory sample at its start and its end.
        let phase_span = |name: &str| {
            sample(&timeline);
            timeline.span(category::PHASE, name)
        };
        let [h, w] = opts.latent_size(self.vae_scale_factor());
        let vae_activations = self.activation_estimates(opts)[2];
        let (embeds, schedule, latents) = phases.run(PHASES[0], || -> Result<_> {
            let phase = phase_span(PHASES[0]);
            let mut prompts = vec![opts.prompt.clone()];
            if opts.guided() {
                prompts.push(opts.negative_prompt.clone().unwrap_or_default());
            }
            let embeds = self.encode_prompts(&prompts, opts.max_sequence_length)?;
            let noise = match &opts.latents {
                Some(latents) => latents.clone().cast(DType::F32).to_device(&device),
                None => {
                    let channels = self.configs.vae.latent_channels;
                    initial_noise(opts.seed, [1, channels, h, w], self.placement.host()).to_device(&device)
                }
            };
            let full = self.configs.scheduler.schedule(opts.steps, (h / 2) * (w / 2))?;
            let (schedule, latents) = match &opts.image {
                None => (full, noise),
                Some(image) => {
                    let schedule = full.img2img(opts.strength)?;
                    let clean = self.encode_image(image.clone().to_device(&device), vae_activations)?;
                    let noised = schedule.scale_noise(clean, noise);
                    (schedule, noised)
                }
            };
            drop(phase);
            sample(&timeline);
            Ok((embeds, schedule, latents))
        })?;
        let latents = phases.run(PHASES[1], || -> Result<_> {
            let phase = phase_span(PHASES[1]);
            let mut latents = latents;
            for i in 0..schedule.len() {
                let step = timeline.span(category::STEP, &format!("step {}", i + 1)).arg("of", schedule.len());
                latents = self.denoise_step(&schedule, i, latents, &embeds, opts)?;
                drop(step);
                progress(i + 1, schedule.len());
            }
            drop(phase);
            sample(&timeline);
            Ok(latents)
        })?;
        drop(embeds);
        let image = phases.run(PHASES[2], || {
            let phase = phase_span(PHASES[2]);
            let image = self.decode_with(latents, vae_activations);
            drop(phase);
            sample(&timeline);
            image
        })?;
        if let Some(observer) = &self.phase_observer {
            observer(PHASES[2]);
        }
        Ok(Generated { image, phases: phases.finish() })
    }

    fn denoise_step(
        &self,
        schedule: &Schedule,
        i: usize,
        latents: Tensor<4>,
        embeds: &[Tensor<2>],
        opts: &GenerateOptions,
    ) -> Result<Tensor<4>> {
        let t = schedule.model_time(i);
        let guidance = opts.guidance;
        let activations = self.activation_estimates(opts)[1];
        let x = latents.clone().unsqueeze_dim::<5>(2);
        let [_, channels, frames, h, w] = x.dims();
        let inputs = |dtype: DType, device: &Device| {
            let items: Vec<Tensor<4>> = embeds
                .iter()
                .map(|_| x.clone().to_device(device).cast(dtype).reshape([channels, frames, h, w]))
                .collect();
            let caps: Vec<Tensor<2>> = embeds.iter().map(|e| e.clone().to_device(device).cast(dtype)).collect();
            let time = Tensor::<1>::from_data(TensorData::new(vec![t; caps.len()], [caps.len()]), (device, DType::F32))
                .cast(dtype);
            (items, time, caps)
        };
        let dtype = self.transformer_dtype();
        let outs = self.transformer.try_run(activations, |weights, device| {
            let (items, time, caps) = inputs(dtype, device);
            weights.forward_items(items, time, caps)
        })?;
        let mut outs = outs.into_iter().map(|o| o.cast(DType::F32));
        let positive =
            outs.next().ok_or_else(|| Error::Shape { op: "transformer".into(), reason: "no output".into() })?;
        let prediction = match outs.next() {
            Some(negative) => positive.clone() + (positive - negative) * guidance,
            None => positive,
        };
        // [C, 1, h, w] -> [1, C, h, w]
        let prediction = prediction.reshape([1, channels, h, w]).to_device(&latents.device());
        // The transformer predicts x0 − noise; the scheduler steps along the velocity, its negation.
        Ok(schedule.step(prediction.neg(), latents, i))
    }

    fn encode_image(&self, image: Tensor<4>, activations: u64) -> Result<Tensor<4>> {
        let run = self.vae.run(activations, |vae, device| {
            let pixels = (image.clone().to_device(device) * 2.0 - 1.0).cast(vae_dtype(vae));
            Ok(vae.scale_latents(vae.encode_mean(pixels).cast(DType::F32)))
        });
        Ok(run?)
    }

    /// Decodes pipeline latents `[1, 16, h, w]` to an image `[1, 3, s·h, s·w]` in `[0, 1]`, `s` the VAE's scale
    /// factor.
    pub fn decode(&self, latents: Tensor<4>) -> Result<Tensor<4>> {
        let [_, _, h, w] = latents.dims();
        let s = self.vae_scale_factor();
        let activations = vae_activation_bytes(&self.configs.vae, s * h, s * w, self.transformer_dtype);
        self.decode_with(latents, activations)
    }

    fn decode_with(&self, latents: Tensor<4>, activations: u64) -> Result<Tensor<4>> {
        let run = self.vae.run(activations, |vae, device| {
            let z = vae.unscale_latents(latents.clone().to_device(device)).cast(vae_dtype(vae));
            Ok(AutoencoderKl::postprocess(vae.decode(z).cast(DType::F32)))
        });
        Ok(run?)
    }

    fn transformer_dtype(&self) -> DType {
        self.transformer_dtype
    }

    /// Records this pipeline's runs in `timeline`: each phase (`encode`, `denoise`, `decode`) and the release
    /// after it as a span of category `phase`, each denoising step (`step`), with a device memory sample at every
    /// phase boundary; and, through the manager ([`ComponentsManager::set_timeline`]) and each group offloader,
    /// every run, onload, offload and group upload, compute and release. Write it with
    /// [`Timeline::write_chrome_trace`].
    ///
    /// Call it before [`enable_group_offload`](Self::enable_group_offload) (or a preset that streams by blocks
    /// or leaves): a group offloader keeps the timeline it was built with, so a later call is refused with
    /// [`Error::InvalidArgument`].
    pub fn set_timeline(&mut self, timeline: Timeline) -> Result<()> {
        if self.components().iter().any(|c| c.group_offload().is_some()) {
            return Err(Error::InvalidArgument {
                name: "timeline",
                reason: "group offload is already enabled and its offloaders keep the timeline they were built \
                         with; set the timeline before enabling group offload or applying a preset"
                    .into(),
            });
        }
        for manager in self.elsewhere.iter() {
            manager.set_timeline(timeline.clone());
        }
        self.manager.set_timeline(timeline);
        Ok(())
    }

    /// The timeline this pipeline records in (disabled unless [`set_timeline`](Self::set_timeline) set one).
    pub fn timeline(&self) -> Timeline {
        self.manager.timeline()
    }

    /// Calls `observer` with each phase's name ([`PHASES`]) once that phase of a generation finished: what a
    /// benchmark reads per-phase figures with (the CLI's `--memory-report` reads the host's peak).
    pub fn set_phase_observer(&mut self, observer: PhaseObserver) {
        self.phase_observer = Some(observer);
    }

    /// The prompt tokenizer, with the chat template it wraps prompts in.
    pub fn tokenizer(&self) -> &PromptTokenizer {
        &self.tokenizer
    }

    /// The text encoder's configuration.
    pub fn text_encoder_config(&self) -> &TextEncoderConfig {
        &self.configs.text_encoder
    }

    /// The VAE's configuration.
    pub fn vae_config(&self) -> &VaeConfig {
        &self.configs.vae
    }

    /// Pixels per latent cell per side, from the VAE's config: `2^(levels − 1)`, 8 for the FLUX VAE.
    pub fn vae_scale_factor(&self) -> usize {
        self.configs.vae.scale_factor()
    }

    /// The table of `component`'s checkpoint files when it was registered from them ([`bind`](Self::bind)):
    /// its bound weights and the disk meter every read of them is timed on. `None` for a component in memory.
    pub fn file_table(&self, component: &str) -> Option<&group_offload::weights::FileTable> {
        match component {
            "text_encoder" => self.text_encoder.file_table(),
            "transformer" => self.transformer.file_table(),
            "vae" => self.vae.file_table(),
            _ => None,
        }
    }

    /// The components' configs, checked against each other when the pipeline was made.
    pub fn configs(&self) -> &CheckpointConfigs {
        &self.configs
    }

    /// Checks `opts` for this pipeline ([`GenerateOptions::validate`] with its configs).
    pub fn validate(&self, opts: &GenerateOptions) -> Result<()> {
        opts.validate(&self.configs)
    }
}

/// Checks `opts` against the checkpoint in `dir` before any weight loads: every component's config, the
/// components against each other ([`CheckpointConfigs::check`]) and `opts` against them
/// ([`GenerateOptions::validate`]). What [`ZImagePipeline::load`] followed by [`ZImagePipeline::validate`] would
/// refuse, refused in milliseconds instead of after minutes of loading at real size.
pub fn check_before_loading(dir: impl AsRef<Path>, opts: &GenerateOptions) -> Result<CheckpointConfigs> {
    let configs = CheckpointConfigs::read(&Checkpoint::open(dir)?)?;
    opts.validate(&configs)?;
    Ok(configs)
}

pub(crate) fn unknown_component(name: &str) -> Error {
    Error::InvalidArgument {
        name: "component",
        reason: format!("{name:?} is not a component of this pipeline; use one of {COMPONENTS:?}"),
    }
}

/// Loaded components, before they are registered.
pub struct Parts {
    /// The tokenizer.
    pub tokenizer: PromptTokenizer,
    /// The scheduler's configuration.
    pub scheduler: SchedulerConfig,
    /// The text encoder.
    pub text_encoder: TextEncoder,
    /// Its configuration.
    pub text_encoder_config: TextEncoderConfig,
    /// The transformer.
    pub transformer: ZImageTransformer2DModel,
    /// Its configuration.
    pub transformer_config: TransformerConfig,
    /// The VAE.
    pub vae: AutoencoderKl,
    /// Its configuration.
    pub vae_config: VaeConfig,
}

fn vae_dtype(vae: &AutoencoderKl) -> DType {
    let mut dtype = DType::F32;
    struct First<'a>(&'a mut DType, bool);
    impl burn::module::ModuleVisitor for First<'_> {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
            if !self.1 {
                *self.0 = param.val().dtype();
                self.1 = true;
            }
        }
    }
    burn::module::Module::visit(vae, &mut First(&mut dtype, false));
    dtype
}

/// The initial noise of a seeded run, drawn on the host (`host`, burn's CPU backend) from `seed` and moved to the
/// execution device by the caller: one seed gives one image on every device, as diffusers advises with a CPU
/// generator, since each device's own generator draws other numbers from the same seed.
pub fn initial_noise(seed: u64, shape: [usize; 4], host: &Device) -> Tensor<4> {
    host.seed(seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), (host, DType::F32))
}

/// Activation bytes of one text-encoder call over `tokens` tokens: the residual stream (`4·T·D·e`) and the
/// MLP's two intermediate tensors (`2·T·I·e`), at `dtype`.
///
/// No attention-score term: measured on wgpu (`docs/benchmarks.md`), the tiny encoder's calls took 31 to 68 KB of
/// pages at 32, 64 and 128 tokens, with no growth in the tokens, where `heads × T²` scores would have added 262 KB
/// at 128 (burn's attention with the encoder's mask does not keep them per layer). At that size the calls are
/// within the runtime's per-call buffers, so the fit is of the shape, not of the coefficients.
pub fn text_encoder_activation_bytes(config: &TextEncoderConfig, tokens: usize, dtype: DType) -> u64 {
    let e = dtype.size() as u64;
    let (t, d) = (tokens as u64, config.hidden_size as u64);
    let mlp = 2 * t * config.intermediate_size as u64 * e;
    4 * t * d * e + mlp
}

/// Activation bytes of one VAE decode at `height × width`: `11/2 · C·P·e`, with `C` the first block's channels
/// (the last up block's, at full resolution), `P` the pixels and `e` the bytes of `dtype`.
///
/// Fitted to the pages of the tiny VAE's decodes on wgpu at 64² to 384² (`docs/benchmarks.md`): the least-squares
/// factor is 5.46, and 11/2 predicts the decodes within −3% and +24% (the analytic three feature maps gave 3). The mid-block's
/// attention scores (`(P / s²)²·e`) are not seen: at 384² they would be 21 MB of the 54 MB measured, and a fit
/// with them gives a negative or vanishing coefficient, so they are left out.
pub fn vae_activation_bytes(config: &VaeConfig, height: usize, width: usize, dtype: DType) -> u64 {
    let e = dtype.size() as u64;
    let pixels = (height * width) as u64;
    let first = *config.block_out_channels.first().unwrap_or(&128) as u64;
    11 * first * pixels * e / 2
}
