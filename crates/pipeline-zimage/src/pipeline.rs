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
use group_offload::GroupOffloadConfig;
use offload_core::plan::{PhaseReport, Phases};
use offload_core::timeline::{Timeline, category};
use offload_core::{ComponentsManager, DeviceLedger, DeviceMemory};

use crate::config::TransformerConfig;
use crate::error::{Error, Result};
use crate::grouped::{GroupLevel, GroupOptions, GroupedModel, GroupedTextEncoder, GroupedTransformer};
use crate::loading::{Checkpoint, LoadOptions, LoadReport};
use crate::offload::{BurnComponent, Placement};
use crate::scheduler::{Schedule, SchedulerConfig};
use crate::text_encoder::{TextEncoder, TextEncoderConfig};
use crate::tokenizer::PromptTokenizer;
use crate::transformer::ZImageTransformer2DModel;
use crate::vae::{AutoencoderKl, VaeConfig};

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

    /// Checks the arguments a user gives, with errors that say what to change, for a VAE of `vae_scale_factor`
    /// pixels per latent cell ([`VaeConfig::scale_factor`]; [`ZImagePipeline::validate`] passes its own): sizes
    /// must be multiples of twice it, as diffusers requires.
    pub fn validate(&self, vae_scale_factor: usize) -> Result<()> {
        let multiple = 2 * vae_scale_factor.max(1);
        if self.height == 0
            || self.width == 0
            || !self.height.is_multiple_of(multiple)
            || !self.width.is_multiple_of(multiple)
        {
            return Err(Error::InvalidSize { height: self.height, width: self.width, multiple });
        }
        if self.steps == 0 {
            return Err(Error::ZeroSteps);
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
        if self.max_sequence_length == 0 {
            return Err(Error::InvalidArgument { name: "max_sequence_length", reason: "it must be at least 1".into() });
        }
        let [h, w] = self.latent_size(vae_scale_factor);
        if let Some(latents) = &self.latents
            && latents.dims() != [1, 16, h, w]
        {
            return Err(Error::InvalidArgument {
                name: "latents",
                reason: format!(
                    "shape {:?} does not match {}x{} (expected [1, 16, {h}, {w}])",
                    latents.dims(),
                    self.height,
                    self.width
                ),
            });
        }
        if let Some(image) = &self.image
            && image.dims() != [1, 3, self.height, self.width]
        {
            return Err(Error::InvalidArgument {
                name: "image",
                reason: format!(
                    "shape {:?} is not [1, 3, {}, {}]; resize the image or pass its size",
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

/// The ids of the pipeline's components in its manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentIds {
    /// The Qwen3 text encoder.
    pub text_encoder: String,
    /// The Z-Image transformer.
    pub transformer: String,
    /// The VAE.
    pub vae: String,
}

/// The pipeline's components, by the names the planner and the manager use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PipelineComponent {
    /// The Qwen3 text encoder (`text_encoder`).
    TextEncoder,
    /// The Z-Image transformer (`transformer`).
    Transformer,
    /// The VAE (`vae`).
    Vae,
}

impl PipelineComponent {
    /// Every component, in the order the pipeline runs them.
    pub const ALL: [PipelineComponent; 3] =
        [PipelineComponent::TextEncoder, PipelineComponent::Transformer, PipelineComponent::Vae];

    /// The component's name: `text_encoder`, `transformer`, `vae`.
    pub fn name(self) -> &'static str {
        match self {
            PipelineComponent::TextEncoder => "text_encoder",
            PipelineComponent::Transformer => "transformer",
            PipelineComponent::Vae => "vae",
        }
    }

    /// Its id in `pipeline`'s manager.
    pub fn id(self, pipeline: &ZImagePipeline) -> &str {
        let ids = pipeline.ids();
        match self {
            PipelineComponent::TextEncoder => &ids.text_encoder,
            PipelineComponent::Transformer => &ids.transformer,
            PipelineComponent::Vae => &ids.vae,
        }
    }
}

impl std::fmt::Display for PipelineComponent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
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

/// The Z-Image(-Turbo) pipeline, its components registered in a `ComponentsManager`.
pub struct ZImagePipeline {
    manager: Arc<ComponentsManager>,
    ids: ComponentIds,
    tokenizer: PromptTokenizer,
    scheduler: SchedulerConfig,
    transformer_config: TransformerConfig,
    text_encoder_config: TextEncoderConfig,
    vae_config: VaeConfig,
    placement: Placement,
    reports: Vec<LoadReport>,
    /// Whether the text encoder is under group offload.
    grouped_text_encoder: bool,
    /// Whether the transformer is under group offload.
    grouped_transformer: bool,
    /// The components whose linear weights are quantized.
    quantized: Vec<PipelineComponent>,
    transformer_dtype: DType,
    /// Called with each phase's name once it finished ([`set_phase_observer`](Self::set_phase_observer)).
    phase_observer: Option<PhaseObserver>,
}

/// A callback told each phase's name once the phase finished (before the memory release after it).
pub type PhaseObserver = Arc<dyn Fn(&str) + Send + Sync>;

impl std::fmt::Debug for ZImagePipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZImagePipeline").field("ids", &self.ids).field("placement", &self.placement).finish()
    }
}

impl ZImagePipeline {
    /// Loads a diffusers checkpoint directory onto `placement.host` and registers its components in a new
    /// manager. Auto offload is not enabled: call [`enable_auto_offload`](Self::enable_auto_offload), or run
    /// everything where it is.
    pub fn load(dir: impl AsRef<Path>, placement: Placement, opts: &LoadOptions) -> Result<Self> {
        let checkpoint = Checkpoint::open(dir)?;
        let host = placement.host.clone();
        let tokenizer = PromptTokenizer::from_dir(checkpoint.component_dir("tokenizer")?, 512)?;
        let scheduler = SchedulerConfig::from_file(checkpoint.config_path("scheduler"))?;
        let (text_encoder_config, text_encoder, te_report) =
            TextEncoder::load(checkpoint.component_dir("text_encoder")?, &host, opts)?;
        let (transformer, tr_report) = checkpoint.load_transformer(&host, opts)?;
        let transformer_config = transformer.config.clone();
        let (vae_config, vae, vae_report) = AutoencoderKl::load(checkpoint.component_dir("vae")?, &host, opts)?;
        let reports = vec![te_report, tr_report, vae_report];
        Self::from_parts(
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
            placement,
            reports,
        )
    }

    /// Assembles a pipeline from loaded parts.
    pub fn from_parts(parts: Parts, placement: Placement, reports: Vec<LoadReport>) -> Result<Self> {
        let manager = Arc::new(ComponentsManager::new());
        let dtype = parts.transformer.dtype();
        let text_encoder = manager.add(
            "text_encoder",
            BurnComponent::new(parts.text_encoder, "Qwen3Model", placement.clone()),
            None,
        )?;
        let transformer = manager.add(
            "transformer",
            BurnComponent::new(parts.transformer, "ZImageTransformer2DModel", placement.clone()),
            None,
        )?;
        let vae = manager.add("vae", BurnComponent::new(parts.vae, "AutoencoderKL", placement.clone()), None)?;
        Ok(Self {
            manager,
            ids: ComponentIds { text_encoder, transformer, vae },
            tokenizer: parts.tokenizer,
            scheduler: parts.scheduler,
            transformer_config: parts.transformer_config,
            text_encoder_config: parts.text_encoder_config,
            vae_config: parts.vae_config,
            placement,
            reports,
            grouped_text_encoder: false,
            grouped_transformer: false,
            quantized: Vec::new(),
            transformer_dtype: dtype,
            phase_observer: None,
        })
    }

    /// Puts the transformer under block-level group offload: its refiner and main blocks stream through the
    /// device in groups of `blocks_per_group`, the next `prefetch_depth` groups uploaded on a worker thread
    /// (none when `prefetch_depth` is 0). Every group move is charged to `ledger` and recorded in the manager's
    /// record. The manager then holds it as a group-offloaded component, never evicted wholesale.
    ///
    /// Call it before [`enable_auto_offload`](Self::enable_auto_offload). See
    /// [`enable_group_offload_with`](Self::enable_group_offload_with) for the text encoder, leaf level, the
    /// resident budget, a disk store and release between phases.
    pub fn enable_group_offload(
        &mut self,
        ledger: Arc<dyn DeviceLedger>,
        memory: Option<Arc<dyn DeviceMemory>>,
        blocks_per_group: usize,
        prefetch_depth: usize,
    ) -> Result<()> {
        let options = GroupOptions {
            level: GroupLevel::Block { blocks_per_group },
            prefetch: prefetch_depth > 0,
            prefetch_depth: prefetch_depth.max(1),
            ..GroupOptions::default()
        };
        self.enable_group_offload_with(PipelineComponent::Transformer, ledger, memory, &options)
    }

    /// Puts the transformer or the text encoder under group offload, at block or leaf level, with every option
    /// of [`GroupOptions`]. Does nothing when the component already is (the first options stay). The VAE has no
    /// blocks to stream: it is refused with [`Error::RouteUnsupported`] (after the options are checked).
    ///
    /// Nothing is lost when it fails: the options and the offloader's configuration are checked before the
    /// component is touched, and the component stays registered as it was.
    pub fn enable_group_offload_with(
        &mut self,
        component: PipelineComponent,
        ledger: Arc<dyn DeviceLedger>,
        memory: Option<Arc<dyn DeviceMemory>>,
        options: &GroupOptions,
    ) -> Result<()> {
        if self.is_grouped(component) {
            return Ok(());
        }
        if self.is_quantized(component) {
            return Err(Error::RouteUnsupported {
                component: component.name().into(),
                route: "group offload".into(),
                reason: "its linear weights are quantized, and group offload streams float parameters only: a \
                         quantized component moves whole (component offload keeps its quantized tensors and \
                         kernels); load it unquantized to stream it by blocks or leaves"
                    .into(),
            });
        }
        options.validate()?;
        let mut config = GroupOffloadConfig::new(component.name(), self.placement.exec.clone())
            .with_device_name(self.placement.name.clone())
            .with_ledger(ledger.clone())
            .with_record(self.manager.offload_record())
            .with_timeline(self.manager.timeline());
        if let Some(memory) = memory {
            config = config.with_memory(memory);
        }
        options.configure(config.clone()).validate()?;
        // Taking the model apart into an in-memory store touches no device and cannot fail once the options
        // are valid (resident layers upload later, when the manager onloads the model), so the registered
        // component is taken out and consumed: its host tensors become the group store without a copy. A disk
        // store can fail (a full or read-only disk), so then the store is built from a copy of the handles while
        // the registered component stays where it is, and is removed only once the store exists.
        let copy = options.disk_store.is_some();
        let id = component.id(self).to_string();
        let new_id = match component {
            PipelineComponent::Transformer => {
                let module: ZImageTransformer2DModel = self.take_module(&id, copy)?;
                let grouped = GroupedTransformer::new(module, config, options, ledger)?;
                self.register_grouped(&id, copy, component, grouped)?
            }
            PipelineComponent::TextEncoder => {
                let module: TextEncoder = self.take_module(&id, copy)?;
                let grouped = GroupedTextEncoder::new(module, config, options, ledger)?;
                self.register_grouped(&id, copy, component, grouped)?
            }
            PipelineComponent::Vae => {
                return Err(Error::RouteUnsupported {
                    component: "vae".into(),
                    route: "group offload".into(),
                    reason: "the VAE is not cut into blocks in this pipeline; it moves whole under component offload \
                             (the default when auto offload is on)"
                        .into(),
                });
            }
        };
        match component {
            PipelineComponent::Transformer => {
                self.ids.transformer = new_id;
                self.grouped_transformer = true;
            }
            _ => {
                self.ids.text_encoder = new_id;
                self.grouped_text_encoder = true;
            }
        }
        Ok(())
    }

    /// The registered module of `id`: a copy of its handles (`copy`), or the module itself, unregistered.
    fn take_module<M: burn::module::Module + Clone + 'static>(&self, id: &str, copy: bool) -> Result<M> {
        if copy {
            return Ok(self.manager.inspect(id, |c: &BurnComponent<M>| c.module().clone())?);
        }
        let component: Box<dyn std::any::Any> = self.manager.remove(id)?;
        let component = component.downcast::<BurnComponent<M>>().map_err(|_| Error::Shape {
            op: "group offload".into(),
            reason: format!("the component {id} has another type"),
        })?;
        Ok(component.into_module())
    }

    /// Registers a grouped component in place of `id` (removed first when it was copied); returns the new id.
    fn register_grouped<P: Send + 'static>(
        &self,
        id: &str,
        copied: bool,
        component: PipelineComponent,
        grouped: GroupedModel<P>,
    ) -> Result<String> {
        if copied {
            self.manager.remove(id)?;
        }
        Ok(self.manager.add(component.name(), grouped, None)?)
    }

    /// Quantizes the linear weights of `component` to 8 bits with burn's quantized tensors
    /// ([`crate::quantize`]): the weights stay quantized wherever the manager moves the component, and its
    /// linear layers run burn's quantized kernels. Returns how many weights were quantized. Refused for a
    /// component under group offload (quantize first: a quantized component then moves whole), and does nothing
    /// the second time.
    ///
    /// The component is re-registered with its new size (its id changes, see [`ids`](Self::ids)); a failure
    /// leaves it registered as it was.
    pub fn quantize(&mut self, component: PipelineComponent) -> Result<usize> {
        if self.is_grouped(component) {
            return Err(Error::OffloadAlreadyApplied {
                component: component.name().into(),
                reason: "it is under group offload, whose host copies are float; quantize it before enabling \
                         offload (a quantized component moves whole)"
                    .into(),
            });
        }
        if self.is_quantized(component) {
            return Ok(0);
        }
        let id = component.id(self).to_string();
        let scheme = crate::quantize::int8_scheme();
        let (new_id, count) = match component {
            PipelineComponent::TextEncoder => {
                self.requantize::<TextEncoder>(&id, "text_encoder", "Qwen3Model", &scheme)?
            }
            PipelineComponent::Transformer => {
                self.requantize::<ZImageTransformer2DModel>(&id, "transformer", "ZImageTransformer2DModel", &scheme)?
            }
            PipelineComponent::Vae => self.requantize::<AutoencoderKl>(&id, "vae", "AutoencoderKL", &scheme)?,
        };
        match component {
            PipelineComponent::TextEncoder => self.ids.text_encoder = new_id,
            PipelineComponent::Transformer => self.ids.transformer = new_id,
            PipelineComponent::Vae => self.ids.vae = new_id,
        }
        self.quantized.push(component);
        Ok(count)
    }

    /// Replaces the registered module `id` with its quantized copy, registered as `name`.
    fn requantize<M: burn::module::Module + Clone + 'static>(
        &self,
        id: &str,
        name: &str,
        class: &'static str,
        scheme: &burn::tensor::quantization::QuantScheme,
    ) -> Result<(String, usize)> {
        // Quantize a copy of the handles first, so nothing is unregistered until the quantized module exists.
        let module: M = self.take_module(id, true)?;
        let (quantized, count) = crate::quantize::quantize_linear_weights(module, scheme);
        self.manager.remove(id)?;
        let new_id = self.manager.add(name, BurnComponent::new(quantized, class, self.placement.clone()), None)?;
        Ok((new_id, count))
    }

    /// Whether `component`'s linear weights are quantized ([`quantize`](Self::quantize)).
    pub fn is_quantized(&self, component: PipelineComponent) -> bool {
        self.quantized.contains(&component)
    }

    /// Whether `component` is under group offload.
    pub fn is_grouped(&self, component: PipelineComponent) -> bool {
        match component {
            PipelineComponent::TextEncoder => self.grouped_text_encoder,
            PipelineComponent::Transformer => self.grouped_transformer,
            PipelineComponent::Vae => false,
        }
    }

    /// The dtype the transformer computes in, which the activation estimates assume.
    pub fn dtype(&self) -> DType {
        self.transformer_dtype
    }

    /// The group offloader of `component`, when it is grouped: its statistics, groups, order and pinned bytes.
    /// The handle shares the offloader.
    pub fn group_offload(&self, component: PipelineComponent) -> Option<group_offload::GroupOffload> {
        let id = component.id(self);
        match component {
            PipelineComponent::Transformer if self.grouped_transformer => {
                self.manager.inspect(id, |g: &GroupedTransformer| g.offload().clone()).ok()
            }
            PipelineComponent::TextEncoder if self.grouped_text_encoder => {
                self.manager.inspect(id, |g: &GroupedTextEncoder| g.offload().clone()).ok()
            }
            _ => None,
        }
    }

    /// Group-offload statistics of `component` (onloads, prefetch hits, misses, stray loads), when it is grouped.
    pub fn group_stats(&self, component: PipelineComponent) -> Option<group_offload::GroupStats> {
        self.group_offload(component).map(|offload| offload.stats())
    }

    /// Where the components execute and what accounts for them.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The manager holding the components.
    pub fn manager(&self) -> &Arc<ComponentsManager> {
        &self.manager
    }

    /// The components' ids.
    pub fn ids(&self) -> &ComponentIds {
        &self.ids
    }

    /// What loading applied, and found missing or unused, per component.
    pub fn load_reports(&self) -> &[LoadReport] {
        &self.reports
    }

    /// The transformer's configuration.
    pub fn transformer_config(&self) -> &TransformerConfig {
        &self.transformer_config
    }

    /// Enables auto offload onto the execution device, read through `memory`.
    pub fn enable_auto_offload(&self, memory: Arc<dyn DeviceMemory>, reserve: u64, retry_on_oom: bool) -> Result<()> {
        Ok(self.manager.enable_auto_offload(memory, reserve, retry_on_oom)?)
    }

    /// Activation bytes each component's call holds beside its weights, for a generation: what a run charges
    /// a simulated card (`[text encoder, transformer, VAE]`); a real device allocates for itself.
    pub fn activation_estimates(&self, opts: &GenerateOptions) -> [u64; 3] {
        let dtype = self.transformer_dtype;
        let caption = self.caption_tokens(opts);
        let s = self.vae_scale_factor();
        [
            text_encoder_activation_bytes(&self.text_encoder_config, opts.max_sequence_length, dtype),
            self.transformer_config.activation_bytes_with_caption(opts.height, opts.width, s, caption, dtype),
            vae_activation_bytes(&self.vae_config, opts.height, opts.width, dtype),
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
            text_encoder_activation_bytes(&self.text_encoder_config, max_sequence_length, self.transformer_dtype);
        if self.grouped_text_encoder {
            return Ok(self.manager.run(&self.ids.text_encoder, |c: &mut GroupedTextEncoder| {
                c.run(activations, |model, device| {
                    model.encode(tokens.input_ids_tensor(device), tokens.attention_mask_tensor(device))
                })
            })?);
        }
        let run = self.manager.run(&self.ids.text_encoder, |c: &mut BurnComponent<TextEncoder>| {
            c.run(activations, |module, device| {
                module.encode(tokens.input_ids_tensor(device), tokens.attention_mask_tensor(device))
            })
        });
        Ok(run?)
    }

    /// Generates an image `[1, 3, H, W]` in `[0, 1]` (f32), calling `progress(step, steps)` after each step.
    pub fn generate(&self, opts: &GenerateOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Tensor<4>> {
        self.generate_with_report(opts, progress).map(|generated| generated.image)
    }

    /// Generates an image as [`generate`](Self::generate) does, in three timed phases ([`PHASES`]): `encode`
    /// (the prompts, and the input image for image-to-image), `denoise` and `decode`. Between two phases the
    /// execution device's memory is released (`Device::memory_cleanup`; a simulated card needs nothing more).
    pub fn generate_with_report(
        &self,
        opts: &GenerateOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Generated> {
        self.validate(opts)?;
        let device = self.placement.exec.clone();
        let release_device = device.clone();
        let observer = self.phase_observer.clone();
        let timeline = self.manager.timeline();
        let release_timeline = timeline.clone();
        let memory = self.placement.memory.clone();
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
                None => initial_noise(opts.seed, [1, 16, h, w], &self.placement.host).to_device(&device),
            };
            let full = self.scheduler.schedule(opts.steps, (h / 2) * (w / 2))?;
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
        let outs = if self.grouped_transformer {
            self.manager.run(&self.ids.transformer, |c: &mut GroupedTransformer| {
                c.run(activations, |model, device| {
                    let (items, time, caps) = inputs(self.transformer_dtype(), device);
                    model.forward_items(items, time, caps)
                })
            })?
        } else {
            self.manager.run(&self.ids.transformer, |c: &mut BurnComponent<ZImageTransformer2DModel>| {
                c.run(activations, |model, device| {
                    let (items, time, caps) = inputs(model.dtype(), device);
                    Ok(model.forward_items(items, time, caps))
                })
            })?
        };
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
        let run = self.manager.run(&self.ids.vae, |c: &mut BurnComponent<AutoencoderKl>| {
            c.run(activations, |vae, device| {
                let pixels = (image.clone().to_device(device) * 2.0 - 1.0).cast(vae_dtype(vae));
                Ok(vae.scale_latents(vae.encode_mean(pixels).cast(DType::F32)))
            })
        });
        Ok(run?)
    }

    /// Decodes pipeline latents `[1, 16, h, w]` to an image `[1, 3, s·h, s·w]` in `[0, 1]`, `s` the VAE's scale
    /// factor.
    pub fn decode(&self, latents: Tensor<4>) -> Result<Tensor<4>> {
        let [_, _, h, w] = latents.dims();
        let s = self.vae_scale_factor();
        let activations = vae_activation_bytes(&self.vae_config, s * h, s * w, self.transformer_dtype);
        self.decode_with(latents, activations)
    }

    fn decode_with(&self, latents: Tensor<4>, activations: u64) -> Result<Tensor<4>> {
        let run = self.manager.run(&self.ids.vae, |c: &mut BurnComponent<AutoencoderKl>| {
            c.run(activations, |vae, device| {
                let z = vae.unscale_latents(latents.clone().to_device(device)).cast(vae_dtype(vae));
                Ok(AutoencoderKl::postprocess(vae.decode(z).cast(DType::F32)))
            })
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
        if self.grouped_text_encoder || self.grouped_transformer {
            return Err(Error::InvalidArgument {
                name: "timeline",
                reason: "group offload is already enabled and its offloaders keep the timeline they were built \
                         with; set the timeline before enabling group offload or applying a preset"
                    .into(),
            });
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
        &self.text_encoder_config
    }

    /// The VAE's configuration.
    pub fn vae_config(&self) -> &VaeConfig {
        &self.vae_config
    }

    /// Pixels per latent cell per side, from the VAE's config: `2^(levels − 1)`, 8 for the FLUX VAE.
    pub fn vae_scale_factor(&self) -> usize {
        self.vae_config.scale_factor()
    }

    /// Checks `opts` for this pipeline ([`GenerateOptions::validate`] with its VAE's scale factor).
    pub fn validate(&self, opts: &GenerateOptions) -> Result<()> {
        opts.validate(self.vae_scale_factor())
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
