//! The crate's one error type: everything that can go wrong at its edge (checkpoints, configs, arguments).
//!
//! Validation happens once, where user input enters: [`crate::loading`] checks the checkpoint directory, configs
//! and tensors; the pipeline checks generation arguments. The model code behind that edge trusts its inputs and
//! does not return errors. Every message is lowercase, names the file, tensor or component involved, and says
//! what to do next.

use std::path::PathBuf;

/// Everything this crate can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The checkpoint directory (or a component directory inside it) does not exist.
    #[error("checkpoint directory {} does not exist; pass the folder that holds model_index.json", path.display())]
    MissingDirectory {
        /// The directory that was looked for.
        path: PathBuf,
    },

    /// The directory is not a diffusers Z-Image checkpoint.
    #[error(
        "{} is not a z-image checkpoint: {reason}; download Tongyi-MAI/Z-Image-Turbo in the diffusers layout",
        path.display()
    )]
    NotZImageCheckpoint {
        /// The directory or `model_index.json` that was inspected.
        path: PathBuf,
        /// What was wrong (missing `model_index.json`, wrong pipeline class, ...).
        reason: String,
    },

    /// A component is declared with a different class than this crate implements.
    #[error(
        "{component} in {} is a {found}, expected {expected}; this crate only runs the classes of Z-Image-Turbo",
        path.display()
    )]
    WrongComponentClass {
        /// The component (`transformer`, `vae`, ...).
        component: String,
        /// The `model_index.json` that declares it.
        path: PathBuf,
        /// The class this crate implements.
        expected: String,
        /// The class the checkpoint declares.
        found: String,
    },

    /// A file that must exist (a config, a shard index, a tokenizer file) is missing.
    #[error("missing {what} for {component}: {} not found; re-download the component", path.display())]
    MissingFile {
        /// The component (`transformer`, `text_encoder`, ...).
        component: String,
        /// What the file is (`config.json`, `weights`, ...).
        what: String,
        /// The path that was looked for.
        path: PathBuf,
    },

    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file does not parse, or does not have the expected fields.
    #[error("invalid json in {}: {source}; the file is damaged or not a diffusers config", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },

    /// A config parses but its values are unusable.
    #[error("invalid config {}: {reason}", path.display())]
    InvalidConfig {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// The shard index names a file that does not exist.
    #[error(
        "shard {} listed in {} is missing; re-download the component's weights",
        file.display(),
        index.display()
    )]
    MissingShard {
        /// The `*.safetensors.index.json`.
        index: PathBuf,
        /// The shard it names.
        file: PathBuf,
    },

    /// A safetensors file cannot be parsed (truncated, corrupted header, ...).
    #[error("cannot read safetensors file {}: {reason}; the file is truncated or corrupt, re-download it", file.display())]
    CorruptWeights {
        /// The safetensors file.
        file: PathBuf,
        /// The parser's error.
        reason: String,
    },

    /// A tensor in the file does not have the shape the model expects.
    #[error(
        "tensor {tensor} in {} has shape {found:?}, the model expects {expected:?}; the checkpoint does not match the component's config.json",
        file.display()
    )]
    ShapeMismatch {
        /// The tensor's name (after key remapping).
        tensor: String,
        /// The file it came from.
        file: PathBuf,
        /// The shape the module expects.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },

    /// A tensor in the file has a dtype of the wrong kind (an integer tensor for a float parameter, ...).
    #[error(
        "tensor {tensor} in {} has dtype {found}, the model expects {expected}; the checkpoint is not a diffusers export",
        file.display()
    )]
    DTypeMismatch {
        /// The tensor's name (after key remapping).
        tensor: String,
        /// The file it came from.
        file: PathBuf,
        /// The dtype the module expects.
        expected: String,
        /// The dtype in the file.
        found: String,
    },

    /// A tensor's bytes could not be read or converted.
    #[error("cannot load tensor {tensor} from {}: {reason}", file.display())]
    TensorLoad {
        /// The tensor's name (after key remapping).
        tensor: String,
        /// The file it came from.
        file: PathBuf,
        /// What went wrong.
        reason: String,
    },

    /// Loading would leave parameters uninitialised or ignore tensors of the checkpoint.
    #[error(
        "refusing a partial load of {component}: {} tensors missing{}, {} unused{}; fix the checkpoint or set allow_partial",
        missing.len(),
        first(missing),
        unused.len(),
        first(unused)
    )]
    PartialLoad {
        /// The component.
        component: String,
        /// Module parameters that no file provided.
        missing: Vec<String>,
        /// File tensors that no module parameter took.
        unused: Vec<String>,
    },

    /// A key-remapping pattern in the load options is not a valid regular expression.
    #[error("invalid key remapping pattern {pattern:?}: {reason}")]
    InvalidKeyRemap {
        /// The pattern.
        pattern: String,
        /// The regex compiler's error.
        reason: String,
    },

    /// An image size the model cannot generate.
    #[error("cannot generate {width}x{height}: width and height must be positive multiples of {multiple}")]
    InvalidSize {
        /// The requested height in pixels.
        height: usize,
        /// The requested width in pixels.
        width: usize,
        /// The multiple both must be.
        multiple: usize,
    },

    /// Zero denoising steps were requested.
    #[error("num_inference_steps must be at least 1: pass --steps 1 or more (Turbo uses 8)")]
    ZeroSteps,

    /// An img2img strength outside `[0, 1]`.
    #[error("img2img strength {strength} is outside [0, 1]: pass a strength such as 0.6")]
    InvalidStrength {
        /// The requested strength.
        strength: f64,
    },

    /// The tokenizer failed to load or to encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A tensor handed to the crate has the wrong shape.
    #[error("{op}: {reason}")]
    Shape {
        /// The operation that rejected it.
        op: String,
        /// What was expected and what was found.
        reason: String,
    },

    /// A generation argument is out of range or inconsistent with another.
    #[error("invalid {name}: {reason}")]
    InvalidArgument {
        /// The argument's name.
        name: &'static str,
        /// What is wrong and what to pass instead.
        reason: String,
    },

    /// A LoRA file cannot be read or used as a whole (not safetensors, empty, DoRA, bad metadata). Nothing was
    /// applied.
    #[error("lora {}: {reason}; nothing was applied", path.display())]
    LoraFile {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },

    /// A key of a LoRA file names no layer of the model, or is in no layout this crate reads. Nothing was
    /// applied.
    #[error("lora {}: key {key} {reason}; nothing was applied", path.display())]
    LoraKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong and what to do.
        reason: String,
    },

    /// A LoRA factor's shape does not fit its layer, or its pair's rank. Nothing was applied.
    #[error("lora {}: key {key}: {reason}; nothing was applied", path.display())]
    LoraShape {
        /// The file.
        path: PathBuf,
        /// The key of the module's down factor (or of the tensor at fault).
        key: String,
        /// What is wrong and what to do.
        reason: String,
    },

    /// A LoRA cannot be applied in the way asked (fused into quantized weights, changed under group offload).
    /// Nothing was applied.
    #[error("lora: {reason}; nothing was applied")]
    LoraUnsupported {
        /// What is wrong and what to do.
        reason: String,
    },

    /// A LoRA file holds a value that cannot be applied (a factor or an alpha that is infinite or NaN), or a
    /// LoRA's scale is not finite or lies past [`crate::lora::MAX_SCALE`]. Nothing was applied.
    #[error("lora {}: {what} {reason}; nothing was applied", path.display())]
    LoraValue {
        /// The file.
        path: PathBuf,
        /// What holds the value: `key <key>`, or `the scale <scale>`.
        what: String,
        /// What is wrong and what to do.
        reason: String,
    },

    /// Fusing LoRAs into a layer would make some of its weights infinite or NaN (finite factors whose sum leaves
    /// the weights' range, at an absurd scale): the fuse was undone bit for bit, and the model holds what it held
    /// before.
    #[error(
        "lora: fusing {files} into the {component}'s {layer} {reason}; the fuse was undone bit for bit and nothing \
         was applied: lower the scale, or check the file's factors"
    )]
    LoraNotFinite {
        /// The files and scales that update the layer.
        files: String,
        /// The component.
        component: &'static str,
        /// The layer's path.
        layer: String,
        /// How many weights, and how far the update reaches.
        reason: String,
    },

    /// The offload machinery refused or failed: a component that does not fit, a failed move, a strategy error.
    #[error(transparent)]
    Offload(#[from] offload_core::Error),

    /// A replay of the run's schedule on a simulated card refused its card or schedule.
    #[error(transparent)]
    Simulation(#[from] memory_sim::SimError),

    /// Group offload failed, or refused a route (a model without blocks, a quantization scheme the device cannot hold).
    #[error(transparent)]
    GroupOffload(group_offload::Error),

    /// Planning failed: an unknown preset, a bad setting, a component that fits no route, an unreadable
    /// capacity profile.
    #[error(transparent)]
    Plan(#[from] offload_core::plan::PlanError),

    /// The memory plot could not be drawn or written.
    #[error("cannot draw the memory plot {}: {reason}", path.display())]
    Plot {
        /// The PNG file asked for.
        path: std::path::PathBuf,
        /// What went wrong and what to do instead.
        reason: String,
    },

    /// An output file the run could not write, found before anything ran.
    #[error("{flag} {}: {problem}", path.display())]
    OutputPath {
        /// The flag or setting that named it.
        flag: String,
        /// The path as given.
        path: std::path::PathBuf,
        /// What is wrong with it and what to give instead.
        problem: String,
    },

    /// Two outputs name one file, so the second would replace the first.
    #[error("{first} and {second} both name {}: the second would replace the first; give each its own file", path.display())]
    OutputsCollide {
        /// The first flag.
        first: String,
        /// The second flag.
        second: String,
        /// The file both name.
        path: std::path::PathBuf,
    },

    /// An output names a file the run reads.
    #[error("{output} would replace {input}: both name {}; write the output elsewhere", path.display())]
    OutputReplacesInput {
        /// The output's flag.
        output: String,
        /// The input's flag.
        input: String,
        /// The file both name.
        path: std::path::PathBuf,
    },

    /// Two components of a checkpoint do not fit together (each config is valid on its own).
    #[error("{first} and {second} do not fit together: {problem}")]
    IncompatibleComponents {
        /// The first config, as the checkpoint names it (`vae/config.json`).
        first: String,
        /// The second config, or what the pipeline itself needs.
        second: String,
        /// What differs, and what to use instead.
        problem: String,
    },

    /// Writing an output failed; any file that was there before is unchanged.
    #[error("cannot write {}: {source}; any earlier file there is as it was", path.display())]
    OutputWrite {
        /// The file asked for.
        path: std::path::PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

/// Renders ` (first: NAME)` for a non-empty list, to keep messages short on large lists.
fn first(names: &[String]) -> String {
    names.first().map(|name| format!(" (first: {name})")).unwrap_or_default()
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<group_offload::Error> for Error {
    /// The library's planner and manager errors keep their own variants ([`Error::Plan`], [`Error::Offload`]),
    /// whichever crate passed them on.
    fn from(error: group_offload::Error) -> Self {
        match error {
            group_offload::Error::Plan(inner) => Error::Plan(inner),
            group_offload::Error::Manager(inner) => Error::Offload(inner),
            other => Error::GroupOffload(other),
        }
    }
}

impl From<Error> for offload_core::ComponentError {
    /// The error a failed component call reports to the manager: a group upload's out-of-memory or device failure
    /// stays typed (so the OOM retry sees it); anything else is the call's own error.
    fn from(error: Error) -> Self {
        match error {
            Error::GroupOffload(inner) => inner.into(),
            other => offload_core::ComponentError::other(other),
        }
    }
}
